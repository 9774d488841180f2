"""Fused prune-and-compress kernels (Triton): read a dense matrix once, choose 2 of every 4
(hard top-2, S-STE's scaled soft threshold, a given mask, or MVUE's unbiased random pick),
and write cuSPARSELt's compressed layout (``layout.py``) directly: values and metadata.

Each program loads a 64-row tile (128 columns under the interpreter; on the GPU the width, 64 to
256, and the warps are autotuned per shape) in one coalesced read (through arbitrary strides,
so the same kernel compresses ``dY^T``, groups along tokens, straight from the row-major ``dY``),
splits it into the four entries of each group, so that every per-group step (ranking,
threshold, inclusion probabilities) is elementwise, and packs the metadata by reshapes.

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

__all__ = ["compress", "MODES", "HAS_TRITON"]

HAS_TRITON = triton is not None
MODES = {"hard": 0, "soft": 1, "mask": 2, "mvue": 3}
BC = 128  # columns per program off the GPU (a 64 x 128 tile); on the GPU autotuned over 64-256


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
    def _out(x, OUT_BF16: tl.constexpr):
        """float32 -> the output's bits, rounding to nearest even (also under the interpreter,
        whose plain bf16 cast truncates); bf16 goes out as int16 bits."""
        if OUT_BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        else:
            y = x.to(tl.float16)
        return y

    @triton.jit
    def _compress_kernel(src, sr, sc, m_rows, k_cols, mask_ptr, u_ptr, seed_ptr, scale_ptr, vals, meta, dense_out,
                         n_ct, MODE: tl.constexpr, HAS_U: tl.constexpr, WRITE_DENSE: tl.constexpr,
                         OUT_BF16: tl.constexpr, BC: tl.constexpr):
        """One 64-row band x BC columns: a coalesced tile load (whichever stride is 1), the four
        entries of each group split into four (64, BC/4) tensors, metadata packed by reshapes."""
        G: tl.constexpr = BC // 4
        CT: tl.constexpr = BC // 32
        band, pc = tl.program_id(0), tl.program_id(1)
        r = band * 64 + tl.arange(0, 64)[:, None]  # (64, 1)
        c = pc * BC + tl.arange(0, BC)[None, :]  # (1, BC)
        ok = (r < m_rows) & (c < k_cols)
        off = r.to(tl.int64) * sr + c.to(tl.int64) * sc
        x = tl.load(src + off, mask=ok, other=0.0).to(tl.float32)
        x0, x1, x2, x3 = _quads(x, G)
        g = pc * G + tl.arange(0, G)[None, :]  # (1, G) group index
        a0, a1, a2, a3 = tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3)
        if MODE == 2:  # a given mask (transposable), read through the same strides
            k0, k1, k2, k3 = _quads(tl.load(mask_ptr + off, mask=ok, other=0).to(tl.int32), G)
            k0, k1, k2, k3 = k0 != 0, k1 != 0, k2 != 0, k3 != 0
        elif MODE == 3:  # MVUE: Efraimidis-Spirakis keys log(u)/a, top-2
            eps = 1e-6 * tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)) + 1e-30
            a0, a1, a2, a3 = a0 + eps, a1 + eps, a2 + eps, a3 + eps
            if HAS_U:
                u0, u1, u2, u3 = _quads(tl.load(u_ptr + r.to(tl.int64) * k_cols + c, mask=ok, other=0.5), G)
            else:
                u0, u1, u2, u3 = tl.rand4x(tl.load(seed_ptr), (r * (k_cols // 4) + g).to(tl.int32))
            tiny = 1.1754943508222875e-38
            k0, k1, k2, k3 = _rank_keep(tl.log(tl.maximum(u0, tiny)) / a0, tl.log(tl.maximum(u1, tiny)) / a1,
                                        tl.log(tl.maximum(u2, tiny)) / a2, tl.log(tl.maximum(u3, tiny)) / a3)
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
        if MODE == 3:  # x / p, p_k = a_k/S * (1 + sum_{i != k} a_i / (S - a_i)), S - a_i summed directly
            s = a0 + a1 + a2 + a3
            r0, r1, r2, r3 = a0 / (a1 + a2 + a3), a1 / (a0 + a2 + a3), a2 / (a0 + a1 + a3), a3 / (a0 + a1 + a2)
            rs = r0 + r1 + r2 + r3
            x0 = x0 / (a0 / s * (1 + rs - r0))
            x1 = x1 / (a1 / s * (1 + rs - r1))
            x2 = x2 / (a2 / s * (1 + rs - r2))
            x3 = x3 / (a3 / s * (1 + rs - r3))
        # the two kept, in ascending position, and the 4-bit code i0 | i1 << 2
        i0 = tl.where(k0, 0, tl.where(k1, 1, 2))
        i1 = tl.where(k3, 3, tl.where(k2, 2, 1))
        v0 = _out(tl.where(k0, x0, tl.where(k1, x1, x2)), OUT_BF16)
        v1 = _out(tl.where(k3, x3, tl.where(k2, x2, x1)), OUT_BF16)
        vv = tl.reshape(tl.join(v0, v1), (64, BC // 2))  # (64, G, 2) -> row-major values
        cv = pc * (BC // 2) + tl.arange(0, BC // 2)[None, :]
        tl.store(vals + r.to(tl.int64) * (k_cols // 2) + cv, vv, mask=(r < m_rows) & (cv < k_cols // 2))
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
        if WRITE_DENSE:  # the effective matrix, row-major, for GEMMs that stay dense
            d01 = tl.join(_out(tl.where(k0, x0, 0.0), OUT_BF16), _out(tl.where(k1, x1, 0.0), OUT_BF16))
            d23 = tl.join(_out(tl.where(k2, x2, 0.0), OUT_BF16), _out(tl.where(k3, x3, 0.0), OUT_BF16))
            dd = tl.reshape(tl.join(d01, d23).permute(0, 1, 3, 2), (64, BC))  # (64, G, e)
            tl.store(dense_out + r.to(tl.int64) * k_cols + c, dd, mask=ok)

    _compress_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc in (64, 128, 256) for w in (4, 8)],
        key=["m_rows", "k_cols", "sr", "sc", "MODE", "WRITE_DENSE"],
    )(_compress_kernel)

    @triton.jit
    def _quads(x, G: tl.constexpr):
        """(64, 4G) -> the group entries 0..3 as four (64, G) tensors."""
        even, odd = tl.split(tl.reshape(x, (64, G, 2, 2)))  # e = 2*i + j: split j
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3


def compress(x: torch.Tensor, mode: str, *, out_dtype: torch.dtype = torch.bfloat16, scale: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, u: torch.Tensor | None = None, seed: torch.Tensor | None = None,
             dense_out: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prune the (M, K) matrix ``x`` (any strides) along K and compress it for cuSPARSELt.

    ``mode``: ``hard`` (top-2), ``soft`` (``scale`` * soft threshold), ``mask`` (keep ``mask``,
    a bool tensor of x's shape and strides) or ``mvue`` (uniforms ``u`` of shape (M, K), or a
    Philox ``seed`` int tensor on the device). Returns the compressed uint8 buffer and, with
    ``dense_out``, the effective (M, K) matrix in ``out_dtype``.
    """
    if not HAS_TRITON:
        raise RuntimeError("twofour's fused compression needs Triton (pip install triton)")
    m, k = x.shape
    if not supported_shape(m, k):
        raise ValueError(f"compress: K must be a multiple of 32, got shape {(m, k)}")
    if mode not in MODES:
        raise ValueError(f"compress: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"compress: out_dtype must be bfloat16 or float16, got {out_dtype}")
    buf = torch.empty(compressed_size(m, k, 2), dtype=torch.uint8, device=x.device)
    nval = m * k // 2
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.float16  # bf16 is written as its bits
    vals = buf[: nval * 2].view(bits)
    meta = buf[nval * 2:].view(torch.int16)
    dense = torch.empty(m, k, dtype=out_dtype, device=x.device) if dense_out else None
    dense_bits = dense.view(bits) if dense is not None else vals
    dummy = buf
    if mode == "mvue" and u is None and seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        if mask.stride() != x.stride():
            raise ValueError("compress: mask must have the same strides as x")
    args = (x, x.stride(0), x.stride(1), m, k, mask if mask is not None else dummy, u if u is not None else dummy,
            seed if seed is not None else dummy, scale if scale is not None else dummy, vals, meta, dense_bits, k // 32)
    consts = dict(MODE=MODES[mode], HAS_U=u is not None, WRITE_DENSE=dense_out, OUT_BF16=out_dtype == torch.bfloat16)
    if x.is_cuda:  # tile width and warps measured once per shape and mode (triton.autotune)
        _compress_tuned[lambda meta: (triton.cdiv(m, 64), triton.cdiv(k, meta["BC"]))](*args, **consts)
    else:
        _compress_kernel[(triton.cdiv(m, 64), triton.cdiv(k, BC))](*args, **consts, BC=BC)
    return buf, dense
