"""A small, readable GPT (after nanoGPT) with the presets twofour trains.

Its FFN linears are ``mlp.fc`` and ``mlp.proj``; attention uses ``attn.qkv`` and
``attn.proj``; the output head ``lm_head`` is tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["GPTConfig", "GPT", "KVCache", "PRESETS", "FFN_PATTERNS", "FFN_IN_PATTERNS", "ATTN_PATTERNS"]

#: Module-name patterns of the FFN and attention linears, for ``twofour.sparsify(include=...)``.
FFN_PATTERNS = ("*.mlp.fc", "*.mlp.proj")
#: The FFN's first linears, whose outputs feed only GELU and the second linear: for
#: ``twofour.sparsify(transposed_output=...)`` (their output may stay in y^T order on the GPU).
FFN_IN_PATTERNS = ("*.mlp.fc",)
ATTN_PATTERNS = ("*.attn.qkv", "*.attn.proj")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT: layers, heads, width, context length and vocabulary."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True


PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt-10m": dict(n_layer=6, n_head=6, n_embd=384),  # about 10.6M weights in its blocks
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600),
}


#: The attention kernels a cached forward may use: both take a boolean mask of any length and
#: run inside CUDA graphs.
_MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class KVCache:
    """Static keys and values of every layer for generation: ``k`` and ``v`` of shape
    (layers, batch, heads, max_len, head_dim), and ``pos``, the next position to write, a
    0-dim tensor on the cache's device. Nothing in a cached forward depends on host-side state,
    so a decoding step can be captured in a CUDA graph and replayed."""

    def __init__(self, cfg: GPTConfig, batch: int, max_len: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32):
        if not 1 <= max_len <= cfg.block_size:
            raise ValueError(f"KVCache: max_len must be in 1..block_size={cfg.block_size}, got {max_len}")
        shape = (cfg.n_layer, batch, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.batch, self.max_len = batch, max_len

    def reset(self) -> None:
        """Start over: the next forward writes at position 0 (in place, so graphs see it)."""
        self.pos.zero_()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, kv: tuple | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if kv is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:  # write this call's keys and values at their positions, attend to everything up to each
            k_cache, v_cache, positions, visible = kv
            k_cache.index_copy_(2, positions, k.to(k_cache.dtype))
            v_cache.index_copy_(2, positions, v.to(v_cache.dtype))
            with sdpa_kernel(_MASKED_BACKENDS):
                y = F.scaled_dot_product_attention(q.to(k_cache.dtype), k_cache, v_cache, attn_mask=visible)
            y = y.to(x.dtype)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: tuple | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns logits and the mean loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> GPT:
        """Build a preset (``tiny``, ``gpt2-124m``, ... ``gpt2-1.5b``) with optional overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return cls(GPTConfig(**{**PRESETS[name], **overrides}))

    #: Parameters that are another parameter under a second name (alias -> source): the output
    #: head is the token embedding. Exports store the source only.
    tied_weights: ClassVar[dict[str, str]] = {"lm_head.weight": "wte.weight"}

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def fsdp_units(self) -> list[nn.Module]:
        """The submodules FSDP shards one by one (each gathered just before it runs): the blocks."""
        return list(self.h)

    def make_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` (default
        block_size) tokens, on the model's device, in its weights' dtype unless given."""
        w = self.wte.weight
        return KVCache(self.cfg, batch, max_len or self.cfg.block_size, w.device, dtype or w.dtype)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        """Logits (B, T, vocab) and the mean loss against ``targets`` (or None).

        With a ``cache`` (generation): the tokens take positions ``cache.pos`` onwards, attend to
        everything the cache holds before them, are written into it, and ``cache.pos`` moves on;
        logits come back for the last position only (B, 1, vocab). A prompt is one call (after
        ``cache.reset()``), each new token another."""
        if cache is not None:
            return self._cached_forward(idx, cache), None
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of length {t} is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def _cached_forward(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        t = idx.shape[1]
        if t > cache.max_len:
            raise ValueError(f"{t} tokens don't fit a KV cache of {cache.max_len} positions")
        positions = cache.pos + torch.arange(t, device=idx.device)
        # key j is visible to the query at position p when j <= p (later slots are empty or stale):
        # an additive mask (t, max_len), made once for all layers
        hidden = torch.arange(cache.max_len, device=idx.device) > positions[:, None]
        visible = torch.zeros(hidden.shape, dtype=cache.k.dtype, device=idx.device).masked_fill_(hidden, float("-inf"))
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for i, block in enumerate(self.h):
            x = block(x, (cache.k[i], cache.v[i], positions, visible))
        cache.pos.add_(t)
        return self.lm_head(self.ln_f(x[:, -1:]))
