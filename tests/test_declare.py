"""Run options are declared once (twofour.training.declare): the command line, the checks,
config.json and the resume rules all follow a field's declaration, so adding one is one field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from twofour.errors import TrainError
from twofour.training.config import ADJUSTABLE_OPTIONS, LAUNCH_OPTIONS, TrainConfig
from twofour.training.declare import add_options, option, positive
from twofour.training.resuming import IDENTITY_OPTIONS, resumed_config


@dataclass
class WithMore(TrainConfig):
    """TrainConfig and two options more, declared as every option is."""

    foo: int = option(3, group=0, check=positive(), resume="adjustable", type=int, help="a test option")
    bar: int = option(1, group=2, check=positive(), type=int, help="another, fixed on resume")


def _parse(argv: list[str], command: str = "train") -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_options(p, WithMore, command, {"out_dir": "runs/x"})
    return p.parse_args(argv)


def test_an_added_option_reaches_the_command_line_the_checks_and_the_saved_config():
    a = _parse(["--foo", "5", "--steps", "7"])
    assert (a.foo, a.bar, a.steps, a.out_dir) == (5, 1, 7, "runs/x")
    cfg = WithMore(foo=a.foo, steps=a.steps)
    cfg.validate()
    assert cfg.to_dict()["foo"] == 5 and WithMore.from_dict(cfg.to_dict()).foo == 5
    with pytest.raises(TrainError, match="--foo must be a positive integer, got 0"):
        WithMore(foo=0).validate()
    with pytest.raises(SystemExit):
        _parse(["--foo", "many"])


def test_an_added_option_follows_its_resume_rule():
    saved = WithMore(foo=4, bar=2).to_dict()
    assert resumed_config(saved, WithMore(foo=9), given={"foo"}).foo == 9  # adjustable: a given value wins
    kept = resumed_config(saved, WithMore(), given=set())
    assert (kept.foo, kept.bar) == (4, 2)  # nothing given: the checkpoint's
    with pytest.raises(TrainError, match="--bar 3 contradicts the run being resumed"):
        resumed_config(saved, WithMore(bar=3), given={"bar"})  # fixed: must agree


def test_the_declarations_keep_the_resume_rules():
    assert LAUNCH_OPTIONS == {"out_dir", "resume", "reschedule", "overwrite", "stop_at", "progress"}
    assert ADJUSTABLE_OPTIONS == {"log_interval", "eval_interval", "ckpt_interval", "device", "compile",
                                  "compile_mode", "fsdp", "step_graphs", "skip_nonfinite", "activation_checkpointing"}
    assert set(IDENTITY_OPTIONS) == {"model", "n_layer", "sparse_attention", "seq_len", "vocab_size", "recipe",
                                     "recipe_options", "precision", "data", "seed"}


def test_train_only_options_stay_off_compare():
    assert _parse(["--resume"]).resume
    with pytest.raises(SystemExit):
        _parse(["--resume"], command="compare")
