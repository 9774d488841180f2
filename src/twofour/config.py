"""What a training run depends on: :class:`TrainConfig` (saved as JSON in every run folder and
checkpoint), the learning-rate schedule, and :class:`TrainError` for runs that can't start.

The recipe stays a name plus options here (it is JSON); :meth:`TrainConfig.recipe_object` turns
it into a :class:`twofour.Recipe` once, and the training code below passes that object on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .model import PRESETS
from .recipes import DEFAULT_RECIPE, Recipe, make_recipe, recipe_options

__all__ = ["TrainConfig", "TrainError", "DEFAULT_LR", "lr_at"]

#: Peak learning rate per preset (GPT-3 paper's table for the GPT-2 sizes; higher for tiny).
DEFAULT_LR = {"tiny": 1e-3, "gpt2-124m": 6e-4, "gpt2-350m": 3e-4, "gpt2-774m": 2.5e-4, "gpt2-1.5b": 2e-4}


class TrainError(ValueError):
    """A run that can't start or go on: bad options, an existing run, a bad checkpoint."""


@dataclass
class TrainConfig:
    """Everything a run depends on; saved in its checkpoint and ``config.json``."""

    model: str = "tiny"
    recipe: str = DEFAULT_RECIPE
    recipe_options: dict[str, Any] = field(default_factory=dict)
    sparse_attention: bool = False
    data: str | None = None  # None: the standard library corpus
    vocab_size: int | None = None  # for .bin shards without meta.pkl
    steps: int = 300
    stop_at: int | None = None  # stop (with a checkpoint) after this step, keeping the schedule of `steps`
    batch_size: int = 16
    seq_len: int = 128
    grad_accum: int = 1
    lr: float | None = None  # None: DEFAULT_LR of the preset
    min_lr_ratio: float = 0.1
    warmup: int | None = None  # None: 5% of the steps, at most 2000
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    bf16: bool = True  # bf16 autocast on the GPU (the CPU always runs float32)
    compile: bool = False
    seed: int = 1337
    eval_interval: int = 100
    eval_iters: int = 10
    ckpt_interval: int = 500
    out_dir: str = "runs/train"
    resume: bool = False
    overwrite: bool = False
    device: str = "auto"
    fsdp: bool = False
    progress: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config a ``config.json`` or checkpoint holds (unknown keys ignored)."""
        cfg = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        cfg.betas = tuple(cfg.betas)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def recipe_object(self) -> Recipe:
        """The run's :class:`twofour.Recipe`: the name and options, with ``total_steps`` set to
        ``steps`` when the recipe takes it and it wasn't given. Raises TrainError if invalid."""
        options = dict(self.recipe_options)
        try:
            if "total_steps" in recipe_options(self.recipe) and options.get("total_steps") is None:
                options["total_steps"] = self.steps
            return make_recipe(self.recipe, **options)
        except (ValueError, TypeError) as e:
            raise TrainError(str(e)) from None

    def validate(self) -> None:
        """Raise TrainError naming the first bad option."""
        if self.model not in PRESETS:
            raise TrainError(f"unknown model preset {self.model!r}; valid presets: {', '.join(PRESETS)}")
        self.recipe_object()
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_iters", "ckpt_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise TrainError(f"--stop-at must be between 1 and --steps ({self.steps}), got {self.stop_at}")
        if self.lr is not None and not self.lr > 0:
            raise TrainError(f"--lr must be > 0, got {self.lr}")
        if self.resume and self.overwrite:
            raise TrainError("--resume and --overwrite contradict each other: pick one")

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.model]

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, min(2000, self.steps // 20))

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this config."""
        return {"model": self.model, "recipe": self.recipe, "recipe_options": self.recipe_options,
                "sparse_attention": self.sparse_attention, "seq_len": self.seq_len}


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` of the peak (nanoGPT's schedule)."""
    peak, floor = cfg.peak_lr, cfg.peak_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return floor + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (peak - floor)
