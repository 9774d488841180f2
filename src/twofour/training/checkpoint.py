"""Saving and resuming a run's checkpoint from the training loop, in the form the run needs:
``ckpt.pt`` (one file, written by rank 0) for one process and DDP, the sharded ``ckpt/``
(:mod:`twofour.training.sharded`, written by every rank, nothing gathered) for FSDP2.

Either form resumes in a run of any world size. On the world size that saved it, the resume is
bit-exact: every rank gets back its own RNG states and data position. On another world size the
model and optimizer are resharded (DCP) or sharded anew; the data streams of the saving ranks have
no counterpart, so every rank's data stream starts from a seed of ``(seed, step, rank)`` and the
other RNGs take rank 0's saved states (equal on every rank of a run); one log line says so.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import TrainError
from ..sparse.convert import sparse_layers
from ..version import __version__
from .config import TrainConfig
from .runs import CKPT, load_state_dicts, read_summary, rng_state, save_checkpoint, set_rng_state
from .sharded import SHARDED, load_sharded, save_sharded

__all__ = ["save", "resume", "check_resumable", "check_replicas", "data_seed"]

log = logging.getLogger("twofour")

#: The optimizer state dict's own entries, which DCP's state dicts carry; any other (STEP's phase)
#: travels in the sharded checkpoint's meta.pt.
_OPT_ENTRIES = ("state", "param_groups")


def data_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s data stream when a run resumes at ``step`` on another world size."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)


def check_resumable(ckpt: dict[str, Any], cfg: TrainConfig, out: Path) -> None:
    """Raise TrainError if the checkpoint can't go on as ``cfg`` asks."""
    step = ckpt["step"]
    if cfg.stop_at is not None and step >= cfg.stop_at:
        raise TrainError(f"--stop-at {cfg.stop_at} is not after the checkpoint's step {step}")
    if step > cfg.steps or (step == cfg.steps and read_summary(out) is not None):
        raise TrainError(f"the run in {out} has done {step} of {cfg.steps} steps; to train it further, "
                         f"resume with --steps larger than {step} and --reschedule")


def check_replicas(raw: torch.nn.Module, world: int) -> None:
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


def _per_rank(value: Any, world: int) -> list[Any]:
    """Every rank's ``value`` (small plain data), in rank order, on every rank."""
    if world == 1:
        return [value]
    values = [None] * world
    dist.all_gather_object(values, value)
    return values


def save(out: Path, cfg: TrainConfig, raw: torch.nn.Module, opt: torch.optim.Optimizer, sched, step: int,
         data_gen: torch.Generator, rank: int, world: int, elapsed_s: float) -> Path:
    """Checkpoint the run after ``step``; returns where it went. Every rank takes part (replica
    check, RNG states; under FSDP2 every rank writes its shards, else rank 0 writes ``ckpt.pt``).
    The form not written is removed once the new checkpoint is complete."""
    if world > 1:
        check_replicas(raw, world)
    meta = {"config": cfg.to_dict(), "step": step, "vocab_size": raw.vocab_size, "scheduler": sched.state_dict(),
            "rng": _per_rank(rng_state(data_gen), world), "elapsed_s": elapsed_s, "twofour_version": __version__}
    if world > 1 and cfg.fsdp is not None:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

        model_sd, opt_sd = get_state_dict(raw, opt)  # sharded: each rank's own shards, replicated buffers once
        extra = {k: v for k, v in opt.state_dict().items() if k not in _OPT_ENTRIES}
        meta["optimizer_extra"] = _per_rank(extra, world)
        folder = save_sharded(out, step, {"model": model_sd, "optimizer": opt_sd}, meta, rank, world)
        if rank == 0:
            (out / CKPT).unlink(missing_ok=True)  # an older one-file checkpoint (a resume from it)
        return folder
    model_sd, opt_sd = raw.state_dict(), opt.state_dict()
    if rank == 0:
        save_checkpoint(out / CKPT, {**meta, "model": model_sd, "optimizer": opt_sd})
        shutil.rmtree(out / SHARDED, ignore_errors=True)  # an older sharded checkpoint (a resume from it)
    return out / CKPT


def _keyed(opt_sd: dict[str, Any], raw: torch.nn.Module, opt: torch.optim.Optimizer, by_name: bool) -> dict:
    """``opt_sd`` (a ``ckpt.pt``'s optimizer state) with its parameters named by their model
    names (``by_name``, as DCP's state dicts under FSDP2 have them) or numbered in the optimizer's
    order (as ``Optimizer.state_dict`` has them); the same dict when they are already so."""
    # the names state dicts use: activation checkpointing's wrapper left out, as its hooks leave it out
    names = {id(p): n.replace("_checkpoint_wrapped_module.", "") for n, p in raw.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    key = dict(enumerate(order)) if by_name else {n: i for i, n in enumerate(order)}
    if not all(p in key for g in opt_sd["param_groups"] for p in g["params"]):
        return opt_sd
    return {**opt_sd, "state": {key[k]: v for k, v in opt_sd["state"].items()},
            "param_groups": [{**g, "params": [key[p] for p in g["params"]]} for g in opt_sd["param_groups"]]}


def resume(ckpt: dict[str, Any], cfg: TrainConfig, raw: torch.nn.Module, opt: torch.optim.Optimizer, sched,
           data_gen: torch.Generator, rank: int, world: int) -> int:
    """Load ``ckpt`` (:func:`twofour.training.runs.read_checkpoint`'s dict) into the run's model,
    optimizer, schedule and RNGs, before :func:`twofour.sparse.attach`; returns the step it
    resumes at. Every rank calls it."""
    fsdp = world > 1 and cfg.fsdp is not None
    saved = len(ckpt["rng"])
    if "sharded" in ckpt:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

        model_sd, opt_sd = get_state_dict(raw, opt)  # the shapes to fill: sharded under FSDP2, whole otherwise
        load_sharded(Path(ckpt["sharded"]), {"model": model_sd, "optimizer": opt_sd})
        set_state_dict(raw, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
        extra = ckpt.get("optimizer_extra", [{}])[rank if saved == world else 0]
    else:  # keyed by parameter names under FSDP2, by numbers otherwise: as this run needs it
        load_state_dicts(raw, opt, ckpt["model"], _keyed(ckpt["optimizer"], raw, opt, fsdp), fsdp)
        # loaded whole above, except where DCP's set_state_dict (FSDP2) leaves them out
        extra = {k: v for k, v in ckpt["optimizer"].items() if k not in _OPT_ENTRIES} if fsdp else {}
    if extra:  # DCP's optimizer state dicts leave them out
        opt.load_state_dict({**opt.state_dict(), **extra})
    start = ckpt["step"]
    sched.load_state_dict(ckpt["scheduler"])
    sched.last_epoch = start - 1
    sched.step()  # this step's lr from cfg's schedule (a new one under --reschedule)
    if saved == world:
        set_rng_state(ckpt["rng"][rank], data_gen)
        return start
    set_rng_state(ckpt["rng"][0], data_gen)
    data_gen.manual_seed(data_seed(cfg.seed, start, rank))
    if rank == 0:
        log.warning("twofour: resuming step %d, saved by %d process(es), on %d: the model and optimizer are "
                    "resharded, each rank's data stream starts anew from (seed, step, rank); not bit-exact with a "
                    "run that did not stop", start, saved, world)
    return start
