"""What a training run depends on: :class:`TrainConfig` (saved as JSON in every run folder and
checkpoint), the learning-rate schedule, and :class:`TrainError` for runs that can't start.

The recipe stays a name plus options and the precision a preset's name here (it is JSON);
:meth:`TrainConfig.recipe_object` turns them into a :class:`twofour.Recipe` once, and the training
code passes that object on. A config or summary saved by an older version is read through one
conversion, :func:`saved_options`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TrainError
from ..fp8 import E4M3, E5M2, PRECISIONS, ROWWISE, TENSORWISE, Precision
from ..models.presets import PRESETS
from ..sparse.recipes import DEFAULT_RECIPE, Recipe, make_recipe, recipe_options
from .parallel import FSDP_POLICIES

__all__ = ["TrainConfig", "TrainError", "DEFAULT_LR", "Regime", "REGIMES", "lr_at", "resumed_config", "saved_options",
           "option_name", "resolve_device", "LAUNCH_OPTIONS", "ADJUSTABLE_OPTIONS", "MAX_SEED", "check_seed",
           "IDENTITY_OPTIONS", "first_difference"]

#: Peak learning rate per preset (each :class:`~twofour.models.Preset`'s ``lr``: GPT-3 paper's table
#: for the GPT-2 sizes, higher for the small ones, as nanoGPT's 10M-parameter example).
DEFAULT_LR = {name: preset.lr for name, preset in PRESETS.items()}


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


@dataclass
class TrainConfig:
    """Everything a run depends on; saved in its checkpoint and ``config.json``."""

    model: str = "tiny"
    recipe: str = DEFAULT_RECIPE
    recipe_options: dict[str, Any] = field(default_factory=dict)
    precision: str = "bf16"  # a name of twofour.fp8.PRECISIONS: which GEMMs of the sparsified linears run in FP8
    sparse_attention: bool = False
    n_layer: int | None = None  # None: the preset's number of blocks
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
    skip_nonfinite: int = 0  # steps with a non-finite loss or gradient norm skipped, not applied; one more stops
    bf16: bool = True  # bf16 autocast on the GPU (the CPU always runs float32)
    compile: bool = False
    compile_mode: str = "default"  # torch.compile's mode (COMPILE_MODES) with `compile`
    seed: int = 1337
    eval_interval: int = 100
    eval_iters: int = 10
    ckpt_interval: int = 500  # 0: no checkpoints at all (throughput runs of large models)
    log_interval: int = 10  # a log line, a metrics row and the only host sync every this many steps
    out_dir: str = "runs/train"
    resume: bool = False
    reschedule: bool = False  # resume with another `steps`: the learning-rate schedule is recomputed over it
    overwrite: bool = False
    device: str = "auto"
    fsdp: str | None = None  # under torchrun: FSDP2 with this policy (training.parallel.FSDP_POLICIES), else DDP
    activation_checkpointing: bool = False  # recompute each block's activations in the backward
    step_graphs: bool = True  # the eager step's forward and backward as CUDA graphs (training/graphs.py)
    progress: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config a ``config.json`` or checkpoint holds (unknown keys ignored; an older
        version's as :func:`saved_options` converts it)."""
        cfg = cls(**{k: v for k, v in saved_options(d).items() if k in cls.__dataclass_fields__})
        cfg.betas = tuple(cfg.betas)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON), what config.json and checkpoints hold."""
        return dataclasses.asdict(self)

    def recipe_object(self) -> Recipe:
        """The run's :class:`twofour.Recipe`: the name, options and precision, with ``total_steps`` set to
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
            return make_recipe(self.recipe, precision=self.precision, **options)
        except (ValueError, TypeError) as e:
            raise TrainError(str(e)) from None

    def validate(self) -> None:
        """Raise TrainError naming the first bad option."""
        if self.model not in PRESETS:
            raise TrainError(f"unknown model preset {self.model!r}; valid presets: {', '.join(PRESETS)}")
        if self.regime not in REGIMES:
            raise TrainError(f"unknown regime {self.regime!r}; valid regimes: {', '.join(REGIMES)}")
        if self.precision not in PRECISIONS:
            raise TrainError(f"unknown --precision {self.precision!r}; valid precisions: {', '.join(PRECISIONS)}")
        if self.fsdp is not None and self.fsdp not in FSDP_POLICIES:
            raise TrainError(f"unknown --fsdp policy {self.fsdp!r}; valid policies: {', '.join(FSDP_POLICIES)}")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_iters",
                     "log_interval", "vocab_size", "n_layer"):
            value = getattr(self, name)
            if (value is not None or name not in ("grad_accum", "vocab_size", "n_layer")) and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise TrainError(f"{option_name(name)} must be a positive integer, got {value!r}")
        check_seed(self.seed)
        self.recipe_object()  # after the integers: a bad --steps is named, not the recipe's total_steps
        for name in ("warmup", "skip_nonfinite", "ckpt_interval"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise TrainError(f"{option_name(name)} must be a whole number of steps >= 0, got {value!r}")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise TrainError(f"{option_name(name)} must be >= 0, got {value!r}")
        if self.min_lr_ratio is not None and not 0 <= self.min_lr_ratio <= 1:
            raise TrainError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise TrainError(f"--stop-at must be between 1 and --steps ({self.steps}), got {self.stop_at}")
        if self.stop_at is not None and self.ckpt_interval == 0:
            raise TrainError("--stop-at pauses a run to resume it later, but --ckpt-interval 0 writes no checkpoint")
        if self.lr is not None and not (math.isfinite(self.lr) and 0 < self.lr <= 1):
            raise TrainError(f"--lr must be > 0 and at most 1 (AdamW's peak learning rate; the presets' are "
                             f"2e-4 to 1e-3), got {self.lr}")
        if not (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise TrainError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise TrainError(f"unknown --compile-mode {self.compile_mode!r}; valid modes: {', '.join(COMPILE_MODES)}")
        if self.compile_mode != "default" and not self.compile:
            raise TrainError(f"--compile-mode {self.compile_mode} applies to a compiled run: add --compile")
        if not _DEVICE.fullmatch(str(self.device)):
            raise TrainError(f"unknown --device {self.device!r}; use auto, cpu, cuda or cuda:N")
        if self.resume and self.overwrite:
            raise TrainError("--resume and --overwrite contradict each other: pick one")
        if self.reschedule and not self.resume:
            raise TrainError("--reschedule only applies to a resumed run (with --resume)")

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled model replays CUDA graphs (a :data:`CUDA_GRAPH_MODES` mode)."""
        return self.compile and self.compile_mode in CUDA_GRAPH_MODES

    @property
    def peak_lr(self) -> float:
        """The peak learning rate: ``lr`` if given, else the regime's, else the preset's."""
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


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
#: The largest ``--seed``: torch's generators take 64 bits, and a rank's data stream adds to the seed.
MAX_SEED = 2**63 - 1


def check_seed(seed: Any, option: str = "--seed") -> None:
    """TrainError naming ``option`` unless ``seed`` is a whole number from 0 to :data:`MAX_SEED`."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise TrainError(f"{option} must be a whole number from 0 to 2**63 - 1, got {seed}")


#: torch.compile's modes. "reduce-overhead" replays the step's kernels as CUDA graphs: no host
#: time per kernel (a sparse layer's custom ops cost the host more than a dense GEMM does; the
#: real loop's gain from it is in docs/PERFORMANCE.md).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the modes that capture CUDA graphs: run in one process with one micro-batch a step (a graph's
#: gradients are its own buffers, overwritten by the next micro-batch's replay; DDP and FSDP2
#: with them are not tested)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``--device`` names: ``auto`` is this process's GPU (``local_rank``) if there is
    one, else the CPU; ``cuda`` without an index is this process's GPU too. TrainError for a name
    that is not auto, cpu, cuda or cuda:N, or a GPU asked for where there is none."""
    if not _DEVICE.fullmatch(str(name)):
        raise TrainError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N")
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev

#: Set by each invocation, never taken from the checkpoint of a resumed run.
LAUNCH_OPTIONS = frozenset({"out_dir", "resume", "reschedule", "overwrite", "stop_at", "progress"})
#: How a run executes and reports, not what it trains: a resumed run keeps its checkpoint's value
#: unless one is given.
ADJUSTABLE_OPTIONS = frozenset({"log_interval", "eval_interval", "ckpt_interval", "device", "compile", "compile_mode",
                                "fsdp", "step_graphs", "skip_nonfinite", "activation_checkpointing"})
_OPTION_NAMES = {"out_dir": "--out", "recipe_options": "--opt", "bf16": "--no-bf16", "progress": "--no-progress"}


def option_name(field_name: str) -> str:
    """The command-line option that sets a TrainConfig field (``batch_size`` -> ``--batch-size``)."""
    return _OPTION_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


#: The recipe options older versions spelled the precision with (now :attr:`TrainConfig.precision`).
_FP8_FLAGS = ("fp8", "fp8_rowwise", "fp8_grad_e4m3", "fp8_forward", "fp8_backward")


def saved_options(d: dict[str, Any]) -> dict[str, Any]:
    """A saved config, checkpoint config or summary (``d``) in this version's form: the one place
    that reads older forms. Older versions spelled the precision as recipe options (``fp8``,
    ``fp8_rowwise``, ``fp8_grad_e4m3``, ``fp8_forward``, ``fp8_backward``); they become
    ``precision``, the name of the preset they meant (an FP8 run saved without ``fp8_grad_e4m3``
    dates from when e5m2 was the default: ``fp8-e5m2``). ``fsdp`` was a switch: on meant FSDP2
    with float32 weights (the ``fp32`` policy). ``d`` itself where it holds none of these."""
    if isinstance(d.get("fsdp"), bool):
        d = {**d, "fsdp": "fp32" if d["fsdp"] else None}
    opts = d.get("recipe_options")
    if not isinstance(opts, dict) or not any(k in opts for k in _FP8_FLAGS):
        return d
    on = opts.get("fp8") is True
    grad = None if opts.get("fp8_backward") is False else E4M3 if opts.get("fp8_grad_e4m3") else E5M2
    precision = Precision(opts.get("fp8_forward") is not False, grad,
                          ROWWISE if opts.get("fp8_rowwise") else TENSORWISE) if on else None
    return {**d, "recipe_options": {k: v for k, v in opts.items() if k not in _FP8_FLAGS},
            "precision": precision.name if precision else "bf16"}


def resumed_config(saved: dict[str, Any], cfg: TrainConfig, given: set[str] | None = None) -> TrainConfig:
    """The settings a resumed run trains with, as nanoGPT's ``init_from='resume'`` does: those of
    its checkpoint (``saved``, the checkpoint's config), with ``cfg``'s launch options
    (:data:`LAUNCH_OPTIONS`) and, where ``cfg`` gives them, its :data:`ADJUSTABLE_OPTIONS`.

    ``given`` names the fields ``cfg`` sets explicitly (the command line's options); None means
    all of them (a config built in Python). A given field that changes what is trained (data,
    schedule, batch, recipe, model, ...) must equal the checkpoint's, else TrainError names it
    (one the checkpoint left unset equals what the default amounts to, :data:`_EFFECTIVE`);
    ``steps`` may change only with ``reschedule`` (the learning-rate schedule is recomputed)."""
    old = TrainConfig.from_dict(saved)
    merged = {}
    for f in dataclasses.fields(TrainConfig):
        name, mine, theirs = f.name, getattr(cfg, f.name), getattr(old, f.name)
        explicit = given is None or name in given
        if name in LAUNCH_OPTIONS or (name in ADJUSTABLE_OPTIONS and explicit):
            merged[name] = mine
        elif explicit and not _same(name, mine, old) and not (name == "steps" and cfg.reschedule):
            hint = " or add --reschedule to recompute the schedule over the new --steps" if name == "steps" else ""
            raise TrainError(f"{option_name(name)} {_show(mine)} contradicts the run being resumed "
                             f"({_show_saved(name, old)} in its checkpoint): a resumed run keeps its settings; leave "
                             f"the option out{hint}, or start a new run with another --out")
        else:
            merged[name] = mine if explicit else theirs
    if not merged["compile"] and not (given is None or "compile_mode" in given):
        merged["compile_mode"] = "default"  # resumed with --no-compile: the saved mode goes with it
    return TrainConfig(**merged)


#: The options whose unset value (None, or no recipe options) stands for a default derived from
#: others: a value given on resume is compared with what the checkpoint's amounts to.
_EFFECTIVE: dict[str, Any] = {
    "lr": lambda c: c.peak_lr, "min_lr_ratio": lambda c: c.floor_ratio, "warmup": lambda c: c.warmup_steps,
    "n_layer": lambda c: c.n_layer or PRESETS[c.model].config.n_layer,
    "recipe_options": lambda c: c.recipe_object().to_dict(),
}


#: What makes a run the run it is (its model and shapes, recipe, data, seed): a checkpoint belongs
#: to the run folder whose ``config.json`` agrees with it on all of them.
IDENTITY_OPTIONS = ("model", "n_layer", "sparse_attention", "seq_len", "vocab_size", "recipe", "recipe_options",
                    "precision", "data", "seed")


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first of :data:`IDENTITY_OPTIONS` on which saved configs ``a`` and ``b`` train
    differently, as (option, a's value, b's value) for a message; None when they agree."""
    ca, cb = TrainConfig.from_dict(a), TrainConfig.from_dict(b)
    for name in IDENTITY_OPTIONS:
        if not _same(name, getattr(cb, name), ca):
            return option_name(name), _show_saved(name, ca), _show_saved(name, cb)
    return None


def _same(name: str, mine: Any, old: TrainConfig) -> bool:
    """Whether ``mine``, given for field ``name`` on resume, trains what ``old`` (the checkpoint's
    config) does: the same value, or the value its unset default amounts to."""
    if _norm(mine) == _norm(getattr(old, name)):
        return True
    effective = _EFFECTIVE.get(name)
    try:
        return effective is not None and _norm(effective(dataclasses.replace(old, **{name: mine}))) == _norm(
            effective(old))
    except (TrainError, KeyError, TypeError, ValueError):  # a value that builds no run: it differs
        return False


def _show_saved(name: str, old: TrainConfig) -> str:
    """The checkpoint's value of field ``name``, with what an unset default amounts to."""
    value = getattr(old, name)
    if value is None and name in _EFFECTIVE:
        with contextlib.suppress(TrainError, KeyError, TypeError, ValueError):
            return f"unset: {_EFFECTIVE[name](old)} by default"
    return _show(value)


def _norm(value: Any) -> Any:
    """Settings compared as their JSON form (tuples and lists alike)."""
    return json.loads(json.dumps(value))


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    return "(none)" if value is None else str(value)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to the floor (``floor_ratio`` of the peak; nanoGPT's schedule)."""
    peak, floor = cfg.peak_lr, cfg.peak_lr * cfg.floor_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return floor + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (peak - floor)
