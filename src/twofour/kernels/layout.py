"""cuSPARSELt's compressed layout of a row-major 2:4 matrix, in plain torch (the reference).

Found by compressing matrices with known values and masks through cuSPARSELt 0.8
(``benchmarks/gemm/probe_layout.py`` for bf16, ``benchmarks/gemm/probe_layout_fp8.py`` for e4m3; both
removed after the fit, in the git history at commit 60fdda3) and checked byte-for-byte against it
(``tests/test_layout.py``). For an (M, K) matrix A, 2:4 along K:

* values: the kept entries, row-major, two per group in ascending column order: M x K/2 elements;
* metadata, right after: a 4-bit code per group, ``i0 | i1 << 2`` (the kept indices, i0 < i1),
  for rows padded to a multiple of 64 (padding rows hold code 14), in tiles of 16 rows ordered
  by 64-row band, then column tile, then the 4 row tiles of the band. Within a tile, row ``r``
  and group ``g``:

  - bf16/fp16: 8 groups (32 columns) fill 32 16-bit words; word ``(r % 8) * 4 + g % 4``,
    nibble ``r // 8 + 2 * (g // 4)``.
  - e4m3 (one-byte elements): 16 groups (64 columns) fill 32 32-bit words; word
    ``(r % 8) * 4 + (g // 2) % 4``, nibble ``g % 2 + 2 * (r // 8) + 4 * (g // 8)``.
"""

from __future__ import annotations

import torch

__all__ = ["VALID_CODES", "positions_width", "group_codes", "position_codes", "unpack_24", "compressed_size",
           "compress_reference", "compress_codes", "decompress_reference", "supported_shape",
           "codes_from_meta"]


#: The six codes ``i0 | i1 << 2`` with i0 < i1 (which two of the four positions are kept).
VALID_CODES = (4, 8, 12, 9, 13, 14)


def positions_width(in_features: int) -> int:
    """Bytes per row of ``positions``: one nibble per group of 4 inputs, two per byte."""
    return -(-in_features // 8)


def group_codes(keep: torch.Tensor) -> torch.Tensor:
    """(out, in/4) int32 codes ``i0 | i1 << 2`` (i0 < i1) of a mask ``keep`` (out, in) with exactly
    two kept entries in every group of 4: the codes the export format stores
    (:mod:`twofour.inference.packed`) and cuSPARSELt's metadata holds."""
    g = keep.reshape(keep.shape[0], -1, 4).bool()
    pos = torch.arange(4, device=keep.device, dtype=torch.int32)
    first = torch.where(g, pos, 4).amin(2)
    second = torch.where(g & (pos != first[..., None]), pos, 4).amin(2)
    return first | (second << 2)


def position_codes(positions: torch.Tensor, in_features: int) -> torch.Tensor:
    """The (out, in/4) int32 codes ``i0 | i1 << 2`` stored in ``positions``."""
    p = positions.to(torch.int32)
    codes = torch.stack([p & 15, p >> 4], 2).reshape(p.shape[0], -1)
    return codes[:, : in_features // 4]


def unpack_24(values: torch.Tensor, positions: torch.Tensor, in_features: int) -> torch.Tensor:
    """The dense (out, in) matrix that ``values`` and ``positions`` store (the inverse of
    :func:`pack_24`)."""
    out = values.shape[0]
    codes = position_codes(positions, in_features).to(torch.int64)
    idx = torch.stack([codes & 3, codes >> 2], 2)  # (out, groups, 2)
    dense = values.new_zeros(out, in_features // 4, 4)
    dense.scatter_(2, idx, values.reshape(out, in_features // 4, 2))
    return dense.reshape(out, in_features)


_PAD_CODE = 14  # padding rows read as "keep 2 and 3" of zeros, as cuSPARSELt writes them


def _tile_columns(itemsize: int = 2) -> int:
    """Columns of one metadata tile: 32 for two-byte elements, 64 for one-byte (FP8) ones."""
    return 64 if itemsize == 1 else 32


def supported_shape(m: int, k: int, itemsize: int = 2) -> bool:
    """Shapes whose layout this module knows: K a multiple of the tile's columns (32 for two-byte
    elements, 64 for FP8)."""
    return m > 0 and k > 0 and k % _tile_columns(itemsize) == 0


def compressed_size(m: int, k: int, itemsize: int = 2) -> int:
    """Bytes of the compressed buffer: values plus metadata for rows padded to 64."""
    mp = -(-m // 64) * 64
    return m * k // 2 * itemsize + mp * k // 8


def _nibble_order(c: torch.Tensor, itemsize: int) -> torch.Tensor:
    """(Mp, G) codes, Mp a multiple of 64, as one flat sequence in the metadata's nibble order
    (nibble i is the low half of byte i // 2 when i is even, the high half when odd)."""
    mp, g = c.shape
    if itemsize == 1:
        # r = ((band*4 + rt)*2 + rh)*8 + rl ; g = ((ct*2 + gq)*4 + gw)*2 + gl
        c = c.reshape(mp // 64, 4, 2, 8, g // 16, 2, 4, 2)  # band, rt, rh, rl, ct, gq, gw, gl
        return c.permute(0, 4, 1, 3, 6, 5, 2, 7).reshape(-1)  # band, ct, rt, rl, gw | gq, rh, gl
    # r = ((band*4 + rt)*2 + rh)*8 + rl ; g = (ct*2 + gh)*4 + gl
    c = c.reshape(mp // 64, 4, 2, 8, g // 8, 2, 4)  # band, rt, rh, rl, ct, gh, gl
    return c.permute(0, 4, 1, 3, 6, 5, 2).reshape(-1)  # band, ct, rt, rl, gl | gh, rh


def _meta_bytes(codes: torch.Tensor, itemsize: int = 2) -> torch.Tensor:
    """Pack (M, G) 4-bit codes into cuSPARSELt's metadata bytes, rows padded to 64."""
    m, g = codes.shape
    mp = -(-m // 64) * 64
    c = torch.full((mp, g), _PAD_CODE, dtype=torch.int32, device=codes.device)
    c[:m] = codes
    c = _nibble_order(c, itemsize)
    return (c[0::2] | (c[1::2] << 4)).to(torch.uint8)


def codes_from_meta(meta: torch.Tensor, m: int, k: int, itemsize: int) -> torch.Tensor:
    """The (M, K/4) codes of metadata bytes: the inverse of :func:`_meta_bytes`."""
    mp, g = -(-m // 64) * 64, k // 4
    meta = meta.to(torch.int32)
    nib = torch.stack([meta & 0xF, meta >> 4], 1).reshape(-1)
    order = _nibble_order(torch.arange(mp * g, device=meta.device).reshape(mp, g), itemsize)
    codes = torch.empty(mp * g, dtype=torch.int32, device=meta.device)
    codes[order] = nib
    return codes.reshape(mp, g)[:m]


def compress_reference(a: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """cuSPARSELt's compressed bytes (uint8) of a row-major 2:4 ``a``; ``mask`` defaults to a != 0.

    Every group must keep exactly two positions (a mask from ``mask_24``/``mvue`` kept pattern).
    """
    m, k = a.shape
    if not supported_shape(m, k, a.element_size()):
        raise ValueError(f"compressed layout known only for K a multiple of {_tile_columns(a.element_size())}, "
                         f"got shape {(m, k)}")
    bits = _bits(a)
    if mask is None:  # a non-zero value: any bit set besides the sign's
        mask = (bits & ((1 << (8 * a.element_size() - 1)) - 1)) != 0
    if not bool((mask.reshape(m, -1, 4).sum(2) == 2).all()):
        raise ValueError("compress_reference needs exactly two kept entries in every group of 4")
    return compress_codes(bits[mask].reshape(m, k // 2), group_codes(mask))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as an integer tensor of the same element size (FP8 ops are sparse on the CPU)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compress_codes(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compressed bytes (uint8) from the kept values, (M, K/2) in ascending column
    order per group, and each group's 4-bit code ``i0 | i1 << 2`` (M, K/4; i0 < i1): what a
    matrix already stored as values and positions needs, without going back to dense."""
    m, half = values.shape
    size = values.element_size()
    if codes.shape != (m, half // 2) or not supported_shape(m, 2 * half, size):
        raise ValueError(f"compress_codes: values {tuple(values.shape)} and codes {tuple(codes.shape)} don't "
                         f"describe an (M, K) matrix with K a multiple of {_tile_columns(size)}")
    meta = _meta_bytes(codes.to(torch.int32), size)
    return torch.cat([values.contiguous().view(torch.uint8).reshape(-1), meta])


def decompress_reference(buf: torch.Tensor, m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dense (M, K) matrix a compressed buffer stands for (the inverse of compress_reference)."""
    size = torch.finfo(dtype).bits // 8
    nval = m * k // 2 * size
    values = _bits(buf[:nval].view(dtype)).reshape(m, k // 2, 1)
    g = k // 4
    codes = codes_from_meta(buf[nval:], m, k, size)
    idx = torch.stack([codes & 3, codes >> 2], -1).long()  # (m, g, 2)
    out = torch.zeros(m, g, 4, dtype=values.dtype, device=buf.device)
    out.scatter_(2, idx, values.reshape(m, g, 2))
    return out.reshape(m, k).view(dtype)
