"""twofour: pre-training transformers with 2:4 sparse weights (S-STE and earlier recipes).

    import twofour
    model = twofour.sparsify(model, "s-ste")       # swap eligible nn.Linear layers
    twofour.attach(model, optimizer)               # masks advance once per optimizer step
    twofour.flip_rate(model)["total"]              # monitor mask changes
    model = twofour.load_for_inference("runs/train")   # after `twofour export runs/train`
"""

from . import pruners, pruning, settings
from .inference import SparseInferenceLinear, load_for_inference, sparsify_for_inference, to_inference  # noqa: I001
from .layer import SparseLinear
from .optim import STEPAdamW
from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, make_recipe
from .sampling import generate
from .sparsify import DEFAULT_EXCLUDE, add_masked_decay, advance, attach, flip_rate, sparse_layers, sparsify

__version__ = "0.1.0"

__all__ = [
    "pruning",
    "pruners",
    "settings",
    "SparseLinear",
    "STEPAdamW",
    "Recipe",
    "make_recipe",
    "RECIPES",
    "DEFAULT_RECIPE",
    "sparsify",
    "attach",
    "advance",
    "add_masked_decay",
    "flip_rate",
    "sparse_layers",
    "DEFAULT_EXCLUDE",
    "SparseInferenceLinear",
    "to_inference",
    "sparsify_for_inference",
    "load_for_inference",
    "generate",
    "__version__",
]
