"""docs/RESULTS.md's tables recompute from the run files of docs/results/ (scripts/results_tables.py),
and scripts/s_ste_ablation.py plans one distinct, reusable run folder per variant and seed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import results_tables  # noqa: E402
import s_ste_ablation  # noqa: E402


def test_results_md_tables_match_the_run_files():
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    assert text.count("<!-- table ") == text.count("<!-- /table -->") >= 5
    assert results_tables.rewrite(text) == text, "run scripts/results_tables.py --write docs/RESULTS.md"


def test_rewrite_fills_each_block_and_refuses_unknown_names(monkeypatch):
    monkeypatch.setattr(results_tables, "TABLES", {"a": lambda: "| x |", "b": lambda: "| y |"})
    text = "intro\n<!-- table a -->\nold\n<!-- /table -->\nmid\n<!-- table b -->\n<!-- /table -->\nend\n"
    assert results_tables.rewrite(text) == ("intro\n<!-- table a -->\n| x |\n<!-- /table -->\nmid\n"
                                            "<!-- table b -->\n| y |\n<!-- /table -->\nend\n")
    broken = "<!-- table a -->\nno end marker\n<!-- table b -->\n<!-- /table -->\n"  # a is not swallowed into b
    fixed = "<!-- table a -->\nno end marker\n<!-- table b -->\n| y |\n<!-- /table -->\n"
    assert results_tables.rewrite(broken) == fixed
    with pytest.raises(SystemExit, match="unknown table 'c'"):
        results_tables.rewrite("<!-- table c -->\n<!-- /table -->\n")


def test_one_seed_is_said_and_gaps_pair_by_seed():
    assert results_tables.mean_std([1.234]) == "+1.23 % (one seed)"
    assert results_tables.mean_std([1.0, 3.0]) == "+2.00 ± 1.41 %"
    runs = [{"label": "dense", "seed": 1, "final_val_loss": 2.0}, {"label": "dense", "seed": 2, "final_val_loss": 1.0},
            {"label": "ste", "seed": 1, "final_val_loss": 2.2}, {"label": "ste", "seed": 3, "final_val_loss": 9.0}]
    assert results_tables._gaps(runs, "dense") == {"ste": {1: pytest.approx(10.0)}}


def _args(tmp_path, **kw):
    d = dict(runs=tmp_path / "runs", model="tiny", steps=20, batch_size=2, seq_len=64, seeds=[1, 2], evals=5,
             eval_iters=2, corpus=tmp_path / "corpus", device="cpu")
    return argparse.Namespace(**(d | kw))


def test_ablation_plans_one_distinct_run_per_variant_and_seed(tmp_path):
    cfgs = s_ste_ablation.configs(_args(tmp_path))
    assert len(cfgs) == 2 * len(s_ste_ablation.VARIANTS)
    assert len({c.out_dir for c in cfgs}) == len(cfgs)
    assert [c.seed for c in cfgs[: len(s_ste_ablation.VARIANTS)]] == [1] * len(s_ste_ablation.VARIANTS)
    by_name = {Path(c.out_dir).name: c for c in cfgs}
    assert by_name["s-ste-beta_interval=2-s1"].recipe_options == {"beta_interval": 2}
    assert by_name["s-ste-mvue=false-s2"].recipe_options == {"mvue": False}
    lr = by_name["ste-lr=0.002-s1"]
    assert lr.lr == pytest.approx(2 * by_name["ste-s1"].peak_lr) and lr.weight_decay == by_name["ste-s1"].weight_decay
    assert by_name["s-ste-weight_decay=0-s1"].weight_decay == 0.0
    for c in cfgs:
        c.validate()  # every planned config is one twofour train accepts
        assert c.ckpt_interval == c.steps and c.eval_interval == 4


def test_ablation_reuses_a_finished_run_only_if_it_is_the_same(tmp_path):
    cfg = s_ste_ablation.configs(_args(tmp_path))[2]
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert not s_ste_ablation.finished(cfg)  # no summary: not finished
    (out / "summary.json").write_text(json.dumps({"recipe": cfg.recipe, "seed": cfg.seed, "steps": cfg.steps}))
    assert s_ste_ablation.finished(cfg)
    other = s_ste_ablation.configs(_args(tmp_path, steps=40))[2]
    assert Path(other.out_dir) == out and not s_ste_ablation.finished(other)


def test_make_corpus_stops_at_max_bytes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"m{i}.py").write_text(f"x = {i}\n" * 100)  # 600 bytes each
    out = tmp_path / "corpus"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_corpus.py"), str(out), "--roots", str(src),
                          "--max-bytes", "1500"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert len(list(out.iterdir())) == 3 and "3 files, 0.0 MB" in res.stdout
