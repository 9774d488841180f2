"""SR-STE's masked decay, ``g += decay * W`` where the mask is 0, as one Triton pass that reads the
gradient, the weight and the mask once and writes the gradient once (torch's
``g.addcmul_(W, mask.logical_not())`` writes the mask's complement first: a second pass), with its
plain-torch reference. Tested against the reference on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from .triton_common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["masked_decay_", "masked_decay_reference_", "fits"]

_BLOCK, _WARPS = 2048, 8  # elements per program on the GPU: an elementwise pass needs no tuning
_BLOCK_CPU = 1 << 16  # under the interpreter: a few large programs


def masked_decay_reference_(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """``g += decay * W * (1 - mask)`` in place, in plain torch; returns ``g``."""
    return g.addcmul_(w, mask.logical_not(), value=decay)


def fits(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: contiguous, of one shape and device, a bool mask."""
    return (g.shape == w.shape == mask.shape and mask.dtype == torch.bool and g.device == w.device == mask.device
            and g.is_contiguous() and w.is_contiguous() and mask.is_contiguous())


def masked_decay_(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """:func:`masked_decay_reference_` as one Triton pass (float32 math, g's dtype out); tensors as
    :func:`fits` says. Returns ``g``."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's masked decay kernel needs Triton (pip install triton)")
    if not fits(g, w, mask):
        raise ValueError("masked_decay_: g, W and the bool mask must be contiguous tensors of one shape and device")
    n = g.numel()
    block = _BLOCK if g.is_cuda else _BLOCK_CPU
    extra = {"num_warps": _WARPS} if g.is_cuda else {}
    if n:
        _masked_decay_kernel[(triton.cdiv(n, block),)](g, w, mask.view(torch.uint8), n, float(decay),
                                                       BIG=n >= 2**31, BLOCK=block, **extra)
    return g


if HAS_TRITON:

    @triton.jit
    def _masked_decay_kernel(g_ptr, w_ptr, m_ptr, n, decay, BIG: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * BLOCK if BIG else pid * BLOCK
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        kept = tl.load(m_ptr + offs, mask=inside, other=1)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        out = g.to(tl.float32) + tl.where(kept == 0, decay * w, 0.0)
        tl.store(g_ptr + offs, out.to(g.dtype), mask=inside)
