"""A run's decisions, made once per process before anything is built: the recipe, the device, the
micro-batches a step, the precision the forwards run in, which CUDA graphs replay the steps and
which optimizer steps. :func:`plan_run` makes them from
the options (:class:`~twofour.training.config.TrainConfig`) and the processes
(:class:`~twofour.training.parallel.Parallel`, which holds the processes' own decisions: world,
sharding); set-up, the step and the loop read the :class:`Plan` instead of deciding again."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..sparse.recipes import Recipe
from .config import TrainConfig, resolve_device
from .graphs import capture_plan
from .parallel import Parallel

__all__ = ["Plan", "plan_run", "autocast_on", "autocast_for"]


@dataclass(frozen=True)
class Plan:
    """What a run's options come to in this process."""

    recipe: Recipe
    device: torch.device
    accum: int  # micro-batches per optimizer step in this process
    autocast: bool  # the forwards under bf16 autocast (else float32)
    graphs: str  # the CUDA graphs the steps replay: "compiled", "step" or "" (graphs.capture_plan)
    optimizer: str  # "step-adamw" (STEP's, which switches the masks on) or "adamw"
    plan_layers: bool  # compiled under autocast: each layer shape measured as the 2:4 op or dense GEMMs

    @property
    def precision(self) -> str:
        """The forwards' precision, for the run's first line."""
        return "bf16 autocast" if self.autocast else "float32"

    def autocast_context(self) -> contextlib.AbstractContextManager:
        """The context the run's forwards run in."""
        return _autocast(self.autocast)


def plan_run(cfg: TrainConfig, par: Parallel) -> Plan:
    """The :class:`Plan` of ``cfg`` in this process of ``par`` (TrainError for an impossible one:
    an unknown device, CUDA graphs with several processes or micro-batches)."""
    recipe = cfg.recipe_object()
    device = resolve_device(cfg.device, par.local_rank)
    accum = cfg.micro_batches(par.world)
    autocast = autocast_on(cfg, device)
    return Plan(recipe=recipe, device=device, accum=accum, autocast=autocast,
                graphs=capture_plan(cfg, par.world, accum, par.sharded, device, recipe.starts_dense),
                optimizer="step-adamw" if recipe.starts_dense else "adamw", plan_layers=cfg.compile and autocast)


def autocast_on(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether ``cfg``'s forwards on ``device`` run under bf16 autocast: on a GPU unless ``--no-bf16``."""
    return cfg.bf16 and device.type == "cuda"


def autocast_for(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward of ``cfg``'s model on ``device`` runs in outside a run (scoring a
    finished run), as in the run (:func:`autocast_on`)."""
    return _autocast(autocast_on(cfg, device))


def _autocast(on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if on else contextlib.nullcontext()
