"""The named models ``twofour train --model`` takes, :func:`from_preset` and :func:`build_model`.

Above the model classes: a preset names a class and its shape, so the models know nothing of the
presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ..sparse.convert import sparsify
from .common import ATTN_PATTERNS, FFN_IN_PATTERNS, FFN_PATTERNS, GPTConfig, LlamaConfig, _LanguageModel
from .gpt import GPT
from .llama import Llama


@dataclass(frozen=True)
class Preset:
    """A named model: its class, its shape (``block_size`` and ``vocab_size`` are set per run),
    and its default peak learning rate."""

    model: type[_LanguageModel]
    config: GPTConfig | LlamaConfig
    lr: float

    def build(self, **overrides) -> _LanguageModel:
        """The model, with ``overrides`` replacing fields of the config."""
        return self.model(dataclasses.replace(self.config, **overrides))


def _gpt(lr: float, **shape: int) -> Preset:
    return Preset(GPT, GPTConfig(**shape), lr)


def _llama(lr: float, **shape: int) -> Preset:
    return Preset(Llama, LlamaConfig(**shape), lr)


#: Every model ``twofour train --model`` takes. Peak learning rates: GPT-3 paper's table for the
#: GPT-2 sizes, higher for the small ones (as nanoGPT's 10M-parameter example); the Llama sizes
#: alike, and Llama 2's 3e-4 from 1B up. The Llama FFN widths follow Llama's rule with
#: ``ffn_multiple`` 256 (64 for the tiny one): 2048, 2816, 5632 (TinyLlama's), 11008 (Llama 7B);
#: Llama 3 8B's 14336 is given.
PRESETS: dict[str, Preset] = {
    "tiny": _gpt(1e-3, n_layer=4, n_head=4, n_embd=128),
    "gpt-10m": _gpt(1e-3, n_layer=6, n_head=6, n_embd=384),  # about 10.6M weights in its blocks
    "gpt2-124m": _gpt(6e-4, n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": _gpt(3e-4, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": _gpt(2.5e-4, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-1.5b": _gpt(2e-4, n_layer=48, n_head=25, n_embd=1600),
    "llama-tiny": _llama(1e-3, n_layer=4, n_head=4, n_embd=128, ffn_multiple=64),  # FFN 384
    "llama-125m": _llama(6e-4, n_layer=12, n_head=12, n_embd=768, ffn_multiple=256),
    "llama-350m": _llama(3e-4, n_layer=24, n_head=16, n_embd=1024, ffn_multiple=256),
    "llama-1b": _llama(3e-4, n_layer=22, n_head=32, n_embd=2048, ffn_multiple=256),  # TinyLlama 1.1B's shape
    "llama-7b": _llama(3e-4, n_layer=32, n_head=32, n_embd=4096, ffn_multiple=256),
    # Llama 3 8B's shape: FFN 14336, 8 heads of keys and values (grouped-query attention)
    "llama-8b": _llama(3e-4, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                       rope_theta=500000.0),
}


def from_preset(name: str, family: type[_LanguageModel] | None = None, **overrides) -> _LanguageModel:
    """The model of preset ``name`` (:data:`PRESETS`) with ``overrides`` replacing fields of its
    config (``from_preset("tiny", block_size=128)``); with ``family`` (:class:`GPT`, :class:`Llama`)
    the preset must be one of that class's. ``ValueError`` naming the valid presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if family is not None and not issubclass(preset.model, family):
        raise ValueError(f"preset {name!r} is a {preset.model.__name__}, not a {family.__name__}")
    return preset.build(**overrides)


def build_model(preset: str, recipe, *, vocab_size: int, block_size: int, sparse_attention: bool = False,
                n_layer: int | None = None) -> nn.Module:
    """The preset model ``preset`` (GPT or Llama; with ``n_layer`` blocks if given) with ``recipe``
    (a name or a :class:`~twofour.sparse.recipes.Recipe`) applied to its FFN linears, and to
    attention too with ``sparse_attention``; the FFN's first linears may keep their output
    transposed on the GPU."""
    shape = {"n_layer": n_layer} if n_layer is not None else {}
    model = PRESETS[preset].build(block_size=block_size, vocab_size=vocab_size, **shape)
    include = FFN_PATTERNS + (ATTN_PATTERNS if sparse_attention else ())
    return sparsify(model, recipe, include=include, transposed_output=FFN_IN_PATTERNS)
