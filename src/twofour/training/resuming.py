"""What a resumed run trains with, and whether a checkpoint belongs to a run folder: both read
from the options' declarations (:mod:`twofour.training.declare`: each option's resume rule, whether
it is part of a run's identity, and what its unset value amounts to)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

from ..errors import TrainError
from .config import TrainConfig
from .declare import declared, identity_options, option_name, resume_rule

__all__ = ["resumed_config", "first_difference", "IDENTITY_OPTIONS"]

#: What makes a run the run it is (its model and shapes, recipe, data, seed): a checkpoint belongs
#: to the run folder whose ``config.json`` agrees with it on all of them (declared ``identity=True``).
IDENTITY_OPTIONS = identity_options(TrainConfig)


def resumed_config(saved: dict[str, Any], cfg: TrainConfig, given: set[str] | None = None) -> TrainConfig:
    """The settings a resumed run trains with, as nanoGPT's ``init_from='resume'`` does: those of
    its checkpoint (``saved``, the checkpoint's config), with ``cfg``'s launch options (declared
    ``resume="launch"``) and, where ``cfg`` gives them, its adjustable ones (``resume="adjustable"``).

    ``given`` names the fields ``cfg`` sets explicitly (the command line's options); None means
    all of them (a config built in Python). A given field that changes what is trained (data,
    schedule, batch, recipe, model, ...) must equal the checkpoint's, else TrainError names it
    (one the checkpoint left unset equals what its default amounts to, the declaration's
    ``effective``); ``steps`` may change only with ``reschedule`` (the schedule is recomputed).
    ``cfg``'s class may declare more options than TrainConfig (a subclass)."""
    cls = type(cfg)
    old = cls.from_dict(saved)
    merged = {}
    for f in dataclasses.fields(cls):
        name, mine, theirs = f.name, getattr(cfg, f.name), getattr(old, f.name)
        explicit = given is None or name in given
        rule = resume_rule(cls, name)
        if rule == "launch" or (rule == "adjustable" and explicit):
            merged[name] = mine
        elif explicit and not _same(name, mine, old) and not (name == "steps" and cfg.reschedule):
            hint = " or add --reschedule to recompute the schedule over the new --steps" if name == "steps" else ""
            raise TrainError(f"{option_name(cls, name)} {_show(mine)} contradicts the run being resumed "
                             f"({_show_saved(name, old)} in its checkpoint): a resumed run keeps its settings; leave "
                             f"the option out{hint}, or start a new run with another --out")
        else:
            merged[name] = mine if explicit else theirs
    if not merged["compile"] and not (given is None or "compile_mode" in given):
        merged["compile_mode"] = "default"  # resumed with --no-compile: the saved mode goes with it
    return cls(**merged)


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first of :data:`IDENTITY_OPTIONS` on which saved configs ``a`` and ``b`` train
    differently, as (option, a's value, b's value) for a message; None when they agree."""
    ca, cb = TrainConfig.from_dict(a), TrainConfig.from_dict(b)
    for name in IDENTITY_OPTIONS:
        if not _same(name, getattr(cb, name), ca):
            return option_name(TrainConfig, name), _show_saved(name, ca), _show_saved(name, cb)
    return None


def _effective(cls: type, name: str):
    """What an unset value of field ``name`` amounts to, as a function of the config (or None)."""
    return next((d.effective for f, d in declared(cls) if f.name == name), None)


def _same(name: str, mine: Any, old: Any) -> bool:
    """Whether ``mine``, given for field ``name`` on resume, trains what ``old`` (the checkpoint's
    config) does: the same value, or the value its unset default amounts to."""
    if _norm(mine) == _norm(getattr(old, name)):
        return True
    effective = _effective(type(old), name)
    try:
        return effective is not None and _norm(effective(dataclasses.replace(old, **{name: mine}))) == _norm(
            effective(old))
    except (TrainError, KeyError, TypeError, ValueError):  # a value that builds no run: it differs
        return False


def _show_saved(name: str, old: Any) -> str:
    """The checkpoint's value of field ``name``, with what an unset default amounts to."""
    value = getattr(old, name)
    effective = _effective(type(old), name)
    if value is None and effective is not None:
        with contextlib.suppress(TrainError, KeyError, TypeError, ValueError):
            return f"unset: {effective(old)} by default"
    return _show(value)


def _norm(value: Any) -> Any:
    """Settings compared as their JSON form (tuples and lists alike)."""
    return json.loads(json.dumps(value))


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "(none)"
    return "(none)" if value is None else str(value)
