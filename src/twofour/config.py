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

__all__ = ["TrainConfig", "TrainError", "DEFAULT_LR", "Regime", "REGIMES", "lr_at"]

#: Peak learning rate per preset (GPT-3 paper's table for the GPT-2 sizes; higher for tiny).
DEFAULT_LR = {"tiny": 1e-3, "gpt2-124m": 6e-4, "gpt2-350m": 3e-4, "gpt2-774m": 2.5e-4, "gpt2-1.5b": 2e-4}


@dataclass(frozen=True)
class Regime:
    """A named set of optimization defaults; any option given explicitly overrides its value.

    Attributes:
        lr: peak learning rate (None: the preset's, :data:`DEFAULT_LR`).
        min_lr_ratio: cosine floor as a fraction of the peak.
        warmup_divisor, max_warmup: warmup is ``steps // warmup_divisor`` steps, at most ``max_warmup``.
        tokens_per_step: tokens per optimizer step reached through gradient accumulation
            (``ceil(tokens_per_step / (batch_size * seq_len * processes))`` micro-batches); None: 1.
        decay: SR-STE masked decay for recipes that take ``decay`` (None: the recipe's default).
    """

    lr: float | None
    min_lr_ratio: float
    warmup_divisor: int
    max_warmup: int
    tokens_per_step: int | None = None
    decay: float | None = None


#: ``ours``: nanoGPT's GPT-2 settings scaled to short runs (the default). ``authors``: the S-STE
#: authors' GPT-2 124M settings (lr 1.5e-4 cosine to 1e-5, 3000 warmup steps, ~0.5M tokens per
#: step, SR-STE decay 6e-5), with the warmup scaled down to 10% of a shorter run.
REGIMES: dict[str, Regime] = {
    "ours": Regime(lr=None, min_lr_ratio=0.1, warmup_divisor=20, max_warmup=2000),
    "authors": Regime(lr=1.5e-4, min_lr_ratio=1e-5 / 1.5e-4, warmup_divisor=10, max_warmup=3000,
                      tokens_per_step=524_288, decay=6e-5),
}


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
    regime: str = "ours"  # a key of REGIMES: the defaults of the four options below and of SR-STE's decay
    grad_accum: int | None = None  # None: the regime's (ours 1; authors ~0.5M tokens per step)
    lr: float | None = None  # None: the regime's (ours: DEFAULT_LR of the preset; authors 1.5e-4)
    min_lr_ratio: float | None = None  # None: the regime's (ours 0.1; authors 1e-5 / 1.5e-4)
    warmup: int | None = None  # None: the regime's (ours 5% of the steps, at most 2000; authors 10%, at most 3000)
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
        ``steps`` when the recipe takes it and it wasn't given, and ``decay`` set to the regime's
        when it has one, the recipe takes it and it wasn't given. Raises TrainError if invalid."""
        options = dict(self.recipe_options)
        try:
            takes = recipe_options(self.recipe)
            if "total_steps" in takes and options.get("total_steps") is None:
                options["total_steps"] = self.steps
            regime = REGIMES.get(self.regime)
            if regime is not None and regime.decay is not None and "decay" in takes and "decay" not in options:
                options["decay"] = regime.decay
            return make_recipe(self.recipe, **options)
        except (ValueError, TypeError) as e:
            raise TrainError(str(e)) from None

    def validate(self) -> None:
        """Raise TrainError naming the first bad option."""
        if self.model not in PRESETS:
            raise TrainError(f"unknown model preset {self.model!r}; valid presets: {', '.join(PRESETS)}")
        if self.regime not in REGIMES:
            raise TrainError(f"unknown regime {self.regime!r}; valid regimes: {', '.join(REGIMES)}")
        self.recipe_object()
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_iters", "ckpt_interval"):
            value = getattr(self, name)
            if (value is not None or name != "grad_accum") and (not isinstance(value, int) or value < 1):
                raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.min_lr_ratio is not None and not 0 <= self.min_lr_ratio <= 1:
            raise TrainError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise TrainError(f"--stop-at must be between 1 and --steps ({self.steps}), got {self.stop_at}")
        if self.lr is not None and not self.lr > 0:
            raise TrainError(f"--lr must be > 0, got {self.lr}")
        if self.resume and self.overwrite:
            raise TrainError("--resume and --overwrite contradict each other: pick one")

    @property
    def peak_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        regime = REGIMES[self.regime]
        return regime.lr if regime.lr is not None else DEFAULT_LR[self.model]

    @property
    def floor_ratio(self) -> float:
        """The cosine floor as a fraction of the peak learning rate."""
        return self.min_lr_ratio if self.min_lr_ratio is not None else REGIMES[self.regime].min_lr_ratio

    @property
    def warmup_steps(self) -> int:
        if self.warmup is not None:
            return self.warmup
        regime = REGIMES[self.regime]
        return max(1, min(regime.max_warmup, self.steps // regime.warmup_divisor))

    def micro_batches(self, world: int = 1) -> int:
        """Micro-batches per optimizer step per process: ``grad_accum`` if given, else the
        regime's tokens per step over the tokens one micro-batch of every process brings."""
        if self.grad_accum is not None:
            return self.grad_accum
        target = REGIMES[self.regime].tokens_per_step
        return 1 if target is None else max(1, math.ceil(target / (self.batch_size * self.seq_len * world)))

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this config."""
        return {"model": self.model, "recipe": self.recipe, "recipe_options": self.recipe_options,
                "regime": self.regime, "sparse_attention": self.sparse_attention, "seq_len": self.seq_len}


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to the floor (``floor_ratio`` of the peak; nanoGPT's schedule)."""
    peak, floor = cfg.peak_lr, cfg.peak_lr * cfg.floor_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return floor + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (peak - floor)
