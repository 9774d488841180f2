"""FP8 with current scaling (docs/design.md, section 1): quantization, real FP8 GEMMs through
``torch._scaled_mm`` where the hardware and torch have them, and the plain-torch reference.

``quantize(t, fmt, scaling)`` returns ``(q, scale)`` with ``t ~= q * scale``: the scale is
``amax / fmt_max`` from the tensor's (or each row's) current absolute maximum, so the largest
value lands on the format's largest one. e4m3 is for forward operands, e5m2 for gradients.
:class:`FP8LinearFn` runs a linear's three GEMMs in FP8 (y = x W^T, dX = dY W, dW = dY^T X);
each GEMM falls back to the reference (dequantize, multiply in the compute dtype) where
``_scaled_mm`` is missing or refuses the operands.

Overflow policy: values are saturated to the format's range, so finite inputs never overflow.
A NaN or inf in an operand makes its amax (per tensor, or per row) non-finite, hence its scale,
hence every output element that operand touches NaN or inf: a diverging run shows up as a
non-finite loss, never as a finite-looking result. An all-zero tensor (or row) gets scale 1.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .pruning import mvue_24_padded

__all__ = ["fake_fp8", "E4M3", "E5M2", "Scaling", "TENSORWISE", "ROWWISE", "SCALINGS", "DEFAULT_SCALING",
           "quantize", "dequantize", "scaled_mm", "scaled_mm_available", "refusals", "fp8_linear", "FP8LinearFn"]

log = logging.getLogger("twofour")

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FORMATS = (E4M3, E5M2)


@dataclass(frozen=True)
class Scaling:
    """How many scales a quantized matrix gets: one (``tensorwise``) or one per row along the
    contraction dimension (``rowwise``; a GEMM's row scales factor out of its output)."""

    name: str
    rowwise: bool

    def amax(self, t: torch.Tensor) -> torch.Tensor:
        """The float32 absolute maximum: a scalar, or (rows, 1) for rowwise."""
        a = t.detach().abs()
        return (a.amax(dim=-1, keepdim=True) if self.rowwise else a.amax()).float()


TENSORWISE = Scaling("tensorwise", False)
ROWWISE = Scaling("rowwise", True)
SCALINGS: dict[str, Scaling] = {s.name: s for s in (TENSORWISE, ROWWISE)}
#: What FP8 layers use (the scaling the simulation always had).
DEFAULT_SCALING = TENSORWISE


def _check_fmt(fmt: torch.dtype) -> None:
    if fmt not in _FORMATS:
        raise TypeError(f"fmt must be torch.float8_e4m3fn or torch.float8_e5m2, got {fmt}")


def quantize(t: torch.Tensor, fmt: torch.dtype = E4M3,
             scaling: Scaling = TENSORWISE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``t`` (2-D for rowwise) in FP8 ``fmt`` and its float32 dequantization scale
    (a scalar, or (rows, 1) for rowwise) with ``t ~= q * scale``. Current amax scaling; an
    all-zero tensor or row gets scale 1; NaN/inf give a non-finite scale (module docstring)."""
    _check_fmt(fmt)
    if scaling.rowwise and t.dim() != 2:
        raise ValueError(f"rowwise scaling needs a 2-D tensor, got shape {tuple(t.shape)}")
    fmax = torch.finfo(fmt).max
    amax = scaling.amax(t)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / fmax)  # NaN amax stays NaN
    q = (t.detach().float() / scale).clamp(-fmax, fmax).to(fmt)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference dequantization ``q * scale`` in ``dtype``."""
    return (q.float() * scale).to(dtype)


def fake_fp8(t: torch.Tensor, fmt: torch.dtype = E4M3) -> torch.Tensor:
    """``t`` rounded onto the FP8 grid of ``fmt`` (tensorwise current scaling), in its own dtype:
    the numerics of an FP8 GEMM operand."""
    return dequantize(*quantize(t, fmt, TENSORWISE), t.dtype)


# --------------------------------------------------------------------------------------------
# one FP8 GEMM
# --------------------------------------------------------------------------------------------

_refused: set[tuple] = set()


def scaled_mm_available() -> bool:
    """Whether this torch has ``torch._scaled_mm`` at all."""
    return hasattr(torch, "_scaled_mm")


def refusals() -> frozenset[tuple]:
    """The operand kinds ``_scaled_mm`` refused so far in this process (each ran the reference):
    (device type, A format, B format, rowwise, A shape, N, output dtype)."""
    return frozenset(_refused)


def _reference_mm(qa, sa, qb, sb, out_dtype):
    return (dequantize(qa, sa) @ dequantize(qb, sb).t()).to(out_dtype)


@torch.compiler.disable
def scaled_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T`` in ``out_dtype`` from quantized ``a`` (M, K) and ``b`` (N, K),
    both row-major along K with scales from :func:`quantize`: ``torch._scaled_mm`` (a row-major,
    b column-major, rowwise scales as (M, 1) and (1, N)) where it takes the operands, else the
    reference. A refusal is remembered per (device, formats, scaling, shape) and logged once."""
    m, n = qa.shape[0], qb.shape[0]
    qa, qb = qa.contiguous(), qb.contiguous()  # a row-major, b^T column-major (no-ops when already)
    key = (qa.device.type, qa.dtype, qb.dtype, sa.numel() > 1, tuple(qa.shape), n, out_dtype)
    if scaled_mm_available() and key not in _refused:
        try:
            return torch._scaled_mm(qa, qb.t(), sa.reshape(m, 1) if sa.numel() > 1 else sa,
                                    sb.reshape(1, n) if sb.numel() > 1 else sb, out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            _refused.add(key)
            log.warning("torch._scaled_mm refused %s: %s; this GEMM runs the FP8 reference instead", key,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _reference_mm(qa, sa, qb, sb, out_dtype)


# --------------------------------------------------------------------------------------------
# a linear's three GEMMs in FP8
# --------------------------------------------------------------------------------------------


def _other_axis(q: torch.Tensor, s: torch.Tensor, hp: torch.Tensor | None, fmt: torch.dtype,
                scaling: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """The operand quantized along its other dimension: the transposed FP8 tensor (tensorwise,
    one byte per element moved) or the high-precision one quantized again (rowwise)."""
    if scaling.rowwise:
        return quantize(hp.t().contiguous(), fmt, scaling)
    return q.t().contiguous(), s


class FP8LinearFn(torch.autograd.Function):
    """y = x W_eff^T + b with FP8 GEMMs: forward x(e4m3) W_eff(e4m3)^T, dX = dY(e5m2) W_eff(e4m3),
    dW = dY^T(e5m2) X(e4m3) (on the MVUE 2:4 estimate of dY^T with ``mvue``), outputs in the
    compute dtype; dW passed straight through to the master ``weight``."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_eff, mvue: bool, scaling: Scaling, cdt: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize(x2, E4M3, scaling)
        qw, sw = quantize(w_eff, E4M3, scaling)
        y = scaled_mm(qx, sx, qw, sw, cdt)
        if bias is not None:
            y = y + bias.to(cdt)
        keep = (x2, w_eff) if scaling.rowwise else (None, None)
        ctx.save_for_backward(qx, sx, qw, sw, *keep)
        ctx.mvue, ctx.scaling, ctx.cdt, ctx.x_shape, ctx.x_dtype = mvue, scaling, cdt, x.shape, x.dtype
        ctx.has_bias, ctx.w_dtype = bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        qx, sx, qw, sw, x2, w_eff = ctx.saved_tensors
        sc, cdt = ctx.scaling, ctx.cdt
        dy2 = dy.reshape(-1, dy.shape[-1]).to(cdt)
        dx = dw = db = qd = sd = None
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_dx or (need_dw and not ctx.mvue and not sc.rowwise):  # tensorwise: once for dX and dW (transposed)
            qd, sd = quantize(dy2, E5M2, sc)
        if need_dx:
            qwt, swt = _other_axis(qw, sw, w_eff, E4M3, sc)  # W^T (K, N), row-major along N
            dx = scaled_mm(qd, sd, qwt, swt, cdt).reshape(ctx.x_shape).to(ctx.x_dtype)
        if need_dw:
            if ctx.mvue:  # the unbiased 2:4 estimate of dY^T (along tokens), quantized on its own
                qdt, sdt = quantize(mvue_24_padded(dy2.t().contiguous()), E5M2, sc)
            else:
                qdt, sdt = _other_axis(qd, sd, dy2, E5M2, sc)  # dY^T (N, T), row-major along T
            qxt, sxt = _other_axis(qx, sx, x2, E4M3, sc)  # X^T (K, T), row-major along T
            dw = scaled_mm(qdt, sdt, qxt, sxt, cdt).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_eff: torch.Tensor | None = None,
               *, mvue: bool = False, scaling: Scaling = DEFAULT_SCALING) -> torch.Tensor:
    """``F.linear(x, w_eff, bias)`` with FP8 GEMMs (:class:`FP8LinearFn`), the gradient of the
    effective weight ``w_eff`` (default ``weight``) going to ``weight``. The GEMMs run in
    autocast's dtype if on, else ``x``'s; the output has that dtype."""
    dev = x.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    w_eff = weight.detach() if w_eff is None else w_eff
    with torch.autocast(dev, enabled=False):
        return FP8LinearFn.apply(x, weight, bias, w_eff.detach(), mvue, scaling, cdt)
