"""twofour in torchtitan 0.3: a model-config converter and the trainer configs that use it.

torchtitan 0.3 builds a model from a tree of configs (``Module.Config``) that converters rewrite
before anything is built, and a run from a Python function returning a ``Trainer.Config``
(``--module M --config F``). :class:`TwoFourConverter` replaces the matching ``Linear.Config``
entries (the Llama 3 FFN's ``w1``, ``w2``, ``w3`` by default) with :class:`TwoFourLinear.Config`,
whose module is a :class:`~twofour.SparseLinear` that satisfies torchtitan's ``Module`` protocol:
its weight is initialised by torchtitan (``param_init``), then its recipe buffers (masks, scales)
are computed from that weight (``_init_self_buffers``). :func:`with_twofour` puts the converter
into a trainer config, ahead of any float8 converter (which then leaves the 2:4 layers alone: their
config is no ``Linear.Config``), and installs the hooks on torchtitan's optimizers that advance
the masks after each step and add SR-STE's masked decay before it. The configs of this module's
registry (``--module twofour.integrations.torchtitan``) are torchtitan's Llama 3 ones with it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..errors import TrainError
from ..sparse import DEFAULT_RECIPE, Recipe, SparseLinear, add_masked_decay, advance, sparse_layers
from .titan_common import ATTENTION_LINEARS, FFN_LINEARS, NAME, titan_recipe

try:
    import spmd_types as spmd
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.override import override
    from torchtitan.distributed.parallel_dims import SpmdLayout
    from torchtitan.models.common.linear import Linear
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module
except ImportError as e:  # pragma: no cover - the message is the test
    raise ImportError(f"twofour.integrations.titan3 needs torchtitan 0.3 ({e}): "
                      "pip install \"twofour[torchtitan]\"") from None

#: This module's trainer configs (``--config NAME``), twofour's on top of torchtitan's Llama 3 ones.
CONFIG_NAMES = ("llama3_debugmodel_twofour", "llama3_8b_twofour", "llama3_8b_4layers", "llama3_8b_4layers_float8",
                "llama3_8b_4layers_twofour")
__all__ = ["NAME", "TwoFourLinear", "TwoFourConverter", "with_twofour", "recipe_of", "FFN_LINEARS",
           "ATTENTION_LINEARS", "CONFIG_NAMES", "sparse_ffn", *CONFIG_NAMES]
#: The recipe options a converter config may set (None: the recipe's default).
OPTIONS = ("mvue", "decay", "mask_interval", "dense_finetune", "bf16_finetune", "beta_interval", "dx")


class TwoFourLinear(SparseLinear, Module):
    """:class:`~twofour.SparseLinear` as a torchtitan ``Module``: built from its ``Config``,
    initialised by torchtitan's ``init_states`` (the weight by ``param_init``, then the recipe's
    buffers from it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """A ``Linear.Config``'s fields and the recipe (not a ``Linear.Config``: converters that
        swap linears, float8's, pass it by)."""

        in_features: int
        out_features: int
        bias: bool = False
        _recipe: object = None

    def __init__(self, config: Config):
        SparseLinear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                              recipe=config._recipe or DEFAULT_RECIPE)

    def _init_self_buffers(self, buffer_device: Any = None) -> None:
        """The recipe's buffers from the weight torchtitan just initialised."""
        self.reset_state()

    def parallelize(self, parallel_dims: Any) -> None:
        """torchtitan's placement of the layer's states (its default ``spmd_types`` backend): the
        weight's declared one for the mask (of the weight's shape), replicated for the scalars. Data
        parallelism only: TrainError for tensor or pipeline parallelism, whose shards of a weight a
        mask can't be computed from, and for the ``full_dtensor`` backend (every state a DTensor)."""
        if getattr(parallel_dims, "tp_enabled", False) or getattr(parallel_dims, "pp_enabled", False):
            raise TrainError("the twofour converter supports data parallelism (FSDP2, DDP) only, not tensor or "
                             "pipeline parallelism (parallelism.tensor_parallel_degree and "
                             "pipeline_parallel_degree must be 1)")
        if getattr(parallel_dims, "spmd_backend", None) == "full_dtensor":
            raise TrainError("the twofour converter runs with parallelism.spmd_backend spmd_types (the default) or "
                             "partial_dtensor, not full_dtensor")
        sc = self._sharding_config
        if sc is not None and "weight" in sc.state_shardings:
            weight = sc.state_shardings["weight"]
            replicated = SpmdLayout(axis_types={axis: spmd.R for axis in weight.axes()})
            states = dict(sc.state_shardings)
            for name, _ in self.named_buffers(recurse=False):
                states.setdefault(name, weight if name == "mask" else replicated)
            self._sharding_config = dataclasses.replace(sc, state_shardings=states)
        Module.parallelize(self, parallel_dims)


class TwoFourConverter(ModelConfigConverter):
    """Replace the ``Linear.Config`` entries whose names match ``include`` (and not ``exclude``)
    with :class:`TwoFourLinear.Config` of the recipe."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        recipe: str = DEFAULT_RECIPE
        """dense, ste, sr-ste, s-ste or t-sr-ste (step needs twofour's STEPAdamW, which torchtitan doesn't build)."""
        precision: str = "bf16"
        """Which GEMMs of the 2:4 layers run in FP8: a name of twofour.fp8.PRECISIONS."""
        total_steps: int | None = None
        """The run's optimizer steps (``training.steps``; :func:`with_twofour` sets it): needed by a recipe
        with a phase at the end (t-sr-ste's dense fine-tune, an FP8 recipe's bf16_finetune)."""
        include: list[str] = field(default_factory=lambda: list(FFN_LINEARS))
        """fnmatch patterns on module names: the linears made 2:4."""
        exclude: list[str] = field(default_factory=lambda: ["lm_head"])
        """fnmatch patterns on module names left dense."""
        options: dict[str, Any] = field(default_factory=dict)
        """Recipe options (mvue, decay, mask_interval, dense_finetune, bf16_finetune, beta_interval, dx)."""

    def __init__(self, config: Config):
        self.config = config
        self.recipe = recipe_of(config)

    def convert(self, model_config: Module.Config) -> Module.Config:
        """The tree with the matching linears' configs replaced (TrainError if none matched)."""
        swapped = []
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if not self._takes(fqn):
                continue
            new = _sparse_config(cfg, self.recipe)
            if parent is None:
                return new
            if isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            swapped.append(fqn)
        if not swapped:
            raise TrainError(f"[twofour] no linear matches include={self.config.include} (exclude="
                             f"{self.config.exclude}); torchtitan's names look like layers.0.feed_forward.w1")
        return model_config

    def _takes(self, fqn: str) -> bool:
        return (any(fnmatch.fnmatch(fqn, p) for p in self.config.include)
                and not any(fnmatch.fnmatch(fqn, p) for p in self.config.exclude))


def _sparse_config(cfg: Any, recipe: Recipe) -> TwoFourLinear.Config:
    """The 2:4 twin of a ``Linear.Config`` (its shape, bias, initialisation and placements)."""
    return TwoFourLinear.Config(in_features=cfg.in_features, out_features=cfg.out_features, bias=cfg.bias,
                                param_init=cfg.param_init, sharding_config=cfg.sharding_config, _recipe=recipe)


def recipe_of(config: TwoFourConverter.Config) -> Recipe:
    """The :class:`~twofour.Recipe` a converter config names (TrainError for a bad one)."""
    unknown = set(config.options) - set(OPTIONS)
    if unknown:
        raise TrainError(f"[twofour] unknown recipe options {sorted(unknown)}; the options are {', '.join(OPTIONS)}")
    return titan_recipe(config.recipe, config.precision, config.total_steps, config.options)


def _on_titan_optimizers(action: Any) -> Any:
    """An optimizer step hook running ``action`` on each model part of torchtitan's optimizers (the
    container's step, once a step, not each optimizer's inside it; other optimizers are left alone)."""

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if isinstance(optimizer, OptimizersContainer):
            for part in optimizer.model_parts:
                action(part)

    return hook


def _advance_and_settle(part: Any) -> None:
    """Every sparse layer of ``part`` one step on, its mask refresh done now: torchtitan compiles each
    block whole (``fullgraph``), so a refresh left for the next forward (a sharded weight's, where
    FSDP2 gathers it) cannot run there; here it runs from each rank's rows and a gather of the mask
    (:meth:`~twofour.SparseLinear.settle`, a collective every rank makes)."""
    advance(part)
    for _, layer in sparse_layers(part):
        layer.settle()


def with_twofour(config: Any, recipe: str = DEFAULT_RECIPE, *, precision: str = "bf16",
                 include: list[str] | None = None, exclude: list[str] | None = None, **options: Any) -> Any:
    """A torchtitan ``Trainer.Config`` with its model's linears that match ``include`` (the FFN's by
    default) made 2:4 by ``recipe`` (with ``precision`` and the recipe ``options``), the recipe's
    ``total_steps`` from ``config.training.steps`` as it is now (a ``--training.steps`` given on
    the command line later does not reach it: give a recipe with phases its steps through
    :func:`sparse_ffn`'s ``total_steps`` instead). A float8 converter already applied to the
    model config is overruled on those linears (they become 2:4) and keeps the others."""
    cfg = TwoFourConverter.Config(recipe=recipe, precision=precision, total_steps=config.training.steps,
                                  include=list(include or FFN_LINEARS), exclude=list(exclude or ["lm_head"]),
                                  options=options)
    config.model_spec.model = TwoFourConverter(cfg).convert(config.model_spec.model)
    return config


@override(target=Linear.Config, fqns=list(FFN_LINEARS), description="twofour: the FFN linears 2:4")
def sparse_ffn(config: Linear.Config, recipe: str = DEFAULT_RECIPE, precision: str = "bf16",
               total_steps: int | None = None, **options: Any) -> TwoFourLinear.Config:
    """torchtitan's override of a Llama 3 FFN linear by a 2:4 one, from the command line:
    ``--override.imports twofour.integrations.titan3.sparse_ffn``, with the recipe as the entry's
    keyword arguments (``recipe``, ``precision``, ``total_steps`` for recipes with phases, options)."""
    cfg = TwoFourConverter.Config(recipe=recipe, precision=precision, total_steps=total_steps, options=options)
    return _sparse_config(config, recipe_of(cfg))


# -- the configs of ``--module twofour.integrations.torchtitan`` (torchtitan 0.3's config registry) -----------------


def _registry() -> Any:
    from torchtitan.models.llama3 import config_registry  # noqa: PLC0415

    return config_registry


def llama3_debugmodel_twofour() -> Any:
    """torchtitan's Llama 3 debug model (``llama3_debugmodel``) with twofour's default recipe on its FFN."""
    return with_twofour(_registry().llama3_debugmodel())


def llama3_8b_twofour() -> Any:
    """torchtitan's Llama 3 8B (``llama3_8b``) with twofour's default recipe on its FFN."""
    return with_twofour(_registry().llama3_8b())


def llama3_8b_4layers() -> Any:
    """torchtitan's Llama 3 8B cut to its first 4 blocks, dense: the 8B's GEMM shapes on one GPU, the
    baseline of :func:`llama3_8b_4layers_twofour`."""
    config = _registry().llama3_8b()
    config.model_spec.model.layers = config.model_spec.model.layers[:4]
    return config


def llama3_8b_4layers_float8() -> Any:
    """:func:`llama3_8b_4layers` with torchtitan's float8 converter (rowwise, for a compiled run) on
    its linears: the FP8 baseline; with ``sparse_ffn`` on top, the FFN 2:4 and the rest float8."""
    from torchtitan.components.quantization import Float8LinearConverter  # noqa: PLC0415
    from torchtitan.models.llama3 import model_registry  # noqa: PLC0415

    config = llama3_8b_4layers()
    spec = model_registry("8B", converters=[Float8LinearConverter.Config(model_compile_enabled=True)])
    spec.model.layers = spec.model.layers[:4]
    config.model_spec = spec
    return config


def llama3_8b_4layers_twofour() -> Any:
    """:func:`llama3_8b_4layers` with twofour's default recipe on its FFN."""
    return with_twofour(llama3_8b_4layers())


# importing this module turns on its hooks; they act on the sparse layers of torchtitan's optimizers' model parts:
register_optimizer_step_pre_hook(_on_titan_optimizers(add_masked_decay))  # SR-STE's decay, after the clipping
register_optimizer_step_post_hook(_on_titan_optimizers(_advance_and_settle))  # masks, flip counts and phases
