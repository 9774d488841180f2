"""Fused prune-and-compress kernels (Triton): read a dense matrix once, choose 2 of every 4
(hard top-2, S-STE's scaled soft threshold, a given mask, or MVUE's unbiased random pick),
and write cuSPARSELt's compressed layout (``layout.py``) directly: values and metadata.

Each program covers a 64-row band x BC columns (128 under the interpreter; on the GPU the width,
32 to 256, and the warps are autotuned per shape). A row-major source is read as one coalesced
tile and split into the four entries of each group by reshapes; a source whose rows are
contiguous (``dY^T`` read in place from the row-major ``dY``, groups along tokens) is read with
four coalesced loads, one per group entry. Every per-group step (ranking, threshold, MVUE's
draws and inclusion probabilities) is then elementwise, and the metadata is packed by reshapes.
docs/notes/fastpath-experiments.md records the variants measured and why these were kept.

Tested against the plain-torch reference on the CPU with ``TRITON_INTERPRET=1`` and byte for
byte against cuSPARSELt's own compression on the GPU.
"""

from __future__ import annotations

import torch

from .layout import compressed_size, supported_shape

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None

__all__ = ["compress", "compress_e4m3", "MODES", "HAS_TRITON"]

HAS_TRITON = triton is not None
MODES = {"hard": 0, "soft": 1, "mask": 2, "mvue": 3}
BC = 128  # columns per program off the GPU (a 64 x 128 tile); on the GPU autotuned over 32-256
PHILOX_ROUNDS = 10  # Philox4x32 rounds for MVUE's draws (Triton's and cuRAND's default)
#: Layout switch of the kernel for a source with contiguous rows (dY^T read in place): PAIR_ROWS
#: shares one Philox call between rows 2i and 2i+1 of a group, which the thread already holds,
#: instead of between two groups spread over threads (a layout conversion of the random bits
#: through shared memory); measured 0.319 -> 0.283 ms at the 774M fc1 shape on an H200, where two
#: other variants measured slower (docs/notes/fastpath-experiments.md). On the tile-load path
#: (a row-major source) it measured faster too (0.312 -> 0.291 ms) but stays off there until
#: its GPU test has run (it passes under Triton's interpreter).
VARIANT = {"PAIR_ROWS": True}


if HAS_TRITON:

    @triton.jit
    def _rank_keep(s0, s1, s2, s3):
        """Keep the 2 largest scores; ties go to the lower index (as pruning.mask_24)."""
        k0 = ((s1 > s0).to(tl.int32) + (s2 > s0).to(tl.int32) + (s3 > s0).to(tl.int32)) < 2
        k1 = ((s0 >= s1).to(tl.int32) + (s2 > s1).to(tl.int32) + (s3 > s1).to(tl.int32)) < 2
        k2 = ((s0 >= s2).to(tl.int32) + (s1 >= s2).to(tl.int32) + (s3 > s2).to(tl.int32)) < 2
        k3 = ((s0 >= s3).to(tl.int32) + (s1 >= s3).to(tl.int32) + (s2 >= s3).to(tl.int32)) < 2
        return k0, k1, k2, k3

    @triton.jit
    def _uniform(bits):
        """32 random bits -> a float32 uniform in [0, 1) on the 2^-23 grid (exponent trick, no
        int -> float conversion)."""
        one = ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True)  # [1, 2)
        return one - 1.0

    @triton.jit
    def _draw(w0, w1, w2, w3, u):
        """One-hot draw of k in 0..3 with probability w_k / sum(w): the slot of u * sum(w) among
        the running sums w_0, w_0 + w_1, w_0 + w_1 + w_2 (a zero weight is never drawn)."""
        c2 = w0 + w1
        c3 = c2 + w2
        t = u * (c3 + w3)
        ge1, ge2, ge3 = w0 <= t, c2 <= t, c3 <= t
        return ge1 == 0, ge1 & (ge2 == 0), ge2 & (ge3 == 0), ge3

    @triton.jit
    def _rcp(d):
        """1/d for 0 < d < 1e37 as rsqrt(d)^2: one MUFU op and a multiply (relative error ~2^-22)
        where a division costs about eight instructions."""
        r = tl.rsqrt(d)
        return r * r

    @triton.jit
    def _pick(k0, k1, k2, k3, y0, y1, y2, y3):
        """The entries of y at the lower and the higher of the two kept positions."""
        return tl.where(k0, y0, tl.where(k1, y1, y2)), tl.where(k3, y3, tl.where(k2, y2, y1))

    @triton.jit
    def _out(x, OUT_BF16: tl.constexpr):
        """float32 -> the output's bits, rounding to nearest even (also under the interpreter,
        whose plain bf16 cast truncates), NaN kept; bf16 goes out as int16 bits."""
        if OUT_BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
            # a NaN stays a NaN (the GPU's 0x7FFFFFFF would round into the sign bit: -0)
            y = tl.where(x != x, 0x7FC0, y).to(tl.int16)
        else:
            y = x.to(tl.float16)
        return y

    @triton.jit
    def _mvue_weights(a0, a1, a2, a3):
        """MVUE's draw weights: the magnitudes plus a floor relative to the group's largest, so
        that no inclusion probability is zero (and an all-zero group draws uniformly)."""
        eps = 1e-6 * tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)) + 1e-30
        return a0 + eps, a1 + eps, a2 + eps, a3 + eps

    @triton.jit
    def _group_uniforms(seed_ptr, r, pc, k_cols, G: tl.constexpr, ROUNDS: tl.constexpr):
        """Two uniforms per group of a (64, 4G) tile at rows ``r``, column block ``pc``: one
        Philox call gives 4 x 32 bits, two groups' two uniforms (counter: row, group pair)."""
        pair = (r * (k_cols // 8) + pc * (G // 2) + tl.arange(0, G // 2)[None, :]).to(tl.int32)
        b0, b1, b2, b3 = tl.randint4x(tl.load(seed_ptr), pair, ROUNDS)
        return _uniform(tl.reshape(tl.join(b0, b2), (64, G))), _uniform(tl.reshape(tl.join(b1, b3), (64, G)))

    @triton.jit
    def _row_pair_uniforms(seed_ptr, band, pc, k_cols, G: tl.constexpr, ROUNDS: tl.constexpr):
        """Two uniforms per group of a (64, 4G) tile of band ``band``, column block ``pc``: one
        Philox call gives 4 x 32 bits, the two uniforms of rows 2i and 2i+1 of one group, which
        one thread already holds (counter: row pair, group)."""
        r2 = band * 32 + tl.arange(0, 32)[:, None]
        gq = pc * G + tl.arange(0, G)[None, :]
        b0, b1, b2, b3 = tl.randint4x(tl.load(seed_ptr), (r2 * (k_cols // 4) + gq).to(tl.int32), ROUNDS)
        u1 = _uniform(tl.reshape(tl.permute(tl.join(b0, b2), (0, 2, 1)), (64, G)))
        u2 = _uniform(tl.reshape(tl.permute(tl.join(b1, b3), (0, 2, 1)), (64, G)))
        return u1, u2

    @triton.jit
    def _mvue_keep(a0, a1, a2, a3, u1, u2):
        """MVUE's kept pair: two draws without replacement, a_i/S then a_j/(S - a_i)."""
        f0, f1, f2, f3 = _draw(a0, a1, a2, a3, u1)
        h0, h1, h2, h3 = _draw(tl.where(f0, 0.0, a0), tl.where(f1, 0.0, a1), tl.where(f2, 0.0, a2),
                               tl.where(f3, 0.0, a3), u2)
        return f0 | h0, f1 | h1, f2 | h2, f3 | h3

    @triton.jit
    def _load_groups(src, sr, sc, r, pc, off, ok, m_rows, k_cols, G: tl.constexpr, QUAD_LOADS: tl.constexpr):
        """The four entries of each group of a (64, 4G) tile at rows ``r``, column block ``pc``, as
        four (64, G) float32 tensors: four coalesced loads for a source with contiguous rows (dY^T
        read in place), else one coalesced tile load split by reshapes."""
        if QUAD_LOADS:
            # the group each column of the (64, G) tensors holds, in r's index type (64-bit past 2^31)
            gq = (pc * G + tl.arange(0, G)[None, :]).to(r.dtype)
            okq = (r < m_rows) & (gq < k_cols // 4)
            offq = r * sr + gq * (4 * sc)
            x0 = tl.load(src + offq, mask=okq, other=0.0).to(tl.float32)
            x1 = tl.load(src + offq + sc, mask=okq, other=0.0).to(tl.float32)
            x2 = tl.load(src + offq + 2 * sc, mask=okq, other=0.0).to(tl.float32)
            x3 = tl.load(src + offq + 3 * sc, mask=okq, other=0.0).to(tl.float32)
        else:
            x0, x1, x2, x3 = _quads(tl.load(src + off, mask=ok, other=0.0).to(tl.float32), G)
        return x0, x1, x2, x3

    @triton.jit
    def _mvue_draws(a0, a1, a2, a3, u_ptr, seed_ptr, r, band, pc, m_rows, k_cols, G: tl.constexpr,
                    HAS_U: tl.constexpr, PAIR_ROWS: tl.constexpr, ROUNDS: tl.constexpr):
        """MVUE's kept pair of each group from the draw weights ``a``: given uniforms (two per
        group, a contiguous (M, K/2) tensor; tests draw the reference's) or Philox draws."""
        if HAS_U:
            cu = pc * (2 * G) + tl.arange(0, 2 * G)[None, :]
            u = tl.load(u_ptr + r * (k_cols // 2) + cu, mask=(r < m_rows) & (cu < k_cols // 2), other=0.5)
            u1, u2 = tl.split(tl.reshape(u, (64, G, 2)))
        elif PAIR_ROWS:
            u1, u2 = _row_pair_uniforms(seed_ptr, band, pc, k_cols, G, ROUNDS)
        else:
            u1, u2 = _group_uniforms(seed_ptr, r, pc, k_cols, G, ROUNDS)
        return _mvue_keep(a0, a1, a2, a3, u1, u2)

    @triton.jit
    def _mvue_rescale(y0, y1, k0, k1, k2, k3, a0, a1, a2, a3):
        """The kept y / p, p_k = a_k/S * (1 + sum_{i != k} q_i), q_i = a_i / (S - a_i)."""
        s01, s23 = a0 + a1, a2 + a3
        q0, q1 = a0 * _rcp(a1 + s23), a1 * _rcp(a0 + s23)  # S - a_i summed directly
        q2, q3 = a2 * _rcp(s01 + a3), a3 * _rcp(s01 + a2)
        qs = q0 + q1 + q2 + q3
        ak0, ak1 = _pick(k0, k1, k2, k3, a0, a1, a2, a3)
        qk0, qk1 = _pick(k0, k1, k2, k3, q0, q1, q2, q3)
        s = s01 + s23
        return y0 * s * _rcp(ak0 * (1 + qs - qk0)), y1 * s * _rcp(ak1 * (1 + qs - qk1))

    @triton.jit
    def _store_compressed(v0, v1, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC: tl.constexpr):
        """Write a (64, BC) band's kept values ``v0``, ``v1`` (the output's bits, (64, BC/4) each)
        and the positions ``i0`` < ``i1`` of each group in cuSPARSELt's 16-bit layout
        (``layout.py``): values row-major, metadata words packed by reshapes."""
        CT: tl.constexpr = BC // 32
        vv = tl.reshape(tl.join(v0, v1), (64, BC // 2))  # (64, G, 2) -> row-major values
        cv = pc * (BC // 2) + tl.arange(0, BC // 2)[None, :]
        tl.store(vals + r * (k_cols // 2) + cv, vv, mask=(r < m_rows) & (cv < k_cols // 2))
        code = tl.where(r < m_rows, i0 | (i1 << 2), 14)  # padding rows read as "keep 2 and 3"
        # (64 rows, G groups) -> (rt, rh, rl, ct, gh, gl); nibble rh + 2*gh of word (rl, gl)
        c6 = tl.reshape(code, (4, 2, 8, CT, 2, 4))
        rh = tl.arange(0, 2)[None, :, None, None, None, None]
        gh = tl.arange(0, 2)[None, None, None, None, :, None]
        word = tl.sum(tl.sum(c6 << (4 * (rh + 2 * gh)), axis=4), axis=1)  # (rt, rl, ct, gl)
        word = tl.where(word >= 32768, word - 65536, word).to(tl.int16)
        rt = tl.arange(0, 4)[:, None, None, None]
        rl = tl.arange(0, 8)[None, :, None, None]
        ct = pc * CT + tl.arange(0, CT)[None, None, :, None]
        gl = tl.arange(0, 4)[None, None, None, :]
        tl.store(meta + ((band * n_ct + ct) * 4 + rt) * 32 + rl * 4 + gl, word, mask=ct < n_ct)

    @triton.jit
    def _compress_kernel(src, sr, sc, m_rows, k_cols, mask_ptr, u_ptr, seed_ptr, scale_ptr, vals, meta, dense_out,
                         n_ct, MODE: tl.constexpr, HAS_U: tl.constexpr, WRITE_DENSE: tl.constexpr,
                         OUT_BF16: tl.constexpr, BC: tl.constexpr, ROUNDS: tl.constexpr = PHILOX_ROUNDS,
                         BIG: tl.constexpr = False, QUAD_LOADS: tl.constexpr = False,
                         WRITE_SPARSE: tl.constexpr = True, PAIR_ROWS: tl.constexpr = False):
        """One 64-row band x BC columns: the four entries of each group as four (64, BC/4)
        tensors (one tile load and a split, or four loads for a source with contiguous rows),
        the kept pair chosen elementwise, values and metadata packed by reshapes."""
        G: tl.constexpr = BC // 4
        band, pc = tl.program_id(0), tl.program_id(1)
        r = band * 64 + tl.arange(0, 64)[:, None]  # (64, 1)
        c = pc * BC + tl.arange(0, BC)[None, :]  # (1, BC)
        ok = (r < m_rows) & (c < k_cols)
        if BIG:  # offsets past 2^31: 64-bit index arithmetic (else 32-bit, a third of the instructions)
            r, c = r.to(tl.int64), c.to(tl.int64)
        off = r * sr + c * sc
        x0, x1, x2, x3 = _load_groups(src, sr, sc, r, pc, off, ok, m_rows, k_cols, G, QUAD_LOADS)
        a0, a1, a2, a3 = tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3)
        if MODE == 2:  # a given mask (transposable), read through the same strides
            k0, k1, k2, k3 = _quads(tl.load(mask_ptr + off, mask=ok, other=0).to(tl.int32), G)
            k0, k1, k2, k3 = k0 != 0, k1 != 0, k2 != 0, k3 != 0
        elif MODE == 3:  # MVUE: two draws without replacement, a_i/S then a_j/(S - a_i)
            a0, a1, a2, a3 = _mvue_weights(a0, a1, a2, a3)
            k0, k1, k2, k3 = _mvue_draws(a0, a1, a2, a3, u_ptr, seed_ptr, r, band, pc, m_rows, k_cols, G, HAS_U,
                                         PAIR_ROWS, ROUNDS)
        else:
            k0, k1, k2, k3 = _rank_keep(a0, a1, a2, a3)
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
        y0, y1 = _pick(k0, k1, k2, k3, x0, x1, x2, x3)
        if MODE == 3:
            y0, y1 = _mvue_rescale(y0, y1, k0, k1, k2, k3, a0, a1, a2, a3)
        v0, v1 = _out(y0, OUT_BF16), _out(y1, OUT_BF16)
        if WRITE_SPARSE:  # the compressed layout (skipped when only the dense matrix is read)
            _store_compressed(v0, v1, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC)
        if WRITE_DENSE:  # the effective matrix, row-major, for GEMMs that stay dense
            zero = tl.zeros_like(v0)
            d0, d3 = tl.where(k0, v0, zero), tl.where(k3, v1, zero)
            d1 = tl.where(i1 == 1, v1, tl.where(i0 == 1, v0, zero))
            d2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, zero))
            dd = tl.join(tl.join(d0, d1), tl.join(d2, d3)).permute(0, 1, 3, 2)  # (64, G, e)
            tl.store(dense_out + r * k_cols + c, tl.reshape(dd, (64, BC)), mask=ok)

    _compress_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc, w in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8),
                                                                       (256, 8))],
        key=["m_rows", "k_cols", "sr", "sc", "MODE", "WRITE_DENSE", "WRITE_SPARSE", "PAIR_ROWS"],
    )(_compress_kernel)

    @triton.jit
    def _quads(x, G: tl.constexpr):
        """(64, 4G) -> the group entries 0..3 as four (64, G) tensors."""
        even, odd = tl.split(tl.reshape(x, (64, G, 2, 2)))  # e = 2*i + j: split j
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3

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
        x0, x1, x2, x3 = _quads(x, G)
        k0, k1, k2, k3 = _rank_keep(x0 & 0x7F, x1 & 0x7F, x2 & 0x7F, x3 & 0x7F)
        i0 = tl.where(k0, 0, tl.where(k1, 1, 2))
        i1 = tl.where(k3, 3, tl.where(k2, 2, 1))
        y0, y1 = _pick(k0, k1, k2, k3, x0, x1, x2, x3)
        vv = tl.reshape(tl.join(y0, y1), (64, BC // 2)).to(tl.uint8)  # (64, G, 2) -> row-major values
        _store_compressed_e4m3(vv, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC)

    @triton.jit
    def _store_compressed_e4m3(vv, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC: tl.constexpr):
        """Write a (64, BC) band's kept values ``vv`` ((64, BC/2), row-major, in ``vals``' element
        type) and the positions ``i0`` < ``i1`` of each group as the e4m3 metadata tiles (16 rows x
        64 columns in 32-bit words, ``layout.py``)."""
        CT: tl.constexpr = BC // 64
        cv = pc * (BC // 2) + tl.arange(0, BC // 2)[None, :]
        tl.store(vals + r.to(tl.int64) * (k_cols // 2) + cv, vv, mask=(r < m_rows) & (cv < k_cols // 2))
        code = tl.where(r < m_rows, i0 | (i1 << 2), 14).to(tl.int64)  # padding rows read as "keep 2 and 3"
        # (64 rows, G groups) -> (rt, rh, rl, ct, gq, gw, gl); nibble gl + 2*rh + 4*gq of word (rl, gw)
        c7 = tl.reshape(code, (4, 2, 8, CT, 2, 4, 2))
        rh = tl.arange(0, 2)[None, :, None, None, None, None, None]
        gq = tl.arange(0, 2)[None, None, None, None, :, None, None]
        gl = tl.arange(0, 2)[None, None, None, None, None, None, :]
        word = tl.sum(tl.sum(tl.sum(c7 << (4 * (gl + 2 * rh + 4 * gq)), axis=6), axis=4), axis=1)  # (rt, rl, ct, gw)
        word = tl.where(word >= 2**31, word - 2**32, word).to(tl.int32)
        rt = tl.arange(0, 4)[:, None, None, None]
        rl = tl.arange(0, 8)[None, :, None, None]
        ct = pc * CT + tl.arange(0, CT)[None, None, :, None]
        gw = tl.arange(0, 4)[None, None, None, :]
        tl.store(meta + ((band * n_ct + ct) * 4 + rt) * 32 + rl * 4 + gw, word, mask=ct < n_ct)

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


def compress_tiled(x: torch.Tensor, mode: str, *, tile: tuple[int, int] | None = None, pair_rows: bool | None = None,
                   **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`compress` with the launch fixed: ``tile`` = (columns, warps) instead of the
    autotuned one, ``pair_rows`` instead of :data:`VARIANT`'s layout switch. For tests (every
    launch must write the same bytes) and benchmarks (timing each launch)."""
    return _compress(x, mode, tile=tile, pair_rows=pair_rows, **kwargs)


def _compress(x: torch.Tensor, mode: str, *, out_dtype: torch.dtype = torch.bfloat16,
              scale: torch.Tensor | None = None, mask: torch.Tensor | None = None, u: torch.Tensor | None = None,
              seed: torch.Tensor | None = None, dense_out: bool = False, sparse_out: bool = True,
              tile: tuple[int, int] | None = None,
              pair_rows: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not HAS_TRITON:
        raise RuntimeError("twofour's fused compression needs Triton (pip install triton)")
    m, k = x.shape
    if not supported_shape(m, k):
        raise ValueError(f"compress: K must be a multiple of 32, got shape {(m, k)}")
    if mode not in MODES:
        raise ValueError(f"compress: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"compress: out_dtype must be bfloat16 or float16, got {out_dtype}")
    if not (sparse_out or dense_out):
        raise ValueError("compress: asked for neither the compressed nor the dense output")
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
    if mode == "mvue" and u is None and seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        if mask.stride() != x.stride():
            raise ValueError("compress: mask must have the same strides as x")
    args = (x, x.stride(0), x.stride(1), m, k, mask if mask is not None else dummy, u if u is not None else dummy,
            seed if seed is not None else dummy, scale if scale is not None else dummy, vals, meta, dense_bits, k // 32)
    if u is not None and (u.shape != (m, k // 2) or not u.is_contiguous()):
        raise ValueError(f"compress: u must be a contiguous ({m}, {k // 2}) tensor (two uniforms per group)")
    span = (m - 1) * abs(x.stride(0)) + (k - 1) * abs(x.stride(1)) + 1
    consts = dict(MODE=MODES[mode], HAS_U=u is not None, WRITE_DENSE=dense_out, OUT_BF16=out_dtype == torch.bfloat16,
                  BIG=max(span, m * k) >= 2**31, QUAD_LOADS=x.stride(0) == 1 and k > 1,
                  WRITE_SPARSE=sparse_out)
    if pair_rows is None:  # measured for a source read in place
        pair_rows = VARIANT["PAIR_ROWS"] and consts["QUAD_LOADS"]
    consts["PAIR_ROWS"] = pair_rows
    if x.is_cuda:  # tile width and warps measured once per shape and mode (triton.autotune), then
        # launched directly: the autotuner's own dispatch costs ~12 us of host time per call
        key = (m, k, x.stride(0), x.stride(1), x.dtype, tuple(consts.values()))
        cfg = tile or _launch.get(key)
        if cfg is None:
            _compress_tuned[lambda meta: (triton.cdiv(m, 64), triton.cdiv(k, meta["BC"]))](*args, **consts)
            best = getattr(_compress_tuned, "best_config", None)
            if best is not None:
                _launch[key] = (best.kwargs["BC"], best.num_warps)
        else:
            _compress_kernel[(triton.cdiv(m, 64), triton.cdiv(k, cfg[0]))](*args, **consts, BC=cfg[0],
                                                                             num_warps=cfg[1])
    else:
        bc = tile[0] if tile else BC
        _compress_kernel[(triton.cdiv(m, 64), triton.cdiv(k, bc))](*args, **consts, BC=bc)
    return buf, dense


_launch_e4m3: dict[tuple[int, int], tuple[int, int]] = {}  # (M, K) -> the tuned (BC, warps)


def compress_e4m3(q: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compressed bytes (uint8) of a row-major 2:4 e4m3 matrix ``q`` (M, K), K a
    multiple of 64: the two largest magnitudes of each group of 4 along K kept (the non-zeros of a
    2:4 matrix; a group with fewer keeps zeros). What an FP8 2:4 GEMM reads as its sparse operand,
    in one pass at about copy bandwidth, where cuSPARSELt's own compression runs at a few percent
    of it (docs/PERFORMANCE.md). On the GPU the tile width is autotuned once per shape."""
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
    if q.is_cuda:  # tuned once per shape, then launched directly (the autotuner's dispatch costs host time)
        cfg = _launch_e4m3.get((m, k))
        if cfg is None:
            _compress_e4m3_tuned[lambda meta: (triton.cdiv(m, 64), triton.cdiv(k, meta["BC"]))](*args)
            best = getattr(_compress_e4m3_tuned, "best_config", None)
            if best is not None:
                _launch_e4m3[(m, k)] = (best.kwargs["BC"], best.num_warps)
        else:
            _compress_e4m3_kernel[(triton.cdiv(m, 64), triton.cdiv(k, cfg[0]))](*args, BC=cfg[0], num_warps=cfg[1])
    else:
        _compress_e4m3_kernel[(triton.cdiv(m, 64), triton.cdiv(k, BC))](*args, BC=BC)
    return buf


def triton_kernel():
    """The Triton kernel :func:`compress` launches (a ``triton.JITFunction``; None without Triton),
    for tools that compile or launch it on their own (``benchmarks/kernels/sass_count.py``)."""
    return _compress_kernel if HAS_TRITON else None
