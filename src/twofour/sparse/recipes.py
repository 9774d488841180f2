"""The training recipes (docs/design.md, section 2) as small immutable value objects.

A :class:`Recipe` says *what* a sparse layer does (which pruning, which gradient extras, which
schedule); the layer reads its fields and never parses the name. Build one with
:func:`make_recipe`, which knows each recipe's options and defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .pruners import HARD, NONE, SOFT, TRANSPOSABLE, Pruner

__all__ = ["Recipe", "make_recipe", "RECIPES", "DEFAULT_RECIPE"]


@dataclass(frozen=True)
class Recipe:
    """How a SparseLinear prunes its weight and shapes its gradient.

    Attributes:
        name: the recipe's public name (``dense``, ``ste``, ``sr-ste``, ``s-ste``, ``t-sr-ste``, ``step``).
        pruning: the :class:`~twofour.sparse.pruners.Pruner` that makes the weight 2:4: ``NONE`` (dense),
            ``HARD`` (top-2 of 4), ``SOFT`` (S-STE soft threshold with a fixed per-tensor scale)
            or ``TRANSPOSABLE`` (2:4 both ways, refreshed periodically).
        mvue: estimate dW from an unbiased 2:4 MVUE of dY^T instead of the dense dY^T. On the GPU
            fast path only where that route (the estimate's compression plus the 2:4 GEMM)
            measures faster than the dense dW GEMM; elsewhere dW is exact.
        fp8: FP8 GEMMs (e4m3 forward operands and gradients, current amax scaling) through
            ``torch._scaled_mm`` on the effective weight, else their plain-torch reference
            (:mod:`twofour.fp8`). Every recipe takes it, ``dense`` included (the fair baseline).
        fp8_rowwise: with ``fp8``, one scale per row of each operand along the contraction
            dimension instead of one per tensor (finer scales; each GEMM quantizes its own copy).
        fp8_grad_e4m3: with ``fp8``, the output gradient dY in e4m3 (the default: one more
            mantissa bit than e5m2, less range, which current scaling covers; it trained to a lower
            loss, docs/RESULTS.md, and the FP8 2:4 weight-gradient GEMM needs it), or in e5m2
            with ``False``.
        fp8_forward: with ``fp8``, the forward GEMM in FP8 (the default), or with ``False`` in the
            compute dtype from the unquantized x and W_eff, only the backward's in FP8.
        fp8_backward: with ``fp8``, the backward GEMMs (dX and dW) in FP8 (the default), or with
            ``False`` in the compute dtype from the unquantized operands, only the forward's in FP8
            (docs/RESULTS.md has runs of both).
        bf16_finetune: with ``fp8``, the fraction of ``total_steps`` at the end trained without FP8
            (the compute dtype's GEMMs, bf16 in training). At gpt2-124m over 200M tokens the last
            10 % in bf16 ended no closer to bf16 than FP8 throughout (docs/RESULTS.md).
        decay: SR-STE masked decay lambda, added to the gradient as ``decay * (1 - m) * W`` once per
            optimizer step, after gradient clipping (:func:`twofour.attach` does it).
        mask_interval: optimizer steps between mask refreshes (transposable masks only).
        dense_finetune: fraction of ``total_steps`` at the end trained dense (masks dropped).
        total_steps: the run's length in optimizer steps; needed for ``dense_finetune`` and
            ``bf16_finetune``.
        starts_dense: the layer begins dense and an Adam-aware optimizer switches it (STEP).
    """

    name: str
    pruning: Pruner = NONE
    mvue: bool = False
    fp8: bool = False
    fp8_rowwise: bool = False
    fp8_grad_e4m3: bool = True
    fp8_forward: bool = True
    fp8_backward: bool = True
    bf16_finetune: float = 0.0
    decay: float = 0.0
    mask_interval: int = 1
    dense_finetune: float = 0.0
    total_steps: int | None = None
    starts_dense: bool = False

    @property
    def sparse(self) -> bool:
        """Whether this recipe prunes at all (False only for ``dense``)."""
        return self.pruning.sparse

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (the pruner by its name), for checkpoints and logs."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {"pruning": self.pruning.name}


# name -> (fixed fields, {option: default}) ; options not listed are refused
_FP8 = {"fp8": False, "fp8_rowwise": False, "fp8_grad_e4m3": True, "fp8_forward": True, "fp8_backward": True,
        "bf16_finetune": 0.0}
_COMMON = {**_FP8, "total_steps": None}
_SPARSE_COMMON = {"mvue": False, **_COMMON}
_TABLE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dense": ({"pruning": NONE}, dict(_COMMON)),
    "ste": ({"pruning": HARD}, dict(_SPARSE_COMMON)),
    "sr-ste": ({"pruning": HARD}, {**_SPARSE_COMMON, "decay": 2e-4}),
    "s-ste": ({"pruning": SOFT}, {**_SPARSE_COMMON, "mvue": True}),
    "t-sr-ste": (
        {"pruning": TRANSPOSABLE},
        {
            **_SPARSE_COMMON,
            "mvue": True,
            "decay": 2e-4,
            "mask_interval": 40,
            "dense_finetune": 1 / 6,
        },
    ),
    "step": ({"pruning": HARD, "starts_dense": True}, {**_SPARSE_COMMON, "decay": 2e-4}),
}
RECIPES: tuple[str, ...] = tuple(_TABLE)
DEFAULT_RECIPE = "s-ste"


def recipe_options(name: str) -> dict[str, Any]:
    """The options ``name`` accepts, with their defaults."""
    _known(name)
    return dict(_TABLE[name][1])


def _known(name: str) -> None:
    if name not in _TABLE:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")


def make_recipe(recipe: str | Recipe = DEFAULT_RECIPE, **options: Any) -> Recipe:
    """Build a :class:`Recipe` from its name and options, validating both.

    ``make_recipe("sr-ste", decay=6e-5)``; a Recipe passed in is returned with ``options``
    applied. Unknown names or options raise ``ValueError`` listing the valid ones.
    """
    if isinstance(recipe, Recipe):
        options = {**{k: getattr(recipe, k) for k in _TABLE[recipe.name][1]}, **options}
        recipe = recipe.name
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name or a Recipe, got {type(recipe).__name__}")
    _known(recipe)
    fixed, defaults = _TABLE[recipe]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        valid = ", ".join(defaults) or "none"
        raise ValueError(f"recipe {recipe!r} takes no option {', '.join(unknown)}; valid options: {valid}")
    values = {**defaults, **options}
    _validate(recipe, values)
    return Recipe(name=recipe, **fixed, **values)


def _finite(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate(name: str, v: dict[str, Any]) -> None:
    for key in ("mvue", "fp8", "fp8_rowwise", "fp8_grad_e4m3", "fp8_forward", "fp8_backward"):
        if key in v and not isinstance(v[key], bool):
            raise TypeError(f"recipe {name!r}: option {key} must be a bool, got {v[key]!r}")
    for key, default in _FP8.items():  # an FP8 option away from its default is an FP8 run's
        if key != "fp8" and v.get(key, default) != default and not v.get("fp8"):
            raise ValueError(f"recipe {name!r}: {key}={v[key]} needs fp8=True")
    if v.get("fp8_forward") is False and v.get("fp8_backward") is False:
        raise ValueError(f"recipe {name!r}: fp8_forward=False with fp8_backward=False leaves no GEMM in FP8 "
                         f"(leave fp8 off instead)")
    if v.get("fp8_grad_e4m3") is False and v.get("fp8_backward") is False:
        raise ValueError(f"recipe {name!r}: fp8_grad_e4m3=False needs fp8_backward=True (with fp8_backward=False "
                         f"the gradients stay in the compute dtype)")
    if "decay" in v and not (_finite(v["decay"]) and v["decay"] >= 0):
        raise ValueError(f"recipe {name!r}: decay must be a finite number >= 0, got {v['decay']!r}")
    if "mask_interval" in v and (not isinstance(v["mask_interval"], int) or v["mask_interval"] < 1):
        raise ValueError(f"recipe {name!r}: mask_interval must be an int >= 1, got {v['mask_interval']!r}")
    for key in ("dense_finetune", "bf16_finetune"):
        if key in v and not (_finite(v[key]) and 0 <= v[key] < 1):
            raise ValueError(f"recipe {name!r}: {key} must be in [0, 1), got {v[key]!r}")
    ts = v.get("total_steps")
    if ts is not None and (not isinstance(ts, int) or isinstance(ts, bool) or ts < 1):
        raise ValueError(f"recipe {name!r}: total_steps must be a positive int, got {ts!r}")
    if v.get("bf16_finetune") and ts is None:
        raise ValueError(f"recipe {name!r}: bf16_finetune needs total_steps (the run's length in optimizer steps)")
