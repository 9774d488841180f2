"""twofour in torchtitan 0.2.2: a model converter that trains the FFN linears of its Llama 3 with a
twofour recipe (:mod:`twofour.integrations.torchtitan` imports it where torchtitan 0.2.2 is
installed; 0.3: :mod:`~twofour.integrations.titan3`). Three entries in a job's toml
turn it on; the ``[twofour]`` section picks the recipe (every field has a default)::

    [job]
    custom_config_module = "twofour.integrations.torchtitan"   # imports this module
    [model]
    converters = ["twofour"]            # before "float8" when both are listed
    [twofour]
    recipe = "s-ste"                    # dense, ste, sr-ste, s-ste, t-sr-ste
    precision = "bf16"                  # or an FP8 precision of twofour.fp8.PRECISIONS

torchtitan builds the model on the meta device, runs the converters, then applies activation
checkpointing, ``torch.compile`` and FSDP2, allocates the model and calls its ``init_weights``.
The converter swaps the matching ``nn.Linear`` layers for :class:`~twofour.SparseLinear` (the same
parameters, so FSDP2 and the optimizer see plain linears), recomputes the recipe's buffers after
``init_weights`` (:meth:`~twofour.SparseLinear.reset_state`), advances the masks after every
optimizer step (torchtitan's post-optimizer hook) and, for SR-STE's masked decay, adds the decay
right before the step. The buffers (masks, scales, step counters) are module buffers: torchtitan's
distributed checkpoint saves and restores them with the weights.
"""

import types
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import TrainError
from ..sparse import DEFAULT_RECIPE, Recipe, add_masked_decay, advance, sparse_layers, sparsify
from .titan_common import ATTENTION_LINEARS, FFN_LINEARS, NAME, titan_recipe

try:
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
    from torchtitan.protocols.model_converter import register_model_converter
except ImportError as e:  # pragma: no cover - the message is the test
    raise ImportError(f"twofour.integrations.titan2 needs torchtitan 0.2.2 ({e}): "
                      "pip install \"twofour[torchtitan]\"") from None

__all__ = ["NAME", "FLAVORS", "FFN_LINEARS", "ATTENTION_LINEARS", "TwoFour", "JobConfig", "TwoFourConverter",
           "recipe_from_config"]

#: Llama 3 shapes this module adds to torchtitan's ``llama3`` flavors (``model.flavor``), where
#: torchtitan 0.2.2 has none: Llama 3.2 1B's dimensions, and the 8B's layer 4 deep (a benchmark
#: of the 8B's GEMM shapes that fits one GPU and minutes).
FLAVORS: dict[str, dict[str, Any]] = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               rope_theta=500000),
    "8B_4layers": dict(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                       rope_theta=500000),
}
#: Converters of torchtitan that swap ``nn.Linear`` layers too, and where their skip lists live: the
#: twofour converter runs first and adds its layers to these lists, so they stay 2:4.
_LINEAR_SWAPPERS = {"float8": ("float8",), "mx": ("mx",)}


@dataclass
class TwoFour:
    """The ``[twofour]`` section of a torchtitan job config: the recipe and the layers it covers.

    Options left at None take the recipe's default (:func:`twofour.make_recipe`); a recipe refuses
    options it does not take. ``total_steps`` is ``training.steps``."""

    recipe: str = DEFAULT_RECIPE
    """dense, ste, sr-ste, s-ste or t-sr-ste (step needs twofour's STEPAdamW, which torchtitan doesn't build)."""
    precision: str = "bf16"
    """Which GEMMs of the 2:4 layers run in FP8: a name of twofour.fp8.PRECISIONS."""
    include: list[str] = field(default_factory=lambda: list(FFN_LINEARS))
    """fnmatch patterns on module names: the linears made 2:4 (add *.attention.w* for attention)."""
    exclude: list[str] = field(default_factory=lambda: ["output"])
    """fnmatch patterns on module names left dense."""
    mvue: bool | None = None
    decay: float | None = None
    mask_interval: int | None = None
    dense_finetune: float | None = None
    bf16_finetune: float | None = None
    beta_interval: int | None = None


@dataclass
class JobConfig:
    """What ``job.custom_config_module`` merges into torchtitan's JobConfig: the ``[twofour]`` section."""

    twofour: TwoFour = field(default_factory=TwoFour)


#: The recipe options of the section: every field but the recipe, its precision and the layers it covers.
_OPTIONS = tuple(f.name for f in fields(TwoFour) if f.name not in ("recipe", "precision", "include", "exclude"))


def recipe_from_config(cfg: TwoFour, total_steps: int) -> Recipe:
    """The :class:`~twofour.Recipe` a ``[twofour]`` section names, for a run of ``total_steps``."""
    return titan_recipe(cfg.recipe, cfg.precision, total_steps, {k: getattr(cfg, k) for k in _OPTIONS})


class TwoFourConverter:
    """torchtitan's ``ModelConverter`` for twofour: sparsify in ``convert``, advance the masks in
    ``post_optimizer_hook`` (torchtitan calls it after every optimizer step)."""

    def __init__(self, job_config: Any, parallel_dims: Any):
        cfg = getattr(job_config, NAME, None)
        if cfg is None:
            raise TrainError(f"model.converters lists {NAME!r} but the job config has no [twofour] section: set "
                             "job.custom_config_module = \"twofour.integrations.torchtitan\"")
        if getattr(parallel_dims, "pp_enabled", False):
            raise TrainError("the twofour converter does not support pipeline parallelism "
                             "(parallelism.pipeline_parallel_degree > 1)")
        self.recipe = recipe_from_config(cfg, job_config.training.steps)
        self.include, self.exclude = list(cfg.include), list(cfg.exclude)
        self._skip_lists = _swapper_skip_lists(job_config)
        self._models: list[nn.Module] = []
        self._decay_hook: torch.utils.hooks.RemovableHandle | None = None

    def convert(self, model: nn.Module) -> None:
        """Swap the included linears for SparseLinear (in place, on the meta device or not)."""
        sparsify(model, self.recipe, include=self.include, exclude=self.exclude)
        names = [name for name, _ in sparse_layers(model)]
        for skip in self._skip_lists:  # float8 / mx converters listed after this one leave them alone
            skip.extend(n for n in names if n not in skip)
        # the buffers made on the meta device are garbage after to_empty: recompute them after init
        model.init_weights = types.MethodType(_init_weights_then_recipe_state, model)
        self._models.append(model)
        if self.recipe.decay and self._decay_hook is None:
            self._decay_hook = register_optimizer_step_pre_hook(self._masked_decay)

    def _masked_decay(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """SR-STE's masked decay, right before torchtitan's optimizers step (after its gradient
        clipping); once per step: the container's step, not each optimizer's inside it."""
        if isinstance(optimizer, OptimizersContainer):
            for model in self._models:
                add_masked_decay(model)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Advance every sparse layer by one optimizer step (masks, flip counts, phases)."""
        for part in model if isinstance(model, list) else [model]:
            advance(part)

    def close(self) -> None:
        """Remove the process-wide optimizer hook of a decay recipe (a test or a second run in one process)."""
        if self._decay_hook is not None:
            self._decay_hook.remove()
            self._decay_hook = None


def _swapper_skip_lists(job_config: Any) -> list[list[str]]:
    """The skip lists (``filter_fqns``) of the linear-swapping converters listed after twofour's;
    one listed before it is refused (it would have swapped the layers twofour is to make 2:4)."""
    converters = list(job_config.model.converters)
    mine = converters.index(NAME)
    out = []
    for name, path in _LINEAR_SWAPPERS.items():
        if name not in converters:
            continue
        if converters.index(name) < mine:
            raise TrainError(f"model.converters lists {name!r} before {NAME!r}: list {NAME!r} first, so that "
                             f"{name} skips the 2:4 layers (converters = {[NAME, name]!r})")
        section = job_config.quantize.linear
        for attr in path:
            section = getattr(section, attr)
        out.append(section.filter_fqns)
    return out


def _init_weights_then_recipe_state(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """The model's own ``init_weights``, then each sparse layer's buffers from its new weight."""
    type(self).init_weights(self, *args, **kwargs)
    for _, layer in sparse_layers(self):
        layer.reset_state()


register_model_converter(TwoFourConverter, NAME)
for _flavor, _dims in FLAVORS.items():
    llama3_args.setdefault(_flavor, TransformerModelArgs(**_dims))
