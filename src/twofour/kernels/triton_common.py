"""The Triton helpers several kernels share: ranking a group of 4, MVUE's draws and rescaling,
the output's rounding, FP8 grid rounding, and the writers of cuSPARSELt's compressed layout
(``layout.py``) for 16-bit and e4m3 values.

Every helper works on (64, G) tensors, the G groups of 4 along a tile's columns held as four
tensors (entries 0..3 of each group), so that each per-group step is elementwise.
``compress.py`` (the standalone prune-and-compress kernels), ``actgrad.py`` (the activation's
backward fused with MVUE), ``mvue_fp8.py``, ``mask.py`` and ``fp8cast.py`` build on them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None

__all__ = ["HAS_TRITON", "PHILOX_ROUNDS", "fp8_constants", "launch_tuned"]

HAS_TRITON = triton is not None
PHILOX_ROUNDS = 10  # Philox4x32 rounds for MVUE's draws (Triton's and cuRAND's default)


@functools.cache
def fp8_constants(fmt: torch.dtype) -> dict[str, float | int]:
    """The kernels' constants of an FP8 format: its largest value and that value's reciprocal, its
    mantissa bits (from eps = 2^-MBITS) and least normal exponent (from tiny = 2^EMIN)."""
    fi = torch.finfo(fmt)
    return {"FMAX": fi.max, "INV_FMAX": 1.0 / fi.max, "MBITS": 1 - math.frexp(fi.eps)[1],
            "EMIN": math.frexp(fi.tiny)[1] - 1}


def launch_tuned(kernel, tuned, grid: Callable[[dict], tuple], args: tuple, consts: dict, *, names: tuple[str, ...],
                 default: tuple[int, ...], cache: dict, key, tile: tuple[int, ...] | None = None,
                 on_gpu: bool = True) -> None:
    """Launch ``kernel`` with its tile sizes ``names`` (``("BC",)``, ``("BR", "BC")``): on the GPU
    the ones ``tuned`` (the same kernel under ``triton.autotune``) measured for ``key`` once, then
    recorded in ``cache`` and launched directly (the autotuner's own dispatch costs host time on
    every call: docs/notes/fastpath-experiments.md, "Autotuner dispatch"); ``tile`` (sizes, then
    warps) if given; ``default`` with 4 warps inside a CUDA graph capture before any measurement
    (no autotuning there); off the GPU (the interpreter) ``tile``'s sizes or ``default``.
    ``grid`` maps the sizes by name to the launch grid."""
    if not on_gpu:
        meta = dict(zip(names, tile[:len(names)] if tile else default))
        kernel[grid(meta)](*args, **consts, **meta)
        return
    cfg = tile or cache.get(key)
    if cfg is None and torch.cuda.is_current_stream_capturing():
        cfg = (*default, 4)
    if cfg is None:
        tuned[grid](*args, **consts)
        best = getattr(tuned, "best_config", None)
        if best is not None:
            cache[key] = (*(best.kwargs[n] for n in names), best.num_warps)
        return
    meta = dict(zip(names, cfg[:len(names)]))
    kernel[grid(meta)](*args, **consts, **meta, num_warps=cfg[len(names)])


if HAS_TRITON:

    @triton.jit
    def rank_keep(s0, s1, s2, s3):
        """Keep the 2 largest scores; ties go to the lower index (as functional.mask_24)."""
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
    def pick(k0, k1, k2, k3, y0, y1, y2, y3):
        """The entries of y at the lower and the higher of the two kept positions."""
        return tl.where(k0, y0, tl.where(k1, y1, y2)), tl.where(k3, y3, tl.where(k2, y2, y1))

    @triton.jit
    def out_bits(x, OUT_BF16: tl.constexpr):
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
    def in_float(y, OUT_BF16: tl.constexpr):
        """:func:`out_bits`'s output back in float32 (exact: bf16 bits are float32's upper half)."""
        if OUT_BF16:
            x = (y.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = y.to(tl.float32)
        return x

    @triton.jit
    def to_grid(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """``v`` (float32, within the format's range) rounded to the nearest FP8 value, ties to
        even, still in float32: the cast that follows is exact. Done here rather than by the
        cast, so that Triton's interpreter (whose float32 -> FP8 cast drops the carry of a
        rounding into the exponent) runs the GPU's arithmetic."""
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)  # subnormals: EMIN's step
        step = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MBITS)
        inv_step = ((MBITS - e + 127) << 23).to(tl.float32, bitcast=True)  # its exact inverse
        r = ((tl.abs(v) * inv_step + 12582912.0) - 12582912.0) * step  # + 1.5 * 2^23 - 1.5 * 2^23: half to even
        return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # v's sign, -0 too

    @triton.jit
    def quads(x, G: tl.constexpr):
        """(64, 4G) -> the group entries 0..3 as four (64, G) tensors."""
        even, odd = tl.split(tl.reshape(x, (64, G, 2, 2)))  # e = 2*i + j: split j
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3

    @triton.jit
    def load_groups(src, sr, sc, r, pc, off, ok, m_rows, k_cols, G: tl.constexpr, QUAD_LOADS: tl.constexpr):
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
            x0, x1, x2, x3 = quads(tl.load(src + off, mask=ok, other=0.0).to(tl.float32), G)
        return x0, x1, x2, x3

    @triton.jit
    def mvue_weights(a0, a1, a2, a3):
        """MVUE's draw weights: the magnitudes plus a floor relative to the group's largest, so
        that no inclusion probability is zero (and an all-zero group draws uniformly)."""
        eps = 1e-6 * tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)) + 1e-30
        return a0 + eps, a1 + eps, a2 + eps, a3 + eps

    @triton.jit
    def group_uniforms(seed_ptr, r, pc, k_cols, G: tl.constexpr, ROUNDS: tl.constexpr):
        """Two uniforms per group of a (64, 4G) tile at rows ``r``, column block ``pc``: one
        Philox call gives 4 x 32 bits, two groups' two uniforms (counter: row, group pair)."""
        pair = (r * (k_cols // 8) + pc * (G // 2) + tl.arange(0, G // 2)[None, :]).to(tl.int32)
        b0, b1, b2, b3 = tl.randint4x(tl.load(seed_ptr), pair, ROUNDS)
        return _uniform(tl.reshape(tl.join(b0, b2), (64, G))), _uniform(tl.reshape(tl.join(b1, b3), (64, G)))

    @triton.jit
    def _row_pair_uniforms(seed_ptr, band, pc, k_cols, G: tl.constexpr, ROUNDS: tl.constexpr):
        """Two uniforms per group of a (64, 4G) tile of band ``band``, column block ``pc``: one
        Philox call gives 4 x 32 bits, the two uniforms of rows 2i and 2i+1 of one group, which
        one thread already holds when the rows are contiguous (counter: row pair, group)."""
        r2 = band * 32 + tl.arange(0, 32)[:, None]
        gq = pc * G + tl.arange(0, G)[None, :]
        b0, b1, b2, b3 = tl.randint4x(tl.load(seed_ptr), (r2 * (k_cols // 4) + gq).to(tl.int32), ROUNDS)
        u1 = _uniform(tl.reshape(tl.permute(tl.join(b0, b2), (0, 2, 1)), (64, G)))
        u2 = _uniform(tl.reshape(tl.permute(tl.join(b1, b3), (0, 2, 1)), (64, G)))
        return u1, u2

    @triton.jit
    def mvue_keep(a0, a1, a2, a3, u1, u2):
        """MVUE's kept pair: two draws without replacement, a_i/S then a_j/(S - a_i)."""
        f0, f1, f2, f3 = _draw(a0, a1, a2, a3, u1)
        h0, h1, h2, h3 = _draw(tl.where(f0, 0.0, a0), tl.where(f1, 0.0, a1), tl.where(f2, 0.0, a2),
                               tl.where(f3, 0.0, a3), u2)
        return f0 | h0, f1 | h1, f2 | h2, f3 | h3

    @triton.jit
    def mvue_draws(a0, a1, a2, a3, u_ptr, seed_ptr, r, band, pc, m_rows, k_cols, G: tl.constexpr,
                   HAS_U: tl.constexpr, QUAD_LOADS: tl.constexpr, ROUNDS: tl.constexpr):
        """MVUE's kept pair of each group from the draw weights ``a``: given uniforms (two per
        group, a contiguous (M, K/2) tensor; tests draw the reference's) or Philox draws, whose
        counters follow the tile's load (:func:`load_groups`): with ``QUAD_LOADS`` one call serves
        rows 2i and 2i+1 of a group (held by one thread), else two groups of a row."""
        if HAS_U:
            cu = pc * (2 * G) + tl.arange(0, 2 * G)[None, :]
            u = tl.load(u_ptr + r * (k_cols // 2) + cu, mask=(r < m_rows) & (cu < k_cols // 2), other=0.5)
            u1, u2 = tl.split(tl.reshape(u, (64, G, 2)))
        elif QUAD_LOADS:
            u1, u2 = _row_pair_uniforms(seed_ptr, band, pc, k_cols, G, ROUNDS)
        else:
            u1, u2 = group_uniforms(seed_ptr, r, pc, k_cols, G, ROUNDS)
        return mvue_keep(a0, a1, a2, a3, u1, u2)

    @triton.jit
    def mvue_rescale(y0, y1, k0, k1, k2, k3, a0, a1, a2, a3):
        """The kept y / p, p_k = a_k/S * (1 + sum_{i != k} q_i), q_i = a_i / (S - a_i)."""
        s01, s23 = a0 + a1, a2 + a3
        q0, q1 = a0 * _rcp(a1 + s23), a1 * _rcp(a0 + s23)  # S - a_i summed directly
        q2, q3 = a2 * _rcp(s01 + a3), a3 * _rcp(s01 + a2)
        qs = q0 + q1 + q2 + q3
        ak0, ak1 = pick(k0, k1, k2, k3, a0, a1, a2, a3)
        qk0, qk1 = pick(k0, k1, k2, k3, q0, q1, q2, q3)
        s = s01 + s23
        return y0 * s * _rcp(ak0 * (1 + qs - qk0)), y1 * s * _rcp(ak1 * (1 + qs - qk1))

    @triton.jit
    def store_compressed(v0, v1, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC: tl.constexpr):
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
    def store_compressed_e4m3(vv, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC: tl.constexpr):
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

    __all__ += ["rank_keep", "pick", "out_bits", "in_float", "to_grid", "quads", "load_groups", "mvue_weights",
                "group_uniforms", "mvue_keep", "mvue_draws", "mvue_rescale", "store_compressed",
                "store_compressed_e4m3"]
