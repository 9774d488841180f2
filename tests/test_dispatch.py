"""The process-wide state of ``twofour.dispatch``: the switches (environment, run time, the
``override`` context), the measured choices, and the failed-route memo (recorded once, logged
once, skipped from then on)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from twofour import dispatch, fp8, timing


@pytest.fixture
def clean():
    dispatch.clear_failures()
    dispatch.clear_choices()
    yield
    dispatch.clear_failures()
    dispatch.clear_choices()


def fresh_dispatch(monkeypatch, **env):
    """A new copy of the module, imported under ``env`` (the switches are read at import)."""
    for name in ("TWOFOUR_FAST", "TWOFOUR_GEMM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("twofour.fresh_dispatch", dispatch.__file__)  # imports .timing
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


def test_a_timer_given_measures_every_candidate_and_keeps_the_fastest(clean, monkeypatch):
    """``choose`` measures with the timer it is given (the inference routes time graph replays), records
    each candidate's time and runs the fastest from then on."""
    monkeypatch.setattr(dispatch, "can_measure", lambda: True)  # as on a GPU outside a capture
    ran = []
    cands = {"sparse": lambda: ran.append("sparse"), "sparse_gemv": lambda: ran.append("sparse_gemv")}
    timer = {"sparse": 0.5, "sparse_gemv": 0.25}
    with dispatch.override(gemm="auto"):
        got = dispatch.choose("inf", 64, 32, 1, "row", torch.bfloat16, cands, lambda fn: fn() or timer[ran[-1]])
        assert got == "sparse_gemv" and ran == ["sparse", "sparse_gemv"]
        assert dispatch.choose("inf", 64, 32, 1, "row", torch.bfloat16, cands, None) == "sparse_gemv"
    key = dispatch.choice_key("inf", 64, 32, 1, "row", torch.bfloat16, cands)
    assert dispatch.choices()[key] == {"choice": "sparse_gemv", "ms": timer}


@pytest.mark.gpu
def test_gpu_graph_timing_scores_what_cannot_be_captured_as_infinity(clean):
    """A candidate is timed as replays of a captured graph; one that can't be captured (it
    synchronizes the device) scores infinity, and leaves eager work and random draws working."""
    a = torch.zeros(1 << 20, device="cuda")
    assert 0 < timing.graph_median_ms(lambda: a.add_(1.0)) < 1.0

    def syncs() -> None:
        a.add_(1.0)
        torch.cuda.synchronize()

    assert timing.graph_median_ms(syncs) == float("inf")
    assert torch.randn(8, device="cuda").isfinite().all() and a.add_(1.0).isfinite().all()
    assert 0 < timing.graph_median_ms(lambda: a.add_(1.0)) < 1.0


# -- failed routes ----------------------------------------------------------------------------


def test_a_failure_is_recorded_and_logged_once(clean, caplog):
    route = ("fp8-24-fwd", 64, 64, 32, 0, torch.bfloat16)
    assert not dispatch.failed(route)
    with caplog.at_level(logging.WARNING, logger="twofour"):
        dispatch.record_failure(route, "the FP8 2:4 GEMM", RuntimeError("not supported\nsecond line"), "dense")
        dispatch.record_failure(route, "the FP8 2:4 GEMM", RuntimeError("again"), "dense")
    assert dispatch.failed(route) and dispatch.failures() == {route: "RuntimeError: not supported"}
    (record,) = caplog.records
    assert record.getMessage() == (f"the FP8 2:4 GEMM failed for {route} (RuntimeError: not supported); it is not "
                                   "used from now on: dense runs instead")
    dispatch.clear_failures()
    assert not dispatch.failed(route) and not dispatch.failures()


def test_a_route_that_raises_runs_once_and_is_skipped_after(clean, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU builds have no answer
    runs = {"good": 0, "bad": 0}

    def good():
        runs["good"] += 1

    def bad():
        runs["bad"] += 1
        raise ValueError("cannot build")

    routes = {"bad": bad, "good": good}
    with caplog.at_level(logging.WARNING, logger="twofour"):
        for _ in range(3):
            assert list(dispatch.working("inf", routes, (256, 512, 8), "the 2:4 kernel")) == ["good"]
    assert runs == {"good": 1, "bad": 1}  # each route tried once at this shape, the failing one never again
    assert len(caplog.records) == 1 and "the 2:4 kernel 'bad' failed" in caplog.text
    assert dispatch.failures() == {("inf", "bad", 256, 512, 8): "ValueError: cannot build"}
    assert list(dispatch.working("inf", routes, (256, 512, 16), "the 2:4 kernel")) == ["good"]  # a new shape: tried
    assert runs == {"good": 2, "bad": 2}
    with pytest.raises(RuntimeError, match="every route of the 2:4 kernel failed.*bad: ValueError: cannot build"):
        dispatch.working("inf", {"bad": bad}, (256, 512, 8), "the 2:4 kernel")


def test_fp8_refusals_are_the_scaled_mm_failures(clean):
    kind = ("cpu", fp8.E4M3, fp8.E4M3, False, (16, 32), 8, torch.bfloat16)
    dispatch.record_failure(("scaled_mm", *kind), "torch._scaled_mm", RuntimeError("no"))
    dispatch.record_failure(("fp8-24-fwd", 8, 32, 16, 0, torch.bfloat16), "the FP8 2:4 GEMM", RuntimeError("no"))
    assert fp8.refusals() == frozenset({kind})
