"""What a training run depends on: :class:`TrainConfig` (saved as JSON in every run folder and
checkpoint), the learning-rate schedule, and :class:`TrainError` for runs that can't start.

The recipe stays a name plus options and the precision a preset's name here (it is JSON);
:meth:`TrainConfig.recipe_object` turns them into a :class:`twofour.Recipe` once, and the training
code passes that object on. A config or summary saved by an older version is read through one
conversion, :func:`saved_options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TrainError
from ..fp8 import E4M3, E5M2, PRECISIONS, ROWWISE, TENSORWISE, Precision
from ..models.presets import PRESETS
from ..sparse.recipes import DEFAULT_RECIPE, Recipe, make_recipe, recipe_options
from .declare import check_fields, declared, non_negative, one_of, option, positive, whole_steps
from .declare import option_name as declared_option_name
from .options import parse_option
from .parallel import DEFAULT_FSDP, FSDP_POLICIES

__all__ = ["TrainConfig", "TrainError", "DEFAULT_LR", "Regime", "REGIMES", "lr_at", "saved_options", "option_name",
           "resolve_device", "LAUNCH_OPTIONS", "ADJUSTABLE_OPTIONS", "MAX_SEED", "check_seed", "COMPILE_MODES",
           "CUDA_GRAPH_MODES"]

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



def _lr_check(v: Any) -> str | None:
    if v is None or (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 1):
        return None
    return f"--lr must be > 0 and at most 1 (AdamW's peak learning rate; the presets' are 2e-4 to 1e-3), got {v}"


def _seed_check(v: Any) -> str | None:
    try:
        check_seed(v)
    except TrainError as e:
        return str(e)
    return None


_MODEL, _RECIPE, _OPTIM, _LOGS = range(4)  # the command line's groups (declare.GROUPS)


@dataclass
class TrainConfig:
    """Everything a run depends on; saved in its checkpoint and ``config.json``. Each field is one
    run option, declared once (:func:`~twofour.training.declare.option`): the command line, the
    checks, config.json and the resume rules are read from these declarations."""

    model: str = option("tiny", group=_MODEL, identity=True, check=one_of(PRESETS, "model preset|presets"),
                        help=f"preset: {', '.join(PRESETS)} (default %(default)s)")
    recipe: str = option(DEFAULT_RECIPE, None, identity=True)  # set by --recipe (train) or --recipes (compare)
    recipe_options: dict[str, Any] = option(
        None, "--opt", factory=dict, group=_RECIPE, identity=True, type=parse_option, action="append",
        metavar="KEY=VALUE", effective=lambda c: c.recipe_object().to_dict(),
        help="recipe option, repeatable: mvue=false, decay=6e-5, mask_interval=40, dense_finetune=0.2, "
             "bf16_finetune=0.1 (with an FP8 --precision: the last 10%% of the steps without FP8), ...")
    precision: str = option(  # a name of twofour.fp8.PRECISIONS: which GEMMs of the sparsified linears run in FP8
        "bf16", group=_RECIPE, identity=True, check=one_of(PRECISIONS, "--precision|precisions"),
        choices=list(PRECISIONS), metavar="NAME", exclusive=True,
        aliases=[("--fp8", {"action": "store_const", "const": "fp8", "help": "same as --precision fp8"})],
        help="which GEMMs of the FFN linears (attention's too with --sparse-attention) run in FP8, every recipe, "
             "dense included: bf16 (none, the default), fp8 (all three, e4m3, one scale per tensor), fp8-rowwise "
             "(one scale per row), fp8-e5m2 (dY in e5m2), fp8-forward (the forward GEMM only), fp8-backward (dX "
             "and dW only), and their combinations; all: " + ", ".join(PRECISIONS))
    sparse_attention: bool = option(False, group=_MODEL, identity=True, action="store_true",
                                    help="also make the attention projections 2:4")
    n_layer: int | None = option(  # None: the preset's number of blocks
        None, group=_MODEL, identity=True, check=positive(optional=True), type=int, metavar="N",
        effective=lambda c: c.n_layer or PRESETS[c.model].config.n_layer,
        help="the preset with N blocks instead of its own number (a deep shape on fewer GPUs)")
    data: str | None = option(  # None: the standard library corpus
        None, group=_MODEL, identity=True,
        help="text file or folder, folder of .bin token shards (uint16, or uint32 as meta.pkl's 'dtype' says), "
             "or hf:NAME_OR_PATH (default: Python's standard library source)")
    vocab_size: int | None = option(  # for .bin shards without meta.pkl
        None, group=_MODEL, identity=True, check=positive(optional=True), type=int,
        help=".bin shards' vocabulary size, the model's (default: meta.pkl's; at least it)")
    steps: int = option(300, group=_OPTIM, check=positive(), type=int, help="optimizer steps (default %(default)s)")
    stop_at: int | None = option(  # stop (with a checkpoint) after this step, keeping the schedule of `steps`
        None, resume="launch", commands=("train",), type=int,
        help="stop after this step (the schedule still spans --steps)")
    batch_size: int = option(16, group=_OPTIM, check=positive(), type=int,
                             help="sequences per micro-batch per process (default %(default)s)")
    seq_len: int = option(128, group=_OPTIM, identity=True, check=positive(), type=int,
                          help="tokens per sequence (default %(default)s)")
    regime: str = option(  # a key of REGIMES: the defaults of the four options below and of SR-STE's decay
        "ours", group=_OPTIM, check=one_of(REGIMES, "regime|regimes"), choices=list(REGIMES),
        help="optimization defaults: ours (default) or the S-STE authors' GPT-2 settings")
    grad_accum: int | None = option(  # None: the regime's (ours 1; authors ~0.5M tokens per step)
        None, group=_OPTIM, check=positive(optional=True), type=int,
        help="micro-batches per optimizer step (default: regime; ours 1)")
    lr: float | None = option(  # None: the regime's (ours: DEFAULT_LR of the preset; authors 1.5e-4)
        None, group=_OPTIM, check=_lr_check, type=float, effective=lambda c: c.peak_lr,
        help="peak learning rate (default: regime)")
    min_lr_ratio: float | None = option(  # None: the regime's (ours 0.1; authors 1e-5 / 1.5e-4)
        None, group=_OPTIM, type=float, effective=lambda c: c.floor_ratio,
        check=lambda v: None if v is None or 0 <= v <= 1 else f"--min-lr-ratio must be between 0 and 1, got {v}",
        help="cosine floor as a fraction of --lr (default: regime)")
    warmup: int | None = option(  # None: the regime's (ours 5% of the steps, at most 2000; authors 10%, at most 3000)
        None, group=_OPTIM, check=whole_steps, type=int, effective=lambda c: c.warmup_steps,
        help="linear warmup steps (default: regime)")
    weight_decay: float = option(0.1, group=_OPTIM, check=non_negative, type=float,
                                 help="AdamW's (default %(default)s)")
    betas: tuple[float, float] = option(
        (0.9, 0.95), None,
        check=lambda v: None if len(v) == 2 and all(0 <= b < 1 for b in v) else f"betas must be two numbers in "
                                                                                 f"[0, 1), got {v!r}")
    grad_clip: float = option(1.0, group=_OPTIM, check=non_negative, type=float,
                              help="gradient norm clipping; 0 turns it off (default %(default)s)")
    skip_nonfinite: int = option(  # steps with a non-finite loss or gradient norm skipped, not applied; one more stops
        0, group=_OPTIM, resume="adjustable", check=whole_steps, type=int, metavar="N",
        help="skip up to N steps whose loss or gradient norm is not finite (NaN, inf), at one host sync a step; "
             "default %(default)s: the first such step stops the run, keeping the last good checkpoint")
    bf16: bool = option(True, "--no-bf16", group=_OPTIM, action="store_false",  # the CPU always runs float32
                        help="no bf16 autocast on the GPU")
    compile: bool = option(False, group=_OPTIM, resume="adjustable", action=argparse.BooleanOptionalAction,
                           help="torch.compile the model (default: off)")
    compile_mode: str = option(  # torch.compile's mode (COMPILE_MODES) with `compile`
        "default", group=_OPTIM, resume="adjustable", choices=COMPILE_MODES,
        check=one_of(COMPILE_MODES, "--compile-mode|modes"),
        help="torch.compile's mode with --compile; reduce-overhead (CUDA graphs) takes the host's per-kernel time "
             "out of the step (default %(default)s)")
    seed: int = option(1337, group=_OPTIM, identity=True, check=_seed_check, type=int,
                       help="model init and data order (default %(default)s)")
    eval_interval: int = option(100, group=_LOGS, resume="adjustable", check=positive(), type=int,
                                help="steps between validation losses (default %(default)s)")
    eval_iters: int = option(10, group=_LOGS, check=positive(), type=int,
                             help="validation batches per evaluation (default %(default)s)")
    ckpt_interval: int = option(  # 0: no checkpoints at all (throughput runs of large models)
        500, group=_LOGS, resume="adjustable", check=whole_steps, type=int,
        help="steps between checkpoints; also one at the end and on Ctrl-C; 0: none at all (default %(default)s)")
    log_interval: int = option(  # a log line, a metrics row and the only host sync every this many steps
        10, group=_LOGS, resume="adjustable", check=positive(), type=int,
        help="steps between log lines and metrics rows (default %(default)s)")
    out_dir: str = option("runs/train", "--out", group=_LOGS, resume="launch", metavar="OUT",
                          help="run folder (default %(default)s)")
    resume: bool = option(False, resume="launch", commands=("train",), action="store_true",
                          help="continue the run in --out from its checkpoint, with its settings (options given "
                               "must agree with them)")
    reschedule: bool = option(  # resume with another `steps`: the learning-rate schedule is recomputed over it
        False, resume="launch", commands=("train",), action="store_true",
        help="with --resume: allow another --steps, recomputing the learning-rate schedule over it (a warmup given "
             "as a share of the steps changes too)")
    overwrite: bool = option(False, group=_LOGS, resume="launch", action="store_true",
                             help="replace what --out already holds")
    device: str = option("auto", group=_OPTIM, resume="adjustable", help="auto, cpu, cuda or cuda:N (default "
                         "%(default)s)", check=lambda v: None if _DEVICE.fullmatch(str(v)) else
                         f"unknown --device {v!r}; use auto, cpu, cuda or cuda:N")
    fsdp: str | None = option(  # under torchrun: FSDP2 with this policy (training.parallel.FSDP_POLICIES), else DDP
        None, group=_OPTIM, resume="adjustable", check=one_of(FSDP_POLICIES, "--fsdp policy|policies", optional=True),
        nargs="?", const=DEFAULT_FSDP, metavar="POLICY", choices=list(FSDP_POLICIES),
        aliases=[("--no-fsdp", {"action": "store_const", "const": None, "help": "under torchrun: DDP"})],
        help=f"under torchrun: FSDP2 instead of DDP, with this policy ({', '.join(FSDP_POLICIES)}; default "
             f"{DEFAULT_FSDP}: weights gathered in bf16; fp32: as stored)")
    activation_checkpointing: bool = option(  # recompute each block's activations in the backward
        False, group=_OPTIM, resume="adjustable", action=argparse.BooleanOptionalAction,
        help="recompute each block's activations in the backward: less memory, about a third more compute "
             "(default: off)")
    step_graphs: bool = option(  # the eager step's forward and backward as CUDA graphs (training/graphs.py)
        True, group=_OPTIM, resume="adjustable", action=argparse.BooleanOptionalAction,
        help="on one GPU without --compile: replay each step's forward and backward as a CUDA graph, so the "
             "host's per-layer work does not bound the step (default: on; not under torchrun or with the step "
             "recipe)")
    progress: bool = option(True, "--no-progress", group=_LOGS, resume="launch", action="store_false",
                            help="plain log lines instead of a progress bar (the default when output is not a "
                                 "terminal)")

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
        """Raise TrainError naming the first bad option: each option's own check, then those
        between options (the recipe after the integers: a bad --steps is named, not the recipe's
        total_steps)."""
        check_fields(self)
        self.recipe_object()
        if self.stop_at is not None and not (isinstance(self.stop_at, int) and 1 <= self.stop_at <= self.steps):
            raise TrainError(f"--stop-at must be between 1 and --steps ({self.steps}), got {self.stop_at}")
        if self.stop_at is not None and self.ckpt_interval == 0:
            raise TrainError("--stop-at pauses a run to resume it later, but --ckpt-interval 0 writes no checkpoint")
        if self.compile_mode != "default" and not self.compile:
            raise TrainError(f"--compile-mode {self.compile_mode} applies to a compiled run: add --compile")
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

#: Set by each invocation, never taken from the checkpoint of a resumed run (declared ``resume="launch"``).
LAUNCH_OPTIONS = frozenset(f.name for f, d in declared(TrainConfig) if d.resume == "launch")
#: How a run executes and reports, not what it trains: a resumed run keeps its checkpoint's value
#: unless one is given (declared ``resume="adjustable"``).
ADJUSTABLE_OPTIONS = frozenset(f.name for f, d in declared(TrainConfig) if d.resume == "adjustable")


def option_name(field_name: str) -> str:
    """The command-line option that sets a TrainConfig field (``batch_size`` -> ``--batch-size``)."""
    return declared_option_name(TrainConfig, field_name)


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


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to the floor (``floor_ratio`` of the peak; nanoGPT's schedule)."""
    peak, floor = cfg.peak_lr, cfg.peak_lr * cfg.floor_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return floor + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (peak - floor)
