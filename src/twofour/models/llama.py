"""A Llama-style model: RMSNorm, rotary positions, no biases, a gated FFN (SwiGLU) whose gate and up
are one linear ``mlp.gate_up`` with interleaved output rows (:mod:`twofour.activations`)."""

from __future__ import annotations

import torch
from torch import nn

from ..activations import SWIGLU, linear_act
from .common import Block, CausalSelfAttention, LlamaConfig, _LanguageModel, _rope_tables


class GatedMLP(nn.Module):
    """The SwiGLU FFN ``down(silu(gate(x)) * up(x))`` with gate and up as one linear
    ``gate_up`` (2H outputs, rows interleaved: row 2j gate_j, row 2j+1 up_j) and the fused
    activation :func:`twofour.activations.swiglu` reading its output in place; no biases."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(n_embd, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(linear_act(self.gate_up, x, SWIGLU))


class LlamaBlock(Block):
    """A pre-RMSNorm Llama block: rotary attention without biases, then the gated FFN."""

    def __init__(self, cfg: LlamaConfig):
        nn.Module.__init__(self)
        self.ln_1 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.n_embd, cfg.n_head, bias=False, n_kv_head=cfg.kv_heads)
        self.ln_2 = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = GatedMLP(cfg.n_embd, cfg.hidden)


class Llama(_LanguageModel):
    """Llama-style decoder (RMSNorm, rotary positions, SwiGLU FFN, no biases); ``forward(idx,
    targets)`` returns logits and the mean loss, as :class:`GPT`'s."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head} into an even head size "
                             "(rotary positions rotate pairs)")
        if cfg.hidden < 1:
            raise ValueError(f"the FFN width must be positive, got {cfg.hidden}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.h = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)  # recomputed, never saved
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_all(residual=("attn.proj.weight", "mlp.down.weight"))

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (not saved in state dicts), on the embedding's device (the
        CPU while it is on the meta device)."""
        dev = self.wte.weight.device
        self.rope_cos, self.rope_sin = (t.to("cpu" if dev.type == "meta" else dev) for t in _rope_tables(self.cfg))

    @property
    def tied_weights(self) -> dict[str, str]:
        """Parameters that are another parameter under a second name (alias -> source)."""
        return {"lm_head.weight": "wte.weight"} if self.cfg.tie_embeddings else {}

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
        # the tables in the dtype q and k come in (autocast's, else the weights'): one cast per
        # forward, not one per layer
        dev = idx.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.wte.weight.dtype
        if positions is None:  # 0 .. T-1
            positions = slice(0, idx.shape[1])
        return self.wte(idx), (self.rope_cos[positions].to(dt), self.rope_sin[positions].to(dt))


# --------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------
