"""CUTLASS's sm90 2:4 layout of a row-major (M, K) bf16 matrix, in plain torch (the reference).

What CUTLASS 3.x's Hopper sparse GEMM (``cutlass/``) reads, from its
``Sm90GemmSparseConfig`` for 16-bit elements and K tiles of 128:

* values: the kept entries, row-major, two per group of 4 in ascending column order (M x K/2
  elements): the same bytes as cuSPARSELt's values (:mod:`twofour.kernels.layout`);
* metadata E: a 4-bit code ``i0 | i1 << 2`` per group (i0 < i1), two per byte (the lower
  column's code in the low nibble), rows padded to 64, in atoms of 64 rows x 128 columns
  (2048 nibbles): atoms ordered by column block, then row block; within an atom, row
  ``r = 16 * r2 + 8 * r1 + r0`` and group ``g = 8 * g2 + 4 * g1 + g0`` sit at nibble
  ``g0 + 4 r1 + 8 g2 + 32 r0 + 256 g1 + 512 r2`` (cute's ``TensorEAtom_16bit``).

``tests/test_sm90_layout.py`` checks the byte offsets against cute's own layout (a host function
of the built library) and the round trip; the GPU test checks the bytes against CUTLASS's
compressor and the GEMM against the dense product.
"""

from __future__ import annotations

import torch

from twofour.kernels.layout import codes_from_meta, group_codes

__all__ = ["supported_shape", "meta_bytes", "pack_meta", "unpack_meta", "compress_reference", "decompress_reference",
           "from_cusparselt", "split", "values_of"]

ATOM_M, ATOM_K = 64, 128  # one metadata atom: 64 rows x 128 columns (32 groups)
_PAD_CODE = 4  # padding rows: "keep 0 and 1" of zeros


def supported_shape(m: int, k: int) -> bool:
    """Shapes the sm90 route takes: K a multiple of the atom's 128 columns, M of 8 (TMA's 16 bytes)."""
    return m > 0 and k > 0 and k % ATOM_K == 0 and m % 8 == 0


def meta_bytes(m: int, k: int) -> int:
    """Bytes of the metadata E of an (m, k) matrix (rows padded to 64)."""
    return -(-m // ATOM_M) * ATOM_M * k // 8


def _nibble_order(c: torch.Tensor) -> torch.Tensor:
    """(Mp, G) codes, Mp a multiple of 64 and G of 32, as one flat sequence in E's nibble order."""
    mp, g = c.shape
    # r = mb*64 + r2*16 + r1*8 + r0 ; g = kb*32 + g2*8 + g1*4 + g0
    c = c.reshape(mp // 64, 4, 2, 8, g // 32, 4, 2, 4)  # mb, r2, r1, r0, kb, g2, g1, g0
    return c.permute(4, 0, 1, 6, 3, 5, 2, 7).reshape(-1)  # kb, mb, r2, g1, r0, g2, r1, g0


def pack_meta(codes: torch.Tensor) -> torch.Tensor:
    """E (uint8) from the (M, K/4) group codes ``i0 | i1 << 2``."""
    m, g = codes.shape
    mp = -(-m // ATOM_M) * ATOM_M
    c = torch.full((mp, g), _PAD_CODE, dtype=torch.int32, device=codes.device)
    c[:m] = codes
    c = _nibble_order(c)
    return (c[0::2] | (c[1::2] << 4)).to(torch.uint8)


def unpack_meta(e: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """The (M, K/4) group codes E holds (the inverse of :func:`pack_meta`)."""
    mp, g = -(-m // ATOM_M) * ATOM_M, k // 4
    e = e.to(torch.int32)
    nib = torch.stack([e & 0xF, e >> 4], 1).reshape(-1)
    order = _nibble_order(torch.arange(mp * g, device=e.device).reshape(mp, g))
    codes = torch.empty(mp * g, dtype=torch.int32, device=e.device)
    codes[order] = nib
    return codes.reshape(mp, g)[:m]


def _check(m: int, k: int) -> None:
    if not supported_shape(m, k):
        raise ValueError(f"the sm90 2:4 layout needs K a multiple of {ATOM_K} and M of 8, got {(m, k)}")


def compress_reference(a: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (M, K/2), E) of a row-major 2:4 ``a``; ``mask`` (two kept of every 4) defaults to a != 0."""
    m, k = a.shape
    _check(m, k)
    if mask is None:
        mask = a != 0
    if not bool((mask.reshape(m, -1, 4).sum(2) == 2).all()):
        raise ValueError("the sm90 layout needs exactly two kept entries in every group of 4")
    return a[mask].reshape(m, k // 2), pack_meta(group_codes(mask))


def decompress_reference(values: torch.Tensor, e: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """The dense (M, K) matrix that ``values`` and ``e`` stand for."""
    _check(m, k)
    codes = unpack_meta(e, m, k).to(torch.int64)
    idx = torch.stack([codes & 3, codes >> 2], -1)  # (m, g, 2)
    out = values.new_zeros(m, k // 4, 4)
    out.scatter_(2, idx, values.reshape(m, k // 4, 2))
    return out.reshape(m, k)


def from_cusparselt(buf: torch.Tensor, m: int, k: int, dtype: torch.dtype = torch.bfloat16
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, E) from a cuSPARSELt compressed buffer (``kernels/compress.py``'s output): the values
    are a view of the buffer (both layouts store them alike), E is its metadata reordered."""
    _check(m, k)
    size = torch.finfo(dtype).bits // 8
    nval = m * k // 2 * size
    return values_of(buf, m, k, dtype), pack_meta(codes_from_meta(buf[nval:], m, k, size))


def values_of(buf: torch.Tensor, m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The values (M, K/2) of a compressed buffer in either layout: a view, at its start."""
    nval = m * k // 2 * (torch.finfo(dtype).bits // 8)
    return buf[:nval].view(dtype).reshape(m, k // 2)


def split(buf: torch.Tensor, m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (M, K/2), E) views of a buffer the compression kernel wrote in this layout
    (``kernels/compress.py``, ``layout=SM90``): values first, then E."""
    _check(m, k)
    nval = m * k // 2 * (torch.finfo(dtype).bits // 8)
    return values_of(buf, m, k, dtype), buf[nval:nval + meta_bytes(m, k)]
