"""A run's checkpoint, in the form the run needs: ``ckpt.pt`` (one file, written atomically by
rank 0) for one process and DDP, the sharded ``ckpt/`` for FSDP2 (its other half,
:mod:`twofour.training.checkpoint_sharded`: written by every rank, nothing gathered).

The loop calls :func:`save` and :func:`resume`, telling them whether the run is sharded; readers
(``--resume``, ``twofour export``, ``twofour compare``) find a run folder's checkpoint with
:func:`checkpoint_path` and read it with :func:`read_checkpoint` (:func:`load_model` loads its
weights). Checkpoints hold only tensors and plain Python data (RNG states included), so they load
with ``torch.load(..., weights_only=True)``: a file that smuggles in any other object is refused.

Either form resumes in a run of any world size. On the world size that saved it, the resume is
bit-exact: every rank gets back its own RNG states and data position. On another world size the
model and optimizer are resharded (DCP) or sharded anew; the data streams of the saving ranks have
no counterpart, so every rank's data stream starts from a seed of ``(seed, step, rank)`` and the
other RNGs take rank 0's saved states (equal on every rank of a run); one log line says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import TrainError, write_failure
from ..integrity import checksummed_saves, zip_damage
from ..sparse.convert import sparse_layers
from ..version import __version__
from .checkpoint_sharded import (
    META,
    SHARDED,
    load_sharded,
    save_sharded,
    sharded_damage,
    sharded_folder,
    sharded_problem,
)
from .checkpoint_sharded import load_model as load_sharded_model
from .config import TrainConfig, resumed_config

__all__ = ["CKPT", "SHARDED", "save", "resume", "checkpoint_path", "read_checkpoint", "load_checkpoint", "load_model",
           "save_checkpoint", "check_replicas", "data_seed", "check_intact", "FILE"]

log = logging.getLogger("twofour")

CKPT = "ckpt.pt"
#: The optimizer state dict's own entries, which DCP's state dicts carry; any other (STEP's phase)
#: travels in the sharded checkpoint's meta.pt.
_OPT_ENTRIES = ("state", "param_groups")
#: The entry :func:`read_checkpoint` adds to a ``ckpt.pt``'s dict: the file it was read from.
FILE = "file"


# --------------------------------------------------------------------------------------------
# finding and reading
# --------------------------------------------------------------------------------------------


def checkpoint_path(out: str | Path) -> Path | None:
    """The newest checkpoint in run folder ``out``: ``ckpt.pt``, or the sharded checkpoint's step
    folder; None when it holds neither. Both are there only when a run was killed just after
    writing one form and before removing the other: the later step wins (``ckpt.pt`` on a tie)."""
    out = Path(out)
    single = out / CKPT if (out / CKPT).is_file() else None
    sharded = sharded_folder(out)
    if single is None or sharded is None:
        return single or sharded
    with contextlib.suppress(TrainError):
        if _read_meta(sharded)["step"] > read_checkpoint(single)["step"]:
            return sharded
    return single


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A twofour checkpoint (a run folder, ``ckpt.pt`` or a sharded checkpoint's step folder),
    loaded with ``weights_only=True``: tensors and plain data only, so a crafted file can't run
    code. A sharded checkpoint's dict holds its ``meta.pt`` and, under ``"sharded"``, the step
    folder whose model and optimizer :func:`resume` and :func:`load_model` load. TrainError, one
    line naming the file and what is wrong with it."""
    path = Path(path)
    if path.is_dir():
        if (path / META).is_file():
            return {**_read_meta(path), "sharded": str(path)}
        found = checkpoint_path(path)
        if found is None:
            why = sharded_problem(path) or f"it holds neither {CKPT} nor {SHARDED}/"
            raise TrainError(f"no checkpoint in {path}: {why}")
        if found.is_dir():
            return {**_read_meta(found), "sharded": str(found)}
        path = found
    if not path.exists():
        raise TrainError(f"no checkpoint at {path}")
    return {**_load_plain(path, {"config", "model", "step"}, "training checkpoint"), FILE: str(path)}


def check_intact(ckpt: dict[str, Any], way_on: str, rank: int = 0, world: int = 1) -> None:
    """TrainError, one line naming the file and ``way_on`` (what the user can do), when a tensor
    of ``ckpt`` (:func:`read_checkpoint`'s dict) fails its CRC-32: damaged on disk since it was
    written. Under torchrun every rank calls it and checks a share of a sharded checkpoint's files.
    A file this process found intact, unchanged since (size and time), is not read again."""
    where = Path(ckpt["sharded"] if "sharded" in ckpt else ckpt[FILE])
    seen = _stamp(where)
    if seen in _INTACT and world == 1:  # (under torchrun every rank takes part in the check's all-reduce)
        return
    why = sharded_damage(where, ckpt, rank, world) if "sharded" in ckpt else zip_damage(where)
    if why:
        raise TrainError(f"checkpoint {where} is damaged ({why}), so it was not loaded: {way_on}")
    _INTACT.add(seen)


#: The checkpoints :func:`check_intact` found intact in this process, as :func:`_stamp` saw them.
_INTACT: set[tuple] = set()


def _stamp(path: Path) -> tuple:
    """A file's (or step folder's files') path, size and modification time: what tells a file
    checked before from one changed since."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


def load_checkpoint(path: str | Path, cfg: TrainConfig) -> dict[str, Any]:
    """:func:`read_checkpoint`, checking that ``cfg`` trains what the checkpoint's run trained
    (:func:`twofour.training.config.resumed_config`; TrainError names the first option that differs)."""
    ckpt = read_checkpoint(path)
    resumed_config(ckpt["config"], cfg)
    return ckpt


def load_model(ckpt: dict[str, Any], model: torch.nn.Module) -> None:
    """The weights and buffers of ``ckpt`` (:func:`read_checkpoint`'s dict, either form) into
    ``model``, a whole model in one process: how ``twofour export`` reads a run. A damaged
    checkpoint is refused (:func:`check_intact`)."""
    check_intact(ckpt, "restore the run folder from a copy, or train the run again")
    if "sharded" in ckpt:  # an FSDP2 run's: its shards read into the whole model
        load_sharded_model(Path(ckpt["sharded"]), model)
    else:
        model.load_state_dict(ckpt["model"])


def _load_plain(path: Path, required: set[str], what: str) -> dict[str, Any]:
    """The dict in file ``path`` (``what`` names it in errors), loaded with ``weights_only=True``:
    tensors and plain data only, so a crafted file can't run code; TrainError when it is refused,
    unreadable, or lacks a ``required`` key."""
    try:
        # mmap: tensors are read when used, so reading a large checkpoint's settings is cheap
        d = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        names = f" ({found.group(1)})" if found else ""
        raise TrainError(f"{path} is refused and was not loaded: it holds code{names}, not only tensors and plain "
                         "data, and unpickling it could run that code") from None
    except Exception as e:
        raise TrainError(f"checkpoint {path} is unreadable or corrupt ({type(e).__name__})") from None
    if not isinstance(d, dict) or not required <= set(d):
        raise TrainError(f"{path} is not a twofour {what}")
    return d


def _read_meta(folder: Path) -> dict[str, Any]:
    """A step folder's ``meta.pt``: config, step, RNG states and the rest (:func:`_load_plain`)."""
    return _load_plain(folder / META, {"config", "step", "rng"}, "sharded checkpoint's meta.pt")


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: a kill at any moment leaves the previous checkpoint intact.
    TrainError, saying so, when the file can't be written (a full disk, a read-only folder)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh, checksummed_saves():
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        kept = f"; the last checkpoint {path} is intact" if path.exists() else ""
        raise TrainError(f"cannot write the checkpoint {tmp}: {write_failure(e)}{kept}") from None


def save(out: Path, cfg: TrainConfig, raw: torch.nn.Module, opt: torch.optim.Optimizer, sched, step: int,
         data_gen: torch.Generator, rank: int, world: int, elapsed_s: float, *, sharded: bool) -> Path:
    """Checkpoint the run after ``step``; returns where it went. ``sharded``: the run is FSDP2's
    (every rank writes its shards), else rank 0 writes ``ckpt.pt``. Every rank takes part (replica
    check, RNG states). The form not written is removed once the new checkpoint is complete."""
    if world > 1:
        check_replicas(raw, world)
    meta = {"config": cfg.to_dict(), "step": step, "vocab_size": raw.vocab_size, "scheduler": sched.state_dict(),
            "rng": _per_rank(_rng_state(data_gen), world), "elapsed_s": elapsed_s, "twofour_version": __version__}
    if sharded:
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


# --------------------------------------------------------------------------------------------
# resuming
# --------------------------------------------------------------------------------------------


def data_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank``'s data stream when a run resumes at ``step`` on another world size."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)


def resume(ckpt: dict[str, Any], cfg: TrainConfig, raw: torch.nn.Module, opt: torch.optim.Optimizer, sched,
           data_gen: torch.Generator, rank: int, world: int, *, sharded: bool) -> int:
    """Load ``ckpt`` (:func:`read_checkpoint`'s dict, either form) into the run's model,
    optimizer, schedule and RNGs, before :func:`twofour.sparse.attach`; returns the step it
    resumes at. ``sharded``: this run's model is FSDP2's. Every rank calls it. A damaged
    checkpoint is refused (:func:`check_intact`), a model that does not fit it too (:func:`_check_shapes`)."""
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
        _load_whole(raw, opt, ckpt["model"], _keyed(ckpt["optimizer"], raw, opt, sharded), sharded)
        # loaded whole above, except where DCP's set_state_dict (FSDP2) leaves them out
        extra = {k: v for k, v in ckpt["optimizer"].items() if k not in _OPT_ENTRIES} if sharded else {}
    if extra:  # DCP's optimizer state dicts leave them out
        opt.load_state_dict({**opt.state_dict(), **extra})
    start = ckpt["step"]
    sched.load_state_dict(ckpt["scheduler"])
    sched.last_epoch = start - 1
    sched.step()  # this step's lr from cfg's schedule (a new one under --reschedule)
    if saved == world:
        _set_rng_state(ckpt["rng"][rank], data_gen)
        return start
    _set_rng_state(ckpt["rng"][0], data_gen)
    data_gen.manual_seed(data_seed(cfg.seed, start, rank))
    if rank == 0:
        log.warning("twofour: resuming step %d, saved by %d process(es), on %d: the model and optimizer are "
                    "resharded, each rank's data stream starts anew from (seed, step, rank); not bit-exact with a "
                    "run that did not stop", start, saved, world)
    return start


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
