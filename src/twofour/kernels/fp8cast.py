"""FP8 quantization with current scaling in Triton: the least memory traffic the scaling allows.

Tensorwise: one kernel reduces max |t| over the whole tensor (a grid-stride loop, one atomic per
program), a second reads ``t`` again and writes ``q = sat(t / scale)`` and, on request, ``q^T``
row-major, reading its tile a second time along the other axis (mostly from cache) rather than
transposing the cast tile in registers (two reads from memory and one or two FP8 writes: the
scale needs the whole tensor's amax before the first cast), because the in-register transpose
of a tile read from float32 wrote wrong bytes (docs/notes/fp8.md). Rowwise: one kernel per band
of rows reduces each row's amax and casts the row on a second read of it (mostly from L2). ``scale`` is
``amax * (1 / fmax)``, 1 where that is 0 (an all-zero tensor or row), NaN or inf where the amax
is; quotients are IEEE-rounded (``div_rn``) and then rounded to the FP8 grid in float32: the same
scales and bytes as ``twofour.fp8``'s plain-torch reference.

The amax is reduced on the float32 bit patterns of ``t`` with the sign bit cleared, as int32:
for non-negative floats their order is the integer order, and a NaN sorts above inf, so NaN
propagates through the max and the atomic without a separate check.
"""

from __future__ import annotations

import functools
import os

import torch

from .triton_common import HAS_TRITON, fp8_constants

if HAS_TRITON:
    from .triton_common import out_bits, to_grid

__all__ = ["quantize", "supported", "rescale_", "transpose"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _abs_bits(x):
        """The float32 bits of |x| as int32 (sign bit cleared: a NaN stays a NaN above inf)."""
        return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF

    @triton.jit
    def _amax_kernel(x_ptr, amax_ptr, n, iters, BLOCK: tl.constexpr):
        """amax_ptr (int32, zeroed) = max over programs of the bits of max |x|."""
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(iters):
            offs = (i * progs + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, _abs_bits(x))
        tl.atomic_max(amax_ptr, tl.max(acc, 0))

    @triton.jit
    def _scale_of(amax_bits, INV_FMAX: tl.constexpr):
        """amax / fmax, or 1 where that is 0 (an all-zero tensor or row, or one too small to scale)."""
        s = amax_bits.to(tl.float32, bitcast=True) * INV_FMAX
        return tl.where(s == 0.0, 1.0, s)

    @triton.jit
    def _cast_kernel(x_ptr, q_ptr, qt_ptr, amax_ptr, scale_ptr, M, N, FMAX: tl.constexpr, INV_FMAX: tl.constexpr,
                     MBITS: tl.constexpr, EMIN: tl.constexpr, TRANS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """q = sat(x / scale) for one BM x BN tile of the row-major (M, N) x; with TRANS also
        q^T into the row-major (N, M) qt. A 1-D grid over the tiles, row of tiles by row of tiles
        (a grid's second axis holds at most 65535)."""
        tiles_n = tl.cdiv(N, BN)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        scale = _scale_of(tl.load(amax_ptr), INV_FMAX)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_ptr, scale)
        rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        q = to_grid(tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), MBITS, EMIN)
        q = q.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
        if TRANS:  # the tile read again along the other axis (from cache) and cast again: no transpose
            xt = tl.load(x_ptr + rm[None, :] * N + rn[:, None], mask=tl.trans(mask), other=0.0).to(tl.float32)
            qt = to_grid(tl.clamp(tl.math.div_rn(xt, scale), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL),
                          MBITS, EMIN)
            tl.store(qt_ptr + rn[:, None] * M + rm[None, :], qt.to(q_ptr.dtype.element_ty), mask=tl.trans(mask))

    @triton.jit
    def _rowwise_kernel(x_ptr, q_ptr, scale_ptr, M, N, FMAX: tl.constexpr, INV_FMAX: tl.constexpr,
                        MBITS: tl.constexpr, EMIN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """Each row of a BM-row band: its amax, its scale, then the row cast on a second read."""
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rmask = rm < M
        acc = tl.zeros([BM, BN], dtype=tl.int32)
        for n0 in range(0, N, BN):
            rn = n0 + tl.arange(0, BN)
            mask = rmask[:, None] & (rn[None, :] < N)
            x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, _abs_bits(x))
        scale = _scale_of(tl.max(acc, 1), INV_FMAX)
        tl.store(scale_ptr + rm, scale, mask=rmask)
        for n0 in range(0, N, BN):
            rn = n0 + tl.arange(0, BN)
            mask = rmask[:, None] & (rn[None, :] < N)
            x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
            q = to_grid(q, MBITS, EMIN)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _transpose_kernel(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        """y = x^T for one BM x BN tile of the row-major (M, N) x of bytes, y row-major (N, M):
        the tile read along y's rows (as the cast kernel's transposed copy reads it) and stored
        as read, with no transpose in registers; a 1-D grid over the tiles."""
        tiles_n = tl.cdiv(N, BN)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
        mask = (rn[:, None] < N) & (rm[None, :] < M)
        v = tl.load(x_ptr + rm[None, :] * N + rn[:, None], mask=mask, other=0)
        tl.store(y_ptr + rn[:, None] * M + rm[None, :], v, mask=mask)

    @triton.jit
    def _rescale_kernel(y_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr):
        """y = y * (sa * sb) (+ bias) in float32, rounded once, in place, for one BM x BN tile of
        the row-major (M, N) y (bf16 as its int16 bits); a 1-D grid over the tiles."""
        tiles_n = tl.cdiv(N, BN)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        off = rm[:, None] * N + rn[None, :]
        y = tl.load(y_ptr + off, mask=mask, other=0)
        if OUT_BF16:  # bf16 bits -> float32: the high half of the word
            y = (y.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        y = y.to(tl.float32) * (tl.load(sa_ptr) * tl.load(sb_ptr))
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + off, out_bits(y, OUT_BF16), mask=mask)


def supported(t: torch.Tensor, rowwise: bool, transposed: bool) -> bool:
    """Whether :func:`quantize` takes ``t``: Triton here, a contiguous float tensor with elements,
    2-D for rowwise scales or a transposed copy, and on a GPU one with FP8 types (sm89+: Triton
    refuses e4m3 before)."""
    return (HAS_TRITON and t.is_contiguous() and t.numel() > 0 and t.is_floating_point()
            and (t.dim() == 2 or not (rowwise or transposed))
            and (not t.is_cuda or capability(t) >= (8, 9)))


def capability(t: torch.Tensor) -> tuple[int, int]:
    """The compute capability of the GPU ``t`` is on (cached per device)."""
    return _capability(_index(t))


def _index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(t: torch.Tensor) -> int:
    """Programs of the amax reduction: 4 per SM; a few under the interpreter (so that its tests
    exercise the grid-stride loop and the atomic)."""
    return 4 * _sms(_index(t)) if t.is_cuda else 4


def quantize(t: torch.Tensor, fmt: torch.dtype, rowwise: bool = False,
             transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, q^T row-major or None)`` of ``t`` in FP8 ``fmt`` with current scaling: one
    float32 scale, or (rows, 1) with ``rowwise`` (see the module doc). ``t`` as :func:`supported`."""
    if not supported(t, rowwise, transposed):
        raise ValueError(f"fp8cast.quantize takes a contiguous float tensor (2-D for rowwise scales or a "
                         f"transposed copy), got shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype}")
    consts = fp8_constants(fmt)
    n_cols = t.shape[-1] if t.dim() else 1
    m, n = t.numel() // n_cols, n_cols
    q = torch.empty(t.shape, dtype=fmt, device=t.device)
    if rowwise:
        scale = torch.empty((m, 1), dtype=torch.float32, device=t.device)
        bm, bn = (4, 512) if t.is_cuda else (4, 64)
        _rowwise_kernel[(triton.cdiv(m, bm),)](t, q, scale, m, n, BM=bm, BN=bn, num_warps=4, **consts)
        return q, scale, None
    amax = torch.zeros((), dtype=torch.int32, device=t.device)
    block = 4096 if t.is_cuda else 256
    progs = min(_programs(t), triton.cdiv(t.numel(), block))
    _amax_kernel[(progs,)](t, amax, t.numel(), triton.cdiv(t.numel(), block * progs), BLOCK=block, num_warps=8)
    scale = torch.empty((), dtype=torch.float32, device=t.device)
    qt = torch.empty((n, m), dtype=fmt, device=t.device) if transposed else None
    bm, bn = (64, 64) if transposed else (32, 128)
    _cast_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](t, q, qt if transposed else q, amax, scale, m, n,
                                                          TRANS=transposed, BM=bm, BN=bn, num_warps=4, **consts)
    return q, scale, qt


def rescale_(y: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = y * (sa * sb) + bias`` in place, in float32 with one rounding: the dequantization of an
    FP8 GEMM's output whose kernel could not apply the operands' scales (``sa``, ``sb``: one float32
    value each; ``bias``: N values). ``y``: a contiguous (M, N) bf16 or fp16 tensor. One pass of
    Triton on a GPU (or under its interpreter), plain torch elsewhere (the same bytes)."""
    if y.dim() != 2 or not y.is_contiguous() or y.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rescale_ takes a contiguous 2-D bf16 or fp16 tensor, got {tuple(y.shape)} {y.dtype}")
    if sa.numel() != 1 or sb.numel() != 1 or (bias is not None and bias.shape != (y.shape[1],)):
        raise ValueError("rescale_ takes one scale per operand and a bias of N values")
    if not (HAS_TRITON and (y.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")):
        z = y.float() * (sa * sb).reshape(())
        return y.copy_(z if bias is None else z + bias.float())
    m, n = y.shape
    bm, bn = (32, 256) if y.is_cuda else (16, 64)
    bf16 = y.dtype == torch.bfloat16
    _rescale_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        y.view(torch.int16) if bf16 else y, sa, sb, bias if bias is not None else sa, m, n, HAS_BIAS=bias is not None,
        OUT_BF16=bf16, BM=bm, BN=bn, num_warps=4, enable_fp_fusion=False)  # no FMA: torch rounds y*s, then +b
    return y


#: Tile of :func:`transpose` on a GPU (BM, BN, warps), as measured by ``benchmarks/fp8/fp8_transpose.py`` (since
#: removed; in the git history, docs/notes/fp8.md has its numbers).
TRANSPOSE_TILE = (128, 128, 8)


def transpose(q: torch.Tensor, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``q^T`` row-major, for a contiguous 2-D tensor of 1-byte elements (FP8 from
    :func:`quantize`): one Triton pass on a GPU (torch's strided copy of a 1-byte transpose is
    far slower: docs/PERFORMANCE.md), plain torch elsewhere (the same
    bytes). ``tile``: (BM, BN, warps) on a GPU, default :data:`TRANSPOSE_TILE` (the interpreter
    uses a small tile of its own)."""
    if q.dim() != 2 or not q.is_contiguous() or q.element_size() != 1:
        raise ValueError(f"transpose takes a contiguous 2-D tensor of 1-byte elements, got shape "
                         f"{tuple(q.shape)}, strides {q.stride()}, {q.dtype}")
    if not (HAS_TRITON and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")) or q.numel() == 0:
        return q.t().contiguous()
    m, n = q.shape
    out = torch.empty((n, m), dtype=q.dtype, device=q.device)
    bm, bn, warps = (tile or TRANSPOSE_TILE) if q.is_cuda else (16, 32, 4)
    _transpose_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](q.view(torch.uint8), out.view(torch.uint8), m, n,
                                                                  BM=bm, BN=bn, num_warps=warps)
    return out
