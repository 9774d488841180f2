"""The training loop behind ``twofour train`` and ``twofour compare``, in the manner of nanoGPT:
set up once (:mod:`twofour.training.setup`), then for each optimizer step: micro-batches,
clip, step, and at a boundary log, evaluate, checkpoint.

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
:mod:`twofour.training.console`, the processes' roles in :mod:`twofour.training.parallel`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..errors import DivergedError
from .checkpoint import CKPT, checkpoint_path
from .config import TrainConfig
from .console import Interrupted, Progress, StopRequest
from .data import TokenData
from .lock import RunLock
from .parallel import Parallel, everywhere
from .runs import MetricsLog, write_summary
from .setup import Run, build_model, flip_counters, setup, slow_path_warning

__all__ = ["train", "build_model", "evaluate", "val_windows", "slow_path_warning"]

log = logging.getLogger("twofour")


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


def train(cfg: TrainConfig, data: TokenData | None = None) -> dict[str, Any]:
    """Train one run as ``cfg`` says; returns the summary it also writes to ``summary.json``.
    Holds the run folder's lock throughout (rank 0 under torchrun): TrainError if another run
    holds it."""
    cfg.validate()
    par = Parallel.start(cfg.fsdp)
    with RunLock(cfg.out_dir) if par.main else contextlib.nullcontext():
        return _train(setup(cfg, data, par))


def _train(run: Run) -> dict[str, Any]:
    """The loop: one optimizer step per iteration, a boundary (log, evaluation, checkpoint) every
    few; returns the summary."""
    cfg, par = run.cfg, run.par
    tally = Tally(run)
    progress = Progress(par.main, cfg.progress, f"{run.recipe.name} {cfg.model}", run.start, run.stop,
                        header=run.header)
    stop_request = StopRequest(par.main)
    try:
        with stop_request:
            for step in range(run.start, run.stop):
                loss, norm = run.step(run.batches())  # micro-batches' passes, gradient average, clip
                done = step + 1
                if tally.apply(loss, norm, done):  # False: a non-finite step skipped (--skip-nonfinite)
                    run.opt.step()  # twofour.attach's hook advances the sparse layers here
                    tally.add(loss)
                run.end_step()
                progress.update()
                evaluating = done % cfg.eval_interval == 0 or done == run.stop
                saving = cfg.ckpt_interval > 0 and (done % cfg.ckpt_interval == 0 or done == run.stop)
                boundary = done % cfg.log_interval == 0 or evaluating or saving
                stopping = stop_request.agreed(boundary, par.world, run.device) and done < run.stop
                if boundary or stopping:  # else no host sync: the GPU runs ahead of the Python loop
                    progress.log(tally.row(done, evaluating))
                    if saving or (stopping and cfg.ckpt_interval > 0):
                        tally.save(done)
                    if stopping:
                        raise Interrupted(done, tally.written)
    finally:
        progress.close()
        tally.close()
    summary = write_summary(run.out, cfg, {"step_graphs": run.step.report()}) if par.main else {}
    par.barrier()
    return summary


class Tally:
    """What the loop keeps between boundaries, on the device so that no step waits for the GPU:
    the summed train loss and flips, the first non-finite step, the skipped steps and the
    throughput window; and the metrics log and the last checkpoint written."""

    def __init__(self, run: Run) -> None:
        self.run, device = run, run.device
        self.loss = torch.zeros((), device=device)
        # the first step whose loss or gradient norm is not finite (0: none yet), read at boundaries,
        # so that a checkpoint is never written from a diverged state
        self.first_bad = torch.zeros((), device=device, dtype=torch.long)
        self.counters = flip_counters(run.raw)
        self.flips = torch.zeros((), device=device, dtype=torch.long)
        self.mask_size = max(1, sum(layer.weight.numel() for layer in self.counters))
        self.skipped = self.window_skipped = self.window_steps = 0
        self.saved = run.start if run.resumed else None
        self.written: Path | None = None
        self.metrics = MetricsLog(run.out, run.start if run.resumed else None) if run.par.main else None
        # wall time goes on across a resume; throughput is timed over windows of logged steps
        self.t_start = time.perf_counter() - run.resumed_elapsed
        self.t_window = time.perf_counter()

    def apply(self, loss: torch.Tensor, norm: torch.Tensor, done: int) -> bool:
        """Whether step ``done``'s gradients go to the optimizer: False where the loss or norm is
        not finite on some rank and ``--skip-nonfinite`` allows skipping it (one host sync a step,
        only then); DivergedError past that many."""
        run, cfg = self.run, self.run.cfg
        ok = torch.isfinite(loss + norm)  # NaN or inf in either
        self.window_steps, self.lr = self.window_steps + 1, run.sched.get_last_lr()[0]  # the rate this step took
        if cfg.skip_nonfinite and not everywhere(ok, run.par.world):
            self.skipped, self.window_skipped = self.skipped + 1, self.window_skipped + 1
            if self.skipped > cfg.skip_nonfinite:
                raise DivergedError(_diverged(f"the loss or gradient norm is not finite at step {done}, after "
                                              f"{cfg.skip_nonfinite} skipped (--skip-nonfinite)", run.out, self.saved),
                                    done)
            if run.par.main:
                log.warning("twofour: step %d: the loss or gradient norm is not finite; skipped (%d of at most %d)",
                            done, self.skipped, cfg.skip_nonfinite)
            return False
        self.first_bad = torch.where(ok | (self.first_bad > 0), self.first_bad, done)
        return True

    def add(self, loss: torch.Tensor) -> None:
        """An applied step's loss and its layers' mask flips, summed on the device."""
        self.loss += loss
        if self.counters:
            self.flips += torch.stack([layer.flips for layer in self.counters]).sum()

    def row(self, done: int, evaluating: bool) -> dict[str, Any]:
        """The metrics row of the window ending at step ``done`` (logged by rank 0), evaluating
        when asked; DivergedError if a step in it was not finite. Starts the next window."""
        run, par = self.run, self.run.par
        par.max_(self.first_bad)
        par.mean_(self.loss)
        if self.first_bad.item():
            bad = int(self.first_bad.item())
            raise DivergedError(_diverged(f"the loss or gradient norm is not finite at step {bad}", run.out,
                                          self.saved), bad)
        applied = self.window_steps - self.window_skipped
        now = time.perf_counter()
        row = {"step": done, "tokens": done * run.tokens_per_step, "lr": self.lr,
               "train_loss": self.loss.item() / applied if applied else None,
               "val_loss": evaluate(run.fwd, run.data, run.cfg, run.device, run.autocast) if evaluating else None,
               "flip_rate": self.flips.item() / max(applied, 1) / self.mask_size,
               "tokens_per_s": run.tokens_per_step * self.window_steps / max(now - self.t_window, 1e-9),
               "elapsed_s": now - self.t_start}
        if self.metrics is not None:
            self.metrics.log(row)
        self.loss.zero_()
        self.flips.zero_()
        self.window_steps = self.window_skipped = 0
        self.t_window = time.perf_counter()  # evaluation and checkpoints stay out of the window's time
        return row

    def save(self, done: int) -> None:
        """A checkpoint of step ``done``, after checking every weight is finite."""
        run = self.run
        if not _finite_weights(run.raw, run.par.world, run.device):
            raise DivergedError(_diverged(f"the weights are not finite after step {done}", run.out, self.saved), done)
        self.written = run.checkpointer.save(done, time.perf_counter() - self.t_start)
        self.saved = done
        self.t_window = time.perf_counter()

    def close(self) -> None:
        """Close the metrics log."""
        if self.metrics is not None:
            self.metrics.close()


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
