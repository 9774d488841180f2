"""Fused prune-and-compress kernels (Triton): read a dense matrix once, choose 2 of every 4
(hard top-2, S-STE's scaled soft threshold, a given mask, or MVUE's unbiased random pick),
and write cuSPARSELt's compressed layout (``layout.py``) directly: values and metadata.

Each program handles ``WORDS`` metadata words, i.e. 4 x WORDS groups: the four entries of a
group are loaded as four separate tensors, so every per-group step (ranking, threshold,
inclusion probabilities) is elementwise. The source is read through arbitrary strides, so the
same kernel compresses ``dY^T`` (groups along tokens) straight from the row-major ``dY``.

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
WORDS = 128  # metadata words per program (512 groups)


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
    def _compress_kernel(src, sr, sc, m_rows, mask_ptr, u_ptr, seed_ptr, scale_ptr, vals, meta, dense_out,
                         n_words, n_ct, MODE: tl.constexpr, HAS_U: tl.constexpr, WRITE_DENSE: tl.constexpr,
                         K: tl.constexpr, WORDS: tl.constexpr, OUT_BF16: tl.constexpr):
        pid = tl.program_id(0)
        w = pid * WORDS + tl.arange(0, WORDS)[:, None]  # (WORDS, 1) global word index
        j = tl.arange(0, 4)[None, :]  # (1, 4) nibble within the word
        live = w < n_words
        tile, within = w // 32, w % 32
        rl, gl = within // 4, within % 4
        rt, ct, band = tile % 4, (tile // 4) % n_ct, tile // (4 * n_ct)
        rh, gh = j % 2, j // 2
        row = band * 64 + rt * 16 + rh * 8 + rl  # (WORDS, 4)
        group = ct * 8 + gh * 4 + gl
        col = group * 4
        ok = live & (row < m_rows)
        base = src + row.to(tl.int64) * sr + col.to(tl.int64) * sc
        x0 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(base + sc, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * sc, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(base + 3 * sc, mask=ok, other=0.0).to(tl.float32)
        a0, a1, a2, a3 = tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3)
        if MODE == 2:  # a given mask (transposable), read through the same strides
            mb = mask_ptr + row.to(tl.int64) * sr + col.to(tl.int64) * sc
            k0 = tl.load(mb, mask=ok, other=0) != 0
            k1 = tl.load(mb + sc, mask=ok, other=0) != 0
            k2 = tl.load(mb + 2 * sc, mask=ok, other=0) != 0
            k3 = tl.load(mb + 3 * sc, mask=ok, other=0) != 0
        elif MODE == 3:  # MVUE: Efraimidis-Spirakis keys log(u)/a, top-2
            eps = 1e-6 * tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3)) + 1e-30
            a0, a1, a2, a3 = a0 + eps, a1 + eps, a2 + eps, a3 + eps
            flat = (row.to(tl.int64) * K + col.to(tl.int64))
            if HAS_U:
                u0 = tl.load(u_ptr + flat, mask=ok, other=0.5)
                u1 = tl.load(u_ptr + flat + 1, mask=ok, other=0.5)
                u2 = tl.load(u_ptr + flat + 2, mask=ok, other=0.5)
                u3 = tl.load(u_ptr + flat + 3, mask=ok, other=0.5)
            else:
                seed = tl.load(seed_ptr)
                u0, u1, u2, u3 = tl.rand4x(seed, (flat // 4).to(tl.int32))
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
        v0 = tl.where(k0, x0, tl.where(k1, x1, x2))
        v1 = tl.where(k3, x3, tl.where(k2, x2, x1))
        code = tl.where(row < m_rows, i0 | (i1 << 2), 14)  # padding rows read as "keep 2 and 3"
        vout = vals + row.to(tl.int64) * (K // 2) + group * 2
        tl.store(vout, _out(v0, OUT_BF16), mask=ok)
        tl.store(vout + 1, _out(v1, OUT_BF16), mask=ok)
        word = tl.sum(code << (4 * j), axis=1)  # (WORDS,)
        word = tl.where(word >= 32768, word - 65536, word)
        wi = pid * WORDS + tl.arange(0, WORDS)
        tl.store(meta + wi, word.to(tl.int16), mask=wi < n_words)
        if WRITE_DENSE:  # the effective matrix, row-major, for GEMMs that stay dense
            dd = dense_out + row.to(tl.int64) * K + col
            tl.store(dd, _out(tl.where(k0, x0, 0.0), OUT_BF16), mask=ok)
            tl.store(dd + 1, _out(tl.where(k1, x1, 0.0), OUT_BF16), mask=ok)
            tl.store(dd + 2, _out(tl.where(k2, x2, 0.0), OUT_BF16), mask=ok)
            tl.store(dd + 3, _out(tl.where(k3, x3, 0.0), OUT_BF16), mask=ok)


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
    buf = torch.empty(compressed_size(m, k, torch.finfo(out_dtype).bits // 8), dtype=torch.uint8, device=x.device)
    nval = m * k // 2
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"compress: out_dtype must be bfloat16 or float16, got {out_dtype}")
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.float16  # bf16 is written as its bits
    vals = buf[: nval * 2].view(bits)
    meta = buf[nval * 2:].view(torch.int16)
    n_words = meta.numel()
    dense = torch.empty(m, k, dtype=out_dtype, device=x.device) if dense_out else None
    dense_bits = dense.view(bits) if dense is not None else vals
    dummy = buf
    if mode == "mvue" and u is None and seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        if mask.stride() != x.stride():
            raise ValueError("compress: mask must have the same strides as x")
    grid = (triton.cdiv(n_words, WORDS),)
    _compress_kernel[grid](
        x, x.stride(0), x.stride(1), m, mask if mask is not None else dummy, u if u is not None else dummy,
        seed if seed is not None else dummy, scale if scale is not None else dummy, vals, meta, dense_bits,
        n_words, k // 32, MODE=MODES[mode], HAS_U=u is not None, WRITE_DENSE=dense_out, K=k, WORDS=WORDS,
        OUT_BF16=out_dtype == torch.bfloat16)
    return buf, dense
