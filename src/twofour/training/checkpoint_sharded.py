"""The sharded half of :mod:`twofour.training.checkpoint`: an FSDP2 run's checkpoint, written
through ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards of the model and
optimizer, nothing is gathered on one rank.

Layout in the run folder::

    ckpt/latest             the name of the newest complete checkpoint, written last
    ckpt/step-00000008/     DCP's files (.metadata, __<rank>_0.distcp) and meta.pt

``meta.pt`` (written by rank 0, tensors and plain data only) holds the rest: config, step,
scheduler, every rank's RNG states and data position, the optimizer's non-tensor extras, elapsed
time, version, and the CRC-32 of each DCP file (each rank's of its own), which a load checks
first (:func:`sharded_damage`). A save writes a new step folder, then replaces ``latest`` (``os.replace``, atomic)
and only then removes the older step folders: a run killed at any moment leaves ``latest`` naming a
complete checkpoint, and the folders it does not name (a partial save) are removed at the next save.
A ``latest`` that names nothing readable is reported as such (:func:`sharded_problem`), naming the
step folders there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TrainError, write_failure
from ..integrity import crc32_file, damaged_files
from .parallel import everywhere

__all__ = ["SHARDED", "LATEST", "META", "CRCS", "sharded_folder", "sharded_problem", "save_sharded", "load_sharded",
           "load_model", "sharded_damage"]

SHARDED = "ckpt"
LATEST = "latest"
META = "meta.pt"
#: meta.pt's entry holding the CRC-32 of every DCP file of the step folder, by file name.
CRCS = "file_crcs"


def sharded_folder(out: str | Path) -> Path | None:
    """The complete sharded checkpoint in run folder ``out`` (the step folder ``latest`` names), or
    None when there is none (:func:`sharded_problem` says why)."""
    return _latest(Path(out))[0]


def sharded_problem(out: str | Path) -> str | None:
    """Why run folder ``out``'s ``ckpt/`` holds no checkpoint to read, in a phrase naming the file
    at fault and the step folders there (with how to use one that looks complete); None when it
    holds one, or when ``out`` has no ``ckpt/``."""
    root = Path(out) / SHARDED
    folder, why = _latest(Path(out))
    if folder is not None or not root.is_dir():
        return None
    steps = sorted(p.name for p in root.glob("step-*") if p.is_dir())
    held = f"{root} holds {', '.join(steps)}" if steps else f"{root} holds no step folder"
    complete = [name for name in steps if (root / name / META).is_file() and (root / name / ".metadata").is_file()]
    if complete:
        held += f"; if the save of {complete[-1]} finished, write that name into {root / LATEST} to use it"
    return f"{why}; {held}"


def _latest(out: Path) -> tuple[Path | None, str]:
    """(the step folder ``ckpt/latest`` names, if it holds a ``meta.pt``; else None and why not)."""
    root = out / SHARDED
    pointer = root / LATEST
    if not pointer.is_file():
        return None, f"{pointer} is missing (no save finished)"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{pointer} is unreadable ({write_failure(e)})"
    if not name:
        return None, f"{pointer} is empty"
    if Path(name).is_absolute() or Path(name).name != name or name in (".", ".."):
        return None, f"{pointer} names {name!r}, outside {root}"
    folder = root / name
    if not folder.is_dir():
        return None, f"{pointer} names {name}, which is not in {root}"
    if not (folder / META).is_file():
        return None, f"{folder} has no {META} (its save did not finish)"
    return folder, ""


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to the disk (folders: where the OS allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_sharded(out: Path, step: int, state: dict[str, Any], meta: dict[str, Any] | None, rank: int,
                 world: int) -> Path:
    """Write ``state`` (sharded model and optimizer state dicts) with DCP from every rank and
    ``meta`` (rank 0's) into ``out/ckpt/step-<step>``, then point ``latest`` at it; returns the
    folder. Every rank calls it. TrainError on every rank when any rank's write fails; the
    previous checkpoint is then intact."""
    from torch.distributed.checkpoint import CheckpointException, save  # noqa: PLC0415

    root = out / SHARDED
    folder = root / f"step-{step:08d}"
    why = None
    if rank == 0:
        try:
            shutil.rmtree(folder, ignore_errors=True)  # a partial save of this step, killed before the switch
            root.mkdir(exist_ok=True)
            folder.mkdir()
        except OSError as e:  # told to every rank below, not raised on rank 0 alone (the others would wait)
            why = write_failure(e)
    if not everywhere(why is None, world):
        raise TrainError(f"cannot create the sharded checkpoint's folder {folder}: {why or 'rank 0 failed'}")
    try:
        save(state, checkpoint_id=str(folder))  # collective: a failure on any rank raises on every rank
    except (Exception, CheckpointException) as e:  # DCP's wraps every rank's errors: a BaseException
        why = _why(e)
    if everywhere(why is None, world):  # every rank here, or none: the collective below is matched
        crcs = _gathered_crcs(folder, rank, world)
        if rank == 0:
            try:
                _write_meta(folder, {**(meta or {}), CRCS: crcs})
            except (OSError, RuntimeError) as e:
                why = write_failure(e)
    if not everywhere(why is None, world):
        last = sharded_folder(out)
        kept = f"; the last checkpoint {last} is intact" if last else ""
        raise TrainError(f"cannot write the sharded checkpoint {folder}: {why or 'another rank failed'}{kept}")
    if rank == 0:
        try:
            _switch(root, folder.name)
        except OSError as e:
            why = write_failure(e)
    if not everywhere(why is None, world):  # every rank learns whether the new checkpoint is the one to resume
        raise TrainError(f"cannot switch {root} to {folder.name}: {why or 'rank 0 failed'}; the previous "
                         "checkpoint is intact")
    return folder


def _gathered_crcs(folder: Path, rank: int, world: int) -> dict[str, int]:
    """The CRC-32 of every DCP file in ``folder``, each computed by the rank that wrote it (rank 0
    also takes ``.metadata``), gathered on every rank. Every rank calls it."""
    mine = sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])
    crcs = {p.name: crc32_file(p) for p in mine}
    if world == 1:
        return crcs
    everyone: list[dict[str, int] | None] = [None] * world
    dist.all_gather_object(everyone, crcs)
    return {name: crc for part in everyone for name, crc in (part or {}).items()}


def sharded_damage(folder: Path, meta: dict[str, Any], rank: int = 0, world: int = 1) -> str | None:
    """Why the DCP files of step folder ``folder`` are not those its ``meta`` (meta.pt's dict)
    recorded, in a phrase naming the file; None when they match (or a checkpoint of a version that
    recorded none). Rank ``rank`` of ``world`` checks its share of the files alone; every rank
    learns the verdict (one all-reduce), and a rank whose share was intact says another rank's failed."""
    crcs = meta.get(CRCS) or {}
    why = damaged_files(folder, crcs, sorted(crcs)[rank::world]) if crcs else None
    if world > 1 and not everywhere(why is None, world):
        return why or "another rank found one of its files damaged (its log names it)"
    return why


def _why(e: BaseException) -> str:
    """One line on what failed: the first failing rank's own error inside DCP's CheckpointException."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (e, _) = min(failures.items(), key=lambda kv: kv[0])
        return f"rank {rank}: {_why(e)}"
    return write_failure(e)


def _write_meta(folder: Path, meta: dict[str, Any] | None) -> None:
    """``meta.pt`` into the step folder, flushed to the disk."""
    with (folder / META).open("wb") as fh:
        torch.save(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync(folder)


def _switch(root: Path, name: str) -> None:
    """Point ``latest`` at step folder ``name`` (atomic), then remove every other step folder."""
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    _fsync(tmp)
    os.replace(tmp, root / LATEST)
    _fsync(root)
    for old in root.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def load_sharded(folder: Path, state: dict[str, Any], alone: bool = False) -> None:
    """Fill ``state`` (state dicts shaped as this run holds them: sharded under FSDP2, whole
    otherwise) in place from the checkpoint in ``folder``; DCP reshards to this run's world size.
    Every rank calls it; a process without a process group (or ``alone``) reads it by itself."""
    from torch.distributed.checkpoint import CheckpointException, load  # noqa: PLC0415

    try:
        with warnings.catch_warnings():  # "assuming ... a single process": meant so
            warnings.simplefilter("ignore", UserWarning)
            load(state, checkpoint_id=str(folder), no_dist=alone or not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        why = _why(e)
        raise TrainError(f"cannot read the sharded checkpoint {folder}: {why}") from None


def load_model(folder: Path, model: torch.nn.Module) -> None:
    """Load the model's weights and buffers alone from a sharded checkpoint into ``model`` (one
    process, whole tensors): how ``twofour export`` reads an FSDP2 run."""
    sd = model.state_dict()
    load_sharded(folder, {"model": sd}, alone=True)
    model.load_state_dict(sd)
