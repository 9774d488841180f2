"""2:4 sparse training: the pruners, the recipes (a :class:`Recipe` is pruning + schedule +
precision), :class:`SparseLinear` with its reference Function and GPU fast path, conversion of a
model (:func:`sparsify`, :func:`attach`) and the optimizer hooks."""

from .convert import DEFAULT_EXCLUDE, add_masked_decay, advance, attach, flip_rate, sparse_layers, sparsify
from .layer import SparseLinear
from .optim import STEPAdamW
from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, make_recipe

__all__ = ["SparseLinear", "STEPAdamW", "Recipe", "make_recipe", "RECIPES", "DEFAULT_RECIPE", "sparsify", "attach",
           "advance", "add_masked_decay", "flip_rate", "sparse_layers", "DEFAULT_EXCLUDE"]
