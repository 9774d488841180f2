"""The process-wide state of ``twofour.dispatch``: the switches (environment, run time, the
``override`` context) and the measured choices."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from twofour import dispatch


@pytest.fixture
def clean():
    dispatch.clear_choices()
    yield
    dispatch.clear_choices()


def fresh_dispatch(monkeypatch, **env):
    """A new copy of the module, imported under ``env`` (the switches are read at import)."""
    for name in ("TWOFOUR_FAST", "TWOFOUR_GEMM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("fresh_dispatch", dispatch.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- switches ---------------------------------------------------------------------------------


def test_switches_are_read_from_the_environment(monkeypatch):
    d = fresh_dispatch(monkeypatch)
    assert d.fast is True and d.gemm == "auto"
    d = fresh_dispatch(monkeypatch, TWOFOUR_FAST="0", TWOFOUR_GEMM=" Sparse ")
    assert d.fast is False and d.gemm == "sparse"


def test_a_bad_gemm_mode_is_refused_at_import_in_one_line(monkeypatch):
    with pytest.raises(ValueError) as err:
        fresh_dispatch(monkeypatch, TWOFOUR_GEMM="fastest")
    assert str(err.value) == "TWOFOUR_GEMM='fastest': expected one of auto, dense, sparse"


def test_override_restores_the_switches_also_after_an_error():
    before = (dispatch.fast, dispatch.gemm)
    with pytest.raises(KeyError), dispatch.override(fast=not before[0], gemm="dense"):
        assert (dispatch.fast, dispatch.gemm) == (not before[0], "dense")
        raise KeyError("inside")
    assert (dispatch.fast, dispatch.gemm) == before
    with pytest.raises(ValueError, match="expected one of"):
        dispatch.set_gemm("fastest")
    assert dispatch.gemm == before[1]


# -- measured choices -------------------------------------------------------------------------


def never() -> None:
    raise AssertionError("a candidate ran where nothing was to be measured")


def test_a_set_choice_is_used_without_measuring(clean):
    cands = {"sparse": never, "dense": never}
    key = dispatch.choice_key("fwd", 64, 32, 16, "row", torch.bfloat16, cands)
    assert key == "fwd:64x32x16:Brow:bfloat16:dense|sparse"
    dispatch.set_choice(key, "dense")
    with dispatch.override(gemm="auto"):
        assert dispatch.choose("fwd", 64, 32, 16, "row", torch.bfloat16, cands) == "dense"
    assert dispatch.recorded(key) == "dense" and dispatch.choices() == {key: {"choice": "dense", "ms": {}}}
    assert dispatch.choice_lines("fwd") == [f"{key}: dense  {{}}"] and dispatch.choice_lines("dx") == []
    dispatch.clear_choices()
    assert dispatch.recorded(key) is None and not dispatch.choices()


def test_a_forced_side_or_a_single_candidate_measures_nothing(clean):
    cands = {"sparse_dr": never, "sparse": never, "dense": never}
    for mode, want in (("dense", "dense"), ("sparse", "sparse_dr")):
        with dispatch.override(gemm=mode):
            assert dispatch.choose("fwd", 64, 32, 16, "row", torch.bfloat16, cands) == want
    with dispatch.override(gemm="auto"):
        assert dispatch.choose("fwd", 64, 32, 16, "row", torch.bfloat16, {"dense": never}) == "dense"
    assert not dispatch.choices()
