"""twofour's errors: one base class that the command line catches, and its few kinds.

Each is a ``ValueError`` too, so code that caught ``ValueError`` before keeps working.
"""

from __future__ import annotations

import errno
import os
import re
import warnings
from pathlib import Path

__all__ = ["TwofourError", "TrainError", "DivergedError", "DataError", "FormatError", "out_of_memory_message",
           "one_line", "size_text", "write_failure", "DISK_FULL", "missing_link", "TwofourWarning", "warn"]


class TwofourError(ValueError):
    """Anything twofour refuses with a one-line message (the CLI prints it and exits 2)."""


class TrainError(TwofourError):
    """A run that can't start or go on: bad options, an existing run, a bad checkpoint."""


class DivergedError(TrainError):
    """A run whose loss, gradient norm or weights stopped being finite, at optimizer step ``step``
    (a learning-rate sweep records such a run as a result instead of stopping)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class DataError(TwofourError):
    """The data can't be used: missing, empty, too short, or in a form twofour can't read."""


class FormatError(TrainError):
    """A file or folder that is not what twofour writes: an export folder, a checkpoint, a run.
    (A :class:`TrainError` too, which ``twofour export`` and ``generate`` raised before.)"""


class TwofourWarning(UserWarning):
    """What twofour warns about (a skipped file, a slow path, layers left dense): printed as one
    ``twofour: ...`` line, without Python's source file and line (:func:`warn`)."""


def warn(message: str) -> None:
    """Warn with :class:`TwofourWarning`: one ``twofour: message`` line on stderr (once per place,
    as Python's warnings go; filters and ``pytest.warns`` see a ``UserWarning``)."""
    warnings.warn(message, TwofourWarning, stacklevel=2)


def _format_warning(message, category, filename, lineno, line=None, _python=warnings.formatwarning) -> str:
    """Python's warning format, except for :class:`TwofourWarning`: ``twofour: message``, one line."""
    if isinstance(category, type) and issubclass(category, TwofourWarning):
        text = str(message)
        return (text if text.startswith("twofour") else f"twofour: {text}") + "\n"
    return _python(message, category, filename, lineno, line)


warnings.formatwarning = _format_warning


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``, for a log line about an exception that was handled."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


#: How a failed write reads when the disk (or the user's quota) is full.
DISK_FULL = "the disk is full (no space left on device)"


def write_failure(e: BaseException) -> str:
    """Why a write failed, in a phrase: :data:`DISK_FULL` for ENOSPC, a full quota and torch.save's
    short write (``[enforce fail at inline_container.cc:...] unexpected pos``), an OSError's own
    text, else the message's first line."""
    text = str(e)
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "unexpected pos" in text:
        return DISK_FULL
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return (text.splitlines() or [""])[0][:200] or type(e).__name__


def missing_link(path: str | Path) -> str | None:
    """A phrase naming the symbolic link among ``path`` and its parents that points to nothing
    (creating the folder would fail with a bare "File exists"), or None when there is none."""
    for p in (Path(path), *Path(path).parents):
        if p.is_symlink() and not p.exists():
            target = os.readlink(p)
            return f"{p} is a symbolic link to {target}, which does not exist: create {target} or remove the link"
    return None


def out_of_memory_message(e: BaseException) -> str | None:
    """The one line for an out-of-memory error (torch's on the GPU or the CPU, or Python's), else None."""
    import torch  # noqa: PLC0415

    text = str(e)
    if not (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text):
        return None
    asked = re.search(r"(?i)(?:tried to|unable to) allocate ([\d.]+ \w+)", text)
    size = f" (it asked for {_binary_units(asked.group(1))} more)" if asked else ""
    return f"out of memory{size}: try a smaller --batch-size (or --seq-len, or a smaller --model)"


def size_text(n_bytes: int) -> str:
    """A size in bytes as people read it: ``"1.5 GiB"``."""
    return _binary_units(f"{n_bytes} bytes")


def _binary_units(amount: str) -> str:
    """``"140737488355328 bytes"`` as ``"128.0 TiB"``; other units (torch's ``"20.00 MiB"``) as they are."""
    number, unit = amount.split()
    if unit != "bytes":
        return amount
    value = float(number)
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
