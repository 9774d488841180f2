"""One FP8 GEMM: ``torch._scaled_mm`` or cuSPARSELt's FP8 2:4 GEMM where it measures faster,
else the plain-torch reference (the package docstring of :mod:`twofour.fp8` says how)."""

from __future__ import annotations

import torch

from .. import dispatch
from ..kernels import cusparselt, fp8cast, ops
from ..kernels.compress import compress_e4m3
from ..kernels.triton_common import HAS_TRITON
from .quantize import E4M3, dequantize


def scaled_mm_available() -> bool:
    """Whether this torch has ``torch._scaled_mm`` at all."""
    return hasattr(torch, "_scaled_mm")


def refusals() -> frozenset[tuple]:
    """The operand kinds ``_scaled_mm`` refused so far in this process (each ran the reference):
    (device type, A format, B format, rowwise, A shape, N, output dtype); the ``scaled_mm``
    routes of :func:`twofour.dispatch.failures`."""
    return frozenset(route[1:] for route in dispatch.failures() if route[0] == "scaled_mm")


def _reference_mm(qa, sa, qb, sb, out_dtype, bias=None):
    out = dequantize(qa, sa) @ dequantize(qb, sb).t()
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _dense_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    m, n = qa.shape[0], qb.shape[0]
    qa, qb = qa.contiguous(), qb.contiguous()  # a row-major, b^T column-major (no-ops when already)
    key = ("scaled_mm", qa.device.type, qa.dtype, qb.dtype, sa.numel() > 1, tuple(qa.shape), n, out_dtype)
    # torch 2.13's CPU _scaled_mm is a naive loop (79 ms for e4m3 128 x 64 x 256 on a 2-core Xeon,
    # where the dequantized product takes 0.14 ms): the CPU takes the reference, the same math
    if qa.is_cuda and scaled_mm_available() and not dispatch.failed(key):
        try:
            out = torch._scaled_mm(qa, qb.t(), sa.reshape(m, 1) if sa.numel() > 1 else sa,
                                   sb.reshape(1, n) if sb.numel() > 1 else sb, out_dtype=out_dtype)
            return out if bias is None else out.add_(bias)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            dispatch.record_failure(key, "torch._scaled_mm", e, "the FP8 reference")
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


def _fp8_24_fits(sparse_rows: int, k: int, dense_rows: int, out_dtype: torch.dtype) -> bool:
    """Whether cuSPARSELt's FP8 2:4 GEMM takes these sizes: a bf16 or fp16 output, K a multiple of
    64 (the e4m3 layout's tile) and the sparse and dense operands' other sides multiples of 32."""
    return (out_dtype in (torch.bfloat16, torch.float16)
            and sparse_rows % 32 == 0 and k % 64 == 0 and dense_rows % 32 == 0)


def _fp8_24_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s GPU has FP8 2:4 GEMMs (sm89+) and the fast path (cuSPARSELt, Triton) is on
    (a cached query; not traceable: it takes the cuSPARSELt binding's lock)."""
    return fp8cast.capability(t) >= (8, 9) and ops.fast_available()


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
               out_dtype: torch.dtype, sparse_b: bool = False, bias: torch.Tensor | None = None,
               gemm: str = "fwd") -> torch.Tensor:
    if not sparse_b or not _sparse_applies(qb, sb, qa, sa, out_dtype):
        return _dense_mm(qa, sa, qb, sb, out_dtype, bias)
    m, k, n = qa.shape[0], qa.shape[1], qb.shape[0]
    failed = (f"fp8-24-{gemm}", n, k, m, qb.device.index, out_dtype)
    if dispatch.failed(failed):
        return _dense_mm(qa, sa, qb, sb, out_dtype, bias)

    cands = {"sparse": lambda: _sparse_mm(qa, sa, qb, sb, out_dtype, bias),
             "dense": lambda: _dense_mm(qa, sa, qb, sb, out_dtype, bias)}
    try:
        choice = dispatch.choose(f"fp8-{gemm}" + ("+bias" if bias is not None else ""), n, k, m, "col", qa.dtype,
                                 cands)
        return cands[choice]()
    except Exception as e:  # noqa: BLE001 - cuSPARSELt refused the operands: the dense GEMM answers
        dispatch.record_failure(failed, "the FP8 2:4 GEMM", e, "the dense FP8 GEMM")
        return _dense_mm(qa, sa, qb, sb, out_dtype, bias)


# one opaque node under torch.compile (a graph break per GEMM otherwise: the refusal check is a try)
_scaled_mm_op = torch.library.custom_op("twofour::scaled_mm", _scaled_mm, mutates_args=())


@_scaled_mm_op.register_fake
def _(qa, sa, qb, sb, out_dtype, sparse_b=False, bias=None, gemm="fwd"):
    return qa.new_empty((qa.shape[0], qb.shape[0]), dtype=out_dtype)


def scaled_mm(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, sparse_b: bool = False, bias: torch.Tensor | None = None,
              gemm: str = "fwd") -> torch.Tensor:
    """``dequant(a) @ dequant(b)^T (+ bias)`` in ``out_dtype`` from quantized ``a`` (M, K) and ``b``
    (N, K), both row-major along K with scales from :func:`quantize`: ``torch._scaled_mm`` (a
    row-major, b column-major, rowwise scales as (M, 1) and (1, N); the bias, N values in
    ``out_dtype``, added to its output) where it takes the operands, else the reference. A
    refusal is remembered per (device, formats, scaling, shape) and logged once.

    ``sparse_b``: ``b`` is 2:4 along K (a pruned weight). Where cuSPARSELt has FP8 2:4 GEMMs (sm89+,
    e4m3 operands, ``a`` with a single scale), the GEMM also has a 2:4 route, ``b`` compressed on
    each call, and runs whichever of the two measured faster at this shape (``dispatch.choices()`` key
    ``fp8-GEMM``, ``gemm`` naming it: ``fwd``, or ``dx`` for dX = dY W with ``b`` = W^T 2:4 along
    the output features); the product is the same up to the GEMM's rounding.
    Under torch's tracers this is the custom op ``twofour::scaled_mm``, so a compiled model keeps
    the FP8 linear in one graph."""
    args = (qa, sa, qb, sb, out_dtype, sparse_b, bias, gemm)
    return _scaled_mm_op(*args) if torch.compiler.is_compiling() else _scaled_mm(*args)
