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
bias, since cuSPARSELt 0.8 on sm90 refuses a per-row alpha for FP8 and ignores device-side
operand scales (``benchmarks/fp8_spmm.py``), and a host-side alpha would need the scale on the
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
import logging
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import settings
from .kernels import cusparselt, fp8cast, ops
from .kernels.compress import HAS_TRITON, compress_e4m3
from .kernels.mvue_fp8 import SCALE_BOUND, mvue_e4m3
from .pruning import mvue_24_padded

__all__ = ["fake_fp8", "E4M3", "E5M2", "Scaling", "TENSORWISE", "ROWWISE", "SCALINGS", "DEFAULT_SCALING",
           "quantize", "quantize_t", "dequantize", "scaled_mm", "scaled_mm_available", "refusals", "fp8_linear",
           "FP8LinearFn"]

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


TENSORWISE = Scaling("tensorwise", False)
ROWWISE = Scaling("rowwise", True)
SCALINGS: dict[str, Scaling] = {s.name: s for s in (TENSORWISE, ROWWISE)}
#: What FP8 layers use (the scaling the simulation always had).
DEFAULT_SCALING = TENSORWISE


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


_failed: set[tuple] = set()  # (route, variant) whose kernels failed to compile or launch


def _why(e: BaseException) -> str:
    """An exception in one line for a warning: its type and its message's first line."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _guarded(route: str, what: str, key: tuple, fn, fallback, *args):
    """``fn(*args)`` (``what``: the operation, for the log); if it raises, ``(route, key)`` joins
    ``_failed`` (logged once) and ``fallback(*args)``, plain torch computing the same bytes,
    answers: a failing kernel never stops a training run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any compiler or launch failure
        _failed.add((route, key))
        log.warning("%s FP8 %s failed for %s (%s); it is not used from now on", route, what, key, _why(e))
        return fallback(*args)


def quantize_t(t: torch.Tensor, fmt: torch.dtype = E4M3, scaling: Scaling = TENSORWISE, *,
               transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`quantize`, plus (with ``transposed``, tensorwise only) ``q^T`` as a row-major copy
    written in the same pass: the operand a linear's backward multiplies along its other axis.
    On a GPU with the fast path on, the Triton kernels (:mod:`twofour.kernels.fp8cast`) or the
    compiled plain-torch passes, whichever measured faster for this variant and shape (timed
    once, like the GEMM dispatch: ``ops.choices()`` lists them); plain torch elsewhere."""
    _check_fmt(fmt)
    if scaling.rowwise and t.dim() != 2:
        raise ValueError(f"rowwise scaling needs a 2-D tensor, got shape {tuple(t.shape)}")
    if transposed and (scaling.rowwise or t.dim() != 2):
        raise ValueError("a transposed copy needs a 2-D tensor and tensorwise scaling (row scales don't transpose)")
    t, rowwise = t.detach(), scaling.rowwise
    args = (t, fmt, rowwise, transposed)
    if not (t.is_cuda and settings.fast and not torch.compiler.is_compiling()):
        return _quantize(*args)
    key = _variant(*args)
    routes = {}
    if ("triton", key) not in _failed and ops.triton_ok(t) and fp8cast.supported(t, rowwise, transposed):
        routes["triton"] = lambda: _guarded("triton", "quantization", key, fp8cast.quantize, _quantize, *args)
    if ("compiled", key) not in _failed:
        routes["compiled"] = lambda: _guarded("compiled", "quantization", key, _compiled_quantize(key), _quantize,
                                               *args)
    if not routes:
        return _quantize(*args)
    k = t.shape[-1] if t.dim() else 1
    return routes[ops.choose(_dispatch_kind(fmt, rowwise, transposed), t.numel() // k, k, 0, "row", t.dtype,
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


def _reference_mm(qa, sa, qb, sb, out_dtype, bias=None):
    out = dequantize(qa, sa) @ dequantize(qb, sb).t()
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _dense_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    m, n = qa.shape[0], qb.shape[0]
    qa, qb = qa.contiguous(), qb.contiguous()  # a row-major, b^T column-major (no-ops when already)
    key = (qa.device.type, qa.dtype, qb.dtype, sa.numel() > 1, tuple(qa.shape), n, out_dtype)
    if scaled_mm_available() and key not in _refused:
        try:
            out = torch._scaled_mm(qa, qb.t(), sa.reshape(m, 1) if sa.numel() > 1 else sa,
                                   sb.reshape(1, n) if sb.numel() > 1 else sb, out_dtype=out_dtype)
            return out if bias is None else out.add_(bias)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            _refused.add(key)
            log.warning("torch._scaled_mm refused %s: %s; this GEMM runs the FP8 reference instead", key,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _reference_mm(qa, sa, qb, sb, out_dtype, bias)


def _sparse_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T (+ bias)`` with ``b`` 2:4 along K, as one FP8 2:4 GEMM:
    out^T = B A^T with B compressed on each call (:func:`twofour.kernels.compress.compress_e4m3`)
    and A^T read in place (``a`` row-major is A^T column-major, the order cuSPARSELt's FP8 kernels
    take), out^T stored column-major (out row-major). The GEMM cannot apply the scales read on the
    device (module docstring), so one pass over the output multiplies by them and adds the bias,
    in float32 (:func:`twofour.kernels.fp8cast.rescale_`)."""
    n = qb.shape[0]
    qb = qb.contiguous()
    packed = compress_e4m3(qb) if HAS_TRITON else cusparselt.compress(qb)
    out = ops.spmm(packed, qa.contiguous().t(), n, True, out_dtype=out_dtype).t()
    return fp8cast.rescale_(out, sa, sb, bias)


_sparse_failed: set[tuple] = set()  # FP8 2:4 GEMMs cuSPARSELt could not build or run (dense from then on)


def _fp8_24_fits(sparse_rows: int, k: int, dense_rows: int, out_dtype: torch.dtype) -> bool:
    """Whether cuSPARSELt's FP8 2:4 GEMM takes these sizes: a bf16 or fp16 output, K a multiple of
    64 (the e4m3 layout's tile) and the sparse and dense operands' other sides multiples of 32."""
    return (out_dtype in (torch.bfloat16, torch.float16)
            and sparse_rows % 32 == 0 and k % 64 == 0 and dense_rows % 32 == 0)


def _fp8_24_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s GPU has FP8 2:4 GEMMs (sm89+) and the fast path (cuSPARSELt, Triton) is on
    (a cached query; not traceable: it takes the cuSPARSELt binding's lock)."""
    return fp8cast._capability(fp8cast._index(t)) >= (8, 9) and ops.fast_available()


def _fp8_24_takes(t: torch.Tensor, sparse_rows: int, k: int, dense_rows: int, out_dtype: torch.dtype) -> bool:
    """Whether cuSPARSELt's FP8 2:4 GEMM can run here (``t`` on the device it would run on): a GPU
    :func:`_fp8_24_device` and sizes it takes (:func:`_fp8_24_fits`)."""
    return t.is_cuda and _fp8_24_fits(sparse_rows, k, dense_rows, out_dtype) and _fp8_24_device(t)


def _sparse_applies(q24: torch.Tensor, s24: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                    out_dtype: torch.dtype) -> bool:
    """Whether the FP8 2:4 route can take this GEMM: both operands e4m3 with a single scale each
    (rowwise scales would need cuSPARSELt's per-row alpha, which it refuses for FP8), on a GPU and
    at a shape :func:`_fp8_24_takes`."""
    return (q24.dtype == q.dtype == E4M3 and s.numel() == 1 and s24.numel() == 1
            and _fp8_24_takes(q24, q24.shape[0], q24.shape[1], q.shape[0], out_dtype))


def _scaled_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
               out_dtype: torch.dtype, sparse_b: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not sparse_b or not _sparse_applies(qb, sb, qa, sa, out_dtype):
        return _dense_mm(qa, sa, qb, sb, out_dtype, bias)
    m, k, n = qa.shape[0], qa.shape[1], qb.shape[0]
    failed = (n, k, m, qb.device.index, out_dtype)
    if failed in _sparse_failed:
        return _dense_mm(qa, sa, qb, sb, out_dtype, bias)

    cands = {"sparse": lambda: _sparse_mm(qa, sa, qb, sb, out_dtype, bias),
             "dense": lambda: _dense_mm(qa, sa, qb, sb, out_dtype, bias)}
    try:
        choice = ops.choose("fp8-fwd+bias" if bias is not None else "fp8-fwd", n, k, m, "col", qa.dtype, cands)
        return cands[choice]()
    except Exception as e:  # noqa: BLE001 - cuSPARSELt refused the operands: the dense GEMM answers
        _sparse_failed.add(failed)
        log.warning("the FP8 2:4 GEMM failed for %s (%s); it runs dense FP8 from now on", failed,
                    _why(e))
        return _dense_mm(qa, sa, qb, sb, out_dtype, bias)


# one opaque node under torch.compile (a graph break per GEMM otherwise: the refusal check is a try)
_scaled_mm_op = torch.library.custom_op("twofour::scaled_mm", _scaled_mm, mutates_args=())


@_scaled_mm_op.register_fake
def _(qa, sa, qb, sb, out_dtype, sparse_b=False, bias=None):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=out_dtype)


def scaled_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, sparse_b: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T (+ bias)`` in ``out_dtype`` from quantized ``a`` (M, K) and ``b``
    (N, K), both row-major along K with scales from :func:`quantize`: ``torch._scaled_mm`` (a
    row-major, b column-major, rowwise scales as (M, 1) and (1, N); the bias, N values in
    ``out_dtype``, added to its output) where it takes the operands, else the reference. A
    refusal is remembered per (device, formats, scaling, shape) and logged once.

    ``sparse_b``: ``b`` is 2:4 along K (a pruned weight). Where cuSPARSELt has FP8 2:4 GEMMs (sm89+,
    e4m3 operands, ``a`` with a single scale), the GEMM also has a 2:4 route, ``b`` compressed on
    each call, and runs whichever of the two measured faster at this shape (``ops.choices()`` key
    ``fp8-fwd``); the product is the same up to the GEMM's rounding.
    Under torch's tracers this is the custom op ``twofour::scaled_mm``, so a compiled model keeps
    the FP8 linear in one graph."""
    args = (qa, sa, qb, sb, out_dtype, sparse_b, bias)
    return _scaled_mm_op(*args) if torch.compiler.is_compiling() else _scaled_mm(*args)


# --------------------------------------------------------------------------------------------
# a linear's three GEMMs in FP8
# --------------------------------------------------------------------------------------------


def _mvue_dw_fits(dy2: torch.Tensor, qxt: torch.Tensor, fmt: torch.dtype, scaling: Scaling, cdt: torch.dtype) -> bool:
    """Whether dW on the MVUE estimate may run as one FP8 2:4 GEMM, as far as a trace can tell (the
    device's half, :func:`_fp8_24_device`, is checked when the route runs): e4m3 gradients with
    one scale (both operands of an FP8 2:4 GEMM share a format, and the bound of
    :mod:`twofour.kernels.mvue_fp8` scales from dY's tensorwise scale), Triton and the fast path
    on, dY on a GPU, and sizes :func:`_fp8_24_fits` (K: the tokens)."""
    return (fmt == E4M3 and not scaling.rowwise and HAS_TRITON and settings.fast and dy2.is_cuda
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
    :func:`twofour.kernels.fp8cast.transpose` on a GPU (torch's strided copy, about a tenth as
    fast for 1-byte elements, where the kernel cannot run or once it failed: logged once)."""
    if q.t().is_contiguous():
        return q.t()
    key = ("transpose", q.device.type, q.dtype)
    if q.is_contiguous() and ops.triton_ok(q) and ("triton", key) not in _failed:
        return _guarded("triton", "transpose", key, fp8cast.transpose, _torch_transpose, q)
    return _torch_transpose(q)


def _torch_transpose(q: torch.Tensor) -> torch.Tensor:
    return q.t().contiguous()


def _mvue_dw_timed(dy2: torch.Tensor, qd: torch.Tensor | None, sd: torch.Tensor | None, qxt: torch.Tensor,
                   sxt: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """dW with e4m3 gradients and one scale, where :func:`_mvue_dw_fits` on a GPU
    :func:`_fp8_24_device`, by the faster of two routes, timed whole once per shape
    (``ops.choices()`` key ``fp8-dw-mvue``): the exact dense GEMM dY^T X (:func:`_exact_dw`, making
    dY^T included), or FP8 2:4 on the MVUE estimate, where one kernel writes the
    estimate compressed in e4m3 at the bound scale (:func:`mvue_e4m3`), the FP8 2:4 GEMM multiplies
    it by X (``qxt`` row-major is X column-major) and one pass applies the two scales. As in the
    bf16 fast path, the estimate is drawn only where its 2:4 GEMM pays. ``qd``, ``sd``: dY in e4m3
    and its scale where the dX GEMM quantized it, else None."""
    def dense() -> torch.Tensor:
        return _exact_dw(dy2, qd, sd, qxt, sxt, cdt)

    n, t, k = dy2.shape[1], dy2.shape[0], qxt.shape[0]
    failed = ("dw", n, t, k, dy2.device.index, cdt)
    if failed in _sparse_failed:
        return dense()

    def sparse() -> torch.Tensor:
        # dY's e4m3 scale: the dX GEMM's, else from one reduction (no dX GEMM quantized dY)
        s = (sd if sd is not None else _current_scale(dy2, E4M3)) * SCALE_BOUND
        packed = mvue_e4m3(dy2.t(), s)
        return fp8cast.rescale_(ops.spmm(packed, qxt.t(), n, False, out_dtype=cdt), s, sxt)

    cands = {"sparse": sparse, "dense": dense}
    try:
        return cands[ops.choose("fp8-dw-mvue", n, t, k, "col", E4M3, cands)]()
    except Exception as e:  # noqa: BLE001 - cuSPARSELt refused the operands: the dense route answers
        _sparse_failed.add(failed)
        log.warning("the FP8 2:4 dW GEMM failed for %s (%s); it runs dense FP8 from now on", failed,
                    _why(e))
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
    """y = x W_eff^T + b with FP8 GEMMs: forward x(e4m3) W_eff(e4m3)^T, dX = dY(g) W_eff(e4m3),
    dW = dY^T(g) X(e4m3) (with ``mvue``, on the MVUE 2:4 estimate of dY^T where its FP8 2:4 GEMM
    pays, and always in the plain-torch reference), g = ``grad_fmt`` (e4m3
    by default, or e5m2: one mantissa bit less, more range; None: dX and dW in the compute dtype
    from the unquantized x and W_eff), outputs in the compute dtype; ``fp8_forward=False``: the
    forward GEMM in the compute dtype, only the backward's in FP8; dW
    passed straight through to the master ``weight``; ``grad``: whether grad mode was on at the
    call (no backward copies otherwise); ``sparse``: W_eff is 2:4 (the forward GEMM may then run
    FP8 2:4, :func:`scaled_mm`). Tensorwise, each operand is quantized once, with the transposed
    copy its other GEMM reads written in the same pass; rowwise, the other axis is quantized again
    from the high-precision tensor."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_eff, mvue: bool, scaling: Scaling, cdt: torch.dtype, grad: bool = True,
                sparse: bool = False, grad_fmt: torch.dtype | None = E4M3, fp8_forward: bool = True):
        x2 = x.reshape(-1, x.shape[-1])
        tw = not scaling.rowwise and grad_fmt is not None  # transposed copies for FP8 backward GEMMs
        need_dx, need_dw = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        b = None if bias is None else bias.to(cdt)
        if fp8_forward:
            qx, sx, qxt = quantize_t(x2, E4M3, scaling, transposed=tw and need_dw)
            qw, sw, qwt = quantize_t(w_eff, E4M3, scaling, transposed=tw and need_dx)
            y = scaled_mm(qx, sx, qw, sw, cdt, sparse_b=sparse, bias=b)
        else:  # the forward GEMM in the compute dtype; only the copies the FP8 backward reads
            y = F.linear(x2.to(cdt), w_eff.to(cdt), b)
            _, sx, qxt = quantize_t(x2, E4M3, scaling, transposed=True) if tw and need_dw else (None, None, None)
            _, sw, qwt = quantize_t(w_eff, E4M3, scaling, transposed=True) if tw and need_dx else (None, None, None)
        if tw:  # what the backward multiplies: W^T and X^T, row-major along N and T
            ctx.save_for_backward(qwt, sw, qxt, sx)
        else:
            ctx.save_for_backward(x2, w_eff)
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
        fast = dy2.is_cuda and settings.fast
        est = need_dw and ctx.mvue and not fast
        if gf is None:  # the backward GEMMs dense in the compute dtype (no 2:4 route for the estimate)
            x2, w_eff = ctx.saved_tensors
            if need_dx:
                dx = (dy2 @ w_eff.to(cdt)).reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_dw:
                dw = ((mvue_24_padded(dy2.t().contiguous()) if est else dy2.t()) @ x2.to(cdt)).to(ctx.w_dtype)
            return dx, dw, db, None, None, None, None, None, None, None, None
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
            dx = scaled_mm(qd, sd, qwt, swt, cdt).reshape(ctx.x_shape).to(ctx.x_dtype)
        if est:
            dw = _mvue_dw_reference(dy2, qxt, sxt, gf, sc, cdt).to(ctx.w_dtype)
        elif need_dw:
            if sc.rowwise:
                qdt, sdt = quantize(dy2.t().contiguous(), gf, sc)
            dw = _mvue_dw(dy2, qd, sd, qxt, sxt, cdt) if routed else scaled_mm(qdt, sdt, qxt, sxt, cdt)
            dw = dw.to(ctx.w_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, w_eff: torch.Tensor | None = None,
               *, mvue: bool = False, scaling: Scaling = DEFAULT_SCALING, sparse: bool = False,
               grad_fmt: torch.dtype | None = E4M3, fp8_forward: bool = True) -> torch.Tensor:
    """``F.linear(x, w_eff, bias)`` with FP8 GEMMs (:class:`FP8LinearFn`), the gradient of the
    effective weight ``w_eff`` (default ``weight``) going to ``weight``. The GEMMs run in
    autocast's dtype if on, else ``x``'s; the output has that dtype. ``sparse``: ``w_eff`` is 2:4
    along its rows, so the forward GEMM may run FP8 2:4 where that measures faster. ``grad_fmt``:
    the FP8 format of the output gradient dY (:data:`E4M3` or :data:`E5M2`), or None for backward
    GEMMs in the compute dtype. ``fp8_forward=False``: the forward GEMM in the compute dtype (with
    ``grad_fmt``, the backward's in FP8)."""
    if grad_fmt is not None:
        _check_fmt(grad_fmt)
    elif not fp8_forward:
        raise ValueError("fp8_linear: fp8_forward=False with grad_fmt=None leaves no GEMM in FP8 (use F.linear)")
    dev = x.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    w_eff = weight.detach() if w_eff is None else w_eff
    with torch.autocast(dev, enabled=False):
        return FP8LinearFn.apply(x, weight, bias, w_eff.detach(), mvue, scaling, cdt, torch.is_grad_enabled(), sparse,
                                 grad_fmt, fp8_forward)
