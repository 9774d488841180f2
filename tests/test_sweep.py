"""``twofour compare --lrs``: every recipe at every rate, reused when finished, each recipe's rate
chosen on one half of the validation split and reported on the other."""

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from twofour.cli import main
from twofour.errors import DivergedError
from twofour.training import compare, runs
from twofour.training import sweep as sweep_module
from twofour.training.config import TrainConfig
from twofour.training.data import load_data
from twofour.training.export import run_model
from twofour.training.loop import evaluate
from twofour.training.runs import pyplot
from twofour.training.sweep import SCORES, best_rates, halves, parse_rates, sweep_table

from .helpers import error_of

RUN = ["--model", "tiny", "--n-layer", "1", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
       "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "2", "--no-progress"]


def test_sweep_trains_every_rate_once_and_reports_on_the_other_half(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setattr(runs, "plot_run", lambda out, title: None)  # each run's curves.png: not tested here
    out = tmp_path / "sweep"
    args = ["compare", *RUN, "--data", corpus, "--out", str(out), "--seeds", "1"]
    with monkeypatch.context() as m:  # a plain comparison: dense at the preset's rate (its plot: not tested)
        m.setattr(compare, "plot_compare", lambda root, summaries: None)
        assert main([*args, "--recipes", "dense"]) == 0
    sweep = [*args, "--recipes", "dense,ste", "--lrs", "1x,2e-3"]
    assert main(sweep) == 0
    # every recipe at every rate; dense at the preset's (1e-3) is the plain comparison's run, reused
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"dense-s1", "dense-lr=0.002-s1", "ste-lr=0.001-s1",
                                                             "ste-lr=0.002-s1"}
    # each score is the run's final model on its own half of the validation split: no token in both
    data = load_data(corpus)
    first, second = halves(data)
    assert np.array_equal(np.concatenate([first.val, second.val]), data.val) and len(first.val) > 100
    model, cfg, _ = run_model(out / "dense-lr=0.002-s1")
    saved = json.loads((out / "dense-lr=0.002-s1" / SCORES).read_text())
    for name, half in (("selection", first), ("report", second)):
        assert saved[name] == pytest.approx(evaluate(model, half, cfg, torch.device("cpu"), contextlib.nullcontext()))
    table = (out / "compare.md").read_text()
    assert "| dense | 0.001 | 1 |" in table and "| ste | 0.002 | 1 |" in table and table in capsys.readouterr().out
    assert (out / "compare.png").exists() == (pyplot() is not None)
    # run again: nothing trained, nothing scored again
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*") if p.name in ("ckpt.pt", SCORES)}
    monkeypatch.setattr(sweep_module, "plot_sweep", lambda root, summaries: None)  # drawn above, for time
    assert len(stamps) == 8 and main(sweep) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps} and (out / "compare.md").read_text() == table
    # scores left by another run in that folder (another final loss) are not this run's: scored again
    (out / "dense-lr=0.002-s1" / SCORES).write_text(json.dumps({**saved, "selection": 9.0, "final_val_loss": 9.0}))
    assert main(sweep) == 0 and json.loads((out / "dense-lr=0.002-s1" / SCORES).read_text()) == saved


def test_a_run_that_diverges_is_a_result_not_the_end_of_the_sweep(tmp_path, corpus, monkeypatch):
    """A diverged run is recorded in its folder, listed as diverged, never chosen, not trained again
    by a second call; --overwrite trains it again."""
    monkeypatch.setattr(runs, "plot_run", lambda out, title: None)  # not tested here, for time
    monkeypatch.setattr(sweep_module, "plot_sweep", lambda root, summaries: None)
    real, calls = compare.train, []

    def train(cfg, *args, **kwargs):  # ste at 2e-3 diverges at its first step, after writing its config
        calls.append(cfg.out_dir)
        if cfg.recipe == "ste" and cfg.lr == 2e-3:
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.out_dir) / "config.json").write_text(json.dumps(cfg.to_dict()))
            raise DivergedError("training diverged: the loss or gradient norm is not finite at step 1", 1)
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(compare, "train", train)
    out = tmp_path / "sweep"
    sweep = ["compare", *RUN, "--data", corpus, "--out", str(out), "--seeds", "1", "--recipes", "dense,ste",
             "--lrs", "1e-3,2e-3"]
    assert main(sweep) == 0 and len(calls) == 4
    table = (out / "compare.md").read_text()
    assert "| ste | 0.002 | 1 | diverged at step 1 |" in table
    assert "| ste | 0.001 (lowest tried) | 1 |" in table  # the rate that trained is chosen
    assert "| ste | 0.002 | 1 | diverged (seed 1) | diverged (seed 1) | n/a (diverged) | n/a |" in table
    assert main(sweep) == 0 and len(calls) == 4 and (out / "compare.md").read_text() == table
    assert main([*sweep, "--overwrite"]) == 0 and calls.count(str(out / "ste-lr=0.002-s1")) == 2


def _run(recipe, lr, seed, selection, report):
    return {"recipe": recipe, "recipe_options": {}, "precision": "bf16", "model": "tiny", "regime": "ours",
            "seed": seed, "steps": 2, "tokens": 256, "lr": lr, "selection": selection, "report": report,
            "final_val_loss": (selection + report) / 2, "mean_flip_rate": 0.0, "final_flip_rate": 0.0,
            "tokens_per_s": 1.0, "wall_s": 1.0}


def test_the_rate_is_chosen_on_the_selection_half_and_reported_on_the_other():
    """Where the report half would pick another rate, the selection half's choice stands, and the
    numbers reported (losses, gaps paired by seed) are the report half's."""
    runs = [_run("dense", 1e-3, 1, 2.0, 1.0), _run("dense", 1e-3, 2, 2.0, 1.2),
            _run("dense", 2e-3, 1, 1.0, 3.0), _run("dense", 2e-3, 2, 1.1, 3.4),  # dense: 2e-3 on selection
            _run("ste", 1e-3, 1, 1.5, 3.3), _run("ste", 1e-3, 2, 1.6, 3.4),  # ste: 1e-3 on selection
            _run("ste", 2e-3, 1, 2.5, 0.5), _run("ste", 2e-3, 2, 2.6, 0.6),
            _run("ste", 4e-3, 1, 0.1, 0.1)]  # the lowest, but one seed of two: not comparable
    assert best_rates(runs) == {"dense": 2e-3, "ste": 1e-3}
    table = sweep_table(runs)
    best = table[table.index("| recipe | best lr"):table.index("Every recipe at every")]
    # ste at 1e-3 against dense at 2e-3, seed by seed on the report half: gaps 0.3 and 0.0
    assert "| ste | 0.001 (lowest tried) | 1, 2 | 3.3500 ± 0.0707 | 0.002 | +0.1500 ± 0.2121 | +5.00 ± 7.07 % |" in best
    assert "| dense | 0.002 (highest tried) | 1, 2 | 3.2000 ± 0.2828 | 0.002 | +0.0000 ± 0.0000 |" in best
    assert "| ste | 0.002 | 1, 2 | 2.5500 ± 0.0707 | 0.5500 ± 0.0707 | -2.6500 ± 0.2121 |" in table
    assert "| ste | 0.004 | 1 | 0.1000 | 0.1000 | n/a | n/a |" in table  # no dense at 4e-3


def test_lrs_options(tmp_path, corpus, capsys):
    base = TrainConfig(model="tiny")
    assert parse_rates(" 2x, 5e-4,1x", base) == [5e-4, 1e-3, 2e-3]
    assert parse_rates("3x", TrainConfig(model="gpt2-124m")) == [1.8e-3]  # 3 x 6e-4, rounded as written
    assert parse_rates("1.234567891e-3", base) == [1.234567891e-3]  # a rate given is the rate trained
    cmd = ["compare", *RUN, "--data", corpus, "--out", str(tmp_path / "x")]
    assert "--lr and --lrs contradict" in error_of([*cmd, "--lr", "1e-3", "--lrs", "1e-3,2e-3"], capsys)
    assert "got 'fast'" in error_of([*cmd, "--lrs", "1e-3,fast"], capsys)
    assert "0.001 twice" in error_of([*cmd, "--lrs", "1e-3,1x"], capsys)
    assert "at most 1, got 2" in error_of([*cmd, "--lrs", "2"], capsys)
    for bad in ("0", "0x", "-1e-3", "nan"):
        assert f"> 0 and at most 1, got {bad}" in error_of([*cmd, f"--lrs=1e-3,{bad}"], capsys)
    assert "got an empty one in ''" in error_of([*cmd, "--lrs", ""], capsys)
    assert "got an empty one in '1e-3,,2e-3'" in error_of([*cmd, "--lrs", "1e-3,,2e-3"], capsys)
    assert "--ckpt-interval 0 writes none" in error_of([*cmd, "--lrs", "1e-3", "--ckpt-interval", "0"], capsys)
    assert not (tmp_path / "x").exists()
