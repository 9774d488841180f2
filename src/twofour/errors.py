"""twofour's errors: one base class that the command line catches, and its few kinds.

Each is a ``ValueError`` too, so code that caught ``ValueError`` before keeps working.
"""

from __future__ import annotations

__all__ = ["TwofourError", "TrainError", "DataError", "FormatError"]


class TwofourError(ValueError):
    """Anything twofour refuses with a one-line message (the CLI prints it and exits 2)."""


class TrainError(TwofourError):
    """A run that can't start or go on: bad options, an existing run, a bad checkpoint."""


class DataError(TwofourError):
    """The data can't be used: missing, empty, too short, or in a form twofour can't read."""


class FormatError(TrainError):
    """A file or folder that is not what twofour writes: an export folder, a checkpoint, a run.
    (A :class:`TrainError` too, which ``twofour export`` and ``generate`` raised before.)"""
