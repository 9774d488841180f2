"""docs/RESULTS.md's tables recompute from the run files of docs/results/ (scripts/results_tables.py),
scripts/s_ste_ablation.py plans one distinct, reusable run folder per variant and seed, and
scripts/torchtitan_curves.py reads torchtitan's logged steps."""

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
import torchtitan_curves  # noqa: E402


def test_results_md_tables_match_the_run_files():
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    assert text.count("<!-- table ") == text.count("<!-- /table -->") >= 5
    assert results_tables.rewrite(text) == text, "run scripts/results_tables.py --write docs/RESULTS.md"
    assert results_tables.problems(text) == []  # every other table quotes figures the marked ones give


def test_check_finds_an_unmarked_table_and_a_figure_its_tables_lack(monkeypatch):
    monkeypatch.setattr(results_tables, "TABLES", {"a": lambda: "| x | +1.50 ± 0.75 % | +9.20 % |"})
    quoted = "<!-- quotes a -->\n| run | result |\n|---|---|\n| x | {} and +9.20 % |\n<!-- /quotes -->\n"
    marked = "<!-- table a -->\n| old |\n<!-- /table -->\n"
    assert results_tables.problems(marked + quoted.format("+1.50 ± 0.75 %")) == []
    assert results_tables.problems(quoted.format("+1.51 ± 0.75 %")) == [
        "+1.51 ± 0.75 % (quoted from a) is in none of those tables"]
    assert results_tables.problems("text\n\n| a | b |\n|---|---|\n") == ["a table outside the marked blocks: | a | b |"]


def test_a_sweep_folder_is_tabulated_from_its_files(tmp_path):
    """A ``twofour compare --lrs`` folder copied without checkpoints: its tables from summary.json,
    config.json, metrics.csv and val_halves.json."""
    from twofour.errors import TrainError
    from twofour.training.config import TrainConfig
    from twofour.training.sweep import SCORES

    runs = (("dense", 1e-3, 2.0, 2.2), ("dense", 2e-3, 1.9, 2.4), ("ste", 2e-3, 2.0, 2.5))
    for recipe, lr, selection, report in runs:
        run = tmp_path / f"{recipe}-lr={lr}-s1"
        run.mkdir()
        (run / "config.json").write_text(json.dumps(TrainConfig(model="tiny", recipe=recipe, lr=lr, seed=1).to_dict()))
        (run / "metrics.csv").write_text("step,tokens,lr,train_loss,val_loss,flip_rate,tokens_per_s,elapsed_s\n")
        (run / "summary.json").write_text(json.dumps(
            {"recipe": recipe, "model": "tiny", "seed": 1, "steps": 2, "tokens": 64, "final_val_loss": 2.1,
             "mean_flip_rate": 0.0, "final_flip_rate": 0.0, "tokens_per_s": 1.0, "wall_s": 1.0}))
        (run / SCORES).write_text(json.dumps({"selection": selection, "report": report, "steps": 2,
                                               "final_val_loss": 2.1}))
    table = results_tables.sweep_tables(tmp_path)
    assert "| dense | 0.002 (highest tried) | 1 | 2.4000 | 0.002 | +0.0000 | +0.00 % |" in table
    assert "| ste | 0.002 | 1 | 2.5000 | 0.002 | +0.1000 | +4.17 % |" in table
    (tmp_path / "ste-lr=0.002-s1" / SCORES).unlink()
    with pytest.raises(TrainError, match="without its val_halves.json"):
        results_tables.sweep_tables(tmp_path)


def _fake_runs(root: Path, runs: tuple[tuple[str, float, int, float], ...]) -> None:
    """Finished run folders (recipe, lr, seed, final val loss) as a sweep leaves them, without checkpoints."""
    from twofour.training.config import TrainConfig

    for recipe, lr, seed, loss in runs:
        run = root / f"{recipe}-lr={lr}-s{seed}"
        run.mkdir()
        cfg = TrainConfig(model="tiny", recipe=recipe, lr=lr, seed=seed)
        (run / "config.json").write_text(json.dumps(cfg.to_dict()))
        (run / "summary.json").write_text(json.dumps(
            {"recipe": recipe, "model": "tiny", "seed": seed, "steps": 2, "tokens": 64, "final_val_loss": loss,
             "mean_flip_rate": 0.0, "final_flip_rate": 0.0, "tokens_per_s": 1.0, "wall_s": 1.0}))


def test_the_shift_table_pairs_each_rate_with_the_other_recipes_at_that_rate_and_a_factor_above(tmp_path):
    _fake_runs(tmp_path, (("ste", 1e-3, 1, 2.0), ("ste", 1.5e-3, 1, 1.8), ("ste", 1e-3, 2, 4.0),
                          ("ste", 1.5e-3, 2, 3.6), ("s-ste", 1e-3, 1, 1.8), ("s-ste", 1e-3, 2, 3.6),
                          ("s-ste", 1.5e-3, 1, 1.9), ("s-ste", 6.667e-4, 1, 2.0)))
    rows = results_tables.shift_table(tmp_path).splitlines()[2:]
    # s-ste at r matches ste at 1.5 r on both seeds; 6.667e-4 * 1.5 finds 1e-3 (not exactly equal)
    assert rows == ["| 0.0006667 | not run | +0.00 % (one seed) |",
                    "| 0.001 | -10.00 ± 0.00 % | +0.00 ± 0.00 % |",
                    "| 0.0015 | +5.56 % (one seed) | not run |"]


def test_against_pairs_each_run_with_the_same_run_of_another_sweep(tmp_path):
    from twofour.training.sweep import SCORES

    for name, runs in (("attn", (("ste", 1e-3, 1, 2.2), ("ste", 1e-3, 2, 4.4), ("s-ste", 1e-3, 1, 2.0))),
                       ("ffn", (("ste", 1e-3, 1, 2.0), ("ste", 1e-3, 2, 4.0), ("ste", 2e-3, 1, 1.0)))):
        (tmp_path / name).mkdir()
        _fake_runs(tmp_path / name, runs)
        for run in (tmp_path / name).iterdir():
            loss = json.loads((run / "summary.json").read_text())["final_val_loss"]
            (run / SCORES).write_text(json.dumps({"selection": loss, "report": loss, "steps": 2,
                                                   "final_val_loss": loss}))
            (run / "metrics.csv").write_text("step,tokens,lr,train_loss,val_loss,flip_rate,tokens_per_s,elapsed_s\n")
    rows = results_tables.against_table(tmp_path / "attn", tmp_path / "ffn").splitlines()[2:]
    # ste at 1e-3 is 10 % worse on both seeds: outside a spread of 0; s-ste has no twin there
    assert sorted(rows) == ["| s-ste | 0.001 | 1 | no twin | - |",
                            "| ste | 0.001 | 1, 2 | +10.00 ± 0.00 % (n=2) | no |"]
    for run in (tmp_path / "ffn").iterdir():  # runs of another length do not pair
        s = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps(s | {"tokens": 128}))
    with pytest.raises(SystemExit, match="only runs of one model and length pair"):
        results_tables.against_table(tmp_path / "attn", tmp_path / "ffn")


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


def test_make_corpus_prose_keeps_documents_of_words(tmp_path):
    """--kind prose: .md/.rst/.txt documents of words; licences, tables of numbers and .py left out."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "guide.md").write_text("How to use the library, in plain words.\n" * 20)
    (src / "notes.rst").write_text("Another page of documentation text.\n" * 20)
    (src / "LICENSE.txt").write_text("Permission is hereby granted, free of charge.\n" * 20)
    (src / "table.txt").write_text("0.125 3.5e-3 17 42 1e9\n" * 20)
    (src / "vocab.txt").write_text("apple\nbanana\ncherry\n" * 20)  # a word list
    (src / "blob.txt").write_text("QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo" * 20)  # base64
    (src / "m.py").write_text("x = 1\n" * 20)
    out = tmp_path / "corpus"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_corpus.py"), str(out), "--roots", str(src),
                          "--kind", "prose"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(p.suffix for p in out.iterdir()) == [".md", ".rst"]


def test_make_corpus_prose_reads_an_html_pages_article_alone(tmp_path):
    """An HTML page gives its main article's text, without navigation or scripts; Sphinx's copies of
    each page's source and mdBook's one-page print of a book are left out (they repeat pages)."""
    src = tmp_path / "src"
    (src / "_sources").mkdir(parents=True)
    words = "The layer keeps a dense master weight and prunes it once a step.\n"
    page = ("<html><head><title>T</title><script>var x = 1;</script></head><body>"
            "<div class='related' role='navigation'>Home Next Previous index modules</div>"
            f"<div role='main'><h1>Layers</h1><p>{words * 8}</p><p>Caf&eacute; &amp; tea.</p></div>"
            "<div class='footer'>Copyright 2024</div></body></html>")
    (src / "layers.html").write_text(page)
    (src / "print.html").write_text(page.replace("Layers", "All"))
    (src / "_sources" / "layers.rst.txt").write_text(words * 8)
    out = tmp_path / "corpus"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_corpus.py"), str(out), "--roots", str(src),
                          "--kind", "prose"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (text,) = [p.read_text() for p in out.iterdir()]
    assert text.startswith("Layers\n") and "Café & tea." in text and words.strip() in text
    assert not any(junk in text for junk in ("var x", "Home Next", "Copyright", "<p>"))


def _titan_line(step: int, loss: float, tps: int, rank_tps: int = 0) -> str:
    return (f"[titan] 2026-01-01 00:00:00,000 - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss: {loss:8.5f}  "
            f"grad_norm:  1.0  \x1b[38;2;180;60;0mmemory: 17.95GiB(12.84%)  \x1b[34mtps: {tps + rank_tps:,}  "
            "tflops: 1.0  mfu: 1.0%\x1b[39m")


def test_torchtitan_curves_keeps_one_line_a_step_and_round_trips(tmp_path, capsys):
    """Each step's first line counts (every rank logs it), colours and all; the table's median
    leaves the first 5 steps out; the .tsv it writes reads back to the same table."""
    lines = ["## dense-x"]
    for step in range(1, 11):
        lines += [_titan_line(step, 10.0 / step, 1000 * step), _titan_line(step, 99.0, 1000 * step, rank_tps=7)]
    lines += ["## sste-x", *(_titan_line(step, 9.0 / step, 500) for step in range(1, 11)), "## empty", "no steps"]
    src = tmp_path / "torchtitan_steps.txt"
    src.write_text("\n".join(lines) + "\n")
    runs = torchtitan_curves.read_steps(src)
    assert list(runs) == ["dense-x", "sste-x", "empty"] and runs["dense-x"][4] == (2.5, 4000, 17.95)
    tsv = tmp_path / "steps.tsv"
    assert torchtitan_curves.main([str(src), "--every", "5", "--tsv", str(tsv)]) == 0
    table = capsys.readouterr().out
    assert "| dense-x | 1-10 | 8,000 |  | 17.9 | 1.0000 | 2.0000 | 1.0000 |" in table  # median of steps 6-10
    assert "| sste-x | 1-10 | 500 | 0.06x | 17.9 | 0.9000 | 1.8000 | 0.9000 |" in table
    assert "| empty | no steps logged |" in table
    assert torchtitan_curves.read_steps(tsv) == {k: v for k, v in runs.items() if v}
    assert torchtitan_curves.main([str(tmp_path / "missing.txt")]) == 2


def test_the_committed_torchtitan_steps_give_the_documented_losses():
    runs = torchtitan_curves.read_steps(ROOT / "docs" / "results" / "scale-out-4gpu" / "torchtitan_steps.tsv")
    assert runs["dense-1B-compiled"][300][0] == 1.69514 and runs["sste-1B-compiled"][300][0] == 1.61654
    doc = (ROOT / "docs" / "notes" / "torchtitan.md").read_text()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in doc.splitlines() if line.startswith("| ")]
    at = next(i for i, r in enumerate(cells) if r[0].startswith("1B, compiled") and r[1] == "300")
    header = next(r for r in reversed(cells[:at]) if r[0] == "flavor, mode")  # its table's
    assert cells[at][header.index("loss at the last step, dense / s-ste")] == "1.6951 / 1.6165"


def _peer():
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("peer", ROOT / "benchmarks" / "fp8" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def test_the_fp8_peer_tells_an_ffns_gemms_apart_by_shape_or_says_it_cannot():
    """Llama's fused gate|up (4096 -> 28672) and down (14336 -> 4096): forward, dX and dW each found,
    addmm's bias left out of its shapes; GPT's fc and proj (each the other transposed): None."""
    peer, t = _peer(), 8192
    gemms = [(1.0, 4, "aten::addmm", str([[28672], [t, 4096], [4096, 28672]])),  # forward, with its bias
             (2.0, 4, "aten::mm", str([[t, 28672], [28672, 4096], [t, 4096]])),  # dX
             (3.0, 4, "aten::_scaled_mm", str([[28672, t], [t, 4096], [], []])),  # dW
             (4.0, 4, "aten::mm", str([[t, 14336], [14336, 4096], [t, 4096]])),  # down's forward
             (9.0, 1, "aten::mm", str([[t, 4096], [4096, 32000], [t, 32000]]))]  # the head: no FFN part
    got = peer.ffn_gemm_ms(gemms, {(4096, 28672), (14336, 4096)}, t)
    assert got == {"fwd": (5.0, 8), "dX": (2.0, 4), "dW": (3.0, 4)}
    assert peer.ffn_gemm_ms(gemms, {(768, 3072), (3072, 768)}, t) is None


def test_the_fp8_peer_tables_recompute_from_their_run_files():
    """benchmarks/fp8/peer.py --from-json gives, from the committed runs, the ratios and ceilings
    docs/notes/fp8-peer.md quotes."""
    peer = _peer()
    runs = [(name, json.loads((ROOT / "docs" / "results" / "fp8-peer" / f"{name}.json").read_text()))
            for name in ("h200", "h200-before")]
    table = peer.report(runs, [2.0])
    note = (ROOT / "docs" / "notes" / "fp8-peer.md").read_text()
    assert "| ste-fp8 | 81.32 | 100,735 | 1.142x | 0.939x |" in table
    assert "| s-ste-fp8 | 79.43 | 103,140 | 1.170x | 0.961x |" in table
    for row, measured, at2 in (("ste-fp8", "1.034x (r=1.42)", "1.059x"), ("s-ste-fp8", "1.070x (r=1.42)", "1.125x"),
                               ("ste", "1.053x (r=1.43)", "1.092x"), ("s-ste", "1.116x (r=1.43)", "1.207x")):
        assert any(x.startswith(f"| {row} | ") and f"{measured} | {at2} (r=2.00) |" in x for x in table.splitlines())
        assert f"{measured.replace('r=', 'r = ')} | {at2} |" in note


def test_every_summary_under_docs_results_says_which_code_ran():
    """Each run's summary.json records its code (twofour, torch, source digest) or says it was not
    recorded and names the commit that added its files."""
    summaries = sorted((ROOT / "docs" / "results").rglob("summary.json"))
    assert len(summaries) >= 54
    for path in summaries:
        code = json.loads(path.read_text()).get("code")
        assert code is not None, f"{path.relative_to(ROOT)} records no code"
        assert ("source" in code and "torch" in code) or (
            code.get("recorded") is False and len(code.get("files_added_in", "")) == 40), path.relative_to(ROOT)


def test_never_slower_counts_rank_0s_recompilations_and_graph_breaks():
    """A compiled run's Dynamo log lines: rank 0's (or a single process's) counted, other ranks' not."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("never_slower", ROOT / "benchmarks" / "step" / "never_slower.py")
    ns = importlib.util.module_from_spec(spec)
    sys.modules["never_slower"] = ns  # its dataclasses look their module up
    spec.loader.exec_module(ns)
    brk = "torch/_dynamo/symbolic_convert.py:5124] [0/0] [__graph_breaks] Graph break in user code at x.py:1"
    rec = "torch/_dynamo/guards.py:5396] [0/1] [__recompiles] Recompiling function inner in y.py:67"
    log = "\n".join([f"[rank0]:V1129 {brk}", f"[rank1]:V1129 {brk}", f"[rank0]:V1129 {rec}", f"[rank1]:V1129 {rec}",
                     f"V1129 {rec}", "[rank0]: the loss of step 3 is 1.0", "some other line"])
    assert ns.compile_events(log) == {"recompiles": 2, "graph_breaks": 1}


def test_effective_step_splits_s_stes_move_and_tables_the_record(corpus):
    """effective_step.run: every recipe's move of its effective weight per step, S-STE's split into
    beta times the move of |W| and of the threshold (both non-zero: the threshold moves too)."""
    import effective_step

    from twofour.training.data import load_data

    data = load_data(corpus)
    ste, sste = (effective_step.run(r, 1e-3, 3, 1, data) for r in ("ste", "s-ste"))
    assert set(ste) == {"move", "kept_move"} and len(ste["move"]) == 3
    assert set(sste) == set(effective_step.COLUMNS)
    assert all(v > 0 for k in effective_step.COLUMNS for v in sste[k])
    assert all(k <= m + 1e-12 for k, m in zip(ste["kept_move"], ste["move"]))
    rows = effective_step.table({"runs": {"ste": {"1": ste}, "s-ste": {"1": sste}}}).splitlines()
    assert rows[2].startswith("| ste | ") and rows[2].endswith(" | - | - |") and len(rows) == 4


def test_the_peer_takes_any_recipe_with_options_as_a_row():
    peer = _peer()
    assert peer.row_recipe("ao-float8") == ("dense", "bf16", {})
    assert peer.row_recipe("s-ste-fp8+dx=mvue") == ("s-ste", "fp8", {"dx": "mvue"})
    assert peer.row_recipe("t-sr-ste") == ("t-sr-ste", "bf16", {})
    assert peer.row_recipe("s-ste+dx=pruned-t+attn") == ("s-ste", "bf16", {"dx": "pruned-t"})
    assert peer.row_attention("s-ste+dx=pruned-t+attn") and not peer.row_attention("s-ste+dx=pruned-t")
    with pytest.raises(ValueError, match="dx must be one of"):
        peer.row_recipe("ste+dx=sideways")


def test_the_dx_route_tables_recompute_from_their_run_files():
    """docs/notes/dx-routes.md's speed rows and its route-against-twin table come from the run
    files in docs/results/dx-speed and docs/results/dx-code."""
    note = (ROOT / "docs" / "notes" / "dx-routes.md").read_text()
    runs = json.loads((ROOT / "docs" / "results" / "dx-speed" / "h100-4blocks.json").read_text())
    table = _peer().report([("", runs)], [2.0])
    assert "| s-ste+dx=pruned-t | 88.67 | 92,392 | 1.077x | 0.922x |" in table
    assert "| s-ste dx=pruned-t | fwd, dX, dW | 88.67 | 1.077x |" in note
    four, eight = (json.loads((ROOT / "docs" / "results" / "dx-speed" / f"h100-one-pass-{n}blocks.json").read_text())
                   ["rows"] for n in (4, 8))
    r = "s-ste+dx=pruned-t"
    cells = [f"{rows[r]['ms']:.2f}** | **{rows['dense']['ms'] / rows[r]['ms']:.3f}x" for rows in (four, eight)]
    per_block = (eight["dense"]["ms"] - four["dense"]["ms"]) / (eight[r]["ms"] - four[r]["ms"])
    assert f"| **s-ste dx=pruned-t** | fwd, dX, dW | **{cells[0]}** | **{cells[1]}** | **{per_block:.3f}x** |" in note
    twins = results_tables.twin_table(ROOT / "docs" / "results" / "dx-code").splitlines()
    assert len(twins) == 6 and all(line in note for line in twins)


def test_dx_sweep_leaves_out_the_runs_a_results_folder_holds(tmp_path):
    """scripts/dx_sweep.py --reuse: a run whose scored folder is in the results folder is not
    trained again; the others are, seed by seed."""
    import dx_sweep  # noqa: PLC0415

    (tmp_path / "ste-dx=pruned-t-lr=0.0015-s3").mkdir()
    (tmp_path / "ste-dx=pruned-t-lr=0.0015-s3" / "val_halves.json").write_text("{}")
    args = argparse.Namespace(seeds=[3], lrs=["1.5x"], model="gpt-10m", reuse=tmp_path, steps=500, batch_size=32,
                              seq_len=1024, evals=5, eval_iters=16, corpus=tmp_path / "c", device="auto",
                              runs=tmp_path / "r", variants=list(dx_sweep.VARIANTS), best=None, sparse_attention=False)
    names = [name for name, _ in dx_sweep.jobs(args)]
    assert len(names) == len(dx_sweep.VARIANTS) - 1 and "ste-dx_pruned-t-lr1.5x-s3" not in names
    # with --sparse-attention an FFN-only run is no reuse, and every run takes the flag
    attention = dx_sweep.jobs(argparse.Namespace(**{**vars(args), "sparse_attention": True}))
    assert len(attention) == len(dx_sweep.VARIANTS) and all("--sparse-attention" in cmd for _, cmd in attention)
    assert "ste-dx_pruned-t-attn-lr1.5x-s3" in [name for name, _ in attention]


def test_dx_sweep_runs_each_variant_at_its_best_rate_for_a_horizon(tmp_path):
    """--best-from: each variant at the rate with the lowest mean selection score in a finished sweep
    (docs/results/dx-code), recomputed here from its scores; --tokens-per-weight: the steps of 20
    tokens per block weight of gpt-10m (its 6 blocks' matrices)."""
    import dx_sweep  # noqa: PLC0415

    folder = ROOT / "docs" / "results" / "dx-code"
    means: dict[str, dict[float, list[float]]] = {}
    for f in folder.glob("*/val_halves.json"):
        summary = json.loads((f.parent / "summary.json").read_text())
        label = dx_sweep.run_label(summary["recipe"], summary.get("recipe_options"))
        rate = json.loads((f.parent / "config.json").read_text())["lr"]
        means.setdefault(label, {}).setdefault(rate, []).append(json.loads(f.read_text())["selection"])
    best = dx_sweep.best_rates_in(folder)
    for label, rates in means.items():
        most = max(len(v) for v in rates.values())
        assert best[label] == min((r for r, v in rates.items() if len(v) == most), key=lambda r: sum(rates[r]))
    args = argparse.Namespace(seeds=[1], lrs=["1x"], model="gpt-10m", reuse=None, steps=6480, batch_size=32,
                              seq_len=1024, evals=5, eval_iters=16, corpus=tmp_path / "c", device="auto",
                              runs=tmp_path / "r", variants=[dx_sweep.variant("s-ste+dx=pruned-t")], best=best,
                              best_from=folder, sparse_attention=False)
    [(name, cmd)] = dx_sweep.jobs(args)
    assert cmd[cmd.index("--lrs") + 1] == json.dumps(best["s-ste dx=pruned-t"]) and "--opt" in cmd
    assert dx_sweep.block_weights("gpt-10m") == 6 * (1152 * 384 + 384 * 384 + 2 * 1536 * 384)
    with pytest.raises(SystemExit, match="no finished sweep"):
        dx_sweep.jobs(argparse.Namespace(**{**vars(args), "variants": [dx_sweep.variant("t-sr-ste")]}))


def test_performances_step_tables_recompute_from_their_run_files():
    """docs/PERFORMANCE.md's per-step kernel tables (and the earlier one, now in the dX note) are
    peer.py's --summary of the files they name."""
    tables = {"dx-speed/h100-4blocks.json": ("notes/dx-routes.md",
                                             "dense,ste,s-ste,s-ste+dx=pruned-t,s-ste+dx=mvue,t-sr-ste,ao-float8"),
              "dx-speed/h100-one-pass-4blocks.json": ("PERFORMANCE.md",
                                                      "dense,ste+dx=pruned-t,s-ste+dx=pruned-t,t-sr-ste,ao-float8"),
              "fp8-peer/h200.json": ("PERFORMANCE.md", "ao-float8,dense,dense-fp8,ste-fp8,s-ste-fp8")}
    for name, (doc, rows) in tables.items():
        run = json.loads((ROOT / "docs" / "results" / name).read_text())
        assert _peer().summary_table(run, rows.split(",")) in (ROOT / "docs" / doc).read_text(), name
