"""A linear layer's three GEMMs in FP8 (:class:`FP8LinearFn`, :func:`fp8_linear`) and the routes
of its weight gradient (exact, or on the MVUE 2:4 estimate where that measures faster)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dispatch
from ..functional import _prune_transpose_24, mvue_24_padded
from ..kernels import fp8cast, ops
from ..kernels.mvue_fp8 import SCALE_BOUND, mvue_e4m3
from ..kernels.triton_common import HAS_TRITON
from .matmul import _fp8_24_device, _fp8_24_fits, scaled_mm
from .precision import FP8, Precision, as_precision
from .quantize import (
    E4M3,
    TENSORWISE,
    Scaling,
    _current_scale,
    _guarded,
    quantize,
    quantize_t,
)


def _pruned_t(w_eff: torch.Tensor) -> torch.Tensor:
    """The pruned-t route's W_pt: one kernel pass where it runs on the GPU, else plain torch."""
    return ops.prune_transpose(w_eff) if ops.prune_transpose_ok(w_eff) else _prune_transpose_24(w_eff)


def _mvue_dw_fits(dy2: torch.Tensor, qxt: torch.Tensor, fmt: torch.dtype, scaling: Scaling, cdt: torch.dtype) -> bool:
    """Whether dW on the MVUE estimate may run as one FP8 2:4 GEMM, as far as a trace can tell (the
    device's half, :func:`_fp8_24_device`, is checked when the route runs): e4m3 gradients with
    one scale (both operands of an FP8 2:4 GEMM share a format, and the bound of
    :mod:`twofour.kernels.mvue_fp8` scales from dY's tensorwise scale), Triton and the fast path
    on, dY on a GPU, and sizes :func:`_fp8_24_fits` (K: the tokens)."""
    return (fmt == E4M3 and not scaling.rowwise and HAS_TRITON and dispatch.fast and dy2.is_cuda
            and _fp8_24_fits(dy2.shape[1], dy2.shape[0], qxt.shape[0], cdt))


def _mvue_dw_reference(dy2: torch.Tensor, qxt: torch.Tensor, sxt: torch.Tensor, fmt: torch.dtype, scaling: Scaling,
                       cdt: torch.dtype) -> torch.Tensor:
    """dW = est(dY^T) X as the plain-torch reference draws it: the estimate, its own quantization,
    then ``scaled_mm``."""
    qet, set_ = quantize(mvue_24_padded(dy2.t().contiguous()), fmt, scaling)
    return scaled_mm(qet, set_, qxt, sxt, cdt)


def _exact_dw(dy2: torch.Tensor, qd: torch.Tensor | None, sd: torch.Tensor | None, qxt: torch.Tensor,
              sxt: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """dW = dY^T X exact, e4m3 and one scale: ``scaled_mm`` on dY's e4m3 copy transposed (``qd``,
    ``sd``: the dX GEMM's quantization of dY, transposed in one pass of
    :func:`twofour.kernels.fp8cast.transpose`; where there was none, one pass over dY writes the
    transposed copy)."""
    if qd is None:
        _, sd, qdt = quantize_t(dy2, E4M3, TENSORWISE, transposed=True)
    else:  # one copy of the FP8 bytes, no second quantization
        qdt = _transposed(qd)
    return scaled_mm(qdt, sd, qxt, sxt, cdt)


def _transposed(q: torch.Tensor) -> torch.Tensor:
    """``q^T`` row-major: a view where ``q`` is column-major, else one pass of
    :func:`twofour.kernels.fp8cast.transpose` on a GPU; torch's strided copy, far slower for
    1-byte elements (docs/PERFORMANCE.md), where the kernel cannot run or once it failed (logged
    once)."""
    if q.t().is_contiguous():
        return q.t()
    route = ("fp8-transpose-triton", q.device.type, q.dtype)
    if q.is_contiguous() and ops.triton_ok(q) and not dispatch.failed(route):
        return _guarded(route, "the triton FP8 transpose", fp8cast.transpose, _torch_transpose, q)
    return _torch_transpose(q)


def _torch_transpose(q: torch.Tensor) -> torch.Tensor:
    return q.t().contiguous()


def _mvue_dw_timed(dy2: torch.Tensor, qd: torch.Tensor | None, sd: torch.Tensor | None, qxt: torch.Tensor,
                   sxt: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """dW with e4m3 gradients and one scale, where :func:`_mvue_dw_fits` on a GPU
    :func:`_fp8_24_device`, by the faster of two routes, timed whole once per shape
    (``dispatch.choices()`` key ``fp8-dw-mvue``): the exact dense GEMM dY^T X (:func:`_exact_dw`, making
    dY^T included), or FP8 2:4 on the MVUE estimate, where one kernel writes the
    estimate compressed in e4m3 at the bound scale (:func:`mvue_e4m3`), the FP8 2:4 GEMM multiplies
    it by X (``qxt`` row-major is X column-major) and one pass applies the two scales. As in the
    bf16 fast path, the estimate is drawn only where its 2:4 GEMM pays. ``qd``, ``sd``: dY in e4m3
    and its scale where the dX GEMM quantized it, else None."""
    def dense() -> torch.Tensor:
        return _exact_dw(dy2, qd, sd, qxt, sxt, cdt)

    n, t, k = dy2.shape[1], dy2.shape[0], qxt.shape[0]
    failed = ("fp8-24-dw", n, t, k, dy2.device.index, cdt)
    if dispatch.failed(failed):
        return dense()

    def sparse() -> torch.Tensor:
        # dY's e4m3 scale: the dX GEMM's, else from one reduction (no dX GEMM quantized dY)
        s = (sd if sd is not None else _current_scale(dy2, E4M3)) * SCALE_BOUND
        packed = mvue_e4m3(dy2.t(), s)
        return fp8cast.rescale_(ops.spmm(packed, qxt.t(), n, False, out_dtype=cdt), s, sxt)

    cands = {"sparse": sparse, "dense": dense}
    try:
        return cands[dispatch.choose("fp8-dw-mvue", n, t, k, "col", E4M3, cands)]()
    except Exception as e:  # noqa: BLE001 - cuSPARSELt refused the operands: the dense route answers
        dispatch.record_failure(failed, "the FP8 2:4 dW GEMM", e, "the exact dense FP8 GEMM")
        return dense()


def _mvue_dw_routes(dy2: torch.Tensor, qd: torch.Tensor | None, sd: torch.Tensor | None, qxt: torch.Tensor,
                    sxt: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """For operands :func:`_mvue_dw_fits`: :func:`_mvue_dw_timed` on a GPU with FP8 2:4 GEMMs, else
    the exact dense GEMM."""
    if dy2.is_cuda and _fp8_24_device(dy2):
        return _mvue_dw_timed(dy2, qd, sd, qxt, sxt, cdt)
    return _exact_dw(dy2, qd, sd, qxt, sxt, cdt)


# one opaque node in a compiled backward, so that the routes are timed and taken at run time there too
_mvue_dw_op = torch.library.custom_op("twofour::mvue_dw_e4m3", _mvue_dw_routes, mutates_args=())


@_mvue_dw_op.register_fake
def _(dy2, qd, sd, qxt, sxt, cdt):
    return dy2.new_empty((dy2.shape[1], qxt.shape[0]), dtype=cdt)


def _mvue_dw(dy2: torch.Tensor, qd: torch.Tensor | None, sd: torch.Tensor | None, qxt: torch.Tensor,
             sxt: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """dW in ``cdt`` for operands :func:`_mvue_dw_fits`: :func:`_mvue_dw_routes` (under torch's
    tracers the custom op ``twofour::mvue_dw_e4m3``, which checks the device when it runs, so a
    compiled model, CUDA graphs included, takes the 2:4 route too)."""
    return (_mvue_dw_op if torch.compiler.is_compiling() else _mvue_dw_routes)(dy2, qd, sd, qxt, sxt, cdt)


class FP8LinearFn(torch.autograd.Function):
    """y = x W_eff^T + b with the GEMMs a :class:`~twofour.fp8.precision.Precision` puts in FP8:
    forward x(e4m3) W_eff(e4m3)^T, dX = dY(g) W_eff(e4m3), dW = dY^T(g) X(e4m3) (with ``mvue``, on
    the MVUE 2:4 estimate of dY^T where its FP8 2:4 GEMM pays, and always in the plain-torch
    reference), g = ``precision.grad``; a GEMM the precision leaves out runs in the compute dtype
    ``cdt`` from the unquantized operands; outputs in ``cdt``; dW passed straight through to the
    master ``weight``; ``grad``: whether grad mode was on at the call (no backward copies
    otherwise); ``sparse``: W_eff is 2:4 (the forward GEMM may then run FP8 2:4,
    :func:`scaled_mm`, and so may dX where the dX route makes W^T 2:4 along the output features:
    ``pruned-t``, ``transposable``). Tensorwise, each operand is quantized once, with the transposed copy its
    other GEMM reads written in the same pass; rowwise, the other axis is quantized again from
    the high-precision tensor."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_eff, precision: Precision, mvue: bool, cdt: torch.dtype, grad: bool = True,
                sparse: bool = False, dx: str = "dense"):
        scaling, grad_fmt = precision.scaling, precision.grad
        x2 = x.reshape(-1, x.shape[-1])
        tw = not scaling.rowwise and grad_fmt is not None  # transposed copies for FP8 backward GEMMs
        need_dx, need_dw = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        b = None if bias is None else bias.to(cdt)
        # what dX multiplies by: W_eff, or for the pruned-t route W_eff with W_eff^T pruned 2:4 too
        w_dx = _pruned_t(w_eff) if dx == "pruned-t" and need_dx else w_eff
        swt = qwt = None  # dX's copy of W^T and its scale
        if precision.forward:
            qx, sx, qxt = quantize_t(x2, E4M3, scaling, transposed=tw and need_dw)
            qw, sw, qwt = quantize_t(w_eff, E4M3, scaling, transposed=tw and need_dx and w_dx is w_eff)
            swt = sw
            y = scaled_mm(qx, sx, qw, sw, cdt, sparse_b=sparse, bias=b)
        else:  # the forward GEMM in the compute dtype; only the copies the FP8 backward reads
            y = F.linear(x2.to(cdt), w_eff.to(cdt), b)
            _, sx, qxt = quantize_t(x2, E4M3, scaling, transposed=True) if tw and need_dw else (None, None, None)
        if tw and need_dx and qwt is None:  # W^T's copy from its own pass (pruned-t, or no FP8 forward)
            _, swt, qwt = quantize_t(w_dx, E4M3, scaling, transposed=True)
        if tw:  # what the backward multiplies: W^T and X^T, row-major along N and T
            ctx.save_for_backward(qwt, swt, qxt, sx)
        else:
            ctx.save_for_backward(x2, w_dx)
        ctx.dx_mvue = dx == "mvue"
        ctx.sparse_dx = sparse and dx in ("pruned-t", "transposable")  # W_dx^T 2:4 along N: dX may run FP8 2:4
        ctx.mvue, ctx.scaling, ctx.cdt, ctx.x_shape, ctx.x_dtype = mvue, scaling, cdt, x.shape, x.dtype
        ctx.grad_fmt = grad_fmt
        ctx.has_bias, ctx.w_dtype = bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        sc, cdt, gf = ctx.scaling, ctx.cdt, ctx.grad_fmt
        dy2 = dy.reshape(-1, dy.shape[-1]).to(cdt)
        dx = dw = db = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        # MVUE's estimate: drawn by the plain-torch reference; on the GPU fast path only where its
        # FP8 2:4 GEMM measures faster than the exact GEMM, else dW is exact (unbiased either way)
        fast = dy2.is_cuda and dispatch.fast
        est = need_dw and ctx.mvue and not fast
        # the mvue dX route's estimate of dY along the features: the reference's (no FP8 2:4 GEMM
        # takes it as its sparse operand, so on the fast path dX is exact, unbiased either way)
        dy_dx = mvue_24_padded(dy2) if need_dx and ctx.dx_mvue and not fast else dy2
        if gf is None:  # the backward GEMMs dense in the compute dtype (no 2:4 route for the estimate)
            x2, w_eff = ctx.saved_tensors
            if need_dx:
                dx = (dy_dx @ w_eff.to(cdt)).reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_dw:
                dw = ((mvue_24_padded(dy2.t().contiguous()) if est else dy2.t()) @ x2.to(cdt)).to(ctx.w_dtype)
            return dx, dw, db, None, None, None, None, None, None, None
        if sc.rowwise:
            x2, w_eff = ctx.saved_tensors
            if need_dx:
                qwt, swt = quantize(w_eff.t().contiguous(), E4M3, sc)
            if need_dw:
                qxt, sxt = quantize(x2.t().contiguous(), E4M3, sc)
        else:
            qwt, swt, qxt, sxt = ctx.saved_tensors
        routed = need_dw and ctx.mvue and fast and _mvue_dw_fits(dy2, qxt, gf, sc, cdt)  # transposes dY's copy itself
        dy_t = need_dw and not est and not routed  # dY^T exact: from dY's quantization (tensorwise) or its own
        qd = sd = qdt = sdt = None
        if need_dx or (dy_t and not sc.rowwise):
            qd, sd, qdt = quantize_t(dy2, gf, sc, transposed=dy_t and not sc.rowwise)
            sdt = sd
        if need_dx:
            qe, se = (qd, sd) if dy_dx is dy2 else quantize(dy_dx, gf, sc)
            dx = scaled_mm(qe, se, qwt, swt, cdt, sparse_b=ctx.sparse_dx, gemm="dx")
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if est:
            dw = _mvue_dw_reference(dy2, qxt, sxt, gf, sc, cdt).to(ctx.w_dtype)
        elif need_dw:
            if sc.rowwise:
                qdt, sdt = quantize(dy2.t().contiguous(), gf, sc)
            dw = _mvue_dw(dy2, qd, sd, qxt, sxt, cdt) if routed else scaled_mm(qdt, sdt, qxt, sxt, cdt)
            dw = dw.to(ctx.w_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_eff: torch.Tensor | None = None,
               *, precision: str | Precision = FP8, mvue: bool = False, sparse: bool = False,
               dx: str = "dense") -> torch.Tensor:
    """``F.linear(x, w_eff, bias)`` with the GEMMs ``precision`` (a :class:`Precision` or a name of
    :data:`~twofour.fp8.precision.PRECISIONS`, default ``fp8``) puts in FP8 (:class:`FP8LinearFn`),
    the gradient of the effective weight ``w_eff`` (default ``weight``) going to ``weight``. The
    GEMMs run in autocast's dtype if on, else ``x``'s; the output has that dtype. ``sparse``:
    ``w_eff`` is 2:4 along its rows, so the forward GEMM may run FP8 2:4 where that measures
    faster. ``dx``: the dX route (:data:`~twofour.sparse.recipes.DX_ROUTES`; ``pruned-t`` multiplies
    dY by W_eff with its transpose pruned 2:4 too, ``mvue`` by dY's estimate in the reference;
    ``transposable`` says ``w_eff`` is 2:4 along both dimensions, a transposable mask's). With
    ``sparse`` and ``pruned-t`` or ``transposable`` the dX GEMM may run FP8 2:4 as well.
    ``ValueError`` for a precision with no GEMM in FP8 (``F.linear`` is that)."""
    precision = as_precision(precision)
    if not precision.fp8:
        raise ValueError(f"fp8_linear: precision {precision.name!r} puts no GEMM in FP8 (use F.linear)")
    dev = x.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    w_eff = weight.detach() if w_eff is None else w_eff
    with torch.autocast(dev, enabled=False):
        return FP8LinearFn.apply(x, weight, bias, w_eff.detach(), precision, mvue, cdt, torch.is_grad_enabled(), sparse,
                                 dx)
