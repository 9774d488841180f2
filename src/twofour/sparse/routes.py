"""The ways a :class:`~twofour.sparse.layer.SparseLinear` computes its output, as one table.

Each :class:`Route` says when it applies to a call (the layer, the input ``x``, the activation
``act`` that follows or None) and what it runs; :data:`ROUTES` lists them in the order the forward
tries them, and the forward runs the first that applies (:func:`route_for`). Each route but the
last applies to calls no other does, so the order only makes the reference the fallback.
Adding a route is one entry here.

The conditions read the layer's host flags ``is_dense_phase`` and ``is_fp8_phase`` (and the
fast path reads ``step_count``): plain Python values, which a compiled forward takes as constants
(see :class:`~twofour.sparse.layer.SparseLinear`). What a route reads of the layer is
:class:`Layer`; the layer imports this module, never the other way. Compiled code's choice between
the 2:4 op and dense GEMMs (:func:`dense_gemms`) is read from the record that
:func:`twofour.sparse.compiled.plan_compiled` leaves in :mod:`twofour.dispatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .. import dispatch
from ..activations import Activation
from ..fp8.linear import fp8_linear
from .fastpath import (
    CompressedWeight,
    FastLinearActFn,
    FastSparseLinearFn,
    applies,
    compiled_linear,
    compute_dtype,
    operands,
)
from .pruners import Pruner
from .recipes import Recipe
from .reference import SparseLinearFn

__all__ = ["Layer", "Route", "ROUTES", "route_for", "dense_gemms", "plan_key"]


class Layer(Protocol):
    """What a route reads of a :class:`~twofour.sparse.layer.SparseLinear` (its public state)."""

    recipe: Recipe
    weight: torch.Tensor
    bias: torch.Tensor | None
    beta: torch.Tensor | None
    mask: torch.Tensor | None
    in_features: int
    out_features: int
    transposed_output: bool
    compressed: CompressedWeight

    @property
    def pruner(self) -> Pruner: ...
    @property
    def is_dense_phase(self) -> bool: ...
    @property
    def is_fp8_phase(self) -> bool: ...
    @property
    def step_count(self) -> int: ...
    def effective_weight(self) -> torch.Tensor: ...


def plan_key(layer: Layer, tokens: int, dtype: torch.dtype) -> str:
    """The dispatch key of one layer form's choice in compiled code: recipe, shape, tokens, dtype, bias."""
    r = layer.recipe
    dx = f"-dx={r.dx}" if r.dx in ("pruned-t", "mvue") else ""
    kind = f"compiled-layer-{r.name}" + ("-mvue" if r.mvue else "") + dx + ("-bias" if layer.bias is not None else "")
    return dispatch.choice_key(kind, layer.out_features, layer.in_features, tokens, "row", dtype, ("dense", "sparse"))


@torch.compiler.assume_constant_result
def _recorded_dense(key: str) -> bool:
    """Whether the plan under ``key`` chose dense GEMMs (a constant for the compiled code)."""
    return dispatch.recorded(key) == "dense"


def dense_gemms(layer: Layer, x: torch.Tensor) -> bool:
    """Whether ``layer`` runs dense GEMMs on its effective weight for ``x`` in compiled code:
    :func:`~twofour.sparse.compiled.plan_compiled` measured them faster at this shape (else, or
    unplanned: False)."""
    tokens = x.numel() // x.shape[-1]
    return _recorded_dense(plan_key(layer, tokens, compute_dtype(x)))


@dataclass(frozen=True)
class Route:
    """One way to compute a SparseLinear's output: ``applies(layer, x, act)`` says whether it takes
    this call, ``run(layer, x, act)`` computes ``x W_eff^T + b`` (then ``act`` of it, if given)."""

    name: str
    applies: Callable[[Layer, torch.Tensor, Activation | None], bool]
    run: Callable[[Layer, torch.Tensor, Activation | None], torch.Tensor]


def _fast(layer: Layer, x: torch.Tensor) -> bool:
    """The GPU fast path can take this call (:func:`twofour.sparse.fastpath.applies`)."""
    return applies(x, layer.in_features, layer.out_features)


def _sparse_phase(layer: Layer) -> bool:
    """A sparse recipe in a sparse phase, its GEMMs in the compute dtype (not FP8)."""
    return layer.recipe.sparse and not layer.is_dense_phase and not layer.is_fp8_phase


def _then(act: Activation | None, y: torch.Tensor) -> torch.Tensor:
    return y if act is None else act(y)


def _dx(layer: Layer, estimates: bool = True) -> str:
    """The dX route in effect (:meth:`~twofour.sparse.recipes.Recipe.dx_route`)."""
    return layer.recipe.dx_route(layer.is_dense_phase, estimates)


def _compressed(layer: Layer, cdt: torch.dtype, sparse: bool = True):
    """The layer's effective weight as the fast path takes it, built once per optimizer step."""
    return layer.compressed.get(layer.weight, layer.pruner, layer.beta, layer.mask, layer.step_count, cdt, sparse,
                                _dx(layer))


def _fused_applies(layer: Layer, x: torch.Tensor, act: Activation | None) -> bool:
    return (act is not None and _sparse_phase(layer) and layer.recipe.mvue and not torch.compiler.is_compiling()
            and _fast(layer, x))


def _fused_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """``act(x W_eff^T + b)`` as one op whose backward computes the activation's gradient and the
    MVUE estimate of dY^T in one kernel (``kernels/actgrad.py``) where that measures faster."""
    cdt = compute_dtype(x)
    with torch.autocast("cuda", enabled=False):
        wc, wd, wtc = _compressed(layer, cdt)
        return FastLinearActFn.apply(x.to(cdt), layer.weight, layer.bias, wc, wd, wtc, layer.transposed_output, act,
                                     _dx(layer))


def _fp8_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """The GEMMs the recipe's precision puts in FP8 (``torch._scaled_mm`` or FP8 2:4, else their
    reference), on the fused kernel's dense effective weight where the fast path takes the call:
    once per optimizer step eagerly, as the custom op ``twofour::compress`` under ``torch.compile``
    (one pass over the weight where Inductor's pruning takes several, docs/notes/fp8-peer.md)."""
    r, dense = layer.recipe, layer.is_dense_phase
    if dense or not _fast(layer, x):
        w_eff = layer.effective_weight()
    elif torch.compiler.is_compiling():
        w_eff = layer.pruner.compress(layer.weight.detach(), layer.beta, layer.mask, compute_dtype(x), sparse=False)[1]
    else:  # the fused kernel's dense effective weight (no 2:4 operands), once per optimizer step
        w_eff = _compressed(layer, compute_dtype(x), sparse=False)[1]
    return _then(act, fp8_linear(x, layer.weight, layer.bias, w_eff, precision=r.precision,
                                 mvue=r.mvue and not dense, sparse=not dense, dx=_dx(layer)))


def _dense_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """nn.Linear's forward: the ``dense`` recipe without FP8."""
    return _then(act, F.linear(x, layer.weight, layer.bias))


def _eager_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """The fast path eagerly: the weight compressed once per optimizer step, each GEMM dense or 2:4,
    whichever measured faster (:class:`~twofour.sparse.fastpath.FastSparseLinearFn`)."""
    cdt = compute_dtype(x)
    with torch.autocast("cuda", enabled=False):
        wc, wd, wtc = _compressed(layer, cdt)
        y = FastSparseLinearFn.apply(x.to(cdt), layer.weight, layer.bias, wc, wd, wtc, layer.recipe.mvue,
                                     layer.transposed_output, _dx(layer))
    return _then(act, y)


def _compiled_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """The fast path under ``torch.compile``: the compression in the graph, the GEMMs as custom ops
    (:func:`~twofour.sparse.fastpath.compiled_linear`)."""
    cdt = compute_dtype(x)
    with torch.autocast("cuda", enabled=False):
        dx = _dx(layer)
        wc, wd, wtc = operands(layer.pruner, layer.weight.detach(), layer.beta, layer.mask, cdt, dx=dx)
        y = compiled_linear(x.to(cdt), layer.weight, layer.bias, wc, wd, wtc, layer.recipe.mvue, dx)
    return _then(act, y)


def _dense_gemms_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """The recipe's math with dense GEMMs on the effective weight and an exact dW, in plain torch
    that compiled code fuses: where :func:`~twofour.sparse.compiled.plan_compiled` measured it
    faster than the 2:4 op; the ``mvue`` dX route's estimate is left out too."""
    return _then(act, SparseLinearFn.apply(x, layer.weight, layer.bias, layer.effective_weight(), False,
                                           _dx(layer, estimates=False)))


def _reference_run(layer: Layer, x: torch.Tensor, act: Activation | None) -> torch.Tensor:
    """The plain-torch reference math (:class:`~twofour.sparse.reference.SparseLinearFn`): any
    device and dtype, and a sparse recipe's dense phases (W_eff = W, no MVUE)."""
    dense = layer.is_dense_phase
    return _then(act, SparseLinearFn.apply(x, layer.weight, layer.bias, layer.effective_weight(),
                                           layer.recipe.mvue and not dense, _dx(layer)))


#: The forward's routes in the order it tries them.
ROUTES: tuple[Route, ...] = (
    Route("fused linear+activation", _fused_applies, _fused_run),
    Route("fp8", lambda layer, x, act: layer.is_fp8_phase, _fp8_run),
    Route("dense", lambda layer, x, act: not layer.recipe.sparse and not layer.is_fp8_phase, _dense_run),
    Route("fast path eager", lambda layer, x, act: (_sparse_phase(layer) and not torch.compiler.is_compiling()
                                                    and _fast(layer, x) and not _fused_applies(layer, x, act)),
          _eager_run),
    Route("dense GEMMs compiled", lambda layer, x, act: (_sparse_phase(layer) and torch.compiler.is_compiling()
                                                         and _fast(layer, x) and dense_gemms(layer, x)),
          _dense_gemms_run),
    Route("fast path compiled", lambda layer, x, act: (_sparse_phase(layer) and torch.compiler.is_compiling()
                                                       and _fast(layer, x) and not dense_gemms(layer, x)),
          _compiled_run),
    Route("reference", lambda layer, x, act: True, _reference_run),
)


def route_for(layer: Layer, x: torch.Tensor, act: Activation | None = None) -> Route:
    """The route ``layer(x, act=act)`` runs: the first of :data:`ROUTES` that applies."""
    return next(route for route in ROUTES if route.applies(layer, x, act))
