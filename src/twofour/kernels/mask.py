"""The per-step mask refresh of a SparseLinear in one Triton kernel: the new 2:4 mask of the
weight (2 largest |w| of every group of 4, ties to the lower index, as ``pruning.mask_24``)
written over the old one, and the number of positions that changed added to a device counter.

The plain-torch version (``pruning._mask_24``, a comparison and a sum) builds a 4 x 4
comparison per group and ran at 0.58 ms a layer on the H200 (42 ms of a 259 ms gpt2-774m step
for its 72 FFN layers, docs/notes/fastpath-experiments.md); this kernel reads the weight and the old mask once
and writes the new mask. Tested against the reference on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import torch

from .compress import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .compress import _rank_keep

    @triton.jit
    def _swap(mask, off, keep, ok):
        """Store the new mask bit at ``off``; 1 where it differs from the old one."""
        new = keep.to(tl.uint8)
        old = tl.load(mask + off, mask=ok, other=0)
        tl.store(mask + off, new, mask=ok)
        return ((new != old) & ok).to(tl.int32)

    @triton.jit
    def _refresh_kernel(w, mask, flips, n_groups, BG: tl.constexpr):
        g = tl.program_id(0) * BG + tl.arange(0, BG)
        ok = g < n_groups
        off = g.to(tl.int64) * 4
        a0 = tl.abs(tl.load(w + off, mask=ok, other=0.0).to(tl.float32))
        a1 = tl.abs(tl.load(w + off + 1, mask=ok, other=0.0).to(tl.float32))
        a2 = tl.abs(tl.load(w + off + 2, mask=ok, other=0.0).to(tl.float32))
        a3 = tl.abs(tl.load(w + off + 3, mask=ok, other=0.0).to(tl.float32))
        k0, k1, k2, k3 = _rank_keep(a0, a1, a2, a3)
        changed = (_swap(mask, off, k0, ok) + _swap(mask, off + 1, k1, ok) + _swap(mask, off + 2, k2, ok)
                   + _swap(mask, off + 3, k3, ok))
        tl.atomic_add(flips, tl.sum(changed, axis=0).to(tl.int64))


__all__ = ["refresh_mask_"]


def refresh_mask_(w: torch.Tensor, mask: torch.Tensor, flips: torch.Tensor) -> None:
    """``flips = (mask_24(w) != mask).sum(); mask[:] = mask_24(w)``, in place, on the device:
    ``w`` a contiguous float tensor, ``mask`` a contiguous bool tensor of its shape, ``flips``
    a one-element int64 tensor."""
    if not HAS_TRITON:
        raise RuntimeError("refresh_mask_ needs Triton (pip install triton)")
    if not (w.is_contiguous() and mask.is_contiguous() and mask.shape == w.shape and mask.dtype == torch.bool
            and w.shape[-1] % 4 == 0 and flips.numel() == 1 and flips.dtype == torch.int64):
        raise ValueError(f"refresh_mask_: needs a contiguous weight with last dimension a multiple of 4, a bool "
                         f"mask of its shape and an int64 counter; got {tuple(w.shape)}, {mask.dtype} "
                         f"{tuple(mask.shape)}, {flips.dtype} {tuple(flips.shape)}")
    n_groups = w.numel() // 4
    bg = 1024
    flips.zero_()
    _refresh_kernel[(triton.cdiv(n_groups, bg),)](w, mask.view(torch.uint8), flips, n_groups, BG=bg, num_warps=4)
