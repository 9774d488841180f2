"""Fused prune-and-compress kernels (Triton): read a dense matrix once, choose 2 of every 4
(hard top-2, S-STE's scaled soft threshold, a given mask, or MVUE's unbiased random pick),
and write cuSPARSELt's compressed layout (``layout.py``) directly: values and metadata.

Each program covers a 64-row band x BC columns (128 under the interpreter; on the GPU the width,
32 to 256, and the warps are autotuned per shape). A row-major source is read as one coalesced
tile and split into the four entries of each group by reshapes; a source whose rows are
contiguous (``dY^T`` read in place from the row-major ``dY``, groups along tokens) is read with
four coalesced loads, one per group entry. Every per-group step (ranking, threshold, MVUE's
draws and inclusion probabilities) is then elementwise, and the metadata is packed by reshapes
(the helpers of ``triton_common.py``, shared with the fused kernels). MVUE's Philox counters
follow the load: for a source with contiguous rows one call serves rows 2i and 2i+1 of a group,
which one thread holds, else two groups of a row. docs/notes/fastpath-experiments.md records
the variants measured and why these were kept.

Tested against the plain-torch reference on the CPU with ``TRITON_INTERPRET=1`` and byte for
byte against cuSPARSELt's own compression on the GPU.
"""

from __future__ import annotations

import torch

from .layout import compressed_size, supported_shape
from .triton_common import HAS_TRITON, PHILOX_ROUNDS, launch_tuned

__all__ = ["compress", "compress_tiled", "compress_both", "compress_e4m3", "MODES"]

MODES = {"hard": 0, "soft": 1, "mask": 2, "mvue": 3}


BC = 128  # columns per program off the GPU (a 64 x 128 tile); on the GPU autotuned over 32-256

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import (
        in_float,
        load_groups,
        mvue_draws,
        mvue_rescale,
        mvue_weights,
        out_bits,
        pick,
        quads,
        rank_keep,
        store_compressed,
        store_compressed_e4m3,
    )

    @triton.jit
    def _compress_kernel(src, sr, sc, m_rows, k_cols, mask_ptr, u_ptr, seed_ptr, scale_ptr, vals, meta, dense_out,
                         n_ct, tvals, tmeta, n_ct_t, MODE: tl.constexpr, HAS_U: tl.constexpr, WRITE_DENSE: tl.constexpr,
                         OUT_BF16: tl.constexpr, BC: tl.constexpr, ROUNDS: tl.constexpr = PHILOX_ROUNDS,
                         BIG: tl.constexpr = False, QUAD_LOADS: tl.constexpr = False,
                         WRITE_SPARSE: tl.constexpr = True, WRITE_T: tl.constexpr = False):
        """One 64-row band x BC columns: the four entries of each group as four (64, BC/4)
        tensors (one tile load and a split, or four loads for a source with contiguous rows),
        the kept pair chosen elementwise, values and metadata packed by reshapes. With
        ``WRITE_T`` (BC = 64) also the effective tile's transpose, 2:4 along the rows (pruned by
        magnitude: the ``pruned-t`` dX route's W_pt^T; or by the transposed mask in mask mode),
        compressed into ``tvals``/``tmeta`` (:func:`compress_both`)."""
        G: tl.constexpr = BC // 4
        band, pc = tl.program_id(0), tl.program_id(1)
        r = band * 64 + tl.arange(0, 64)[:, None]  # (64, 1)
        c = pc * BC + tl.arange(0, BC)[None, :]  # (1, BC)
        ok = (r < m_rows) & (c < k_cols)
        if BIG:  # offsets past 2^31: 64-bit index arithmetic (else 32-bit, a third of the instructions)
            r, c = r.to(tl.int64), c.to(tl.int64)
        off = r * sr + c * sc
        x0, x1, x2, x3 = load_groups(src, sr, sc, r, pc, off, ok, m_rows, k_cols, G, QUAD_LOADS)
        a0, a1, a2, a3 = tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3)
        if MODE == 2:  # a given mask (transposable), read through the same strides
            k0, k1, k2, k3 = quads(tl.load(mask_ptr + off, mask=ok, other=0).to(tl.int32), G)
            k0, k1, k2, k3 = k0 != 0, k1 != 0, k2 != 0, k3 != 0
        elif MODE == 3:  # MVUE: two draws without replacement, a_i/S then a_j/(S - a_i)
            a0, a1, a2, a3 = mvue_weights(a0, a1, a2, a3)
            k0, k1, k2, k3 = mvue_draws(a0, a1, a2, a3, u_ptr, seed_ptr, r, band, pc, m_rows, k_cols, G, HAS_U,
                                        QUAD_LOADS, ROUNDS)
        else:
            k0, k1, k2, k3 = rank_keep(a0, a1, a2, a3)
        if MODE == 1:  # beta * S(x): threshold at the largest dropped magnitude
            t = tl.maximum(tl.maximum(tl.where(k0, 0.0, a0), tl.where(k1, 0.0, a1)),
                           tl.maximum(tl.where(k2, 0.0, a2), tl.where(k3, 0.0, a3)))
            beta = tl.load(scale_ptr)
            x0 = tl.where(x0 >= 0, 1.0, -1.0) * tl.maximum(a0 - t, 0.0) * beta
            x1 = tl.where(x1 >= 0, 1.0, -1.0) * tl.maximum(a1 - t, 0.0) * beta
            x2 = tl.where(x2 >= 0, 1.0, -1.0) * tl.maximum(a2 - t, 0.0) * beta
            x3 = tl.where(x3 >= 0, 1.0, -1.0) * tl.maximum(a3 - t, 0.0) * beta
        # the two kept, in ascending position, and the 4-bit code i0 | i1 << 2
        i0 = tl.where(k0, 0, tl.where(k1, 1, 2))
        i1 = tl.where(k3, 3, tl.where(k2, 2, 1))
        y0, y1 = pick(k0, k1, k2, k3, x0, x1, x2, x3)
        if MODE == 3:
            y0, y1 = mvue_rescale(y0, y1, k0, k1, k2, k3, a0, a1, a2, a3)
        v0, v1 = out_bits(y0, OUT_BF16), out_bits(y1, OUT_BF16)
        if WRITE_SPARSE:  # cuSPARSELt's layout (skipped when only the dense matrix is read)
            store_compressed(v0, v1, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC)
        if WRITE_DENSE:  # the effective matrix, row-major, for GEMMs that stay dense
            tl.store(dense_out + r * k_cols + c, _spread(v0, v1, i0, i1, tl.zeros_like(v0), BC), mask=ok)
        if WRITE_T:  # W_eff^T's groups run down this tile's columns: 4 rows of W_eff each
            _store_transposed(in_float(v0, OUT_BF16), in_float(v1, OUT_BF16), i0, i1, band, pc, m_rows, k_cols, n_ct_t,
                              tvals, tmeta, OUT_BF16, BIG, BC, MODE == 2)

    @triton.jit
    def _spread(v0, v1, i0, i1, zero, BC: tl.constexpr):
        """The (64, BC) tile of a group's kept pair ``v0`` < ``v1`` at positions ``i0`` < ``i1``, zeros elsewhere."""
        d0, d3 = tl.where(i0 == 0, v0, zero), tl.where(i1 == 3, v1, zero)
        d1 = tl.where(i1 == 1, v1, tl.where(i0 == 1, v0, zero))
        d2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
        return tl.reshape(tl.join(tl.join(d0, d1), tl.join(d2, d3)).permute(0, 1, 3, 2), (64, BC))  # (64, G, e)

    @triton.jit
    def _store_transposed(f0, f1, i0, i1, band, pc, m_rows, k_cols, n_ct_t, tvals, tmeta, OUT_BF16: tl.constexpr,
                          BIG: tl.constexpr, BC: tl.constexpr, MASK_T: tl.constexpr):
        """The transpose's operand of a square (64, 64) tile: the effective tile (its kept pairs
        ``f0``, ``f1`` in float32, as rounded) transposed and written compressed as W^T's band
        ``pc``, column block ``band``, keeping in each group of 4 rows its 2 largest magnitudes (the
        ``pruned-t`` route) or, with ``MASK_T``, the positions the tile's mask keeps there (a
        transposable mask: 2:4 along both dimensions)."""
        t0, t1, t2, t3 = quads(tl.trans(_spread(f0, f1, i0, i1, tl.zeros_like(f0), BC)), BC // 4)
        if MASK_T:
            one = tl.full(f0.shape, 1, tl.int32)
            m0, m1, m2, m3 = quads(tl.trans(_spread(one, one, i0, i1, tl.zeros_like(one), BC)), BC // 4)
            q0, q1, q2, q3 = m0 != 0, m1 != 0, m2 != 0, m3 != 0
        else:
            q0, q1, q2, q3 = rank_keep(tl.abs(t0), tl.abs(t1), tl.abs(t2), tl.abs(t3))
        j0 = tl.where(q0, 0, tl.where(q1, 1, 2))
        j1 = tl.where(q3, 3, tl.where(q2, 2, 1))
        z0, z1 = pick(q0, q1, q2, q3, t0, t1, t2, t3)
        rt = pc * 64 + tl.arange(0, 64)[:, None]  # W^T's rows: this tile's columns
        if BIG:
            rt = rt.to(tl.int64)
        store_compressed(out_bits(z0, OUT_BF16), out_bits(z1, OUT_BF16), j0, j1, rt, pc, band, k_cols, m_rows, n_ct_t,
                         tvals, tmeta, BC)

    _compress_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc, w in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8),
                                                                       (256, 8))],
        key=["m_rows", "k_cols", "sr", "sc", "MODE", "WRITE_DENSE", "WRITE_SPARSE"],
    )(_compress_kernel)
    _compress_t_tuned = triton.autotune(  # with W^T's operand too (compress_both): square 64 x 64 tiles
        configs=[triton.Config({"BC": 64}, num_warps=w) for w in (2, 4, 8)],
        key=["m_rows", "k_cols", "sr", "sc", "MODE", "WRITE_DENSE"],
    )(_compress_kernel)

    @triton.jit
    def _compress_e4m3_kernel(src, vals, meta, m_rows, k_cols, n_ct, BC: tl.constexpr):
        """One 64-row band x BC columns of a row-major e4m3 matrix (read as its bytes): the two
        largest magnitudes of each group kept (for e4m3 the order of the low 7 bits), written as
        values and the e4m3 metadata tiles (16 rows x 64 columns in 32-bit words, layout.py)."""
        G: tl.constexpr = BC // 4
        band, pc = tl.program_id(0), tl.program_id(1)
        r = band * 64 + tl.arange(0, 64)[:, None]  # (64, 1)
        c = pc * BC + tl.arange(0, BC)[None, :]  # (1, BC)
        x = tl.load(src + r.to(tl.int64) * k_cols + c, mask=(r < m_rows) & (c < k_cols), other=0).to(tl.int32)
        x0, x1, x2, x3 = quads(x, G)
        k0, k1, k2, k3 = rank_keep(x0 & 0x7F, x1 & 0x7F, x2 & 0x7F, x3 & 0x7F)
        i0 = tl.where(k0, 0, tl.where(k1, 1, 2))
        i1 = tl.where(k3, 3, tl.where(k2, 2, 1))
        y0, y1 = pick(k0, k1, k2, k3, x0, x1, x2, x3)
        vv = tl.reshape(tl.join(y0, y1), (64, BC // 2)).to(tl.uint8)  # (64, G, 2) -> row-major values
        store_compressed_e4m3(vv, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC)

    _compress_e4m3_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc, w in ((64, 2), (128, 4), (256, 4), (256, 8))],
        key=["m_rows", "k_cols"],
    )(_compress_e4m3_kernel)


_launch: dict[tuple, tuple[int, int]] = {}  # (shape, strides, dtype, constants) -> the tuned (BC, warps)


def compress(x: torch.Tensor, mode: str, *, out_dtype: torch.dtype = torch.bfloat16, scale: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, u: torch.Tensor | None = None, seed: torch.Tensor | None = None,
             dense_out: bool = False, sparse_out: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prune the (M, K) matrix ``x`` (any strides) along K and compress it for cuSPARSELt.

    ``mode``: ``hard`` (top-2), ``soft`` (``scale`` * soft threshold), ``mask`` (keep ``mask``,
    a bool tensor of x's shape and strides) or ``mvue`` (uniforms ``u``, two per group, a
    contiguous (M, K/2) tensor, or a Philox ``seed`` int tensor on the device). Returns the
    compressed uint8 buffer (empty with ``sparse_out=False``, for a caller that reads only the
    dense matrix) and, with ``dense_out``, the effective (M, K) matrix in ``out_dtype``. On the
    GPU the tile width and warps are autotuned once per shape.
    """
    return compress_tiled(x, mode, out_dtype=out_dtype, scale=scale, mask=mask, u=u, seed=seed, dense_out=dense_out,
                          sparse_out=sparse_out)


def compress_tiled(x: torch.Tensor, mode: str, *, tile: tuple[int, int] | None = None,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`compress` with the launch fixed: ``tile`` = (columns, warps) instead of the
    autotuned one. For tests (every launch must write the same bytes) and benchmarks (timing
    each launch)."""
    return _compress(x, mode, tile=tile, **kwargs)


def compress_both(x: torch.Tensor, mode: str, *, out_dtype: torch.dtype = torch.bfloat16,
                  scale: torch.Tensor | None = None, mask: torch.Tensor | None = None, dense_out: bool = False,
                  tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`compress` of the (N, K) ``x`` and in the same pass its transpose's 2:4 operand: in
    ``hard`` or ``soft`` mode the ``pruned-t`` dX route's (the effective matrix's transpose, as
    rounded to ``out_dtype``, pruned 2:4 by magnitude along N: byte for byte what
    ``compress(W_eff.t(), "hard")`` writes, without reading W_eff back); in ``mask`` mode, with a
    transposable ``mask``, W^T's compressed by ``mask.t()`` (what ``compress(x.t(), "mask",
    mask=mask.t())`` writes). N a multiple of 32; the tiles are 64 x 64 (``tile``: (64, warps))."""
    if mode not in ("hard", "soft", "mask"):
        raise ValueError(f"compress_both: mode must be hard, soft or mask, got {mode!r}")
    if (mode == "mask") != (mask is not None):
        raise ValueError("compress_both: a mask is given in mask mode, and only there")
    if not supported_shape(x.shape[1], x.shape[0]):
        raise ValueError(f"compress_both: N and K must be multiples of 32, got shape {tuple(x.shape)}")
    if tile is not None and tile[0] != 64:
        raise ValueError(f"compress_both: tiles are 64 columns wide, got {tile[0]}")
    return _compress(x, mode, out_dtype=out_dtype, scale=scale, mask=mask, dense_out=dense_out, tile=tile,
                     with_t=True)


def _compress(x: torch.Tensor, mode: str, *, out_dtype: torch.dtype = torch.bfloat16,
              scale: torch.Tensor | None = None, mask: torch.Tensor | None = None, u: torch.Tensor | None = None,
              seed: torch.Tensor | None = None, dense_out: bool = False, sparse_out: bool = True,
              tile: tuple[int, int] | None = None, with_t: bool = False):
    """The launch behind :func:`compress` (returns (buf, dense)) and :func:`compress_both`
    (returns (buf, dense, W^T's 2:4 buf))."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's fused compression needs Triton (pip install triton)")
    m, k = x.shape
    _check(m, k, mode, out_dtype, sparse_out, dense_out)
    buf = torch.empty(compressed_size(m, k, 2) if sparse_out else 0, dtype=torch.uint8, device=x.device)
    nval = m * k // 2 if sparse_out else 0
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.float16  # bf16 is written as its bits
    vals = buf[: nval * 2].view(bits)
    meta = buf[nval * 2:].view(torch.int16)
    dense = torch.empty(m, k, dtype=out_dtype, device=x.device) if dense_out else None
    dense_bits = dense.view(bits) if dense is not None else vals
    if not sparse_out:  # unused pointers must still point at memory
        vals = meta = dense_bits
    dummy = vals
    tbuf = torch.empty(compressed_size(k, m, 2) if with_t else 0, dtype=torch.uint8, device=x.device)
    tvals, tmeta = (tbuf[: m * k].view(bits), tbuf[m * k:].view(torch.int16)) if with_t else (dummy, dummy)
    if mode == "mvue" and u is None and seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        if mask.stride() != x.stride():
            raise ValueError("compress: mask must have the same strides as x")
    args = (x, x.stride(0), x.stride(1), m, k, mask if mask is not None else dummy, u if u is not None else dummy,
            seed if seed is not None else dummy, scale if scale is not None else dummy, vals, meta, dense_bits, k // 32,
            tvals, tmeta, m // 32)
    if u is not None and (u.shape != (m, k // 2) or not u.is_contiguous()):
        raise ValueError(f"compress: u must be a contiguous ({m}, {k // 2}) tensor (two uniforms per group)")
    span = (m - 1) * abs(x.stride(0)) + (k - 1) * abs(x.stride(1)) + 1
    consts = dict(MODE=MODES[mode], HAS_U=u is not None, WRITE_DENSE=dense_out, OUT_BF16=out_dtype == torch.bfloat16,
                  BIG=max(span, m * k) >= 2**31, QUAD_LOADS=x.stride(0) == 1 and k > 1,
                  WRITE_SPARSE=sparse_out, WRITE_T=with_t)
    tuned = (_compress_t_tuned if with_t else _compress_tuned) if x.is_cuda else None
    launch_tuned(_compress_kernel, tuned, lambda meta: (triton.cdiv(m, 64), triton.cdiv(k, meta["BC"])), args, consts,
                 names=("BC",), default=(64 if with_t else BC,), cache=_launch,
                 key=(m, k, x.stride(0), x.stride(1), x.dtype, tuple(consts.values())), tile=tile, on_gpu=x.is_cuda)
    return (buf, dense, tbuf) if with_t else (buf, dense)


def _check(m: int, k: int, mode: str, out_dtype: torch.dtype, sparse_out: bool, dense_out: bool) -> None:
    """One-line errors for what :func:`compress` can't take."""
    if not supported_shape(m, k):
        raise ValueError(f"compress: K must be a multiple of 32, got shape {(m, k)}")
    if mode not in MODES:
        raise ValueError(f"compress: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"compress: out_dtype must be bfloat16 or float16, got {out_dtype}")
    if not (sparse_out or dense_out):
        raise ValueError("compress: asked for neither the compressed nor the dense output")


_launch_e4m3: dict[tuple[int, int], tuple[int, int]] = {}  # (M, K) -> the tuned (BC, warps)


def compress_e4m3(q: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compressed bytes (uint8) of a row-major 2:4 e4m3 matrix ``q`` (M, K), K a
    multiple of 64: the two largest magnitudes of each group of 4 along K kept (the non-zeros of a
    2:4 matrix; a group with fewer keeps zeros). What an FP8 2:4 GEMM reads as its sparse operand,
    in one pass, several times faster than cuSPARSELt's own compression (docs/PERFORMANCE.md).
    On the GPU the tile width is autotuned once per shape."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's fused compression needs Triton (pip install triton)")
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"compress_e4m3 takes a contiguous 2-D float8_e4m3fn tensor, got {tuple(q.shape)} "
                         f"{q.dtype}{'' if q.dim() != 2 or q.is_contiguous() else ' (not contiguous)'}")
    m, k = q.shape
    if not supported_shape(m, k, 1):
        raise ValueError(f"compress_e4m3: K must be a multiple of 64, got shape {(m, k)}")
    buf = torch.empty(compressed_size(m, k, 1), dtype=torch.uint8, device=q.device)
    nval = m * k // 2
    args = (q.view(torch.uint8), buf[:nval], buf[nval:].view(torch.int32), m, k, k // 64)
    launch_tuned(_compress_e4m3_kernel, _compress_e4m3_tuned if q.is_cuda else None,
                 lambda meta: (triton.cdiv(m, 64), triton.cdiv(k, meta["BC"])), args, {}, names=("BC",),
                 default=(BC,), cache=_launch_e4m3, key=(m, k), on_gpu=q.is_cuda)
    return buf


def triton_kernel():
    """The Triton kernel :func:`compress` launches (a ``triton.JITFunction``; None without Triton),
    for tools that launch it on their own (``benchmarks/step/layer_profile.py``)."""
    return _compress_kernel if HAS_TRITON else None
