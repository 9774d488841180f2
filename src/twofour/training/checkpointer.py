"""Where and how a run is saved and resumed: :class:`Checkpointer` owns the run's folder and the
form its checkpoints take, whole (``ckpt.pt``, written by rank 0: one process and DDP) or sharded
(FSDP2's ``ckpt/``: every rank writes its shards, nothing gathered), and the parts of the run a
checkpoint holds: config, model, optimizer, schedule and every RNG. The file formats, reading and
integrity checks are :mod:`twofour.training.checkpoint`'s (and
:mod:`twofour.training.checkpoint_sharded`'s).

Either form resumes in a run of any world size. On the world size that saved it, the resume is
bit-exact: every rank gets back its own RNG states and data position. On another world size the
model and optimizer are resharded (DCP) or sharded anew; the data streams of the saving ranks have
no counterpart, so every rank's data stream starts from a seed of ``(seed, step, rank)`` and the
other RNGs take rank 0's saved states (equal on every rank of a run); one log line says so.
"""

from __future__ import annotations

import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import TrainError
from ..sparse.convert import sparse_layers
from ..version import __version__
from .checkpoint import CKPT, FILE, OPT_ENTRIES, check_intact, save_checkpoint
from .checkpoint_sharded import SHARDED, load_sharded, save_sharded
from .config import TrainConfig

__all__ = ["Checkpointer", "check_replicas", "data_seed"]

log = logging.getLogger("twofour")


@dataclass
class Checkpointer:
    """Saves and resumes one run: its folder ``out``, its config, the unwrapped model, optimizer,
    schedule and data generator, and this process's place (``rank`` of ``world``; ``sharded``:
    the model is FSDP2's). Every rank calls :meth:`save` and :meth:`resume`."""

    out: Path
    cfg: TrainConfig
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any  # torch.optim.lr_scheduler.LRScheduler
    data_gen: torch.Generator
    rank: int = 0
    world: int = 1
    sharded: bool = False

    def save(self, step: int, elapsed_s: float) -> Path:
        """Checkpoint the run after ``step`` (``elapsed_s``: its wall time so far); returns where
        it went. Sharded: every rank writes its shards; else rank 0 writes ``ckpt.pt``. Every rank
        takes part (replica check, RNG states). The form not written is removed once the new
        checkpoint is complete."""
        raw, opt, world = self.model, self.opt, self.world
        if world > 1:
            check_replicas(raw, world)
        meta = {"config": self.cfg.to_dict(), "step": step, "vocab_size": raw.vocab_size,
                "scheduler": self.sched.state_dict(), "rng": _per_rank(_rng_state(self.data_gen), world),
                "elapsed_s": elapsed_s, "twofour_version": __version__}
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

            model_sd, opt_sd = get_state_dict(raw, opt)  # sharded: each rank's own shards, replicated buffers once
            extra = {k: v for k, v in opt.state_dict().items() if k not in OPT_ENTRIES}
            meta["optimizer_extra"] = _per_rank(extra, world)
            folder = save_sharded(self.out, step, {"model": model_sd, "optimizer": opt_sd}, meta, self.rank, world)
            if self.rank == 0:
                (self.out / CKPT).unlink(missing_ok=True)  # an older one-file checkpoint (a resume from it)
            return folder
        model_sd, opt_sd = raw.state_dict(), opt.state_dict()
        if self.rank == 0:
            save_checkpoint(self.out / CKPT, {**meta, "model": model_sd, "optimizer": opt_sd})
            shutil.rmtree(self.out / SHARDED, ignore_errors=True)  # an older sharded checkpoint (a resume from it)
        return self.out / CKPT

    def resume(self, ckpt: dict[str, Any]) -> int:
        """Load ``ckpt`` (:func:`~twofour.training.checkpoint.read_checkpoint`'s dict, either form)
        into the run's model, optimizer, schedule and RNGs, before :func:`twofour.sparse.attach`;
        returns the step it resumes at. A damaged checkpoint is refused
        (:func:`~twofour.training.checkpoint.check_intact`), a model that does not fit it too."""
        raw, opt, rank, world = self.model, self.opt, self.rank, self.world
        check_intact(ckpt, "only the last checkpoint is kept, so `--overwrite` instead of `--resume` starts the run "
                     "again (or restore the run folder from a copy)", rank, world)
        saved = len(ckpt["rng"])
        if "sharded" in ckpt:
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

            model_sd, opt_sd = get_state_dict(raw, opt)  # the shapes to fill: sharded under FSDP2, whole otherwise
            load_sharded(Path(ckpt["sharded"]), {"model": model_sd, "optimizer": opt_sd})
            set_state_dict(raw, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
            extra = ckpt.get("optimizer_extra", [{}])[rank if saved == world else 0]
        else:  # keyed by parameter names under FSDP2, by numbers otherwise: as this run needs it
            _check_shapes(ckpt["model"], raw, Path(ckpt[FILE]))
            _load_whole(raw, opt, ckpt["model"], _keyed(ckpt["optimizer"], raw, opt, self.sharded), self.sharded)
            # loaded whole above, except where DCP's set_state_dict (FSDP2) leaves them out
            extra = {k: v for k, v in ckpt["optimizer"].items() if k not in OPT_ENTRIES} if self.sharded else {}
        if extra:  # DCP's optimizer state dicts leave them out
            opt.load_state_dict({**opt.state_dict(), **extra})
        start = ckpt["step"]
        self.sched.load_state_dict(ckpt["scheduler"])
        self.sched.last_epoch = start - 1
        self.sched.step()  # this step's lr from cfg's schedule (a new one under --reschedule)
        if saved == world:
            _set_rng_state(ckpt["rng"][rank], self.data_gen)
            return start
        _set_rng_state(ckpt["rng"][0], self.data_gen)
        self.data_gen.manual_seed(data_seed(self.cfg.seed, start, rank))
        if rank == 0:
            log.warning("twofour: resuming step %d, saved by %d process(es), on %d: the model and optimizer are "
                        "resharded, each rank's data stream starts anew from (seed, step, rank); not bit-exact with "
                        "a run that did not stop", start, saved, world)
        return start


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


def _rng_state(data_gen: torch.Generator) -> dict[str, Any]:
    """Every RNG a resumed run needs, as tensors and plain Python values (no numpy objects)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "data": data_gen.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state



def data_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s data stream when a run resumes at ``step`` on another world size."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)


def _load_whole(model: torch.nn.Module, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict,
                sharded: bool) -> None:
    """Load whole model and optimizer state dicts (a ``ckpt.pt``'s), sharding them under FSDP2."""
    if not sharded:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # noqa: PLC0415

    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd,
                   options=StateDictOptions(full_state_dict=True))


def _check_shapes(model_sd: dict[str, torch.Tensor], raw: torch.nn.Module, where: Path) -> None:
    """TrainError naming the first tensor of the checkpoint's model (``model_sd``) missing from, or
    shaped otherwise than in, the run's model ``raw`` (whole, before FSDP2 shards it)."""
    mine = raw.state_dict()
    for name, t in model_sd.items():
        ours = mine.get(name)
        if ours is None or tuple(ours.shape) != tuple(t.shape):
            here = "absent" if ours is None else f"{list(ours.shape)}"
            raise TrainError(f"checkpoint {where} does not fit this run's model: {name} is {list(t.shape)} in it, "
                             f"{here} here; it was saved by another model: leave --resume out, or resume its own run")
    gone = [name for name in mine if name not in model_sd]
    if gone:
        raise TrainError(f"checkpoint {where} does not fit this run's model: it lacks {gone[0]}; it was saved by "
                         "another model: leave --resume out, or resume its own run")


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


def _set_rng_state(state: dict[str, Any], data_gen: torch.Generator) -> None:
    """Restore what :func:`_rng_state` saved."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    data_gen.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
