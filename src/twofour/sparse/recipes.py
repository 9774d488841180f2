"""The training recipes (docs/design.md, section 2) as small immutable value objects.

A :class:`Recipe` says *what* a sparse layer does: its pruning, its gradient extras, its schedule
and its precision (:class:`~twofour.fp8.precision.Precision`: which GEMMs run in FP8); the layer
reads its fields and never parses the name. Build one with :func:`make_recipe`, which knows each
recipe's options and defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..fp8.precision import BF16, Precision, as_precision
from .pruners import HARD, NONE, SOFT, TRANSPOSABLE, Pruner

__all__ = ["Recipe", "make_recipe", "RECIPES", "DEFAULT_RECIPE", "DX_ROUTES"]

#: How a sparse recipe computes dX = dY W_eff (docs/design.md, "dX routes"): ``dense`` (exact, a
#: dense GEMM), ``transposable`` (exact and 2:4: a transposable mask, t-sr-ste's), ``pruned-t``
#: (W_eff^T pruned 2:4 along the output features once more, for dX only) or ``mvue`` (dY's unbiased
#: 2:4 estimate along the output features).
DX_ROUTES: tuple[str, ...] = ("dense", "transposable", "pruned-t", "mvue")


@dataclass(frozen=True)
class Recipe:
    """How a SparseLinear prunes its weight, shapes its gradient and rounds its GEMMs.

    Attributes:
        name: the recipe's public name (``dense``, ``ste``, ``sr-ste``, ``s-ste``, ``t-sr-ste``, ``step``).
        pruning: the :class:`~twofour.sparse.pruners.Pruner` that makes the weight 2:4: ``NONE`` (dense),
            ``HARD`` (top-2 of 4), ``SOFT`` (S-STE soft threshold with a fixed per-tensor scale)
            or ``TRANSPOSABLE`` (2:4 both ways, refreshed periodically).
        mvue: estimate dW from an unbiased 2:4 MVUE of dY^T instead of the dense dY^T. On the GPU
            fast path only where that route (the estimate's compression plus the 2:4 GEMM) is
            faster than the dense dW GEMM; elsewhere dW is exact.
        dx: how dX is computed, one of :data:`DX_ROUTES` (sparse recipes; ``dense`` but for
            ``t-sr-ste``'s ``transposable``). ``pruned-t`` is part of the math wherever it runs;
            ``mvue``, like ``mvue`` for dW, is drawn on the GPU fast path only where its 2:4 GEMM
            pays (else dX is exact, unbiased either way) and always in the reference math.
        precision: which GEMMs run in FP8 and how (:data:`~twofour.fp8.precision.PRECISIONS`):
            ``bf16`` (none, the default) or an FP8 one, through ``torch._scaled_mm`` on the
            effective weight, else its plain-torch reference (:mod:`twofour.fp8`). Every recipe
            takes it, ``dense`` included (the fair baseline).
        decay: SR-STE masked decay lambda, added to the gradient as ``decay * (1 - m) * W`` once per
            optimizer step, after gradient clipping (:func:`twofour.attach` does it).
        mask_interval: optimizer steps between mask refreshes (transposable masks only).
        beta_interval: S-STE only: optimizer steps between refits of the per-tensor scale beta to
            the current weight (``beta = <W, S(W)> / <S(W), S(W)>``); 0 (the default, as the paper
            and the authors' code) fits it once, when the layer is made sparse, and never again.
        dense_finetune: fraction of ``total_steps`` at the end trained dense (masks dropped).
        bf16_finetune: with an FP8 precision, the fraction of ``total_steps`` at the end trained
            without FP8 (the compute dtype's GEMMs, bf16 in training); its effect on quality is in
            docs/RESULTS.md.
        total_steps: the run's length in optimizer steps; needed for ``dense_finetune`` and
            ``bf16_finetune``.
        starts_dense: the layer begins dense and an Adam-aware optimizer switches it (STEP).
    """

    name: str
    pruning: Pruner = NONE
    mvue: bool = False
    dx: str = "dense"
    precision: Precision = BF16
    decay: float = 0.0
    mask_interval: int = 1
    beta_interval: int = 0
    dense_finetune: float = 0.0
    bf16_finetune: float = 0.0
    total_steps: int | None = None
    starts_dense: bool = False

    @property
    def sparse(self) -> bool:
        """Whether this recipe prunes at all (False only for ``dense``)."""
        return self.pruning.sparse

    def unsupported(self, out_features: int, in_features: int) -> str | None:
        """Why a weight of this shape can't take this recipe (None if it can): the pruning's
        shapes, and ``pruned-t``'s second pruning along the output features."""
        if self.dx == "pruned-t" and out_features % 4:
            return f"out_features={out_features} is not a multiple of 4 (dx='pruned-t' prunes W^T 2:4 too)"
        return self.pruning.unsupported(out_features, in_features)

    def dx_route(self, dense_phase: bool, estimates: bool = True) -> str:
        """The dX route in effect: the recipe's, or ``dense`` in a dense phase (W_eff = W); without
        ``estimates`` (dense GEMMs chosen for speed, where an estimate buys nothing) ``mvue`` is
        exact too, while ``pruned-t``'s second pruning, part of the math, stays."""
        if dense_phase or (self.dx == "mvue" and not estimates):
            return "dense"
        return self.dx

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (the pruner and the precision by their names), for checkpoints and logs."""
        return ({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
                | {"pruning": self.pruning.name, "precision": self.precision.name})


# name -> (fixed fields, {option: default}) ; options not listed are refused
_COMMON = {"bf16_finetune": 0.0, "total_steps": None}
_SPARSE_COMMON = {"mvue": False, "dx": "dense", **_COMMON}
_TABLE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "dense": ({"pruning": NONE}, dict(_COMMON)),
    "ste": ({"pruning": HARD}, dict(_SPARSE_COMMON)),
    "sr-ste": ({"pruning": HARD}, {**_SPARSE_COMMON, "decay": 2e-4}),
    "s-ste": ({"pruning": SOFT}, {**_SPARSE_COMMON, "mvue": True, "beta_interval": 0}),
    "t-sr-ste": (
        {"pruning": TRANSPOSABLE},
        {
            **_SPARSE_COMMON,
            "mvue": True,
            "dx": "transposable",
            "decay": 2e-4,
            "mask_interval": 40,
            "dense_finetune": 1 / 6,
        },
    ),
    "step": ({"pruning": HARD, "starts_dense": True}, {**_SPARSE_COMMON, "decay": 2e-4}),
}
RECIPES: tuple[str, ...] = tuple(_TABLE)
#: The recipe ``twofour train``, :func:`twofour.sparsify` and :class:`~twofour.SparseLinear` use
#: when none is named: the one constant to switch when the evidence says so (README.md, "The
#: default recipe", and docs/RESULTS.md).
DEFAULT_RECIPE = "ste"


def recipe_options(name: str) -> dict[str, Any]:
    """The options ``name`` accepts, with their defaults (besides ``precision``, which every recipe
    takes)."""
    _known(name)
    return dict(_TABLE[name][1])


def _known(name: str) -> None:
    if name not in _TABLE:
        raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(RECIPES)}")


def make_recipe(recipe: str | Recipe = DEFAULT_RECIPE, *, precision: str | Precision | None = None,
                **options: Any) -> Recipe:
    """Build a :class:`Recipe` from its name, precision and options, validating all three.

    ``make_recipe("sr-ste", decay=6e-5)``, ``make_recipe("s-ste", precision="fp8")``; a Recipe passed
    in is returned with ``precision`` and ``options`` applied. ``precision``: a
    :class:`~twofour.fp8.precision.Precision` or the name of one in
    :data:`~twofour.fp8.precision.PRECISIONS` (default: the Recipe's own, else ``bf16``). Unknown
    names or options and values that make no sense raise ``ValueError`` naming them.
    """
    if isinstance(recipe, Recipe):
        options = {**{k: getattr(recipe, k) for k in _TABLE[recipe.name][1]}, **options}
        precision = recipe.precision if precision is None else precision
        recipe = recipe.name
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be a name or a Recipe, got {type(recipe).__name__}")
    _known(recipe)
    fixed, defaults = _TABLE[recipe]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        valid = ", ".join(defaults) or "none"
        hint = "; FP8 is the recipe's precision (precision='fp8', twofour.fp8.PRECISIONS)" if any(
            k.startswith("fp8") for k in unknown) else ""
        raise ValueError(f"recipe {recipe!r} takes no option {', '.join(unknown)}; valid options: {valid}{hint}")
    try:
        prec = as_precision(BF16 if precision is None else precision)
    except ValueError as e:
        raise ValueError(f"recipe {recipe!r}: {e}") from None
    values = {**defaults, **options}
    _validate(recipe, values, prec)
    return Recipe(name=recipe, **fixed, precision=prec, **values)


def _finite(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _validate(name: str, v: dict[str, Any], precision: Precision) -> None:
    def bad(key: str, want: str) -> ValueError:
        return ValueError(f"recipe {name!r}: {key} must be {want}, got {v[key]!r}")

    if "mvue" in v and not isinstance(v["mvue"], bool):
        raise TypeError(f"recipe {name!r}: option mvue must be a bool, got {v['mvue']!r}")
    if "dx" in v:
        _validate_dx(name, v["dx"])
    if "decay" in v and not (_finite(v["decay"]) and v["decay"] >= 0):
        raise bad("decay", "a finite number >= 0")
    for key, low in (("mask_interval", 1), ("beta_interval", 0)):
        if key in v and (not isinstance(v[key], int) or isinstance(v[key], bool) or v[key] < low):
            raise bad(key, f"an int >= {low}")
    for key in ("dense_finetune", "bf16_finetune"):
        if key in v and not (_finite(v[key]) and 0 <= v[key] < 1):
            raise bad(key, "in [0, 1)")
    ts = v.get("total_steps")
    if ts is not None and (not isinstance(ts, int) or isinstance(ts, bool) or ts < 1):
        raise bad("total_steps", "a positive int")
    if v.get("bf16_finetune") and not precision.fp8:
        raise ValueError(f"recipe {name!r}: bf16_finetune={v['bf16_finetune']} needs an FP8 precision (precision "
                         f"{precision.name!r} has no FP8 to leave)")
    if v.get("bf16_finetune") and ts is None:
        raise ValueError(f"recipe {name!r}: bf16_finetune needs total_steps (the run's length in optimizer steps)")


def _validate_dx(name: str, dx: Any) -> None:
    """The dX routes a recipe takes: a transposable mask's exact 2:4 dX (t-sr-ste), or MVUE on top;
    for the others dense, pruned-t or MVUE."""
    allowed = ("transposable", "mvue") if _TABLE[name][0]["pruning"] is TRANSPOSABLE else ("dense", "pruned-t", "mvue")
    if dx in allowed:
        return
    why = ""
    if dx == "transposable":
        why = " (a transposable mask is t-sr-ste's)"
    elif dx in DX_ROUTES:
        why = " (its transposable mask makes the exact dX 2:4 already)"
    raise ValueError(f"recipe {name!r}: dx must be one of {', '.join(allowed)}{why}, got {dx!r}")
