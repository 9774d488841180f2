"""y = x W^T (+ b) for a few tokens (decoding), with W 2:4 read as stored: kept values and 2-bit
positions (``twofour.inference.packed``), 0.5625x of the dense bf16 bytes.

At one to eight tokens a linear layer is bound by reading its weight, and cuSPARSELt's GEMM
needs at least 8 columns of padded input; this kernel streams the compact weight once instead.
Each program covers ``BO`` output rows and walks the inputs ``BK`` at a time, with contiguous
loads only: the values (BO, BK/2), the position bytes (BO, BK/8), split into the groups' codes,
and the (tokens, BK) tile of x, split into the four entries of each group; each entry of the
weight is then a select between the group's two values (or zero), multiplied by its entry of x
and accumulated in float32. Splitting and joining those tiles costs layout conversions through
shared memory, each between barriers (at one token 8-10 conversions in the loop, 16-32 barriers
in the Hopper SASS, ``benchmarks/inference/gemv_sass.py``); the pair-load variant (``_gemv24_pairs_kernel``)
instead reads each group's two values as one word, its code from the position byte by a shift,
and x as four loads, one per group entry, all straight into the products' layout: at one token
and 8 or 16 rows a program, no conversion in the loop and one barrier in the kernel. With a
split of the inputs (split-K), ``S`` programs share each band of rows, one input range each, and
a second small kernel sums their float32 partials and adds the bias: more programs in flight
where a layer has few output rows and long ones (a down projection), at the cost of one more
launch. Variant, tile shape, warps and split are measured once per shape on the GPU.

:func:`reference` is the same product in plain torch; the tests run the kernel against it
under Triton's interpreter on the CPU.
"""

from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

from ..dispatch import median_ms
from .layout import positions_width, unpack_24
from .triton_common import HAS_TRITON

if HAS_TRITON:  # the reference path needs no Triton
    import triton
    import triton.language as tl

log = logging.getLogger("twofour")

__all__ = ["gemv24", "reference", "MAX_TOKENS", "HAS_TRITON", "CONFIGS"]

#: The most tokens (rows of x) the kernel takes; more go to cuSPARSELt's GEMM.
MAX_TOKENS = 8
#: (rows per program, inputs per step, warps, input splits, pair loads) the GPU chooses from, per
#: shape. Pair loads: :func:`_gemv24_pairs_kernel` (no layout conversions), else :func:`_gemv24_kernel`.
CONFIGS = ((4, 256, 2, 1, False), (4, 512, 4, 1, False), (8, 256, 4, 1, False), (8, 512, 4, 1, False),
           (16, 256, 4, 1, False), (16, 512, 8, 1, False), (32, 128, 4, 1, False), (32, 256, 8, 1, False),
           (4, 256, 2, 4, False), (8, 256, 4, 4, False), (8, 512, 4, 2, False), (16, 256, 4, 8, False),
           (4, 256, 2, 1, True), (8, 256, 4, 1, True), (16, 256, 4, 1, True), (8, 512, 4, 1, True),
           (16, 512, 8, 1, True), (8, 256, 4, 4, True), (16, 256, 4, 4, True), (16, 256, 4, 8, True))
_INTERPRETER_CONFIG = (16, 128, 4, 1, True)


if HAS_TRITON:

    @triton.jit
    def _place(v0, v1, code):
        """A group's four weight entries from its two kept values and its code i0 | i1 << 2
        (zero where neither was kept): four tensors of v0's shape."""
        i0 = code & 3
        i1 = code >> 2
        e0 = tl.where(i0 == 0, v0, tl.where(i1 == 0, v1, 0.0))
        e1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, 0.0))
        e2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, 0.0))
        e3 = tl.where(i0 == 3, v0, tl.where(i1 == 3, v1, 0.0))
        return e0, e1, e2, e3

    @triton.jit
    def _accumulate(acc, e0, e1, e2, e3, x0, x1, x2, x3):
        """acc (BT, BO, G) += each (BO, G) weight entry times its (BT, G) entry of x."""
        acc += e0[None, :, :] * x0[:, None, :]
        acc += e1[None, :, :] * x1[:, None, :]
        acc += e2[None, :, :] * x2[:, None, :]
        acc += e3[None, :, :] * x3[:, None, :]
        return acc

    @triton.jit
    def _store_rows(y, y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
        """y (BT, BO) to y[t, o] (+ bias) in y's dtype, or with SPLIT > 1 as this split's float32
        partial at ``y_ptr`` + s T N (no bias), for :func:`_sum_splits`."""
        mask = tm[:, None] & om[None, :]
        if SPLIT > 1:
            tl.store(y_ptr + tl.program_id(1) * T * N + t[:, None] * N + o[None, :], y, mask=mask)
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + o, mask=om, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + t[:, None] * N + o[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gemv24_kernel(x_ptr, sxt, sxk, vals_ptr, pos_ptr, pos_stride, pos_width, bias_ptr, y_ptr, T, N, K,
                       k_per, HAS_BIAS: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr):
        """Rows ``BO`` of y over inputs [s k_per, (s + 1) k_per) for split s (:func:`_store_rows`)."""
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
            # x: one contiguous (BT, BK) tile, split into the four entries of each group
            c = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + t[:, None] * sxt + c[None, :] * sxk, mask=tm[:, None] & (c < K)[None, :],
                         other=0.0).to(tl.float32)
            even, odd = tl.split(tl.reshape(xt, (BT, G, 2, 2)))  # entry e = 2 * i + j: split j
            x0, x2 = tl.split(even)
            x1, x3 = tl.split(odd)
            e0, e1, e2, e3 = _place(v0, v1, code)
            acc = _accumulate(acc, e0, e1, e2, e3, x0, x1, x2, x3)
        _store_rows(tl.sum(acc, axis=2), y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS, SPLIT)

    @triton.jit
    def _group_entries(pairs_ptr, pos_ptr, pos_stride, o, om, g, K, VALUE_BITS: tl.constexpr,
                       IS_BF16: tl.constexpr):
        """The four weight entries of groups ``g`` in rows ``o``: four (BO, G) float32 tensors,
        each group's kept pair read as one word and placed by its 4-bit code (zero elsewhere)."""
        m2 = om[:, None] & (g < K // 4)[None, :]
        w = tl.load(pairs_ptr + o[:, None] * (K // 4) + g[None, :], mask=m2, other=0)  # (BO, G) words
        if VALUE_BITS == 16:
            lo = (w & 0xFFFF).to(tl.uint16)
            hi = ((w >> 16) & 0xFFFF).to(tl.uint16)
            if IS_BF16:
                v0 = lo.to(tl.bfloat16, bitcast=True).to(tl.float32)
                v1 = hi.to(tl.bfloat16, bitcast=True).to(tl.float32)
            else:
                v0 = lo.to(tl.float16, bitcast=True).to(tl.float32)
                v1 = hi.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            v0 = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            v1 = ((w >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        pb = tl.load(pos_ptr + o[:, None] * pos_stride + (g // 2)[None, :], mask=m2, other=0).to(tl.int32)
        return _place(v0, v1, (pb >> ((g & 1) * 4)[None, :]) & 15)

    @triton.jit
    def _gemv24_pairs_kernel(x_ptr, sxt, sxk, pairs_ptr, pos_ptr, pos_stride, bias_ptr, y_ptr, T, N, K, k_per,
                             HAS_BIAS: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                             SPLIT: tl.constexpr, VALUE_BITS: tl.constexpr, IS_BF16: tl.constexpr):
        """:func:`_gemv24_kernel` with every operand loaded straight into the layout the products
        use, no splits or joins (each a round trip through shared memory between barriers): a
        group's two values as one word (two 16-bit halves, or two 32-bit ones for float32), its
        4-bit code from the position byte by a shift, and x as four loads, one per group entry.
        One token (decoding at batch 1) accumulates in two dimensions, in the weights' layout."""
        G: tl.constexpr = BK // 4
        o = tl.program_id(0) * BO + tl.arange(0, BO)
        k_lo = tl.program_id(1) * k_per
        t = tl.arange(0, BT)
        om = o < N
        tm = t < T
        if BT == 1:
            acc = tl.zeros((BO, G), dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BK):
                g = k0 // 4 + tl.arange(0, G)
                e0, e1, e2, e3 = _group_entries(pairs_ptr, pos_ptr, pos_stride, o, om, g, K, VALUE_BITS, IS_BF16)
                xp = x_ptr + (4 * g) * sxk
                xm = g < K // 4
                acc += e0 * tl.load(xp, mask=xm, other=0.0).to(tl.float32)[None, :]
                acc += e1 * tl.load(xp + sxk, mask=xm, other=0.0).to(tl.float32)[None, :]
                acc += e2 * tl.load(xp + 2 * sxk, mask=xm, other=0.0).to(tl.float32)[None, :]
                acc += e3 * tl.load(xp + 3 * sxk, mask=xm, other=0.0).to(tl.float32)[None, :]
            y = tl.sum(acc, axis=1)[None, :]  # (1, BO)
        else:
            acc3 = tl.zeros((BT, BO, G), dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BK):
                g = k0 // 4 + tl.arange(0, G)
                e0, e1, e2, e3 = _group_entries(pairs_ptr, pos_ptr, pos_stride, o, om, g, K, VALUE_BITS, IS_BF16)
                xp = x_ptr + t[:, None] * sxt + (4 * g)[None, :] * sxk  # (BT, G): entry 0 of each group
                xm = tm[:, None] & (g < K // 4)[None, :]
                acc3 = _accumulate(acc3, e0, e1, e2, e3, tl.load(xp, mask=xm, other=0.0).to(tl.float32),
                                   tl.load(xp + sxk, mask=xm, other=0.0).to(tl.float32),
                                   tl.load(xp + 2 * sxk, mask=xm, other=0.0).to(tl.float32),
                                   tl.load(xp + 3 * sxk, mask=xm, other=0.0).to(tl.float32))
            y = tl.sum(acc3, axis=2)  # (BT, BO)
        _store_rows(y, y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS, SPLIT)

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
    pairs = len(cfg) > 4 and cfg[4]
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    b = bias if bias is not None else values
    out = y if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bo), split)
    common = dict(HAS_BIAS=bias is not None, BT=_block_tokens(t), BO=bo, BK=bk, SPLIT=split, num_warps=warps)
    if pairs:  # each group's two values as one word: (N, K/4) of twice the value's width
        words = values.view(torch.int64 if values.element_size() == 4 else torch.int32)
        _gemv24_pairs_kernel[grid](x, x.stride(0), x.stride(1), words, positions, positions.stride(0), b, out, t, n,
                                   k, k_per, VALUE_BITS=8 * values.element_size(),
                                   IS_BF16=values.dtype == torch.bfloat16, **common)
    else:
        _gemv24_kernel[grid](x, x.stride(0), x.stride(1), values, positions, positions.stride(0), positions.shape[1],
                             b, out, t, n, k, k_per, **common)
    if split > 1:
        _sum_splits[(triton.cdiv(t * n, 1024),)](out, b, y, t * n, n, HAS_BIAS=bias is not None, SPLIT=split,
                                                 BLOCK=1024, num_warps=4)


def _tune(x, values, positions, bias, y) -> tuple[int, ...]:
    """The fastest fitting config for this shape, timed as the dispatch times its candidates
    (:func:`twofour.dispatch.median_ms`)."""
    fitting = [c for c in CONFIGS if _fits(_block_tokens(x.shape[0]), c)] or list(CONFIGS[:1])
    times, errors = {}, {}
    for cfg in fitting:  # a variant this GPU's Triton can't build is left out, with a warning
        try:
            times[cfg] = median_ms(lambda cfg=cfg: _launch(x, values, positions, bias, y, cfg))
        except Exception as e:  # noqa: BLE001 (compiler errors have no common type)
            errors[cfg] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not times:
        raise RuntimeError(f"gemv24: no configuration ran at this shape; first error: {next(iter(errors.values()))}")
    for cfg, err in errors.items():
        log.warning("gemv24: configuration %s failed and is skipped (%s)", cfg, err)
    return min(times, key=times.get)


def gemv24(x: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: tuple[int, ...] | None = None) -> torch.Tensor:
    """y (T, N) = x (T, K) W^T (+ bias), W given as ``values`` (N, K/2) and ``positions``
    (N, ceil(K/8)) uint8; T <= :data:`MAX_TOKENS`; x, values and bias of one dtype, y in it.

    ``config`` = (rows per program, inputs per step, warps[, input splits[, pair loads]]) fixes the
    launch (:data:`CONFIGS`); otherwise the GPU
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
    if values.storage_offset() % 2:  # read as pairs of values: words must start on a pair
        values = values.clone()
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


def triton_kernels() -> dict[str, object]:
    """The Triton kernels :func:`gemv24` launches by variant, ``tiles`` and ``pairs`` (pair loads;
    empty without Triton), for tools that compile them on their own (``benchmarks/inference/gemv_sass.py``)."""
    return {"tiles": _gemv24_kernel, "pairs": _gemv24_pairs_kernel} if HAS_TRITON else {}
