"""Timing an exported model against its dense twin on a GPU, as ``twofour bench --inference`` and
``benchmarks/inference/`` do: the pair of models, prefill and decoding rows (timed by
:func:`twofour.timing.graph_ms`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .. import timing
from ..inference.format import load_for_inference, save_inference
from ..models.common import FFN_PATTERNS
from ..models.llama import Llama
from ..models.presets import PRESETS
from ..sparse.convert import sparsify

__all__ = ["exported_pair", "tokens_row", "default_vocab"]

#: The vocabulary a preset's random model gets by default: Llama's tokenizer, else GPT-2's (padded).
LLAMA_VOCAB, GPT_VOCAB = 32000, 50304


def default_vocab(preset: str) -> int:
    """The vocabulary size of ``preset``'s model family (Llama 32000, GPT-2 50304)."""
    return LLAMA_VOCAB if PRESETS[preset].model is Llama else GPT_VOCAB


def exported_pair(preset: str, folder: str | Path, *, vocab_size: int, context: int, recipe: str = "s-ste",
                  device: str = "cuda", n_layer: int | None = None) -> tuple[nn.Module, nn.Module, dict]:
    """A random ``preset`` (``n_layer`` blocks if given) with ``recipe`` on its FFN linears,
    exported in bf16 to ``folder`` and loaded back twice: as exported (2:4 layers) and as its dense
    twin (the same weights in nn.Linear); and the export's config."""
    torch.manual_seed(0)
    shape = {"n_layer": n_layer} if n_layer else {}
    with torch.device(device):  # initialized where it runs: a large model's init on the CPU takes a while
        model = sparsify(PRESETS[preset].build(block_size=context, vocab_size=vocab_size, **shape), recipe,
                         include=FFN_PATTERNS)
    cfg = save_inference(model, folder, dtype=torch.bfloat16, meta={"preset": preset, "recipe": recipe})
    del model
    return load_for_inference(folder, device), load_for_inference(folder, device, dense=True), cfg


def tokens_row(phase: str, b: int, models: dict[str, nn.Module], vocab: int, prompt: int, steps: int) -> str:
    """A markdown row of tokens/s of each model (``dense``, ``2:4``) and their ratio: a prefill of
    ``b`` x ``prompt`` tokens through the static KV cache, or ``steps`` greedy decoding steps after
    it; each replay of a graph that reads the cache and writes it."""
    ms = {}
    for name, model in models.items():
        idx = torch.randint(0, vocab, (b, prompt), device="cuda")
        if phase == "prefill":  # each replay writes positions 0.. again
            cache = model.make_cache(b, prompt)
            ms[name] = timing.graph_ms(lambda m=model, c=cache, i=idx: (c.reset(), m(i, cache=c)), steps) / (b * prompt)
        else:  # the cache holds the prompt, the graph's 2 warm-up steps and the steps timed
            cache = model.make_cache(b, -(-(prompt + steps + 2) // 16) * 16)
            tok = model(idx, cache=cache)[0][:, -1:].argmax(-1)
            step = lambda m=model, c=cache, t=tok: t.copy_(m(t, cache=c)[0][:, -1:].argmax(-1))  # noqa: E731
            ms[name] = timing.graph_ms(step, steps) / b
        del cache
    return f"| {phase} | {b} | {1e3 / ms['dense']:,.0f} | {1e3 / ms['2:4']:,.0f} | {ms['dense'] / ms['2:4']:.2f}x |"
