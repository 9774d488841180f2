"""FP8 with current scaling (docs/design.md, section 1): quantization, real FP8 GEMMs through
``torch._scaled_mm`` where the hardware and torch have them, and the plain-torch reference.

``quantize(t, fmt, scaling)`` returns ``(q, scale)`` with ``t ~= q * scale``: the scale is
``amax * (1 / fmt_max)`` from the tensor's (or each row's) current absolute maximum, so the
largest value lands on the format's largest one. e4m3 is for forward operands and (by default)
gradients, e5m2 for gradients on request.
:class:`FP8LinearFn` runs a linear's three GEMMs in FP8 (y = x W^T, dX = dY W, dW = dY^T X);
each GEMM falls back to the reference (dequantize, multiply in the compute dtype) where
``_scaled_mm`` is missing or refuses the operands.

The forward GEMM of a 2:4 weight also has an FP8 2:4 route, taken where it measures faster than
the dense FP8 GEMM with every cost counted: the e4m3 weight compressed into cuSPARSELt's layout (a
Triton kernel), its FP8 2:4 GEMM, and one pass over the output for the operands' scales and the
bias, since cuSPARSELt 0.8 refuses a per-row alpha for FP8 and ignores device-side operand
scales (docs/notes/fp8.md), and a host-side alpha would need the scale on the
host (a sync per GEMM). cuSPARSELt builds FP8 2:4 GEMMs of two e4m3 or two e5m2 operands, not
of one of each: with e5m2 gradients the backward GEMMs stay dense; with e4m3 gradients and one
scale, dW with MVUE has an FP8 2:4 route on the estimate (:func:`_mvue_dw`, the estimate written
compressed by :func:`twofour.kernels.mvue_fp8.mvue_e4m3`), taken where it measures faster than
the exact dense GEMM; as in the bf16 fast path, dW is exact wherever the estimate's 2:4 GEMM does
not pay (only the plain-torch reference always draws it). dX multiplies the dense effective
weight (its 2:4 groups run along the other axis).

On a GPU the quantization runs Triton kernels (:mod:`twofour.kernels.fp8cast`) or compiled
passes, whichever measured faster.

Overflow policy: values are saturated to the format's range, so finite inputs never overflow.
A NaN or inf in an operand makes its amax (per tensor, or per row) non-finite, hence its scale,
hence every output element that operand touches NaN or inf: a diverging run shows up as a
non-finite loss, never as a finite-looking result. An all-zero tensor (or row), or one
whose amax / fmt_max underflows to 0, gets scale 1.
"""


from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch

from .. import dispatch
from ..kernels import fp8cast, ops

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_FORMATS = (E4M3, E5M2)


@dataclass(frozen=True)
class Scaling:
    """How many scales a quantized matrix gets: one (``tensorwise``) or one per row along the
    contraction dimension (``rowwise``; a GEMM's row scales factor out of its output)."""

    name: str
    rowwise: bool


TENSORWISE = Scaling("tensorwise", False)
ROWWISE = Scaling("rowwise", True)
SCALINGS: dict[str, Scaling] = {s.name: s for s in (TENSORWISE, ROWWISE)}


def _check_fmt(fmt: torch.dtype) -> None:
    if fmt not in _FORMATS:
        raise TypeError(f"fmt must be torch.float8_e4m3fn or torch.float8_e5m2, got {fmt}")


def _current_scale(t: torch.Tensor, fmt: torch.dtype, rowwise: bool = False) -> torch.Tensor:
    """The float32 dequantization scale of ``t`` (of each row with ``rowwise``, as (rows, 1)):
    max |t| in one reduction, NaN propagating, times 1 / fmax (as the compiler lowers a division by
    a constant: the same bits eager and compiled); 1 where that is 0 (all zeros, or an amax too
    small to scale), a NaN amax stays NaN."""
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1 if rowwise else None, keepdim=rowwise,
                                    dtype=torch.float32)
    scale = amax * (1.0 / torch.finfo(fmt).max)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _quantize(t: torch.Tensor, fmt: torch.dtype, rowwise: bool,
              transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The quantization in plain torch: ``(q, scale, q^T row-major or None)``. One amax reduction
    (no |t| tensor), then scale, saturate and cast."""
    fmax = torch.finfo(fmt).max
    scale = _current_scale(t, fmt, rowwise)
    q = (t.float() / scale).clamp(-fmax, fmax).to(fmt)
    return q, scale, (q.t().contiguous() if transposed else None)


_compiled: dict[tuple, object] = {}


def _compiled_quantize(key: tuple):
    """:func:`_quantize` compiled for one variant (``key``: input dtype and layout, format, flags)
    into one fused pass for amax and one for scale + cast + transposed copy; shapes stay dynamic.
    Dynamo caps the recompilations of one code object (8 by default) and the variants in use
    outnumber that, so each variant compiles its own copy of the code."""
    fn = _compiled.get(key)
    if fn is None:
        code = _quantize.__code__.replace(co_name=f"_quantize_{len(_compiled)}")
        fn = _compiled[key] = torch.compile(types.FunctionType(code, _quantize.__globals__, code.co_name),
                                            fullgraph=True, dynamic=True)
    return fn


def _variant(t: torch.Tensor, fmt: torch.dtype, rowwise: bool, transposed: bool) -> tuple:
    """What a compiled quantization specializes on (shapes stay dynamic)."""
    return t.dtype, t.dim(), t.is_contiguous(), fmt, rowwise, transposed


def _guarded(route: tuple, what: str, fn, fallback, *args):
    """``fn(*args)`` (``what``: the operation, for the log); if it raises, ``route`` is recorded
    as failed (:func:`twofour.dispatch.record_failure`, logged once) and ``fallback(*args)``,
    plain torch computing the same bytes, answers: a failing kernel never stops a training run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any compiler or launch failure
        dispatch.record_failure(route, what, e, "plain torch")
        return fallback(*args)


def quantize_t(t: torch.Tensor, fmt: torch.dtype = E4M3, scaling: Scaling = TENSORWISE, *,
               transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`quantize`, plus (with ``transposed``, tensorwise only) ``q^T`` as a row-major copy
    written in the same pass: the operand a linear's backward multiplies along its other axis.
    On a GPU with the fast path on, the Triton kernels (:mod:`twofour.kernels.fp8cast`) or the
    compiled plain-torch passes, whichever measured faster for this variant and shape (timed
    once, like the GEMM dispatch: ``dispatch.choices()`` lists them); plain torch elsewhere."""
    _check_fmt(fmt)
    if scaling.rowwise and t.dim() != 2:
        raise ValueError(f"rowwise scaling needs a 2-D tensor, got shape {tuple(t.shape)}")
    if transposed and (scaling.rowwise or t.dim() != 2):
        raise ValueError("a transposed copy needs a 2-D tensor and tensorwise scaling (row scales don't transpose)")
    t, rowwise = t.detach(), scaling.rowwise
    args = (t, fmt, rowwise, transposed)
    if not (t.is_cuda and dispatch.fast and not torch.compiler.is_compiling()):
        return _quantize(*args)
    key = _variant(*args)
    routes = {}
    by_triton, by_compiled = ("fp8-quantize-triton", *key), ("fp8-quantize-compiled", *key)
    if not dispatch.failed(by_triton) and ops.triton_ok(t) and fp8cast.supported(t, rowwise, transposed):
        routes["triton"] = lambda: _guarded(by_triton, "the triton FP8 quantization", fp8cast.quantize, _quantize,
                                            *args)
    if not dispatch.failed(by_compiled):
        routes["compiled"] = lambda: _guarded(by_compiled, "the compiled FP8 quantization", _compiled_quantize(key),
                                              _quantize, *args)
    if not routes:
        return _quantize(*args)
    k = t.shape[-1] if t.dim() else 1
    return routes[dispatch.choose(_dispatch_kind(fmt, rowwise, transposed), t.numel() // k, k, 0, "row", t.dtype,
                                  routes)]()


@functools.cache
def _dispatch_kind(fmt: torch.dtype, rowwise: bool, transposed: bool) -> str:
    """The quantization's name in the dispatch's choices (built once per variant, not per call)."""
    scaling = ROWWISE if rowwise else TENSORWISE
    return f"fp8-quantize-{str(fmt).split('_')[1]}-{scaling.name}{'+T' if transposed else ''}"


def quantize(t: torch.Tensor, fmt: torch.dtype = E4M3,
             scaling: Scaling = TENSORWISE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``t`` (2-D for rowwise) in FP8 ``fmt`` and its float32 dequantization scale
    (a scalar, or (rows, 1) for rowwise) with ``t ~= q * scale``. Current amax scaling; an
    all-zero tensor or row gets scale 1; NaN/inf give a non-finite scale (module docstring)."""
    q, scale, _ = quantize_t(t, fmt, scaling)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference dequantization ``q * scale`` in ``dtype``."""
    return (q.float() * scale).to(dtype)


def fake_fp8(t: torch.Tensor, fmt: torch.dtype = E4M3) -> torch.Tensor:
    """``t`` rounded onto the FP8 grid of ``fmt`` (tensorwise current scaling), in its own dtype:
    the numerics of an FP8 GEMM operand."""
    return dequantize(*quantize(t, fmt, TENSORWISE), t.dtype)
