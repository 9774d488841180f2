"""What the command line's options mean past argparse: ``--opt KEY=VALUE`` pairs, and the options
refused because the run would silently drop them (a key or recipe given twice, ``--fsdp`` in one
process)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import TrainError
from .parallel import world_size

__all__ = ["option_value", "parse_option", "precision_key", "opt_pairs", "once", "check_fsdp_launch"]


def option_value(text: str) -> Any:
    """An ``--opt`` value: a bool (true/yes/on, false/no/off), an int, a float, or a name (letters,
    digits, ``-`` and ``_``, such as ``dx=pruned-t``; the recipe checks which names it takes)."""
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text[:1].isalpha() and text.replace("-", "").replace("_", "").isalnum():
        return text
    raise argparse.ArgumentTypeError(f"option value {text!r} is not a bool, a number or a name")


def parse_option(text: str) -> tuple[str, Any]:
    """``--opt KEY=VALUE`` as (key with ``_`` for ``-``, value); argparse's type for ``--opt``."""
    key, sep, val = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. decay=6e-5), got {text!r}")
    key = key.replace("-", "_")
    return key, (val if precision_key(key) else option_value(val))  # kept as text: opt_pairs refuses it by name


def precision_key(key: str) -> bool:
    """An ``--opt`` key that means the precision, which ``--precision`` sets (``fp8``, ``fp8_rowwise``, ...)."""
    return key == "precision" or key.startswith("fp8")


def once(values: list, option: str, advice: str) -> None:
    """TrainError naming ``option`` when one of its ``values`` repeats (the last would win, silently)."""
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise TrainError(f"{option} names {twice} twice: {advice}")


def opt_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The recipe options of the ``--opt`` pairs; a precision's key, or a key given twice, is refused."""
    for key, value in pairs:
        if precision_key(key):
            raise TrainError(f"--opt {key}={value}: the precision is --precision NAME (--fp8 for --precision fp8), "
                             "not a recipe option")
    once([key for key, _ in pairs], "--opt", "give each option once")
    return dict(pairs)


def check_fsdp_launch(fsdp: str | None, given: bool) -> None:
    """TrainError when ``--fsdp`` was given to one process (FSDP2 shards over torchrun's processes;
    a run resumed in one process keeps its saved setting unasked)."""
    if fsdp is not None and given and world_size() < 2:
        raise TrainError("--fsdp shards the model over the processes torchrun starts, and this is one process: "
                         "run under torchrun --nproc-per-node N (N >= 2), or leave --fsdp out")
