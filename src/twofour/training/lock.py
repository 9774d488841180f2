"""One run per folder: :class:`RunLock`, a lock file that ``twofour train`` and ``twofour compare``
hold in the folder they write, so that a second command on the same ``--out`` is refused
instead of mixing its rows and checkpoints with the first's.

The lock is ``.twofour.lock`` in the folder, created with ``O_CREAT | O_EXCL`` (one process wins)
and holding the owner's PID, host and process start time; it is removed when the command ends,
by an error or an interrupt too. A lock left by a process that is gone (killed, or the machine
went down) is stale: on the same host that is told by the PID, and the next run takes it over
with one log line. A lock from another host can't be checked from here and is refused, naming
the file to delete once that run is known to be over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..errors import TrainError, missing_link

log = logging.getLogger("twofour")

__all__ = ["LOCK", "RunLock"]

#: hidden, so that a run folder inside a text data folder adds nothing to the data
LOCK = ".twofour.lock"


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, Linux's /proc), or None where that
    can't be read: with the PID it names one process, even after the PID is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the process that wrote ``owner`` (a lock on this host) is still running."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, under another user
        pass
    now = _started(pid)
    return owner.get("started") is None or now is None or now == owner["started"]


class RunLock:
    """A context manager that holds ``folder``'s lock (creating the folder) and removes it on
    exit; TrainError, naming the owner, when another live process holds it. A folder that it
    created and that is still empty on exit is removed too: a run that could not start leaves
    nothing behind."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self._created = False
        self._held = False
        self._mine: dict[str, Any] = {}

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, taking over a stale one; TrainError if it is held or can't be written."""
        if self.folder.exists() and not self.folder.is_dir():
            raise TrainError(f"output folder {self.folder} exists and is not a folder")
        dangling = missing_link(self.folder)
        if dangling:
            raise TrainError(f"--out {self.folder}: {dangling}, or choose another --out")
        self._created = not self.folder.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not self._create():
                owner = self._owner()
                if owner is None or owner.get("host") != socket.gethostname() or _alive(owner):
                    raise TrainError(self._held_message(owner))
                # stale: its process is gone; take it over unless another run did so meanwhile
                if self._owner() == owner:
                    self.path.unlink(missing_ok=True)
                if not self._create():
                    raise TrainError(self._held_message(self._owner()))
                log.warning("twofour: took over the lock of %s left by process %s, which is no longer running",
                            self.folder, owner.get("pid"))
        except OSError as e:
            self._remove_folder()
            raise TrainError(f"cannot write to output folder {self.folder}: {e.strerror or e}") from None
        except TrainError:
            self._remove_folder()
            raise
        self._held = True

    def holder(self) -> str | None:
        """The refusal naming the live run that holds this folder's lock (what :meth:`acquire`
        would raise), or None when there is no lock, it is stale, or it is this process's."""
        if not self.path.exists():
            return None
        owner = self._owner()
        if owner is not None and owner.get("host") == socket.gethostname() and (
                owner.get("pid") == os.getpid() or not _alive(owner)):
            return None
        return self._held_message(owner)

    def release(self) -> None:
        """Remove the lock (if this process holds it), and the folder if this lock created it
        and it is empty."""
        if self._held:
            self._held = False
            with contextlib.suppress(OSError):
                if self._owner() == self._mine:
                    self.path.unlink()
        self._remove_folder()

    def _create(self) -> bool:
        """Create the lock file with this process's details; False if it exists."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        self._mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": _started(os.getpid()),
                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(self._mine))
        except OSError:  # (a full disk) no half-written lock left behind
            self.path.unlink(missing_ok=True)
            raise
        return True

    def _owner(self) -> dict[str, Any] | None:
        """What the lock file says (None if it is gone, empty or unreadable)."""
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def _held_message(self, owner: dict[str, Any] | None) -> str:
        if owner is None:
            return (f"{self.folder} is locked by another twofour run ({self.path} is being written or unreadable); "
                    f"if no run is using the folder, delete {self.path}; else choose another --out")
        who = f"process {owner.get('pid')} on {owner.get('host')}, since {owner.get('since')}"
        if owner.get("host") != socket.gethostname():
            return (f"{self.folder} is in use by another twofour run ({who}); if that run is over, delete "
                    f"{self.path}; else wait for it, or choose another --out")
        return f"{self.folder} is in use by another twofour run ({who}); wait for it to finish, or choose another --out"

    def _remove_folder(self) -> None:
        if self._created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only if empty
