"""The 2:4 storage format of an exported weight, in plain torch (docs/export-format.md).

A 2:4 matrix W (out, in) is stored as

* ``values`` (out, in/2): the two kept entries of every group of 4, in ascending column order,
  in the weight's dtype;
* ``positions`` (out, ceil(in/8)) uint8: each group's two kept indices i0 < i1 as the 4-bit code
  ``i0 | i1 << 2``, two groups per byte (group 2j in the low nibble, 2j+1 in the high one; a
  last odd group leaves the high nibble 0).

In bf16 that is in/2 * 2 + in/8 bytes a row against 2 * in dense: 0.5625x. ``values`` is also
exactly the first part of cuSPARSELt's compressed layout (``kernels/layout.py``), and the codes
are its metadata codes, so a GPU builds its operand from these without going back to dense.
"""

from __future__ import annotations

import torch

from .pruning import _mask_24

__all__ = ["pack_24", "unpack_24", "group_codes", "position_codes", "check_positions", "positions_width", "VALID_CODES"]

#: The six codes ``i0 | i1 << 2`` with i0 < i1 (which two of the four positions are kept).
VALID_CODES = (4, 8, 12, 9, 13, 14)


def positions_width(in_features: int) -> int:
    """Bytes per row of ``positions``: one nibble per group of 4 inputs, two per byte."""
    return -(-in_features // 8)


def pack_24(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, positions) of a 2:4 matrix ``w`` (out, in); ValueError naming the first group
    with more than two non-zeros if it isn't 2:4. Groups with fewer keep zeros at the lowest
    free positions, so every group stores exactly two entries."""
    if w.dim() != 2 or w.shape[1] % 4 or w.shape[1] == 0:
        raise ValueError(f"pack_24: expected an (out, in) matrix with in a multiple of 4, got {tuple(w.shape)}")
    out, inn = w.shape
    keep = _mask_24(w)  # the two largest |w| of each group, ties to the lower index
    stray = (w != 0) & ~keep
    if bool(stray.any()):
        r, c = (int(i) for i in stray.nonzero()[0])
        n = int((w[r, c // 4 * 4: c // 4 * 4 + 4] != 0).sum())
        raise ValueError(f"not 2:4: row {r}, columns {c // 4 * 4}-{c // 4 * 4 + 3} hold {n} non-zeros")
    values = w[keep].reshape(out, inn // 2)
    codes = group_codes(keep).to(torch.uint8)
    if codes.shape[1] % 2:
        codes = torch.cat([codes, codes.new_zeros(out, 1)], 1)
    return values.contiguous(), (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def group_codes(keep: torch.Tensor) -> torch.Tensor:
    """(out, in/4) int32 codes ``i0 | i1 << 2`` (i0 < i1) of a mask ``keep`` (out, in) with exactly
    two kept entries in every group of 4: the codes :func:`pack_24` stores and cuSPARSELt's
    metadata holds (``kernels/layout.py``)."""
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


def check_positions(positions: torch.Tensor, in_features: int, name: str = "positions") -> None:
    """ValueError naming the first group whose code is not one of :data:`VALID_CODES`."""
    codes = position_codes(positions, in_features)
    valid = torch.zeros(16, dtype=torch.bool, device=codes.device)
    valid[list(VALID_CODES)] = True
    bad = ~valid[codes]
    if bool(bad.any()):
        r, g = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} is not a 2:4 pattern: row {r}, group {g} holds code {int(codes[r, g])} "
                         "(not two distinct positions)")


def unpack_24(values: torch.Tensor, positions: torch.Tensor, in_features: int) -> torch.Tensor:
    """The dense (out, in) matrix that ``values`` and ``positions`` store (the inverse of
    :func:`pack_24`)."""
    out = values.shape[0]
    codes = position_codes(positions, in_features).to(torch.int64)
    idx = torch.stack([codes & 3, codes >> 2], 2)  # (out, groups, 2)
    dense = values.new_zeros(out, in_features // 4, 4)
    dense.scatter_(2, idx, values.reshape(out, in_features // 4, 2))
    return dense.reshape(out, in_features)
