"""What GPT and Llama share: configs, module-name patterns, the KV cache, attention, the MLP and
the block, and the language-model base class."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..activations import GELU_TANH, linear_act

#: Module-name patterns of the FFN and attention linears, for ``twofour.sparsify(include=...)``:
#: twofour's GPT and Llama, and Hugging Face's Llama (``gate_proj``, ``up_proj``, ``down_proj``;
#: ``self_attn.q_proj`` ... ``o_proj``).
FFN_PATTERNS = ("*.mlp.fc", "*.mlp.proj", "*.mlp.gate_up", "*.mlp.down", "*.mlp.gate_proj", "*.mlp.up_proj",
                "*.mlp.down_proj")
#: The FFN's first linears, whose outputs feed only the activation and the second linear: for
#: ``twofour.sparsify(transposed_output=...)`` (their output may stay in y^T order on the GPU).
FFN_IN_PATTERNS = ("*.mlp.fc", "*.mlp.gate_up")
ATTN_PATTERNS = ("*.attn.qkv", "*.attn.proj", "*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj",
                 "*.self_attn.o_proj")


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

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: as many as of queries."""
        return self.n_head


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model. The FFN width is ``ffn_hidden`` if given, else Llama's rule:
    8/3 of ``n_embd`` rounded up to a multiple of ``ffn_multiple`` (4096 -> 11008 with 256)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 256
    vocab_size: int = 256
    ffn_hidden: int | None = None
    ffn_multiple: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    n_kv_head: int | None = None  # heads of keys and values (grouped-query attention); None: n_head

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: ``n_kv_head``, else ``n_head`` (no grouping)."""
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The FFN's hidden width H (gate and up have H outputs each)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(8 * self.n_embd / 3)
        return -(-h // self.ffn_multiple) * self.ffn_multiple


#: The attention kernels a cached forward may use: both take a boolean mask of any length and
#: run inside CUDA graphs.
_MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class KVCache:
    """Static keys and values of every layer for generation: ``k`` and ``v`` of shape
    (layers, batch, heads, max_len, head_dim), and ``pos``, the next position to write, a
    0-dim tensor on the cache's device. Nothing in a cached forward depends on host-side state,
    so a decoding step can be captured in a CUDA graph and replayed."""

    def __init__(self, cfg: GPTConfig | LlamaConfig, batch: int, max_len: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        if not 1 <= max_len <= cfg.block_size:
            raise ValueError(f"KVCache: max_len must be in 1..block_size={cfg.block_size}, got {max_len}")
        shape = (cfg.n_layer, batch, cfg.kv_heads, max_len, cfg.n_embd // cfg.n_head)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.batch, self.max_len = batch, max_len

    def reset(self) -> None:
        """Start over: the next forward writes at position 0 (in place, so graphs see it)."""
        self.pos.zero_()


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: tuple) -> torch.Tensor:
    """Write this call's keys and values into the layer's cache at their positions and attend
    to everything up to each query's position (``kv``: cache k, cache v, positions, mask)."""
    k_cache, v_cache, positions, visible = kv
    k_cache.index_copy_(2, positions, k.to(k_cache.dtype))
    v_cache.index_copy_(2, positions, v.to(v_cache.dtype))
    k_all, v_all = _grouped(k_cache, q), _grouped(v_cache, q)
    with sdpa_kernel(_MASKED_BACKENDS):
        y = F.scaled_dot_product_attention(q.to(k_cache.dtype), k_all, v_all, attn_mask=visible)
    return y.to(q.dtype)


def _grouped(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Keys or values (batch, kv heads, t, head_dim) repeated to q's heads (grouped-query
    attention: each of the kv heads serves n_head / kv_heads query heads in a row)."""
    rep = q.shape[1] // kv.shape[1]
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (block_size, head_dim / 2) of the rotary angles pos * theta^(-2i / head_dim)."""
    hd = cfg.n_embd // cfg.n_head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (batch, heads, t, head_dim), Llama's pairing of dimensions i and
    i + head_dim / 2 (as Hugging Face's ``rotate_half``); the tables in x's dtype (Llama's
    forward casts them once for all layers, so this is no copy)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention with one fused qkv linear (GPT's; Llama's without biases and
    with rotary positions on q and k, given as ``rope`` = (cos, sin)); with ``kv``, cached
    (:class:`KVCache`). With ``n_kv_head`` < ``n_head``, grouped-query attention: the qkv linear
    has ``n_embd + 2 * n_kv_head * head_dim`` outputs (q, then k, then v)."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, dropout: float = 0.0,
                 n_kv_head: int | None = None):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head or n_head
        if n_head % self.n_kv_head:
            raise ValueError(f"n_head={n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        self.kv_dim = n_embd // n_head * self.n_kv_head
        self.qkv = nn.Linear(n_embd, n_embd + 2 * self.kv_dim, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, kv: tuple | None = None, rope: tuple | None = None) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.n_head
        q, k, v = self.qkv(x).split((c, self.kv_dim, self.kv_dim), dim=2)
        q = q.view(b, t, self.n_head, hd).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv_head, hd).transpose(1, 2) for z in (k, v))
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if kv is None:
            y = F.scaled_dot_product_attention(q, _grouped(k, q), _grouped(v, q), is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            y = _cached_attention(q, k, v, kv)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """GPT's FFN: ``proj(gelu(fc(x)))``, width 4 x n_embd."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(linear_act(self.fc, x, GELU_TANH)))


class Block(nn.Module):
    """A pre-norm block: attention, then the FFN, each on the residual stream. GPT's: LayerNorm
    and the GELU FFN (:class:`LlamaBlock` swaps in RMSNorm, rotary attention and the gated FFN)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg.n_embd, cfg.n_head, cfg.bias, cfg.dropout)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: tuple | None = None, rope: tuple | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, rope)
        return x + self.mlp(self.ln_2(x))


class _LanguageModel(nn.Module):
    """What GPT and Llama share: the blocks ``h`` (FSDP's units), the head, the loss, the init,
    building from a preset."""

    cfg: GPTConfig | LlamaConfig
    h: nn.ModuleList

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def _init_all(self, residual: tuple[str, ...]) -> None:
        """std 0.02 everywhere, GPT-2's 0.02 / sqrt(2 n_layer) for the residual projections
        (parameters whose names end with one of ``residual``)."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(residual):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def fsdp_units(self) -> list[nn.Module]:
        """The submodules FSDP shards one by one (each gathered just before it runs): the blocks."""
        return list(self.h)

    def reset_buffers(self) -> None:
        """Recompute the buffers a state dict doesn't hold (a model loaded onto the meta device
        needs them): none for GPT, the rotary tables for Llama."""

    def _check_length(self, t: int) -> None:
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of length {t} is longer than block_size={self.cfg.block_size}")

    def make_cache(self, batch: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` (default
        block_size) tokens, on the model's device, in its weights' dtype unless given."""
        w = self.wte.weight
        return KVCache(self.cfg, batch, max_len or self.cfg.block_size, w.device, dtype or w.dtype)

    @staticmethod
    def _cache_positions(idx: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of ``idx``'s tokens in ``cache`` and the additive attention mask (t,
        max_len) that shows each query the keys up to its own position (later slots are empty or
        stale), made once for all layers."""
        t = idx.shape[1]
        if t > cache.max_len:
            raise ValueError(f"{t} tokens don't fit a KV cache of {cache.max_len} positions")
        positions = cache.pos + torch.arange(t, device=idx.device)
        hidden = torch.arange(cache.max_len, device=idx.device) > positions[:, None]
        visible = torch.zeros(hidden.shape, dtype=cache.k.dtype, device=idx.device).masked_fill_(hidden, float("-inf"))
        return positions, visible

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, tuple | None]:
        """The blocks' input for ``idx`` at ``positions`` (None: 0 .. T-1) and the rotary tables
        the attention takes (None where the model has none)."""
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        """Logits (B, T, vocab) and the mean loss against ``targets`` (or None).

        With a ``cache`` (generation): the tokens take positions ``cache.pos`` onwards, attend to
        everything the cache holds before them, are written into it, and ``cache.pos`` moves on;
        logits come back for the last position only (B, 1, vocab). A prompt is one call (after
        ``cache.reset()``), each new token another. The caller keeps ``cache.pos`` plus the tokens
        within the cache's ``max_len`` (nothing checks it on the host, so that the step can be
        captured in a CUDA graph; :func:`twofour.generate` restarts a full cache)."""
        if cache is None:
            self._check_length(idx.shape[1])
            x, rope = self._embed(idx, None)
            for block in self.h:
                x = block(x, None, rope)
            logits = self.lm_head(self.ln_f(x))
            loss = None
            if targets is not None:
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
            return logits, loss
        positions, visible = self._cache_positions(idx, cache)
        x, rope = self._embed(idx, positions)
        for i, block in enumerate(self.h):
            x = block(x, (cache.k[i], cache.v[i], positions, visible), rope)
        cache.pos.add_(idx.shape[1])
        return self.lm_head(self.ln_f(x[:, -1:])), None
