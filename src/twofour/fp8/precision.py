"""Which of a linear's GEMMs run in FP8, and how: :class:`Precision`, one frozen value per
combination, and its named presets :data:`PRECISIONS` (``--precision NAME`` on the command line).

A linear has three GEMMs: the forward y = x W_eff^T and the backward's dX = dY W_eff and
dW = dY^T X. A Precision says whether the forward runs in FP8 (x and W_eff in e4m3), whether the
backward does (dY in e4m3 or e5m2, its other operands in e4m3), and how many scales each quantized
operand gets. Its name is spelled from those fields, so every valid combination has exactly one
name and a name read back from a saved config means the same numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quantize import E4M3, E5M2, ROWWISE, TENSORWISE, Scaling

__all__ = ["Precision", "PRECISIONS", "BF16", "FP8", "as_precision"]


@dataclass(frozen=True)
class Precision:
    """The numerics of a linear's GEMMs (the combinations that make no sense raise ``ValueError``).

    Attributes:
        forward: the forward GEMM in FP8 (x and W_eff in e4m3), else in the compute dtype.
        grad: the FP8 format of the output gradient dY in the backward GEMMs (their other operands
            in e4m3): :data:`~twofour.fp8.E4M3` (one more mantissa bit than e5m2, less range,
            which current scaling covers; it trained to a lower loss, docs/RESULTS.md, and the
            FP8 2:4 weight-gradient GEMM needs it) or :data:`~twofour.fp8.E5M2`; None runs dX
            and dW in the compute dtype from the unquantized operands.
        scaling: :data:`~twofour.fp8.TENSORWISE` (one scale per operand) or
            :data:`~twofour.fp8.ROWWISE` (one per row along the contraction dimension; each GEMM
            quantizes its own copy).

    When a run stops using FP8 (``bf16_finetune``) is not here: a Precision is how the GEMMs round
    at one step, while the step at which that changes is part of the recipe's schedule, beside
    ``dense_finetune`` and ``total_steps``.
    """

    forward: bool = False
    grad: torch.dtype | None = None
    scaling: Scaling = TENSORWISE

    def __post_init__(self) -> None:
        if not isinstance(self.forward, bool):
            raise ValueError(f"Precision: forward must be a bool, got {self.forward!r}")
        if self.grad not in (E4M3, E5M2, None):
            raise ValueError(f"Precision: grad must be torch.float8_e4m3fn, torch.float8_e5m2 or None, "
                             f"got {self.grad!r}")
        if self.scaling not in (TENSORWISE, ROWWISE):
            raise ValueError(f"Precision: scaling must be TENSORWISE or ROWWISE, got {self.scaling!r}")
        if self.scaling.rowwise and not self.fp8:
            raise ValueError("Precision: rowwise scaling needs a GEMM in FP8 (forward=True or a grad format)")

    @property
    def fp8(self) -> bool:
        """Whether any GEMM runs in FP8 (False only for :data:`BF16`)."""
        return self.forward or self.grad is not None

    @property
    def name(self) -> str:
        """The preset's name: ``bf16`` without FP8, else ``fp8``, then ``-forward`` or ``-backward``
        where only those GEMMs are FP8, ``-rowwise``, ``-e5m2`` (``fp8-backward-rowwise-e5m2``)."""
        if not self.fp8:
            return "bf16"
        parts = ["fp8"]
        if self.grad is None:
            parts.append("forward")
        elif not self.forward:
            parts.append("backward")
        if self.scaling.rowwise:
            parts.append("rowwise")
        if self.grad == E5M2:
            parts.append("e5m2")
        return "-".join(parts)


def _valid() -> list[Precision]:
    """Every valid combination, the plainest first."""
    gemms = ((False, None), (True, E4M3), (True, E5M2), (True, None), (False, E4M3), (False, E5M2))
    return [Precision(forward, grad, scaling) for forward, grad in gemms for scaling in (TENSORWISE, ROWWISE)
            if forward or grad is not None or not scaling.rowwise]


#: Every precision by name: ``bf16`` (no FP8: the compute dtype's GEMMs, bf16 under autocast; the
#: default), ``fp8`` (all three GEMMs, e4m3, one scale per tensor), ``fp8-rowwise``, ``fp8-e5m2``
#: (dY in e5m2), ``fp8-forward`` (only the forward GEMM), ``fp8-backward`` (only dX and dW), and
#: their combinations.
PRECISIONS: dict[str, Precision] = {p.name: p for p in _valid()}
BF16 = PRECISIONS["bf16"]
FP8 = PRECISIONS["fp8"]


def as_precision(precision: str | Precision) -> Precision:
    """``precision`` itself, or the preset of :data:`PRECISIONS` it names (``ValueError`` listing
    them for an unknown name)."""
    if isinstance(precision, Precision):
        return precision
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a name or a Precision, got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid precisions: {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]
