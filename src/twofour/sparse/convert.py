"""Applying a recipe to a model and driving it: sparsify(), attach(), advance(), flip_rate()."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import warn
from .layer import SparseLinear, advance_layers
from .optim import STEPAdamW
from .recipes import DEFAULT_RECIPE, Recipe, make_recipe
from .sharded import refresh_where_gathered

__all__ = ["sparsify", "attach", "advance", "add_masked_decay", "flip_rate", "sparse_layers", "DEFAULT_EXCLUDE"]

log = logging.getLogger("twofour")

#: Module-name patterns left dense by default: output heads (embeddings are not nn.Linear).
DEFAULT_EXCLUDE: tuple[str, ...] = ("lm_head", "*.lm_head", "head", "*.head", "classifier", "*.classifier",
                                    "score", "*.score")


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether the module name ``name`` matches any of the shell-style ``patterns`` (``*.mlp.fc``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def sparsify(model: nn.Module, recipe: str | Recipe = DEFAULT_RECIPE, *, include: Iterable[str] | None = None,
             exclude: Iterable[str] = DEFAULT_EXCLUDE, transposed_output: Iterable[str] = (),
             **options: Any) -> nn.Module:
    """Swap the eligible ``nn.Linear`` layers of ``model`` for :class:`SparseLinear`, in place.

    ``include``/``exclude`` are ``fnmatch`` patterns on module names (``"*.mlp.*"``); by default
    every Linear is a candidate except output heads (:data:`DEFAULT_EXCLUDE`) and layers whose
    weight is tied to an embedding. Layers whose shape can't be 2:4 are skipped with a warning
    naming them. Parameters are kept (the same objects), so an existing optimizer stays valid,
    except for Hugging Face ``Conv1D`` layers (GPT-2), whose (in, out) weight gets a transposed
    copy: make the optimizer after ``sparsify`` there.

    ``transposed_output`` names (patterns) the layers whose output may come back column-major on
    the GPU (see :class:`SparseLinear`): an FFN's first linear (``"*.mlp.fc"`` in twofour's GPT,
    ``"*.mlp.c_fc"`` in Hugging Face's GPT-2), whose output feeds only the activation and the
    second linear.
    """
    rec = make_recipe(recipe, **options)
    include = None if include is None else tuple([include] if isinstance(include, str) else include)
    exclude = tuple([exclude] if isinstance(exclude, str) else exclude)
    transposed = tuple([transposed_output] if isinstance(transposed_output, str) else transposed_output)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    mha_children = {id(c) for m in model.modules() if isinstance(m, nn.MultiheadAttention) for c in m.children()}
    converted, skipped = [], []
    for name, mod in list(model.named_modules()):
        conv1d = is_hf_conv1d(mod)
        if not (isinstance(mod, nn.Linear) or conv1d) or isinstance(mod, SparseLinear):
            continue
        if (include is not None and not matches(name, include)) or matches(name, exclude):
            continue
        if id(mod.weight) in tied:
            continue  # an output head tied to the embedding: stays dense
        if id(mod) in mha_children:
            skipped.append((name, "inside nn.MultiheadAttention, which bypasses its forward"))
            continue
        in_f, out_f = mod.weight.shape if conv1d else mod.weight.shape[::-1]
        reason = rec.unsupported(out_f, in_f)
        if reason:
            skipped.append((name, reason))
            continue
        parent_name, _, attr = name.rpartition(".")
        flag = matches(name, transposed)
        new = (SparseLinear.from_conv1d(mod, rec, transposed_output=flag) if conv1d
               else SparseLinear.from_linear(mod, rec, transposed_output=flag))
        setattr(model.get_submodule(parent_name), attr, new)
        converted.append(name)
    if skipped:
        warn("twofour.sparsify left these layers dense: " + "; ".join(f"{n} ({why})" for n, why in skipped))
    if not converted:
        warn("twofour.sparsify found no eligible nn.Linear layer to convert")
    log.info("sparsify(%s): %d layers converted, %d skipped", rec.name, len(converted), len(skipped))
    return model


def is_hf_conv1d(mod: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2's linear layer), recognised without importing transformers."""
    return type(mod).__name__ == "Conv1D" and type(mod).__module__.startswith("transformers") and mod.weight.dim() == 2


def sparse_layers(model: nn.Module) -> Iterator[tuple[str, SparseLinear]]:
    """(name, layer) for every SparseLinear in ``model`` (works through DDP/compile wrappers)."""
    for name, mod in model.named_modules():
        if isinstance(mod, SparseLinear):
            yield name, mod


@torch.no_grad()
def advance(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Move every SparseLinear of ``model`` on by one optimizer step (masks, flips, phases).

    Call it right after ``optimizer.step()``, once per step (not per micro-batch); or let
    :func:`attach` call it for you.
    """
    sparse_phase = optimizer.switched if isinstance(optimizer, STEPAdamW) else None
    layers = [layer for _, layer in sparse_layers(model)]
    advance_layers(layers, sparse_phase)
    refresh_where_gathered(model, layers)  # a sharded weight's refresh: before its unit's next forward


@torch.no_grad()
def add_masked_decay(model: nn.Module) -> None:
    """Add SR-STE's masked decay ``decay * (1 - m) * W`` to every sparse layer's gradient.

    Call it once per optimizer step, after gradient clipping and right before
    ``optimizer.step()`` (so that it counts once, however many micro-batches were accumulated);
    or let :func:`attach` call it for you. Layers whose recipe has no decay are left alone.
    """
    for _, layer in sparse_layers(model):
        layer.add_masked_decay_()


class _Attached:
    """The hooks :func:`attach` put on an optimizer; ``remove()`` takes both off."""

    def __init__(self, *handles: torch.utils.hooks.RemovableHandle):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def attach(model: nn.Module, optimizer: torch.optim.Optimizer) -> _Attached:
    """Drive ``model``'s sparse layers from ``optimizer``: the one call a loop needs.

    Before every ``optimizer.step()`` it adds SR-STE's masked decay to the gradients
    (:func:`add_masked_decay`; after your gradient clipping, which comes before the step), and
    after it advances masks, flip counts and phases (:func:`advance`). With gradient
    accumulation the optimizer steps once per N micro-batches, and so do both. Returns a handle
    whose ``remove()`` detaches it.
    """
    needs_step = any(layer.recipe.starts_dense for _, layer in sparse_layers(model))
    if needs_step and not isinstance(optimizer, STEPAdamW):
        raise TypeError("the 'step' recipe needs twofour.STEPAdamW as its optimizer "
                        f"(got {type(optimizer).__name__}): it decides when the masks switch on")
    pre = None
    if any(layer.recipe.decay for _, layer in sparse_layers(model)):
        pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: add_masked_decay(model))
    post = optimizer.register_step_post_hook(lambda opt, args, kwargs: advance(model, opt))
    return _Attached(*(h for h in (pre, post) if h is not None))


def flip_rate(model: nn.Module) -> dict[str, float]:
    """Fraction of mask positions that changed at the last optimizer step, per layer and ``"total"``.

    Reads counters the layers keep on their device: one host sync, no pass over the weights.
    """
    layers = [(n, m) for n, m in sparse_layers(model) if m.recipe.sparse]
    if not layers:
        return {"total": 0.0}
    flips = torch.stack([m.flips.to(layers[0][1].flips.device) for _, m in layers]).tolist()
    sizes = [m.weight.numel() for _, m in layers]
    out = {n: f / s for (n, _), f, s in zip(layers, flips, sizes)}
    out["total"] = sum(flips) / sum(sizes)
    return out
