"""FP8 with per-tensor current scaling (docs/design.md, section 1), simulated in plain torch.

``fake_fp8(t, fmt)`` rounds ``t`` onto the FP8 grid of ``fmt`` after scaling its absolute
maximum to the format's largest value, and scales back: the numerics of an FP8 GEMM operand,
in the tensor's own dtype. e4m3 is for forward operands, e5m2 for gradients.
"""

from __future__ import annotations

import torch

__all__ = ["fake_fp8", "E4M3", "E5M2"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def fake_fp8(t: torch.Tensor, fmt: torch.dtype = E4M3) -> torch.Tensor:
    """Quantize ``t`` to FP8 ``fmt`` with scale ``fp8_max / amax`` and dequantize it."""
    if fmt not in (E4M3, E5M2):
        raise TypeError(f"fake_fp8: fmt must be torch.float8_e4m3fn or torch.float8_e5m2, got {fmt}")
    amax = t.detach().abs().amax().float()
    scale = torch.finfo(fmt).max / amax.clamp_min(1e-12)
    q = (t.float() * scale).clamp(-torch.finfo(fmt).max, torch.finfo(fmt).max).to(fmt)
    return (q.float() / scale).to(t.dtype)
