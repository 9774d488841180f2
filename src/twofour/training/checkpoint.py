"""A run's checkpoint, in the form the run needs: ``ckpt.pt`` (one file, written atomically by
rank 0) for one process and DDP, the sharded ``ckpt/`` for FSDP2 (its other half,
:mod:`twofour.training.checkpoint_sharded`: written by every rank, nothing gathered).

A run saves and resumes through its :class:`~twofour.training.checkpointer.Checkpointer`; readers
(``--resume``, ``twofour export``, ``twofour compare``) find a run folder's checkpoint with
:func:`checkpoint_path` and read it with :func:`read_checkpoint` (:func:`load_model` loads its
weights). Checkpoints hold only tensors and plain Python data (RNG states included), so they load
with ``torch.load(..., weights_only=True)``: a file that smuggles in any other object is refused.

Either form resumes in a run of any world size (:mod:`twofour.training.checkpointer`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import TrainError, write_failure
from ..integrity import checksummed_saves, zip_damage
from .checkpoint_sharded import (
    META,
    SHARDED,
    sharded_damage,
    sharded_folder,
    sharded_problem,
)
from .checkpoint_sharded import load_model as load_sharded_model
from .config import TrainConfig
from .resuming import resumed_config

__all__ = ["CKPT", "SHARDED", "checkpoint_path", "read_checkpoint", "load_checkpoint", "load_model", "save_checkpoint",
           "check_intact", "FILE", "OPT_ENTRIES"]

log = logging.getLogger("twofour")

CKPT = "ckpt.pt"
#: The optimizer state dict's own entries, which DCP's state dicts carry; any other (STEP's phase)
#: travels in the sharded checkpoint's meta.pt.
OPT_ENTRIES = ("state", "param_groups")
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
    (:func:`twofour.training.resuming.resumed_config`; TrainError names the first option that differs)."""
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
