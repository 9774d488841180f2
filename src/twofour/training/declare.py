"""Each run option declared once, as a field of :class:`~twofour.training.config.TrainConfig`.

:func:`option` makes the field and records, beside its default: its command-line flag and argparse
settings, its help, its check, and what a resumed run does with it (:data:`RESUME_RULES`). The
command line (:func:`add_options`), the validation (:func:`check_fields`), config.json (the
dataclass's own fields) and the resume rules (:func:`resume_rule`, :func:`identity_options`) are
all read from those declarations, so that adding an option is one field plus the code that uses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import TrainError

__all__ = ["option", "Declared", "declared", "option_name", "add_options", "check_fields", "resume_rule",
           "identity_options", "RESUME_RULES", "GROUPS", "positive", "whole_steps", "non_negative", "one_of"]

#: What a resumed run does with an option: ``fixed`` (the checkpoint's; one given must agree),
#: ``adjustable`` (the checkpoint's unless given: how a run executes and reports, not what it
#: trains), ``launch`` (this invocation's, never the checkpoint's).
RESUME_RULES = ("fixed", "adjustable", "launch")
#: The command line's groups of run options, in the order ``--help`` lists them.
GROUPS = ("model and data", "recipe", "optimization (defaults marked 'regime' come from --regime; see the table "
          "below)", "logging and checkpoints")

#: A check: the message saying what is wrong with a value (its option named by ``{opt}``), or None.
Check = Callable[[Any], "str | None"]


@dataclasses.dataclass(frozen=True)
class Declared:
    """One option's declaration (a field's metadata): flag, argparse settings, check, resume rule."""

    flag: str | None  # None: no command-line option of its own (set by the command: --recipe, --recipes)
    help: str
    group: int | None  # None: the command's own options, in no group
    check: Check | None
    resume: str
    identity: bool  # part of what makes a run the run it is (a checkpoint belongs to its folder)
    effective: Callable[[Any], Any] | None  # what an unset value (None, {}) amounts to, for the resume check
    cli: dict[str, Any]
    aliases: tuple[tuple[str, dict[str, Any]], ...]
    exclusive: bool  # the flag and its aliases exclude each other on one command line
    commands: tuple[str, ...] | None  # the commands that take it (None: every run command)


def option(default: Any = None, flag: str | None = "", *, help: str = "", group: int | None = None,  # noqa: A002
           check: Check | None = None, resume: str = "fixed", identity: bool = False,
           effective: Callable[[Any], Any] | None = None, aliases: Iterable[tuple[str, dict[str, Any]]] = (),
           exclusive: bool = False, commands: tuple[str, ...] | None = None, factory: Callable[[], Any] | None = None,
           **cli: Any) -> Any:
    """A run option's field: ``default`` (or ``factory``), the ``flag`` (``""``: ``--`` and the
    field's name with dashes; None: none), its ``help`` and ``group`` (an index of :data:`GROUPS`;
    None: none), a ``check``,
    its ``resume`` rule (:data:`RESUME_RULES`), ``aliases`` (more flags writing the same field, with
    their argparse settings; ``exclusive``: not together with the flag), the ``commands`` that take
    it, what an unset value amounts to (``effective``, of the config) and argparse's settings
    (``type``, ``action``, ``choices``, ...) in ``cli``."""
    if resume not in RESUME_RULES:
        raise ValueError(f"resume must be one of {RESUME_RULES}, got {resume!r}")
    meta = {"twofour": Declared(flag, help, group, check, resume, identity, effective, cli, tuple(aliases), exclusive,
                                  commands)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.cache
def declared(cls: type) -> tuple[tuple[dataclasses.Field, Declared], ...]:
    """The declared options of config class ``cls``, in field order (read once per class)."""
    return tuple((f, f.metadata["twofour"]) for f in dataclasses.fields(cls) if "twofour" in f.metadata)


def _flag(f: dataclasses.Field, d: Declared) -> str:
    return d.flag or "--" + f.name.replace("_", "-")


def option_name(cls: type, name: str) -> str:
    """The command-line option that sets field ``name`` of ``cls`` (``batch_size`` -> ``--batch-size``)."""
    for f, d in declared(cls):
        if f.name == name:
            return _flag(f, d) if d.flag is not None else "--" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


def add_options(p: argparse.ArgumentParser, cls: type, command: str, defaults: dict[str, Any]) -> None:
    """Add every declared option of ``cls`` that ``command`` takes to parser ``p``, in its group,
    with the field's name as destination; ``defaults`` replaces declared defaults (``--out``'s)."""
    groups = [p.add_argument_group(title) for title in GROUPS]
    for f, d in declared(cls):
        if d.flag is None or (d.commands is not None and command not in d.commands):
            continue
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        where = p if d.group is None else groups[d.group]
        if d.exclusive:
            where = where.add_mutually_exclusive_group()
        kwargs = {"dest": f.name, "default": default, "help": d.help, **d.cli}
        where.add_argument(_flag(f, d), **kwargs)
        for alias, settings in d.aliases:
            where.add_argument(alias, dest=f.name, **settings)


def check_fields(cfg: Any) -> None:
    """Raise TrainError with the first declared option of ``cfg`` whose check fails, in field order."""
    for f, d in declared(type(cfg)):
        if d.check is not None:
            problem = d.check(getattr(cfg, f.name))
            if problem:
                raise TrainError(problem.replace("{opt}", option_name(type(cfg), f.name)))


def resume_rule(cls: type, name: str) -> str:
    """What a resumed run does with field ``name`` of ``cls`` (:data:`RESUME_RULES`; undeclared: fixed)."""
    return next((d.resume for f, d in declared(cls) if f.name == name), "fixed")


def identity_options(cls: type) -> tuple[str, ...]:
    """The fields of ``cls`` that make a run the run it is (model, shapes, recipe, data, seed)."""
    return tuple(f.name for f, d in declared(cls) if d.identity)


# -- checks ------------------------------------------------------------------------------------

def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive(optional: bool = False) -> Check:
    """A positive integer (or None, with ``optional``)."""
    def check(v: Any) -> str | None:
        if (v is None and optional) or (_int(v) and v >= 1):
            return None
        return f"{{opt}} must be a positive integer, got {v!r}"
    return check


def whole_steps(v: Any) -> str | None:
    """A whole number of steps >= 0, or None."""
    return None if v is None or (_int(v) and v >= 0) else f"{{opt}} must be a whole number of steps >= 0, got {v!r}"


def non_negative(v: Any) -> str | None:
    """A finite number >= 0."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    return None if ok else f"{{opt}} must be >= 0, got {v!r}"


def one_of(names: Iterable[str], what: str, optional: bool = False) -> Check:
    """One of ``names`` (or None, with ``optional``): "unknown WHAT 'x'; valid ...: a, b"."""
    names = tuple(names)
    noun, plural = what.split("|")

    def check(v: Any) -> str | None:
        if (v is None and optional) or v in names:
            return None
        return f"unknown {noun} {v!r}; valid {plural}: {', '.join(names)}"
    return check
