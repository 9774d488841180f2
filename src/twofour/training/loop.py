"""The training loop behind ``twofour train`` and ``twofour compare``, in the manner of nanoGPT:
one function, read top to bottom: set up, then for each optimizer step, micro-batches, clip,
step, log, evaluate, checkpoint.

Runs on the CPU, one GPU, or several through ``torchrun`` (DDP by default, FSDP2 with
``fsdp=True``); only rank 0 logs and writes, except that every rank of an FSDP2 run writes its
shards of the checkpoint (:mod:`twofour.training.checkpoint`). Checkpoints are atomic and hold
everything a bit-identical resume needs (model and recipe state, optimizer, scheduler, data
position and RNG states); a run resumes on another world size too, not bit-exact. Between log
lines (every ``log_interval`` steps) the loop never waits for the GPU. Ctrl-C or SIGTERM
finishes the current step and checkpoints it before stopping (unless ``ckpt_interval`` is 0:
no checkpoints at all). A step whose loss or gradient
norm is not finite stops the run at the next log line, before any checkpoint is written from it
(with ``skip_nonfinite``, up to that many such steps are skipped instead). The run folder is
locked meanwhile (:class:`twofour.training.lock.RunLock`).
The options live in :mod:`twofour.training.config`, the run folder in
:mod:`twofour.training.runs`, the terminal output and signal handling in
:mod:`twofour.training.console`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import dispatch
from ..errors import TrainError
from ..kernels import ops
from ..models.presets import build_model as _build_model
from ..sparse.convert import attach, sparse_layers
from ..sparse.optim import STEPAdamW
from ..sparse.recipes import Recipe
from .checkpoint import check_resumable, resume, save
from .config import TrainConfig, lr_at, resolve_device
from .console import Interrupted, Progress, StopRequest
from .data import TokenData, load_data
from .graphs import StepGraphs
from .lock import RunLock
from .parallel import checkpoint_blocks, everywhere, fsdp_policy, grad_norm, shard
from .runs import CKPT, MetricsLog, checkpoint_path, load_checkpoint, prepare_run_dir, write_summary

__all__ = ["train", "build_model", "evaluate", "val_windows"]

log = logging.getLogger("twofour")


def build_model(cfg: TrainConfig, recipe: Recipe, vocab_size: int) -> torch.nn.Module:
    """``cfg``'s preset model with ``recipe`` applied (:func:`twofour.models.build_model`)."""
    return _build_model(cfg.model, recipe, vocab_size=vocab_size, block_size=cfg.seq_len,
                        sparse_attention=cfg.sparse_attention, n_layer=cfg.n_layer)


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


def val_windows(data: TokenData, cfg: TrainConfig) -> np.ndarray:
    """Start offsets of the validation windows: ``eval_iters * batch_size`` windows spaced evenly
    over the whole val split. They depend on the data and the batch shape only, never on the
    seed, so runs of different seeds (and recipes) are scored on the same text."""
    last = len(data.val) - cfg.seq_len - 1
    return np.linspace(0, last, cfg.eval_iters * cfg.batch_size).round().astype(np.int64)


@torch.no_grad()
def evaluate(model, data: TokenData, cfg: TrainConfig, device, autocast) -> float:
    """Mean validation loss over the fixed windows of :func:`val_windows` (the same every time)."""
    model.eval()
    starts = val_windows(data, cfg).reshape(cfg.eval_iters, cfg.batch_size)
    total = torch.zeros((), device=device)
    for batch in starts:
        rows = np.stack([np.asarray(data.val[s : s + cfg.seq_len + 1], dtype=np.int64) for s in batch])
        t = torch.from_numpy(rows).to(device)
        if cfg.cuda_graphs:  # each call a new step for the CUDA graphs
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            total += model(t[:, :-1], t[:, 1:])[1].float()
    model.train()
    return total.item() / cfg.eval_iters  # one host sync


def slow_path_warning(device: torch.device, recipe: Recipe) -> str | None:
    """What to tell a user whose sparse run on a GPU can't take the fast path (cuSPARSELt
    bindings or Triton missing) and so runs the reference math, slower than dense; else None.
    Nothing when the fast path was turned off on purpose (``TWOFOUR_FAST=0``)."""
    if device.type != "cuda" or not recipe.sparse or not dispatch.fast or ops.fast_available():
        return None
    return ("twofour: the 2:4 fast path is unavailable here (it needs an sm80+ GPU, Triton and nvmath-python's "
            "cuSPARSELt bindings: pip install 'twofour[gpu]'), so the sparse layers run the plain-torch "
            "reference math, slower than dense")


def train(cfg: TrainConfig, data: TokenData | None = None) -> dict[str, Any]:
    """Train one run as ``cfg`` says; returns the summary it also writes to ``summary.json``.
    Holds the run folder's lock throughout (rank 0 under torchrun): TrainError if another run
    holds it."""
    cfg.validate()
    rank, world, local_rank = _dist()
    with RunLock(cfg.out_dir) if rank == 0 else contextlib.nullcontext():
        return _train(cfg, data, rank, world, local_rank)


def _train(cfg: TrainConfig, data: TokenData | None, rank: int, world: int, local_rank: int) -> dict[str, Any]:
    """:func:`train`'s work, in the locked run folder."""
    # ---- set-up: data, run folder, model, optimizer, schedule, resume ----
    recipe = cfg.recipe_object()
    if cfg.cuda_graphs and (world > 1 or cfg.micro_batches(world) > 1):
        raise TrainError(f"--compile-mode {cfg.compile_mode} (CUDA graphs) runs in one process with one micro-batch "
                         f"a step; this run has {world} process(es) and {cfg.micro_batches(world)} micro-batches: "
                         "use --grad-accum 1 and no torchrun, or another --compile-mode")
    device = resolve_device(cfg.device, local_rank)
    slow = slow_path_warning(device, recipe)
    if slow and rank == 0:
        warnings.warn(slow, stacklevel=3)  # at train()'s caller
    if data is None:
        data = load_data(cfg.data, cfg.vocab_size)
    data.check(cfg.seq_len)
    out = Path(cfg.out_dir)
    if rank == 0:
        out = prepare_run_dir(cfg)
    if world > 1:
        dist.barrier()
    ckpt = load_checkpoint(out, cfg) if cfg.resume else None  # ckpt.pt, or the sharded ckpt/'s meta.pt
    if ckpt is not None:
        check_resumable(ckpt, cfg, out)

    torch.manual_seed(cfg.seed)
    fsdp = world > 1 and cfg.fsdp is not None
    # an FSDP2 run's model is built on its GPU (a large model's init on the CPU takes minutes)
    with torch.device(device) if fsdp else contextlib.nullcontext():
        model = build_model(cfg, recipe, data.vocab_size).to(device)
    raw = model  # the unwrapped model: state dicts, recipe state, flip rates
    if cfg.activation_checkpointing:
        checkpoint_blocks(model)
    if fsdp:
        shard(model, fsdp_policy(cfg.fsdp))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if recipe.starts_dense:  # STEP: the optimizer decides when the masks switch on
        opt = STEPAdamW(groups, total_steps=cfg.steps, lr=cfg.peak_lr, betas=cfg.betas)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=cfg.betas, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(cfg, s) / cfg.peak_lr)
    data_gen = torch.Generator().manual_seed(cfg.seed + 7919 * rank)
    start = resume(ckpt, cfg, raw, opt, sched, data_gen, rank, world) if ckpt is not None else 0
    attach(raw, opt)  # masks, refreshes and phases advance once per optimizer step
    ddp = world > 1 and not fsdp
    if ddp:  # the recipes' buffers (masks, scales) follow from the weights, equal on every rank: not broadcast
        ids = [local_rank] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    fwd = torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    use_bf16 = cfg.bf16 and device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    accum = cfg.micro_batches(world)

    def micro_step(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        """One micro-batch's forward and backward; DDP reduces the gradients on the last one only."""
        if cfg.cuda_graphs:  # a new step for the CUDA graphs: the previous call's outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        with (contextlib.nullcontext() if last or not ddp else model.no_sync()), autocast:
            loss = fwd(x, y)[1] / accum
        loss.backward()
        return loss.detach()

    def clip() -> torch.Tensor:  # the gradients clipped, their norm returned
        return grad_norm(model, cfg.grad_clip)
    graphs = None  # under DDP the graph holds the local passes, the gradients' average runs after it
    if cfg.step_graphs and device.type == "cuda" and not fsdp and not cfg.compile and not recipe.starts_dense:
        graphs = StepGraphs(raw, micro_step, clip, world=world)

    metrics = MetricsLog(out, start if ckpt else None) if rank == 0 else None
    if rank == 0:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    tokens_per_step = cfg.batch_size * cfg.seq_len * accum * world
    stop = cfg.stop_at or cfg.steps
    progress = Progress(rank == 0, cfg.progress, f"{recipe.name} {cfg.model}", start, stop)
    # wall time goes on across a resume; throughput is timed over windows of logged steps
    t_start = time.perf_counter() - (ckpt.get("elapsed_s", 0.0) if ckpt else 0.0)
    t_window, window_steps = time.perf_counter(), 0
    loss_acc = torch.zeros((), device=device)
    # the first step whose loss or gradient norm is not finite, kept on the device (0: none yet)
    # and read at log lines, so a checkpoint is never written from a diverged state
    first_bad = torch.zeros((), device=device, dtype=torch.long)
    skipped, window_skipped, saved, written = 0, 0, (start if ckpt else None), None
    # each sparse layer's flip counter (a buffer updated in place by advance()), gathered once
    counters = [layer for _, layer in sparse_layers(raw) if layer.recipe.sparse]
    flips = torch.zeros((), device=device, dtype=torch.long)
    mask_size = max(1, sum(layer.weight.numel() for layer in counters))
    stop_request = StopRequest(rank == 0)

    # ---- the loop: one optimizer step per iteration ----
    try:
        with stop_request:
            for step in range(start, stop):
                # micro-batches (gradients add up) and clip: replayed as a CUDA graph where one is captured
                batches = [data.batch("train", cfg.batch_size, cfg.seq_len, data_gen, device) for _ in range(accum)]
                replayed = graphs.step(batches) if graphs is not None else None
                if replayed is not None:
                    step_loss, norm = replayed
                else:
                    if graphs is not None:
                        graphs.zero_grad()  # in place: a captured graph keeps the gradients' addresses
                    step_loss = sum(micro_step(x, y, i == accum - 1) for i, (x, y) in enumerate(batches))
                    norm = clip()
                # step (the attach() hook advances the sparse layers here), schedule
                ok = torch.isfinite(step_loss + norm)  # NaN or inf in either
                lr = sched.get_last_lr()[0]
                done, window_steps = step + 1, window_steps + 1
                if cfg.skip_nonfinite and not everywhere(ok, world):  # one host sync a step, only when allowed
                    skipped, window_skipped = skipped + 1, window_skipped + 1
                    if skipped > cfg.skip_nonfinite:
                        raise TrainError(_diverged(f"the loss or gradient norm is not finite at step {done}, after "
                                                   f"{cfg.skip_nonfinite} skipped (--skip-nonfinite)", out, saved))
                    if rank == 0:
                        log.warning("twofour: step %d: the loss or gradient norm is not finite; skipped (%d of at "
                                    "most %d)", done, skipped, cfg.skip_nonfinite)
                else:
                    first_bad = torch.where(ok | (first_bad > 0), first_bad, done)
                    opt.step()
                    loss_acc += step_loss
                    if counters:  # summed on the device for the window's mean flip rate: no host sync
                        flips += torch.stack([layer.flips for layer in counters]).sum()
                sched.step()
                if graphs is None:
                    opt.zero_grad(set_to_none=True)
                progress.update()
                evaluating = done % cfg.eval_interval == 0 or done == stop
                saving = cfg.ckpt_interval > 0 and (done % cfg.ckpt_interval == 0 or done == stop)
                boundary = done % cfg.log_interval == 0 or evaluating or saving
                stopping = stop_request.agreed(boundary, world, device) and done < stop  # the last step ends
                if not (boundary or stopping):
                    continue  # no host sync between log lines: the GPU runs ahead of the Python loop
                if world > 1:
                    dist.all_reduce(first_bad, op=dist.ReduceOp.MAX)
                    dist.all_reduce(loss_acc)
                    loss_acc /= world
                if first_bad.item():
                    raise TrainError(_diverged(f"the loss or gradient norm is not finite at step "
                                               f"{int(first_bad.item())}", out, saved))
                # log: the mean train loss and the throughput since the last log line (one host sync)
                applied = window_steps - window_skipped
                train_loss = loss_acc.item() / applied if applied else None
                loss_acc.zero_()
                now = time.perf_counter()
                row = {"step": done, "tokens": done * tokens_per_step, "lr": lr, "train_loss": train_loss,
                       "val_loss": evaluate(fwd, data, cfg, device, autocast) if evaluating else None,
                       "flip_rate": flips.item() / max(applied, 1) / mask_size,
                       "tokens_per_s": tokens_per_step * window_steps / max(now - t_window, 1e-9),
                       "elapsed_s": now - t_start}
                if rank == 0:
                    metrics.log(row)
                    progress.log(row)
                if saving or (stopping and cfg.ckpt_interval > 0):
                    if not _finite_weights(raw, world, device):
                        raise TrainError(_diverged(f"the weights are not finite after step {done}", out, saved))
                    written = save(out, cfg, raw, opt, sched, done, data_gen, rank, world,
                                   time.perf_counter() - t_start)
                    saved = done
                if stopping:
                    raise Interrupted(done, written)
                flips.zero_()
                # evaluation and checkpoints stay out of the window's time
                t_window, window_steps, window_skipped = time.perf_counter(), 0, 0
    finally:
        progress.close()
        if metrics is not None:
            metrics.close()

    # ---- wrap up ----
    summary = write_summary(out, cfg) if rank == 0 else {}
    if world > 1:
        dist.barrier()
    return summary


def _finite_weights(raw: torch.nn.Module, world: int, device: torch.device) -> bool:
    """Whether every parameter, on every rank, is finite: checked before each checkpoint."""
    flags = [torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all() for p in raw.parameters()]
    return everywhere(torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device), world)


def _diverged(what: str, out: Path, saved: int | None) -> str:
    """The one line that ends a diverged run (``what``: which values are not finite, at which
    step), naming the last good checkpoint (step ``saved``) and the ways on."""
    if saved is None:
        return (f"training diverged: {what}; no checkpoint was written: start again with a lower --lr, or with "
                "--skip-nonfinite N to skip up to N such steps")
    return (f"training diverged: {what}; the last good checkpoint (step {saved}) is kept in "
            f"{checkpoint_path(out) or out / CKPT}: "
            f"`twofour train --out {out} --resume --skip-nonfinite N` goes on from it, skipping up to N such steps, "
            "or start again with a lower --lr")
