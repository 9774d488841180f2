"""One small object per way of making a weight 2:4 (docs/design.md, section 1).

A :class:`Pruner` owns everything that depends on the pruning kind: which shapes it accepts,
the state it keeps (S-STE's frozen scale), the mask it tracks, the effective weight the forward
multiplies by, how often the mask is refreshed, and how the GPU fast path compresses the weight.
:class:`~twofour.SparseLinear`, :func:`~twofour.sparsify` and the fast path ask it; nothing else
looks at which kind it is.

    NONE          dense: W itself
    HARD          top-2 of every 4 (STE, SR-STE, STEP): W * mask_24(W)
    SOFT          S-STE: beta * S(W), beta fitted when the layer is made sparse (refitted every
                  ``beta_interval`` steps where the recipe asks)
    TRANSPOSABLE  T-SR-STE: W * m, m 2:4 along both dimensions, refreshed every few steps
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..functional import _fixed_scale, _mask_24, _soft_threshold_24, _transposable_mask_24
from ..kernels import ops
from .sharded import whole

__all__ = ["Pruner", "NoPruning", "HardPruner", "SoftPruner", "TransposablePruner", "PRUNERS",
           "NONE", "HARD", "SOFT", "TRANSPOSABLE"]

#: (compressed W, dense W_eff, compressed W^T or an empty tensor): what the fast path multiplies by.
Compressed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Pruner:
    """How a weight becomes 2:4. Stateless: the state it needs lives in the layer's buffers
    (``beta``, ``mask``) and is passed in."""

    name: ClassVar[str]
    #: False only for :class:`NoPruning`.
    sparse: ClassVar[bool] = True
    #: The GPU's fused kernel can refresh the mask (a top-2 of |W|) in place.
    fused_refresh: ClassVar[bool] = True

    def unsupported(self, out_features: int, in_features: int) -> str | None:
        """Why a weight of this shape can't be pruned this way (None if it can)."""
        if in_features % 4:
            return f"in_features={in_features} is not a multiple of 4"
        return None

    def initial_state(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Buffers for a layer made sparse from weight ``w`` (fresh init or a dense checkpoint)."""
        return {"mask": self.mask(w)}

    def mask(self, w: torch.Tensor) -> torch.Tensor:
        """The bool mask this kind tracks for ``w``: positions kept, flips counted on it."""
        return _mask_24(whole(w))

    def refresh_due(self, step: int, interval: int) -> bool:
        """Whether the mask is recomputed after optimizer step ``step``."""
        return True

    def scale(self, w: torch.Tensor) -> torch.Tensor | None:
        """The per-tensor scale this kind multiplies by, fitted to ``w`` (None: it has none)."""
        return None

    def effective(self, w: torch.Tensor, beta: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """What the forward multiplies by (``w`` detached by the caller)."""
        raise NotImplementedError

    def compress(self, w: torch.Tensor, beta: torch.Tensor | None, mask: torch.Tensor | None,
                 dtype: torch.dtype, sparse: bool = True) -> Compressed:
        """The fast path's operands, built by one fused kernel pass over ``w``: (compressed W_eff,
        dense W_eff, compressed W_eff^T or empty); without ``sparse`` only the dense W_eff (the
        2:4 operands empty: an FP8 layer multiplies the dense one)."""
        raise NotImplementedError

    def compress_pruned_t(self, w: torch.Tensor, beta: torch.Tensor | None, mask: torch.Tensor | None,
                          dtype: torch.dtype) -> Compressed:
        """The ``pruned-t`` dX route's operands: :meth:`compress`'s first two, then W_eff^T pruned
        2:4 along the output features and compressed (a second pass over the dense W_eff, unless
        the kind fuses it into the first)."""
        wc, wd, _ = self.compress(w, beta, mask, dtype)
        return wc, wd, ops.compress(wd.t(), "hard", out_dtype=dtype)[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


class NoPruning(Pruner):
    """The dense recipe: the layer is a plain nn.Linear."""

    name = "none"
    sparse = False
    fused_refresh = False

    def unsupported(self, out_features: int, in_features: int) -> str | None:
        return None

    def initial_state(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def effective(self, w, beta, mask):
        return w


def _no_transpose(w: torch.Tensor) -> torch.Tensor:
    return w.new_empty(0, dtype=torch.uint8)


def _one_pass(w: torch.Tensor, mode: str, dtype: torch.dtype, scale: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> Compressed | None:
    """W's and W^T's 2:4 operands from one pass of the fused kernel (:func:`twofour.kernels.ops.compress_both`)
    where the output features are a multiple of 32 (its W^T tiles), else None."""
    return None if w.shape[0] % 32 else ops.compress_both(w, mode, scale=scale, mask=mask, out_dtype=dtype)


class HardPruner(Pruner):
    """Top-2 of every group of 4 by magnitude, recomputed from the current weight every step."""

    name = "hard"

    def effective(self, w, beta, mask):
        return w * _mask_24(w)

    def compress(self, w, beta, mask, dtype, sparse=True):
        wc, wd = ops.compress(w, "hard", dense_out=True, out_dtype=dtype, sparse_out=sparse)
        return wc, wd, _no_transpose(w)

    def compress_pruned_t(self, w, beta, mask, dtype):
        return _one_pass(w, "hard", dtype) or super().compress_pruned_t(w, beta, mask, dtype)


class SoftPruner(Pruner):
    """S-STE: beta * S(W), the soft threshold with a per-tensor scale fixed at the start (it
    drifts upward if recomputed). Its mask is the hard top-2 of W, for the flip rate."""

    name = "soft"

    def initial_state(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"beta": self.scale(w), "mask": self.mask(w)}

    def scale(self, w: torch.Tensor) -> torch.Tensor:
        """beta = <W, S(W)> / <S(W), S(W)> in float32 (the authors' ``init_scale``)."""
        return _fixed_scale(whole(w))

    def effective(self, w, beta, mask):
        return beta.to(w.dtype) * _soft_threshold_24(w)

    def compress(self, w, beta, mask, dtype, sparse=True):
        wc, wd = ops.compress(w, "soft", scale=beta.reshape(1), dense_out=True, out_dtype=dtype, sparse_out=sparse)
        return wc, wd, _no_transpose(w)

    def compress_pruned_t(self, w, beta, mask, dtype):
        return _one_pass(w, "soft", dtype, scale=beta.reshape(1)) or super().compress_pruned_t(w, beta, mask, dtype)


class TransposablePruner(Pruner):
    """T-SR-STE: a mask 2:4 along both dimensions (so W^T is 2:4 too and dX can run sparse),
    optimal per 4x4 block, kept between refreshes every ``mask_interval`` steps."""

    name = "transposable"
    fused_refresh = False

    def unsupported(self, out_features: int, in_features: int) -> str | None:
        if out_features % 4:
            return f"out_features={out_features} is not a multiple of 4 (a transposable mask needs both " \
                   "dimensions to be multiples of 4)"
        return super().unsupported(out_features, in_features)

    def mask(self, w: torch.Tensor) -> torch.Tensor:
        return _transposable_mask_24(whole(w))

    def refresh_due(self, step: int, interval: int) -> bool:
        return step % interval == 0

    def effective(self, w, beta, mask):
        return w * mask

    def compress(self, w, beta, mask, dtype, sparse=True):
        both = _one_pass(w, "mask", dtype, mask=mask) if sparse else None
        if both:
            return both
        wc, wd = ops.compress(w, "mask", mask=mask, dense_out=True, out_dtype=dtype, sparse_out=sparse)
        wtc = ops.compress(w.t(), "mask", mask=mask.t(), out_dtype=dtype)[0] if sparse else _no_transpose(w)
        return wc, wd, wtc


NONE, HARD, SOFT, TRANSPOSABLE = NoPruning(), HardPruner(), SoftPruner(), TransposablePruner()
#: Every pruning kind by name (the names checkpoints and ``Recipe.to_dict()`` use).
PRUNERS: dict[str, Pruner] = {p.name: p for p in (NONE, HARD, SOFT, TRANSPOSABLE)}
