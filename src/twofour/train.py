"""The training loop behind ``twofour train`` and ``twofour compare``, in the manner of nanoGPT:
one function, read top to bottom: set up, then for each optimizer step, micro-batches, clip,
step, log, evaluate, checkpoint.

Runs on the CPU, one GPU, or several through ``torchrun`` (DDP by default, FSDP2 with
``fsdp=True``); only rank 0 logs and writes. Checkpoints are atomic and hold everything a
bit-identical resume needs on the CPU (model and recipe state, optimizer, scheduler, data
position and RNG states).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from . import __version__, attach, flip_rate, sparse_layers, sparsify
from .data import TokenData, load_data
from .model import ATTN_PATTERNS, FFN_IN_PATTERNS, FFN_PATTERNS, GPT, PRESETS, GPTConfig
from .optim import STEPAdamW
from .recipes import make_recipe, recipe_options

__all__ = ["TrainConfig", "TrainError", "train", "DEFAULT_LR", "build_model", "lr_at", "load_checkpoint",
           "save_checkpoint", "read_metrics", "plot_run"]

#: Peak learning rate per preset (GPT-3 paper's table for the GPT-2 sizes; higher for tiny).
DEFAULT_LR = {"tiny": 1e-3, "gpt2-124m": 6e-4, "gpt2-350m": 3e-4, "gpt2-774m": 2.5e-4, "gpt2-1.5b": 2e-4}
CKPT = "ckpt.pt"
METRICS = "metrics.csv"
FIELDS = ["step", "tokens", "lr", "train_loss", "val_loss", "flip_rate", "tokens_per_s", "elapsed_s"]


class TrainError(ValueError):
    """A run that can't start or go on: bad options, an existing run, a bad checkpoint."""


@dataclass
class TrainConfig:
    """Everything a run depends on; saved in its checkpoint and ``config.json``."""

    model: str = "tiny"
    recipe: str = "s-ste"
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

    def validate(self) -> None:
        """Raise TrainError naming the first bad option."""
        if self.model not in PRESETS:
            raise TrainError(f"unknown model preset {self.model!r}; valid presets: {', '.join(PRESETS)}")
        try:
            make_recipe(self.recipe, **self.recipe_options)
        except (ValueError, TypeError) as e:
            raise TrainError(str(e)) from None
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


# --------------------------------------------------------------------------------------------
# set-up pieces
# --------------------------------------------------------------------------------------------


def _dist() -> tuple[int, int, int]:
    """(rank, world size, local rank); initializes the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            # each rank on its own GPU before NCCL starts: otherwise every rank's first
            # collective (the barrier below) lands on GPU 0 and a 2-GPU run hangs there
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), world, local_rank


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but no CUDA GPU is available")
    return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev


def _prepare_out_dir(cfg: TrainConfig) -> Path:
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise TrainError(f"output folder {out} exists and is not a folder")
    existing = out.exists() and any((out / n).exists() for n in (CKPT, METRICS))
    if cfg.resume:
        if not (out / CKPT).exists():
            raise TrainError(f"--resume: no checkpoint {out / CKPT} to resume from")
    elif existing and not cfg.overwrite:
        raise TrainError(f"{out} already holds a run; pass --resume to continue it, --overwrite to replace it, "
                         "or choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TrainError(f"cannot write to output folder {out}: {e.strerror or e}") from None
    if cfg.overwrite and not cfg.resume:
        for name in (CKPT, METRICS, "curves.png", "summary.json"):
            (out / name).unlink(missing_ok=True)
    return out


def build_model(cfg: TrainConfig, vocab_size: int) -> GPT:
    """The preset GPT with the recipe applied (FFN linears; attention too if asked)."""
    model = GPT(GPTConfig(**PRESETS[cfg.model], block_size=cfg.seq_len, vocab_size=vocab_size))
    options = dict(cfg.recipe_options)
    if "total_steps" in recipe_options(cfg.recipe) and options.get("total_steps") is None:
        options["total_steps"] = cfg.steps
    include = FFN_PATTERNS + (ATTN_PATTERNS if cfg.sparse_attention else ())
    return sparsify(model, cfg.recipe, include=include, transposed_output=FFN_IN_PATTERNS, **options)


def _rng_state(data_gen: torch.Generator) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "data": data_gen.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], data_gen: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    data_gen.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full_state_dicts(raw, opt, fsdp: bool) -> tuple[dict, dict]:
    """Whole (unsharded) model and optimizer state dicts, on the CPU for FSDP2."""
    if not fsdp:
        return raw.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # noqa: PLC0415

    return get_state_dict(raw, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_state_dicts(raw, opt, model_sd, opt_sd, fsdp: bool) -> None:
    if not fsdp:
        raw.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # noqa: PLC0415

    set_state_dict(raw, opt, model_state_dict=model_sd, optim_state_dict=opt_sd,
                   options=StateDictOptions(full_state_dict=True))


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: a kill at any moment leaves the previous checkpoint intact."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, cfg: TrainConfig) -> dict[str, Any]:
    """Read a checkpoint and check it belongs to this model and recipe."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise TrainError(f"checkpoint {path} is unreadable or corrupt ({type(e).__name__}); "
                         "start again with --overwrite or another --out") from None
    if not isinstance(ckpt, dict) or "identity" not in ckpt:
        raise TrainError(f"{path} is not a twofour training checkpoint")
    want, have = cfg.identity(), ckpt["identity"]
    diff = [f"{k}: checkpoint {have.get(k)!r}, asked {want[k]!r}" for k in want if have.get(k) != want[k]]
    if diff:
        raise TrainError(f"checkpoint {path} is from another run ({'; '.join(diff)})")
    return ckpt


class _Metrics:
    """metrics.csv (appended across resumes) and TensorBoard when it is installed."""

    def __init__(self, out: Path, resume_step: int | None):
        self.path = out / METRICS
        rows = []
        if resume_step is not None and self.path.exists():  # drop rows logged after the checkpoint
            with self.path.open() as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) <= resume_step]
        with self.path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, FIELDS)
            w.writeheader()
            w.writerows(rows)
        self.tb = None
        with contextlib.suppress(Exception):
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

            self.tb = SummaryWriter(str(out / "tb"))

    def log(self, row: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as fh:
            csv.DictWriter(fh, FIELDS).writerow({k: ("" if row.get(k) is None else row[k]) for k in FIELDS})
        if self.tb is not None:
            for k in ("lr", "train_loss", "val_loss", "flip_rate", "tokens_per_s"):
                if row.get(k) is not None:
                    self.tb.add_scalar(k, row[k], row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Columns of a metrics.csv as (step, value) lists, skipping blanks."""
    cols: dict[str, list[tuple[int, float]]] = {k: [] for k in FIELDS[1:]}
    with path.open() as fh:
        for r in csv.DictReader(fh):
            for k in cols:
                if r.get(k):
                    cols[k].append((int(r["step"]), float(r[k])))
    return cols


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt


def plot_run(out: Path, title: str) -> Path | None:
    """curves.png: train/val loss and flip rate against step (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    m = read_metrics(out / METRICS)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        if m[key]:
            ax1.plot(*zip(*m[key]), style, label=key.replace("_", " "), markersize=3)
    ax1.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax1.legend()
    if m["flip_rate"]:
        ax2.plot(*zip(*m["flip_rate"]))
        if any(v > 0 for _, v in m["flip_rate"]):
            ax2.set_yscale("log")
    ax2.set(xlabel="step", ylabel="flip rate", title="mask flip rate per step")
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, data: TokenData, cfg: TrainConfig, device, autocast) -> float:
    """Mean validation loss over ``eval_iters`` fixed batches (the same ones every time)."""
    model.eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    total = torch.zeros((), device=device)
    for _ in range(cfg.eval_iters):
        x, y = data.batch("val", cfg.batch_size, cfg.seq_len, gen, device)
        with autocast:
            total += model(x, y)[1].float()
    model.train()
    return total.item() / cfg.eval_iters  # one host sync


def train(cfg: TrainConfig, data: TokenData | None = None) -> dict[str, Any]:
    """Train one run as ``cfg`` says; returns the summary it also writes to ``summary.json``."""
    cfg.validate()
    rank, world, local_rank = _dist()
    device = _device(cfg, local_rank)
    if data is None:
        data = load_data(cfg.data, cfg.vocab_size)
    data.check(cfg.seq_len)
    out = Path(cfg.out_dir)
    if rank == 0:
        out = _prepare_out_dir(cfg)
    if world > 1:
        dist.barrier()
    ckpt = load_checkpoint(out / CKPT, cfg) if cfg.resume else None

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data.vocab_size).to(device)
    raw = model
    if world > 1 and cfg.fsdp:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.recipe == "step":
        opt = STEPAdamW(groups, total_steps=cfg.steps, lr=cfg.peak_lr, betas=cfg.betas)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=cfg.betas, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(cfg, s) / cfg.peak_lr)
    data_gen = torch.Generator().manual_seed(cfg.seed + 7919 * rank)
    start = 0
    if ckpt is not None:
        _load_state_dicts(raw, opt, ckpt["model"], ckpt["optimizer"], world > 1 and cfg.fsdp)
        sched.load_state_dict(ckpt["scheduler"])
        start = ckpt["step"]
        _set_rng_state(ckpt["rng"][rank], data_gen)
    attach(raw, opt)  # masks, refreshes and phases advance once per optimizer step
    if world > 1 and not cfg.fsdp:
        ids = [local_rank] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    fwd = torch.compile(model) if cfg.compile else model
    use_bf16 = cfg.bf16 and device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    metrics = _Metrics(out, start if ckpt else None) if rank == 0 else None
    if rank == 0:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * world
    stop = cfg.stop_at or cfg.steps
    bar = tqdm(range(start, stop), initial=start, total=stop, desc=f"{cfg.recipe} {cfg.model}",
               disable=rank != 0 or not cfg.progress, dynamic_ncols=True)
    t_start, t_last, tok_s = time.perf_counter(), time.perf_counter(), 0.0
    loss_acc = torch.zeros((), device=device)
    for step in bar:
        for micro in range(cfg.grad_accum):
            x, y = data.batch("train", cfg.batch_size, cfg.seq_len, data_gen, device)
            sync = micro == cfg.grad_accum - 1 or not isinstance(model, torch.nn.parallel.DistributedDataParallel)
            with (contextlib.nullcontext() if sync else model.no_sync()), autocast:
                loss = fwd(x, y)[1] / cfg.grad_accum
            loss.backward()
            loss_acc += loss.detach()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = sched.get_last_lr()[0]
        opt.step()  # the attach() hook advances the sparse layers here
        sched.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(loss_acc)
            loss_acc /= world
        train_loss = loss_acc.item()
        loss_acc.zero_()
        now = time.perf_counter()
        tok_s = tokens_per_step / max(now - t_last, 1e-9)
        t_last = now
        done = step + 1
        val_loss = None
        if done % cfg.eval_interval == 0 or done == stop:
            val_loss = evaluate(fwd, data, cfg, device, autocast)
            t_last = time.perf_counter()  # keep evaluation out of the throughput
        fr = flip_rate(raw)["total"]
        if rank == 0:
            metrics.log({"step": done, "tokens": done * tokens_per_step, "lr": lr, "train_loss": train_loss,
                         "val_loss": val_loss, "flip_rate": fr, "tokens_per_s": tok_s,
                         "elapsed_s": now - t_start})
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_s:,.0f}", flip=f"{fr:.1e}", refresh=False)
        if done % cfg.ckpt_interval == 0 or done == stop:
            _checkpoint(out, cfg, raw, opt, sched, done, data_gen, rank, world)
    bar.close()
    if metrics is not None:
        metrics.close()
    summary = _summary(out, cfg) if rank == 0 else {}
    if world > 1:
        dist.barrier()
    return summary


def _check_replicas(raw: torch.nn.Module, world: int) -> None:
    """Raise if any rank's masks, scales or step counters differ from rank 0's."""
    sums = []
    for _, layer in sparse_layers(raw):
        if layer.mask is None:
            continue
        m = layer.mask.flatten().long()
        w = torch.arange(m.numel(), device=m.device) % 9973
        sums += [m.sum(), (m * w).sum(), layer.step.long()]
        if layer.beta is not None:
            sums.append((layer.beta.double() * 1e9).round().long())
    if not sums:
        return
    mine = torch.stack(sums)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    bad = [r for r, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
    if bad:
        raise TrainError(f"recipe state of rank(s) {bad} differs from rank 0's: masks diverged across replicas")


def _checkpoint(out, cfg, raw, opt, sched, step, data_gen, rank, world) -> None:
    if world > 1:
        _check_replicas(raw, world)
    model_sd, opt_sd = _full_state_dicts(raw, opt, world > 1 and cfg.fsdp)
    rng = [_rng_state(data_gen)]
    if world > 1:  # every rank's data position and RNG states, kept by rank 0
        rng = [None] * world
        dist.all_gather_object(rng, _rng_state(data_gen))
    if rank == 0:
        save_checkpoint(out / CKPT, {"identity": cfg.identity(), "config": dataclasses.asdict(cfg), "step": step,
                                     "model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict(),
                                     "rng": rng, "twofour_version": __version__})


def _summary(out: Path, cfg: TrainConfig) -> dict[str, Any]:
    m = read_metrics(out / METRICS)
    tok = [v for _, v in m["tokens_per_s"]]
    flips = [v for _, v in m["flip_rate"]]
    summary = {
        "recipe": cfg.recipe, "model": cfg.model, "seed": cfg.seed, "steps": m["train_loss"][-1][0],
        "tokens": int(m["tokens"][-1][1]),
        "final_train_loss": m["train_loss"][-1][1],
        "final_val_loss": m["val_loss"][-1][1] if m["val_loss"] else None,
        # median over steps after the first few (compilation and warm-up excluded)
        "tokens_per_s": float(np.median(tok[min(5, len(tok) - 1):])),
        "mean_flip_rate": float(np.mean(flips)),
        "final_flip_rate": flips[-1],
        "wall_s": m["elapsed_s"][-1][1],
        "out_dir": str(out),
    }
    plot = plot_run(out, f"{cfg.model}, {cfg.recipe}")
    summary["plot"] = str(plot) if plot else None
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


