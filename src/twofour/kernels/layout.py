"""cuSPARSELt's compressed layout of a row-major 2:4 matrix, in plain torch (the reference).

Found by compressing matrices with known values and masks through cuSPARSELt 0.8 on an H200
(``benchmarks/probe_layout.py``) and checked byte-for-byte against it. For an (M, K) bf16/fp16
matrix A, 2:4 along K:

* values: the kept entries, row-major, two per group in ascending column order: M x K/2 elements;
* metadata, right after: a 4-bit code per group, ``i0 | i1 << 2`` (the kept indices, i0 < i1),
  for rows padded to a multiple of 64 (padding rows hold code 14), packed into 16-bit words.
  A tile of 16 rows x 8 groups (32 columns) fills 32 words: row ``r`` and group ``g`` of the tile go to word
  ``(r % 8) * 4 + g % 4`` at nibble ``r // 8 + 2 * (g // 4)``. Tiles are ordered by 64-row band,
  then column tile, then the 4 row tiles of the band.
"""

from __future__ import annotations

import torch

from ..packed import group_codes

__all__ = ["compressed_size", "compress_reference", "compress_codes", "decompress_reference", "supported_shape"]


_PAD_CODE = 14  # padding rows read as "keep 2 and 3" of zeros, as cuSPARSELt writes them


def supported_shape(m: int, k: int) -> bool:
    """Shapes whose layout this module knows: K a multiple of 32 (whole column tiles)."""
    return m > 0 and k > 0 and k % 32 == 0


def compressed_size(m: int, k: int, itemsize: int = 2) -> int:
    """Bytes of the compressed buffer: values plus metadata for rows padded to 64."""
    mp = -(-m // 64) * 64
    return m * k // 2 * itemsize + mp * k // 8


def _meta_words(codes: torch.Tensor) -> torch.Tensor:
    """Pack (M, G) 4-bit codes into cuSPARSELt's int16 metadata words, rows padded to 64."""
    m, g = codes.shape
    mp = -(-m // 64) * 64
    c = torch.full((mp, g), _PAD_CODE, dtype=torch.int32, device=codes.device)
    c[:m] = codes
    # r = ((band*4 + rt)*2 + rh)*8 + rl ; g = (ct*2 + gh)*4 + gl
    c = c.reshape(mp // 64, 4, 2, 8, g // 8, 2, 4)  # band, rt, rh, rl, ct, gh, gl
    c = c.permute(0, 4, 1, 3, 6, 5, 2)  # band, ct, rt, rl, gl, gh, rh -> word order, then nibble
    c = c.reshape(-1, 4)  # 4 nibbles per word, nibble index = rh + 2*gh
    word = c[:, 0] | (c[:, 1] << 4) | (c[:, 2] << 8) | (c[:, 3] << 12)
    return (word - ((word >> 15) << 16)).to(torch.int16)  # the same 16 bits, as a signed int16


def compress_reference(a: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """cuSPARSELt's compressed bytes (uint8) of a row-major 2:4 ``a``; ``mask`` defaults to a != 0.

    Every group must keep exactly two positions (a mask from ``mask_24``/``mvue`` kept pattern).
    """
    m, k = a.shape
    if not supported_shape(m, k):
        raise ValueError(f"compressed layout known only for K a multiple of 32, got shape {(m, k)}")
    if mask is None:
        mask = a != 0
    if not bool((mask.reshape(m, -1, 4).sum(2) == 2).all()):
        raise ValueError("compress_reference needs exactly two kept entries in every group of 4")
    return compress_codes(a[mask].reshape(m, k // 2), group_codes(mask))


def compress_codes(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compressed bytes (uint8) from the kept values, (M, K/2) in ascending column
    order per group, and each group's 4-bit code ``i0 | i1 << 2`` (M, K/4; i0 < i1): what a
    matrix already stored as values and positions needs, without going back to dense."""
    m, half = values.shape
    if codes.shape != (m, half // 2) or not supported_shape(m, 2 * half):
        raise ValueError(f"compress_codes: values {tuple(values.shape)} and codes {tuple(codes.shape)} don't "
                         "describe an (M, K) matrix with K a multiple of 32")
    meta = _meta_words(codes.to(torch.int32))
    return torch.cat([values.contiguous().view(torch.uint8).reshape(-1), meta.view(torch.uint8).reshape(-1)])


def decompress_reference(buf: torch.Tensor, m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense (M, K) matrix a compressed buffer stands for (the inverse of compress_reference)."""
    nval = m * k // 2 * torch.finfo(dtype).bits // 8
    values = buf[:nval].view(dtype).reshape(m, k // 2, 1)
    words = buf[nval:].view(torch.int16).to(torch.int32) & 0xFFFF
    mp, g = -(-m // 64) * 64, k // 4
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(4)], 1)  # (words, 4) by rh + 2*gh
    nib = nib.reshape(mp // 64, g // 8, 4, 8, 4, 2, 2)  # band, ct, rt, rl, gl, gh, rh
    codes = nib.permute(0, 2, 6, 3, 1, 5, 4).reshape(mp, g)[:m]
    idx = torch.stack([codes & 3, codes >> 2], -1).long()  # (m, g, 2)
    out = torch.zeros(m, g, 4, dtype=dtype, device=buf.device)
    out.scatter_(2, idx, values.reshape(m, g, 2))
    return out.reshape(m, k)
