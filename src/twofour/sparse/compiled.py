"""Which form a sparse layer takes in compiled code, chosen by measurement before compiling.

Under ``torch.compile`` the fast path is one opaque op (``twofour::sparse_linear``) around the
weight's per-call compression; it pays where its 2:4 GEMMs beat dense ones by more than the
compression and the fusion the compiler loses around the op. Where they do not (small widths),
the layer runs the recipe's math with dense GEMMs on its effective weight, in plain torch the
compiler fuses (the reference math, with an exact dW: MVUE pays only with a 2:4 dW GEMM).
:func:`plan_compiled` times both forms of each sparse layer shape, eagerly, forward and backward,
and records the faster in :mod:`twofour.dispatch`; :func:`~twofour.sparse.routes.dense_gemms`
reads that record when compiled code is traced. A shape nobody planned keeps the 2:4 op.
"""

from __future__ import annotations

import torch

from .. import dispatch
from .fastpath import applies, compiled_linear, operands
from .layer import SparseLinear
from .reference import SparseLinearFn
from .routes import dense_gemms, plan_key

__all__ = ["plan_compiled", "dense_gemms", "plan_key"]


def plan_compiled(model: torch.nn.Module, tokens: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """For each sparse layer shape of ``model`` in a sparse phase, on the GPU fast path: time its
    forward and backward on ``tokens`` rows in ``dtype`` as the 2:4 op (compressing the weight,
    as compiled code does each call) and as dense GEMMs on the effective weight, and record the
    faster for compiled code to take. Measured on a fresh layer of the same shape and recipe (the
    model's may be sharded). Call before the first compiled call. Returns {key: choice}."""
    chosen: dict[str, str] = {}
    for layer in model.modules():
        if not (isinstance(layer, SparseLinear) and layer.recipe.sparse and not layer.is_dense_phase
                and not layer.is_fp8_phase and layer.weight.device.type == "cuda"):
            continue
        key = plan_key(layer, tokens, dtype)
        x = torch.randn(tokens, layer.in_features, device=layer.weight.device, dtype=dtype, requires_grad=True)
        if key in chosen or not applies(x, layer.in_features, layer.out_features):
            continue
        probe = SparseLinear(layer.in_features, layer.out_features, layer.bias is not None, device=x.device,
                             recipe=layer.recipe)
        chosen[key] = dispatch.recorded(key) or dispatch.measure(key, _candidates(probe, x))
    return chosen


def _candidates(layer, x: torch.Tensor) -> dict:
    """The two forms of ``layer`` on ``x``, forward and backward, as the dispatch times them."""
    dy = torch.randn(x.shape[0], layer.out_features, device=x.device, dtype=x.dtype)
    w, r = layer.weight, layer.recipe

    def sparse() -> None:
        wc, wd, wtc = operands(layer.pruner, w.detach(), layer.beta, layer.mask, x.dtype, dx=r.dx)
        y = compiled_linear(x, w, layer.bias, wc, wd, wtc, r.mvue, r.dx)
        torch.autograd.grad(y, (x, w), dy)

    def dense() -> None:
        y = SparseLinearFn.apply(x, w, layer.bias, layer.effective_weight(), False, r.dx_route(False, estimates=False))
        torch.autograd.grad(y, (x, w), dy)

    return {"sparse": sparse, "dense": dense}
