"""y = x W^T (+ b) for a few tokens (decoding), with W 2:4 read as stored: kept values and 2-bit
positions (``twofour.packed``), 0.5625x of the dense bf16 bytes.

At one to eight tokens a linear layer is bound by reading its weight, and cuSPARSELt's GEMM
needs at least 8 columns of padded input; this kernel streams the compact weight once instead.
Each program covers ``BO`` output rows and walks the inputs ``BK`` at a time, with contiguous
loads only: the values (BO, BK/2), the position bytes (BO, BK/8), split into the groups' codes,
and the (tokens, BK) tile of x, split into the four entries of each group; each entry of the
weight is then a select between the group's two values (or zero), multiplied by its entry of x
and accumulated in float32. With a split of the inputs (split-K), ``S`` programs share each
band of rows, one input range each, and a second small kernel sums their float32 partials and
adds the bias: more programs in flight where a layer has few output rows and long ones (a
down projection), at the cost of one more launch. Tile shape, warps and split are measured once
per shape on the GPU.

:func:`reference` is the same product in plain torch; the tests run the kernel against it
under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..packed import positions_width, unpack_24
from .compress import HAS_TRITON
from .ops import median_ms

if HAS_TRITON:  # the reference path needs no Triton
    import triton
    import triton.language as tl

__all__ = ["gemv24", "reference", "MAX_TOKENS", "HAS_TRITON", "CONFIGS"]

#: The most tokens (rows of x) the kernel takes; more go to cuSPARSELt's GEMM.
MAX_TOKENS = 8
#: (rows per program, inputs per step, warps, input splits) the GPU chooses from, per shape.
CONFIGS = ((4, 256, 2, 1), (4, 512, 4, 1), (8, 256, 4, 1), (8, 512, 4, 1), (16, 256, 4, 1), (16, 512, 8, 1),
           (32, 128, 4, 1), (32, 256, 8, 1), (4, 256, 2, 4), (8, 256, 4, 4), (8, 512, 4, 2), (16, 256, 4, 8))
_INTERPRETER_CONFIG = (16, 128, 4, 1)


if HAS_TRITON:

    @triton.jit
    def _gemv24_kernel(x_ptr, sxt, sxk, vals_ptr, pos_ptr, pos_stride, pos_width, bias_ptr, y_ptr, T, N, K,
                       k_per, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr):
        """Rows ``BO`` of y over inputs [s k_per, (s + 1) k_per) for split s; with SPLIT > 1 the
        float32 partial goes to ``y_ptr`` + s T N (no bias), for :func:`_sum_splits`."""
        G: tl.constexpr = BK // 4  # groups per step
        o = tl.program_id(0) * BO + tl.arange(0, BO)  # output rows (BO,)
        k_lo = tl.program_id(1) * k_per
        t = tl.arange(0, BT)  # tokens (BT,)
        om = o < N
        tm = t < T
        acc = tl.zeros((BT, BO, G), dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BK):
            # the two kept values of each group: one contiguous (BO, G, 2) load
            g = k0 // 4 + tl.arange(0, G)
            vi = 2 * g[None, :, None] + tl.arange(0, 2)[None, None, :]
            v = tl.load(vals_ptr + o[:, None, None] * (K // 2) + vi,
                        mask=om[:, None, None] & (g < K // 4)[None, :, None], other=0.0).to(tl.float32)
            v0, v1 = tl.split(v)  # (BO, G)
            # their positions: (BO, G/2) whole bytes, two groups each (low nibble first)
            pc = k0 // 8 + tl.arange(0, G // 2)
            pb = tl.load(pos_ptr + o[:, None] * pos_stride + pc[None, :], mask=om[:, None] & (pc < pos_width)[None, :],
                         other=0).to(tl.int32)
            code = tl.reshape(tl.join(pb & 15, pb >> 4), (BO, G))
            i0 = code & 3
            i1 = code >> 2
            # x: one contiguous (BT, BK) tile, split into the four entries of each group
            c = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + t[:, None] * sxt + c[None, :] * sxk, mask=tm[:, None] & (c < K)[None, :],
                         other=0.0).to(tl.float32)
            even, odd = tl.split(tl.reshape(xt, (BT, G, 2, 2)))  # entry e = 2 * i + j: split j
            x0, x2 = tl.split(even)
            x1, x3 = tl.split(odd)
            acc += tl.where(i0 == 0, v0, tl.where(i1 == 0, v1, 0.0))[None, :, :] * x0[:, None, :]
            acc += tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, 0.0))[None, :, :] * x1[:, None, :]
            acc += tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, 0.0))[None, :, :] * x2[:, None, :]
            acc += tl.where(i0 == 3, v0, tl.where(i1 == 3, v1, 0.0))[None, :, :] * x3[:, None, :]
        y = tl.sum(acc, axis=2)  # (BT, BO)
        if SPLIT > 1:
            tl.store(y_ptr + tl.program_id(1) * T * N + t[:, None] * N + o[None, :], y, mask=tm[:, None] & om[None, :])
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + o, mask=om, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + t[:, None] * N + o[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=tm[:, None] & om[None, :])

    @triton.jit
    def _sum_splits(part_ptr, bias_ptr, y_ptr, TN, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK: tl.constexpr):
        """y = the SPLIT float32 partials summed (+ bias), in y's dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < TN
        y = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT):
            y += tl.load(part_ptr + s * TN + i, mask=m, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + i % N, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=m)


def reference(x: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in plain torch: x @ unpack(values, positions)^T + bias."""
    return F.linear(x, unpack_24(values, positions, x.shape[-1]).to(x.dtype), bias)


def _block_tokens(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


def _fits(bt: int, cfg: tuple[int, ...]) -> bool:
    """At most 32 float32 accumulators a thread."""
    bo, bk, warps = cfg[:3]
    return bt * bo * (bk // 4) <= 32 * 32 * warps


_tuned: dict[tuple, tuple[int, ...]] = {}


def _launch(x, values, positions, bias, y, cfg) -> None:
    t, k = x.shape
    n = values.shape[0]
    bo, bk, warps = cfg[:3]
    split = min(cfg[3] if len(cfg) > 3 else 1, triton.cdiv(k, bk))  # no split without inputs
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    b = bias if bias is not None else values
    out = y if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    _gemv24_kernel[(triton.cdiv(n, bo), split)](x, x.stride(0), x.stride(1), values, positions, positions.stride(0),
                                                positions.shape[1], b, out, t, n, k, k_per,
                                                HAS_BIAS=bias is not None, BT=_block_tokens(t), BO=bo, BK=bk,
                                                SPLIT=split, num_warps=warps)
    if split > 1:
        _sum_splits[(triton.cdiv(t * n, 1024),)](out, b, y, t * n, n, HAS_BIAS=bias is not None, SPLIT=split,
                                                 BLOCK=1024, num_warps=4)


def _tune(x, values, positions, bias, y) -> tuple[int, ...]:
    """The fastest fitting config for this shape, timed as the dispatch times its candidates
    (:func:`twofour.kernels.ops.median_ms`: median of 5 after 2 warm-ups)."""
    fitting = [c for c in CONFIGS if _fits(_block_tokens(x.shape[0]), c)] or list(CONFIGS[:1])
    return min(fitting, key=lambda cfg: median_ms(lambda: _launch(x, values, positions, bias, y, cfg), reps=5))


def gemv24(x: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: tuple[int, ...] | None = None) -> torch.Tensor:
    """y (T, N) = x (T, K) W^T (+ bias), W given as ``values`` (N, K/2) and ``positions``
    (N, ceil(K/8)) uint8; T <= :data:`MAX_TOKENS`; x, values and bias of one dtype, y in it.

    ``config`` = (rows per program, inputs per step, warps[, input splits]) fixes the launch; otherwise the GPU
    measures :data:`CONFIGS` once per shape (never while a CUDA graph is being captured: then an
    unmeasured shape takes the first that fits)."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's 2:4 GEMV kernel needs Triton (pip install triton)")
    t, k = x.shape
    n = values.shape[0]
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"gemv24: takes 1 to {MAX_TOKENS} tokens, got {t}")
    if values.shape != (n, k // 2) or k % 4 or positions.shape != (n, positions_width(k)):
        raise ValueError(f"gemv24: x {tuple(x.shape)}, values {tuple(values.shape)} and positions "
                         f"{tuple(positions.shape)} don't describe one (N, K) 2:4 weight")
    if values.dtype != x.dtype or positions.dtype != torch.uint8 or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"gemv24: x, values and bias must share a dtype and positions be uint8; got x {x.dtype}, "
                        f"values {values.dtype}, positions {positions.dtype}")
    values, positions = values.contiguous(), positions.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if config is None:
        if not x.is_cuda:
            config = _INTERPRETER_CONFIG
        else:
            key = (n, k, _block_tokens(t), x.dtype, bias is not None)
            config = _tuned.get(key)
            if config is None:
                fitting = [c for c in CONFIGS if _fits(_block_tokens(t), c)] or list(CONFIGS[:1])
                if torch.cuda.is_current_stream_capturing():
                    config = fitting[0]
                else:
                    config = _tuned[key] = _tune(x, values, positions, bias, y)
    _launch(x, values, positions, bias, y, config)
    return y
