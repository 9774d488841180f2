"""The choice among cuSPARSELt's algorithm configurations in ``ops.spmm``, on the CPU with a
stand-in for the cuSPARSELt binding (the real configurations are checked by the GPU test in
test_kernels.py): the fastest configuration whose product matches is kept and recorded, a
recorded or forced choice is used without measuring, and capture builds nothing."""

from __future__ import annotations

import types

import pytest
import torch

from twofour import dispatch, timing
from twofour.kernels import cusparselt as real_cs
from twofour.kernels import ops

TIMES = {0: 3.0, 1: 1.0, 2: 0.5, 3: 2.0, 4: 9.0}  # ms per configuration; 2 is wrong, 4 cannot build
WRONG, BROKEN = 2, 4


class FakePlan:
    def __init__(self, key: real_cs.PlanKey, log: list):
        if key.config == BROKEN:
            raise RuntimeError("not supported")
        self.key, self.log, self.tuned = key, log, None
        self.config_id = 0 if key.config is None else key.config
        self.num_configs, self.compressed_size = len(TIMES), 123

    def matmul(self, a, b, d, bias=None):
        self.log.append(self.config_id)
        prod = a.float() @ b.float() + (1.0 if self.config_id == WRONG else 0.0)
        d.copy_(prod.t() if self.key.d_order == real_cs.COL else prod)
        return d


@pytest.fixture
def fake(monkeypatch):
    """A stand-in binding: plans cached by key, every build and matmul logged."""
    plans: dict = {}
    ran: list[int] = []
    built: list = []

    def plan_for(key):
        if key not in plans:
            built.append(key)
            plans[key] = FakePlan(key, ran)
        return plans[key]

    def get_plan(m, k, n, b_order, d_order, dtype, device=None, bias=False, config=None, out_dtype=None):
        return plan_for(real_cs.PlanKey(m, k, n, b_order, d_order, dtype, 0 if device is None else device, bias,
                                        config, None if out_dtype == dtype else out_dtype))

    def drop_plan(plan):
        plans.pop(plan.key, None)

    def forget_tuning():
        for p in plans.values():
            p.tuned = None

    cs = types.SimpleNamespace(ROW=real_cs.ROW, COL=real_cs.COL, PlanKey=real_cs.PlanKey, get_plan=get_plan,
                               plan_for=plan_for, cached_plan=plans.get, drop_plan=drop_plan,
                               forget_tuning=forget_tuning)
    monkeypatch.setattr(ops, "_cs", cs)
    monkeypatch.setattr(timing, "median_ms", lambda fn: (ran.clear(), fn(), TIMES[ran[-1]])[-1])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    dispatch.clear_choices()
    yield types.SimpleNamespace(plans=plans, ran=ran, built=built)
    dispatch.clear_choices()


def operands():
    torch.manual_seed(0)
    a, b = torch.randn(8, 16), torch.randn(16, 12)
    return a, b, (a @ b)


@pytest.mark.parametrize("d_col", [False, True])
def test_keeps_the_fastest_configuration_whose_product_matches(fake, d_col, caplog):
    a, b, ref = operands()
    y = ops.spmm(a, b, 8, d_col)
    torch.testing.assert_close(y, ref)
    ((key, value),) = dispatch.choices().items()
    assert key.startswith(f"spmm-d{'col' if d_col else 'row'}:8x16x12:Brow:") and key.endswith(":configs")
    assert value["choice"] == "sparse#1"  # 2 is faster but wrong, 4 cannot build
    assert set(value["ms"]) == {"sparse#0", "sparse#1", "sparse#3"}
    assert "configuration 2 gave another product" in caplog.text
    # the losers are dropped from the cache: the default (the lookup entry) and the winner stay
    assert sorted(p.config_id for p in fake.plans.values()) == [0, 1]
    fake.ran.clear()
    ops.spmm(a, b, 8, d_col)
    assert fake.ran == [1]  # no measuring the second time
    line = dispatch.choice_lines("spmm")[0]
    assert line.startswith(key) and "'sparse#0 (default)'" in line and "of 3 configurations" in line


def test_forced_choice_is_used_without_measuring(fake):
    a, b, ref = operands()
    ops.spmm(a, b, 8, False)
    (key,) = dispatch.choices()
    dispatch.set_choice(key, "sparse#3")
    fake.ran.clear()
    torch.testing.assert_close(ops.spmm(a, b, 8, False), ref)
    assert fake.ran == [3]
    dispatch.set_choice(key, "dense")
    with pytest.raises(ValueError, match="sparse#N"):
        ops.spmm(a, b, 8, False)


def test_capture_builds_nothing(fake, monkeypatch):
    a, b, _ = operands()
    ops.spmm(a, b, 8, False)  # measured eagerly: configuration 1 recorded and built
    (key,) = dispatch.choices()
    dispatch.set_choice(key, "sparse#3")  # forced to a configuration whose plan was dropped
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    built = len(fake.built)
    fake.ran.clear()
    ops.spmm(a, b, 8, False)
    assert fake.ran == [0] and len(fake.built) == built  # the default, nothing built
    dispatch.set_choice(key, "sparse#1")  # recorded, and its plan exists
    fake.ran.clear()
    ops.spmm(a, b, 8, False)
    assert fake.ran == [1] and len(fake.built) == built
    dispatch.clear_choices()  # nothing recorded: the default, nothing measured
    fake.ran.clear()
    ops.spmm(a, b, 8, False)
    assert fake.ran == [0] and not dispatch.choices()


def test_set_choice_keys_are_what_choice_lines_print(fake):
    a, b, _ = operands()
    ops.spmm(a, b, 8, True)
    key = dispatch.choice_lines()[0].split(": ")[0]
    assert key in dispatch.choices()


def test_nan_in_the_data_is_not_a_disagreement(fake):
    a, b, _ = operands()
    a[0, 0] = float("nan")
    ops.spmm(a, b, 8, False)
    ((_, value),) = dispatch.choices().items()
    assert set(value["ms"]) == {"sparse#0", "sparse#1", "sparse#3"}  # only the wrong one left out
