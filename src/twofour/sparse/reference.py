"""The reference math of a SparseLinear in plain torch (any device, dtype, ``torch.compile``):
y = x W_eff^T + b, dX by the recipe's dX route (dY W_eff, dY W_pt with W_pt = W_eff with W_eff^T
pruned 2:4, or MVUE(dY) W_eff), dW = dY^T X (or its MVUE 2:4 estimate) passed straight through to
the master weight. Every fast route is tested against it on random inputs."""

from __future__ import annotations

import torch

from ..functional import _prune_transpose_24, mvue_24_padded
from .fastpath import compute_dtype

__all__ = ["SparseLinearFn", "dx_reference"]


def dx_reference(dy2: torch.Tensor, w_eff: torch.Tensor, dx: str) -> torch.Tensor:
    """dX of (tokens, out) ``dy2`` by the dX route ``dx`` (:data:`~twofour.sparse.recipes.DX_ROUTES`):
    ``dY W_eff`` (``dense``, ``transposable``), ``dY W_pt`` (``pruned-t``: W_eff's columns pruned
    2:4 too) or ``MVUE(dY) W_eff`` (``mvue``: dY's unbiased 2:4 estimate along the output features)."""
    if dx == "pruned-t":
        return dy2 @ _prune_transpose_24(w_eff)
    if dx == "mvue":
        return mvue_24_padded(dy2) @ w_eff
    return dy2 @ w_eff


class SparseLinearFn(torch.autograd.Function):
    """The reference math in plain torch (any device, dtype, torch.compile)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_eff, mvue: bool, dx: str = "dense"):
        cdt = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(cdt)
            w_eff = w_eff.to(cdt)
            y = x2 @ w_eff.t()
            if bias is not None:
                y = y + bias.to(cdt)
        ctx.save_for_backward(x2, w_eff)
        ctx.mvue, ctx.dx, ctx.x_shape, ctx.x_dtype = mvue, dx, x.shape, x.dtype
        ctx.has_bias, ctx.w_dtype = bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w_eff = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(w_eff.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dx_reference(dy2, w_eff, ctx.dx).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = dy2.t()
            if ctx.mvue:
                dyt = mvue_24_padded(dyt.contiguous())  # unbiased 2:4 along tokens
            dw = (dyt @ x2).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None
