"""The 2:4 storage format of an exported weight, in plain torch (docs/export-format.md).

A 2:4 matrix W (out, in) is stored as

* ``values`` (out, in/2): the two kept entries of every group of 4, in ascending column order,
  in the weight's dtype;
* ``positions`` (out, ceil(in/8)) uint8: each group's two kept indices i0 < i1 as the 4-bit code
  ``i0 | i1 << 2``, two groups per byte (group 2j in the low nibble, 2j+1 in the high one; a
  last odd group leaves the high nibble 0).

In bf16 that is in/2 * 2 + in/8 bytes a row against 2 * in dense: 0.5625x. ``values`` is also
exactly the first part of cuSPARSELt's compressed layout (``kernels/layout.py``), and the codes
are its metadata codes (defined there), so a GPU builds its operand from these without going back to dense.
"""

from __future__ import annotations

import torch

from ..functional import _mask_24
from ..kernels.layout import VALID_CODES, group_codes, position_codes

__all__ = ["pack_24", "check_positions"]


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
