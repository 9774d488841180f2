"""GPT-2 (after nanoGPT): LayerNorm, learned positions, a GELU FFN; the head tied to the embedding."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from .common import Block, GPTConfig, _LanguageModel


class GPT(_LanguageModel):
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
        self._init_all(residual=("proj.weight",))

    #: Parameters that are another parameter under a second name (alias -> source): the output
    #: head is the token embedding. Exports store the source only.
    tied_weights: ClassVar[dict[str, str]] = {"lm_head.weight": "wte.weight"}

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        return self.drop(self.wte(idx) + self.wpe(pos)), None


# --------------------------------------------------------------------------------------------
# Llama-style
# --------------------------------------------------------------------------------------------
