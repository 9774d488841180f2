"""twofour: pre-training transformers with 2:4 sparse weights (S-STE and earlier recipes).

    import twofour
    model = twofour.sparsify(model, "s-ste")       # swap eligible nn.Linear layers
    twofour.attach(model, optimizer)               # masks advance once per optimizer step
    twofour.flip_rate(model)["total"]              # monitor mask changes
    model = twofour.load_for_inference("runs/train")   # after `twofour export runs/train`

The package by job: :mod:`twofour.kernels` (Triton and cuSPARSELt), :mod:`twofour.sparse` (the
recipes and the layer), :mod:`twofour.fp8` (FP8 GEMMs), :mod:`twofour.models` (GPT and Llama),
:mod:`twofour.inference` and :mod:`twofour.training`; :mod:`twofour.dispatch` holds the
process-wide switches and measured choices. This module is the public API only.
"""

from . import dispatch, functional
from .errors import DataError, DivergedError, FormatError, TrainError, TwofourError
from .inference import SparseInferenceLinear, load_for_inference, sparsify_for_inference, to_inference
from .inference.sampling import generate
from .sparse import (
    DEFAULT_EXCLUDE,
    DEFAULT_RECIPE,
    RECIPES,
    Recipe,
    SparseLinear,
    STEPAdamW,
    add_masked_decay,
    advance,
    attach,
    flip_rate,
    make_recipe,
    pruners,
    sparse_layers,
    sparsify,
)
from .version import __version__

__all__ = [
    "dispatch",
    "functional",
    "pruners",
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
    "TwofourError",
    "TrainError",
    "DivergedError",
    "DataError",
    "FormatError",
    "__version__",
]
