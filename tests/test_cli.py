"""twofour train / compare / export end to end on the CPU: outputs, resume, bad input, torchrun."""

import csv
import errno
import io
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import twofour
from twofour import dispatch
from twofour.cli import build_parser, main
from twofour.functional import mask_24
from twofour.sparse import sparse_layers
from twofour.training.checkpoint import read_checkpoint
from twofour.training.runs import pyplot, source_digest

from .helpers import error_of, free_port

SMALL = ["--model", "tiny", "--steps", "8", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "4",
         "--eval-iters", "2", "--log-interval", "1", "--no-progress"]
LLAMA = ["--model", "llama-tiny", *SMALL[2:]]


def losses(run):
    with open(Path(run) / "metrics.csv") as fh:
        return [(int(r["step"]), r["train_loss"], r["val_loss"]) for r in csv.DictReader(fh)]


def test_train_writes_its_outputs(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    key = "dw-mvue:96x128x32:Brow:bfloat16:dense|sparse"  # a pinned choice is one the run made
    dispatch.set_choice(key, "dense")
    try:  # s-ste: MVUE on, so the run consults the pinned dW choice
        assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "s-ste"]) == 0
    finally:
        dispatch.clear_choices()
    for name in ("metrics.csv", "ckpt.pt", "summary.json", "curves.png", "config.json"):
        assert (out / name).exists(), name
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 8 and s["recipe"] == "s-ste" and s["final_val_loss"] > 0 and s["tokens"] == 8 * 4 * 32
    assert s["gemm_choices"][key]["choice"] == "dense"
    assert s["code"]["source"] == source_digest() and s["code"]["torch"] == torch.__version__
    assert "final train loss" in capsys.readouterr().out
    rows = losses(out)
    assert [r[0] for r in rows] == list(range(1, 9)) and rows[3][2] and rows[7][2]


@pytest.mark.parametrize("recipe", [["--recipe", "t-sr-ste", "--opt", "mask_interval=2"],
                                    ["--recipe", "dense", "--fp8", "--opt", "bf16_finetune=0.25"]],
                         ids=["t-sr-ste", "dense-fp8-bf16-finetune"])  # the second leaves FP8 after step 6
def test_resume_is_bit_identical(tmp_path, corpus, recipe):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "--data", corpus, "--ckpt-interval", "4", *recipe]
    assert main(["train", *args, "--out", str(full)]) == 0
    assert main(["train", *args, "--out", str(part), "--stop-at", "5"]) == 0  # "killed" after step 5...
    assert losses(part)[-1][0] == 5
    # ...whose last checkpoint is step 5; pretend the run died later, at step 6, before a checkpoint
    assert main(["train", *args, "--out", str(part), "--resume"]) == 0
    assert [r[:2] for r in losses(part)] == [r[:2] for r in losses(full)]  # every train loss, bit for bit
    assert [r for r in losses(part) if r[0] % 4 == 0] == [r for r in losses(full) if r[0] % 4 == 0]  # val too
    a = torch.load(full / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(part / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_and_recipe_options(tmp_path, corpus):
    out = tmp_path / "acc"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "sr-ste", "--grad-accum", "2",
                 "--opt", "decay=6e-5", "--sparse-attention"]) == 0
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["config"]["recipe_options"] == {"decay": 6e-5}
    assert int(ck["model"]["h.0.attn.qkv.step"]) == 8  # one advance per optimizer step, not per micro-batch


@pytest.mark.parametrize("recipe", ["dense", "ste", "t-sr-ste", "step"])
def test_train_llama(tmp_path, corpus, recipe):
    """twofour train --model llama-tiny: finite losses; the checkpoint's FFN (fused gate|up and
    down) and attention linears are 2:4 wherever the recipe is in its sparse phase (every recipe
    trains a Llama in tests/test_training.py; s-ste runs in test_compare_llama)."""
    from twofour.training.config import TrainConfig
    from twofour.training.loop import build_model

    out = tmp_path / recipe
    opts = ["--opt", "dense_finetune=0"] if recipe == "t-sr-ste" else []  # 3 steps: else it ends dense
    assert main(["train", *LLAMA, "--steps", "3", "--eval-interval", "3", "--data", corpus, "--out", str(out),
                 "--recipe", recipe, "--sparse-attention", *opts]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["model"] == "llama-tiny" and math.isfinite(s["final_train_loss"]) and math.isfinite(s["final_val_loss"])
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    cfg = TrainConfig.from_dict(ck["config"])
    model = build_model(cfg, cfg.recipe_object(), ck["vocab_size"])
    model.load_state_dict(ck["model"])
    layers = dict(sparse_layers(model))
    assert set(layers) == {f"h.{i}.{m}" for i in range(4) for m in ("attn.qkv", "attn.proj", "mlp.gate_up",
                                                                      "mlp.down")}
    for layer in layers.values():
        if layer.recipe.sparse and not layer.is_dense_phase:
            assert ((layer.effective_weight().reshape(-1, 4) != 0).sum(1) <= 2).all()
    assert all(layer.is_dense_phase == (recipe == "dense") for layer in layers.values())  # STEP switches by step 2
    if recipe == "ste":  # the export holds the 2:4 weights and the untied head
        assert main(["export", str(out)]) == 0
        from safetensors.torch import load_file

        from twofour.kernels.layout import unpack_24

        w = load_file(str(out / "model.safetensors"))
        gate_up = unpack_24(w["h.0.mlp.gate_up.values"], w["h.0.mlp.gate_up.positions"], 128)
        assert ((gate_up.reshape(-1, 4) != 0).sum(1) <= 2).all() and "lm_head.weight" in w
        assert len(json.loads((out / "model_config.json").read_text())["sparse_layers"]) == 16


def test_compare_llama(tmp_path, corpus):
    out = tmp_path / "cmp"
    assert main(["compare", *LLAMA, "--steps", "3", "--eval-interval", "3", "--data", corpus, "--out", str(out),
                 "--recipes", "dense,s-ste"]) == 0
    table = (out / "compare.md").read_text()
    assert "| dense | 1337 |" in table and "| s-ste | 1337 |" in table
    assert json.loads((out / "s-ste-s1337" / "config.json").read_text())["model"] == "llama-tiny"


def test_compare_table_and_plot(tmp_path, corpus, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", *SMALL, "--data", corpus, "--out", str(out), "--recipes", "dense,s-ste",
                 "--seeds", "1,2"]) == 0
    table = (out / "compare.md").read_text()
    assert (out / "compare.png").exists()
    runs = [ln for ln in table.splitlines() if ln.startswith(("| dense | 1 |", "| dense | 2 |", "| s-ste | 1 |",
                                                                 "| s-ste | 2 |"))]
    assert len(runs) == 4 and "gap to dense" in table
    printed = capsys.readouterr().out
    assert "| s-ste | 2 |" in printed
    # the per-recipe rows: mean ± std over the 2 seeds, and the gap to dense paired by seed
    val = {(r, s): json.loads((out / f"{r}-s{s}" / "summary.json").read_text())["final_val_loss"]
           for r in ("dense", "s-ste") for s in (1, 2)}
    gaps = [val["s-ste", s] - val["dense", s] for s in (1, 2)]
    losses = [val["s-ste", s] for s in (1, 2)]
    row = next(ln for ln in printed.splitlines() if ln.startswith("| s-ste | 1, 2 | "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == f"{sum(losses) / 2:.4f} ± {abs(losses[0] - losses[1]) / 2 ** 0.5:.4f}"
    assert cells[3] == f"{sum(gaps) / 2:+.4f} ± {abs(gaps[0] - gaps[1]) / 2 ** 0.5:.4f}"
    assert row in table
    # a second call reuses the finished runs
    mtime = (out / "dense-s1" / "ckpt.pt").stat().st_mtime
    assert main(["compare", *SMALL, "--data", corpus, "--out", str(out), "--recipes", "dense", "--seeds", "1"]) == 0
    assert (out / "dense-s1" / "ckpt.pt").stat().st_mtime == mtime


def test_compare_reports_finished_runs_without_their_data_or_checkpoints(tmp_path, corpus):
    """The table and plot of finished runs need only their folders' summaries and metrics (runs
    trained elsewhere and copied without checkpoints, to another path), not the corpus."""
    data, out = tmp_path / "corpus.txt", tmp_path / "cmp"
    data.write_bytes(Path(corpus).read_bytes())
    args = ["compare", *SMALL, "--data", str(data), "--out", str(out), "--recipes", "dense,ste", "--seeds", "1"]
    assert main(args) == 0
    data.unlink()
    for name in ("dense-s1/ckpt.pt", "ste-s1/ckpt.pt", "compare.md", "compare.png"):
        (out / name).unlink()
    moved = tmp_path / "elsewhere"  # copied to another machine: the summaries name the old folder
    out.rename(moved)
    args[args.index(str(out))] = str(moved)
    assert main(args) == 0
    table = (moved / "compare.md").read_text()
    assert "| dense | 1 |" in table and "| ste | 1 |" in table
    assert (moved / "compare.png").exists() == (pyplot() is not None)
    assert not out.exists()


def test_compare_keeps_a_recipe_variant_apart(tmp_path, corpus):
    """A recipe run with other options (``--opt mvue=false``) gets its own folder, rows and paired gap."""
    out = tmp_path / "cmp"
    base = ["compare", *SMALL, "--data", corpus, "--out", str(out), "--seeds", "1"]
    assert main([*base, "--recipes", "dense,s-ste"]) == 0
    assert main([*base, "--recipes", "s-ste", "--opt", "mvue=false"]) == 0
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"dense-s1", "s-ste-s1", "s-ste-mvue=false-s1"}
    rows = {ln.split("|")[1].strip() for ln in (out / "compare.md").read_text().splitlines()
            if ln.startswith("| ") and "| 1 |" in ln}
    assert rows == {"dense", "s-ste", "s-ste mvue=false"}
    val = {p.name: json.loads((p / "summary.json").read_text())["final_val_loss"] for p in out.iterdir() if p.is_dir()}
    table = (out / "compare.md").read_text()
    assert f"| s-ste mvue=false | 1 | {val['s-ste-mvue=false-s1']:.4f} | " \
           f"{val['s-ste-mvue=false-s1'] - val['dense-s1']:+.4f} |" in table


def test_authors_regime_by_name(tmp_path, corpus, capsys):
    """--regime authors: peak lr 1.5e-4, floor 1e-5, warmup 10% of a short run, SR-STE decay 6e-5."""
    out = tmp_path / "authors"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "sr-ste", "--regime", "authors",
                 "--grad-accum", "1", "--steps", "20", "--eval-interval", "10"]) == 0
    with open(out / "metrics.csv") as fh:
        lr = [float(r["lr"]) for r in csv.DictReader(fh)]
    assert lr[1] == pytest.approx(1.5e-4) and lr[0] == pytest.approx(0.75e-4)  # 2 warmup steps, then the peak
    assert min(lr) >= 1e-5 and lr[-1] < 1.2e-5  # the cosine ends at the 1e-5 floor
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["config"]["regime"] == "authors" and ck["config"]["recipe_options"] == {}
    assert json.loads((out / "summary.json").read_text())["regime"] == "authors"
    # a resumed run keeps its regime: asking for another one is refused, naming the option
    err = error_of(["train", "--out", str(out), "--resume", "--regime", "ours"], capsys)
    assert "--regime ours contradicts" in err and "authors" in err


class _Flushes(io.StringIO):
    """A stdout that keeps what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def flush(self):
        self.seen.append(self.getvalue())
        super().flush()


def test_export_and_generate(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste"]) == 0
    capsys.readouterr()
    assert main(["export", str(out), "--out", str(tmp_path / "exp")]) == 0
    printed = capsys.readouterr()
    info = json.loads(printed.out)
    assert "8 layers 2:4" in printed.err and "0.5625x" in printed.err
    from safetensors.torch import load_file

    from twofour.kernels.layout import unpack_24

    w = load_file(str(tmp_path / "exp" / "model.safetensors"))
    fc = unpack_24(w["h.0.mlp.fc.values"], w["h.0.mlp.fc.positions"], 128).float()
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    assert torch.equal(fc, (ckpt["h.0.mlp.fc.weight"] * mask_24(ckpt["h.0.mlp.fc.weight"])).bfloat16().float())
    assert len(info["sparse_layers"]) == 8 and info["tokenizer"] == {"kind": "bytes"} and info["step"] == 8
    # generate: the prompt, then the sampled continuation; a seed reproduces it, temperature 0 is greedy
    args = ["generate", str(tmp_path / "exp"), "--prompt", "def f(x):", "--max-new-tokens", "20"]
    texts = []
    for extra in ([], [], ["--seed", "7"], ["--temperature", "0"], ["--temperature", "0", "--seed", "7"]):
        assert main([*args, *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert all(t.startswith("def f(x):") for t in texts)
    assert texts[0] == texts[1] and texts[3] == texts[4]
    # the text streams: the prompt, then each token as it comes, adding up to the same text
    from twofour.inference.sampling import MAX_NEW_TOKENS

    monkeypatch.setattr(sys, "stdout", _Flushes())
    assert main([*args, "--temperature", "0"]) == 0
    streamed, flushes = sys.stdout.getvalue(), sys.stdout.seen
    monkeypatch.undo()
    assert streamed == texts[3] and len(flushes) == 21 and flushes[0] == "def f(x):"
    # more tokens than one call samples, a seed out of range: one line each, naming the option
    err = error_of([*args[:-1], "100000000"], capsys)
    assert f"--max-new-tokens must be >= 0 and at most {MAX_NEW_TOKENS:,}" in err
    assert "--seed must be" in error_of([*args, "--seed", "99999999999999999999999"], capsys)
    # bytes that are not UTF-8 on the command line (kept by Python as lone surrogates) are bytes to a byte model
    assert main([*args[:2], "--prompt", "\udcff\udcfedef", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("\ufffd\ufffddef")
    # a run folder holds its export by default; generate reads it there
    assert main(["export", str(out)]) == 0 and main(["generate", str(out), "--max-new-tokens", "5"]) == 0
    capsys.readouterr()
    assert "twofour export" in error_of(["generate", str(tmp_path)], capsys)  # not an export
    assert "not a folder" in error_of(["export", str(out), "--out", str(out / "ckpt.pt")], capsys)
    for opt, value in [("--temperature", "-1"), ("--top-k", "-2"), ("--max-new-tokens", "-1")]:
        assert opt in error_of([*args, opt, value], capsys)
    assert "--device" in error_of([*args, "--device", "tpu"], capsys)
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in error_of(["bench", "--inference"], capsys)
        assert "needs a CUDA GPU" in error_of(["bench", "--fp8"], capsys)
    with pytest.raises(SystemExit):  # argparse's usage error: one report at a time
        main(["bench", "--fp8", "--inference"])
    assert "not allowed with" in capsys.readouterr().err


def test_export_of_a_run_that_ended_dense(tmp_path, corpus, capsys):
    """t-sr-ste trains dense over its last sixth: its export is dense and says so."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "t-sr-ste"]) == 0
    capsys.readouterr()
    assert main(["export", str(out), "--dtype", "float32"]) == 0
    printed = capsys.readouterr()
    info = json.loads(printed.out)
    assert info["dense"] and info["sparse_layers"] == [] and "exported dense" in printed.err


def test_bad_input(tmp_path, corpus, capsys):
    base = ["train", *SMALL, "--out", str(tmp_path / "x")]
    assert "no such file" in error_of([*base, "--data", str(tmp_path / "missing.txt")], capsys)
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in error_of([*base, "--data", str(tmp_path / "empty.txt")], capsys)
    (tmp_path / "short.txt").write_text("a" * 50)
    assert "--seq-len" in error_of([*base, "--data", str(tmp_path / "short.txt")], capsys)
    assert "valid recipes" in error_of([*base, "--data", corpus, "--recipe", "magic"], capsys)
    assert "valid presets" in error_of([*base, "--data", corpus, "--model", "gpt5"], capsys)
    assert "valid options" in error_of([*base, "--data", corpus, "--recipe", "ste", "--opt", "decay=1"], capsys)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert "cannot write" in error_of(["train", *SMALL, "--data", corpus, "--out", str(blocker / "run")], capsys)
    assert "valid recipes" in error_of(["compare", *SMALL, "--recipes", "dense,nope"], capsys)
    # options the run would drop silently: each named, in one line
    assert "leave --vocab-size out" in error_of([*base, "--data", corpus, "--vocab-size", "300"], capsys)
    assert "--recipes names dense twice" in error_of(["compare", *SMALL, "--recipes", "dense,ste,dense"], capsys)
    assert "--seeds names 1 twice" in error_of(["compare", *SMALL, "--seeds", "1,2,1"], capsys)
    assert "--opt names decay twice" in error_of([*base, "--data", corpus, "--recipe", "sr-ste", "--opt", "decay=1e-4",
                                                  "--opt", "decay=2e-4"], capsys)
    assert "torchrun" in error_of([*base, "--data", corpus, "--fsdp"], capsys)  # one process: FSDP2 would not run
    assert not (tmp_path / "x").exists()


def test_never_overwrites_and_checks_checkpoints(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    args = ["train", *SMALL, "--data", corpus, "--out", str(out)]
    assert main(args) == 0
    before = (out / "ckpt.pt").read_bytes()
    assert "already holds a run" in error_of(args, capsys)
    assert "--recipe s-ste contradicts" in error_of([*args, "--resume", "--recipe", "s-ste"], capsys)
    assert (out / "ckpt.pt").read_bytes() == before
    (out / "ckpt.pt").write_bytes(before[: len(before) // 2])  # a torn file
    assert "corrupt" in error_of([*args, "--resume"], capsys)
    assert main([*args, "--overwrite"]) == 0


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoints_load_safely(tmp_path, corpus, capsys):
    """A checkpoint is loaded with weights_only=True: a crafted file whose unpickling would run a
    command is refused with a clear error, and the command never runs."""
    out = tmp_path / "run"
    args = ["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste"]
    assert main(args) == 0
    ck = torch.load(out / "ckpt.pt", weights_only=True)  # only tensors and plain data in a real one
    marker = tmp_path / "pwned"
    boom = _Boom()
    boom.marker = marker
    ck["rng"][0]["python"] = boom
    torch.save(ck, out / "ckpt.pt")
    err = error_of([*args, "--resume"], capsys)
    assert "refused and was not loaded" in err and "holds code (posix.system)" in err
    assert "weights_only" not in err and "Re-running" not in err  # torch's text reads as advice to load it anyway
    assert "refused" in error_of(["export", str(out)], capsys)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "fsdp"), [("tiny", False), ("tiny", True), ("llama-tiny", False),
                                             ("llama-tiny", True)],
                         ids=["ddp", "fsdp2", "llama-ddp", "llama-fsdp2"])
def test_torchrun_two_processes(tmp_path, corpus, model, fsdp):
    """2 CPU processes over gloo: trains, only rank 0 writes, replicas stay identical (checked in-run)."""
    out = tmp_path / "ddp"
    port = str(free_port())  # for the rendezvous
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           "-m", "twofour", "train", *SMALL, "--model", model, "--data", corpus, "--out", str(out),
           "--ckpt-interval", "4",
           "--recipe", "t-sr-ste", "--opt", "mask_interval=2"] + (["--fsdp"] if fsdp else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("final train loss") == 1  # only rank 0 reports
    s = json.loads((out / "summary.json").read_text())
    assert s["tokens"] == 8 * 4 * 32 * 2
    ck = read_checkpoint(out)  # FSDP2: the sharded ckpt/, every rank's shards; DDP: ckpt.pt
    assert len(ck["rng"]) == 2 and ck["step"] == 8
    assert ("sharded" in ck) == fsdp and (out / "ckpt.pt").exists() != fsdp


@pytest.mark.slow
def test_compare_under_torchrun_reports_once(tmp_path, corpus):
    """`torchrun ... twofour compare`: every run trains on both processes, rank 0 alone prints the
    table and writes compare.md; the other rank ends cleanly."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "twofour", "compare", *SMALL, "--data", corpus, "--out", str(out),
           "--recipes", "dense,ste"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("table: ") == 1 and (out / "compare.md").exists()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["dense-s1337", "ste-s1337"]


def test_resume_takes_the_runs_settings(tmp_path, corpus, capsys):
    """--resume alone continues with the checkpoint's data, schedule, batch and recipe; an option
    that contradicts them is refused by name; --steps may grow only with --reschedule."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste", "--stop-at", "4"]) == 0
    capsys.readouterr()
    err = error_of(["train", "--out", str(out), "--resume", "--steps", "4", "--reschedule"], capsys)
    assert "has done 4 steps already" in err and "larger than 4" in err  # refused before saying what it would do
    err = error_of(["train", "--out", str(out), "--resume", "--lr", "2e-3"], capsys)
    assert "--lr 0.002 contradicts" in err and "0.001 by default" in err
    # no --data: the run's own; --lr and --n-layer as the run has them by default (tiny's) are no contradiction
    assert main(["train", "--out", str(out), "--resume", "--lr", "1e-3", "--n-layer", "4", "--no-progress"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["data"] == corpus and cfg["recipe"] == "ste" and cfg["steps"] == 8 and cfg["batch_size"] == 4
    assert losses(out)[-1][0] == 8
    err = error_of(["train", "--out", str(out), "--resume", "--steps", "12"], capsys)
    assert "--steps 12 contradicts" in err and "--reschedule" in err
    assert "--batch-size 8 contradicts" in error_of(["train", "--out", str(out), "--resume", "--batch-size", "8"],
                                                    capsys)
    assert "--data" in error_of(["train", "--out", str(out), "--resume", "--data", str(tmp_path)], capsys)
    assert "done 8 of 8 steps" in error_of(["train", "--out", str(out), "--resume"], capsys)
    assert main(["train", "--out", str(out), "--resume", "--steps", "12", "--reschedule", "--no-progress"]) == 0
    assert losses(out)[-1][0] == 12 and json.loads((out / "config.json").read_text())["steps"] == 12
    # a relative --data names the same file from wherever the run is resumed
    rel = os.path.relpath(corpus)
    assert main(["train", *SMALL, "--data", rel, "--out", str(tmp_path / "rel"), "--stop-at", "2"]) == 0
    assert main(["train", "--out", str(tmp_path / "rel"), "--resume", "--data", rel, "--no-progress"]) == 0


def test_resume_without_compile_drops_the_saved_compile_mode():
    """A run saved with --compile --compile-mode M and resumed with --no-compile runs eager (its
    mode goes back to default) instead of failing; a mode given on resume is kept."""
    from twofour.training.config import TrainConfig  # noqa: PLC0415
    from twofour.training.resuming import resumed_config  # noqa: PLC0415

    saved = TrainConfig(compile=True, compile_mode="reduce-overhead").to_dict()
    eager = resumed_config(saved, TrainConfig(compile=False), given={"compile"})
    assert not eager.compile and eager.compile_mode == "default"
    eager.validate()
    kept = resumed_config(saved, TrainConfig(), given=set())
    assert kept.compile and kept.compile_mode == "reduce-overhead"
    other = resumed_config(saved, TrainConfig(compile_mode="max-autotune"), given={"compile_mode"})
    assert other.compile and other.compile_mode == "max-autotune"


def test_an_old_config_reads_as_its_precision(tmp_path):
    """A config, checkpoint config or summary saved with the former FP8 recipe options reads as the
    precision they meant (without ``fp8_grad_e4m3``: e5m2, the default then), its other options
    kept; a run resumed from it keeps that precision, and another one given contradicts it."""
    from twofour.errors import TrainError  # noqa: PLC0415
    from twofour.training.config import TrainConfig
    from twofour.training.resuming import resumed_config
    from twofour.training.runs import read_config, read_summary  # noqa: PLC0415

    cfg = TrainConfig(recipe="s-ste", precision="fp8", recipe_options={"mvue": False})
    assert cfg.to_dict()["precision"] == "fp8" and TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.recipe_object().precision.name == "fp8"
    for old, precision in [({"fp8": True}, "fp8-e5m2"), ({"fp8": True, "fp8_grad_e4m3": True}, "fp8"),
                           ({"fp8": True, "fp8_grad_e4m3": True, "fp8_rowwise": True}, "fp8-rowwise"),
                           ({"fp8": True, "fp8_grad_e4m3": True, "fp8_backward": False}, "fp8-forward"),
                           ({"fp8": True, "fp8_grad_e4m3": True, "fp8_forward": False}, "fp8-backward"),
                           ({"fp8": False}, "bf16")]:
        saved = {**cfg.to_dict(), "recipe_options": {**old, "mvue": False}}
        del saved["precision"]
        assert TrainConfig.from_dict(saved) == TrainConfig(recipe="s-ste", precision=precision,
                                                           recipe_options={"mvue": False}), old
        assert resumed_config(saved, TrainConfig(), given=set()).recipe_object().precision.name == precision
    old = {**cfg.to_dict(), "recipe_options": {"fp8": True}}
    del old["precision"]
    with pytest.raises(TrainError, match="--precision fp8 contradicts the run being resumed"):
        resumed_config(old, TrainConfig(precision="fp8"), given={"precision"})
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "summary.json").write_text(json.dumps({"recipe": "s-ste", "recipe_options": {"fp8": True}}))
    assert read_config(tmp_path)["precision"] == "fp8-e5m2" and read_config(tmp_path)["recipe_options"] == {}
    assert read_summary(tmp_path)["precision"] == "fp8-e5m2" and read_summary(tmp_path)["recipe_options"] == {}


def test_old_run_folders_of_the_results_still_compare(tmp_path):
    """Run folders saved with the former FP8 options (docs/results/) are reused by ``compare`` and
    labelled by their precision in its table and in scripts/gap_by_eval.py's."""
    from twofour.training.compare import compare  # noqa: PLC0415
    from twofour.training.config import TrainConfig  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]
    results = root / "docs" / "results" / "q124m-ours"
    for name in ("dense-s1", "s-ste-s1", "s-ste-fp8=true-fp8_grad_e4m3=true-s1",
                 "s-ste-fp8=true-fp8_grad_e4m3=false-s1"):
        shutil.copytree(results / name, tmp_path / name)
    base = TrainConfig.from_dict({**json.loads((results / "dense-s1" / "config.json").read_text()),
                                  "out_dir": str(tmp_path)})
    summaries = compare(["dense"], base, [1])  # finished with the same config: reused, not trained
    labels = [f"| {label} | 1 |" for label in ("dense", "s-ste", "s-ste precision=fp8", "s-ste precision=fp8-e5m2")]
    table = (tmp_path / "compare.md").read_text()
    assert len(summaries) == 4 and all(label in table for label in labels)
    out = subprocess.run([sys.executable, "scripts/gap_by_eval.py", str(tmp_path), "--base", "s-ste", "--only",
                          "precision=fp8"], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stderr
    rows = [ln.split(" | ")[0] for ln in out.stdout.splitlines()[2:]]
    assert rows == ["| s-ste precision=fp8", "| s-ste precision=fp8-e5m2"]


def test_precision_on_the_command_line(capsys):
    """``--precision NAME`` (``--fp8`` for ``fp8``) sets the config's precision; the former options
    are refused in one line that names ``--precision``, and so is an unknown name."""
    from twofour.cli import _config  # noqa: PLC0415

    parser = build_parser()
    for argv, precision in [([], "bf16"), (["--fp8"], "fp8"), (["--precision", "fp8-backward"], "fp8-backward")]:
        a = parser.parse_args(["train", *argv])
        assert _config(a, a.recipe).precision == precision
    for opt in ("fp8=true", "fp8_rowwise=true", "precision=fp8"):
        assert "the precision is --precision NAME" in error_of(["train", "--opt", opt], capsys)
    with pytest.raises(SystemExit):
        main(["train", "--precision", "fp9"])
    assert "invalid choice: 'fp9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--fp8", "--precision", "fp8-rowwise"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_every_option_is_checked(tmp_path, corpus, capsys):
    base = ["train", *SMALL, "--data", corpus, "--out", str(tmp_path / "x")]
    for opt, value, says in [("--device", "tpu", "--device"), ("--warmup", "-3", "--warmup"),
                             ("--grad-clip", "-1", "--grad-clip"), ("--min-lr-ratio", "-2", "--min-lr-ratio"),
                             ("--weight-decay", "-0.1", "--weight-decay"), ("--log-interval", "0", "--log-interval"),
                             ("--eval-iters", "0", "--eval-iters"), ("--vocab-size", "0", "--vocab-size"),
                             ("--lr", "nan", "--lr"), ("--lr", "1e6", "at most 1"), ("--stop-at", "99", "--stop-at"),
                             ("--steps", "0", "--steps must be"), ("--skip-nonfinite", "-1", "--skip-nonfinite"),
                             ("--seed", "99999999999999999999999", "--seed must be"), ("--seed", "-1", "--seed")]:
        assert says in error_of([*base, opt, value], capsys), opt
    assert "--steps must be" in error_of([*base, "--recipe", "t-sr-ste", "--steps", "0"], capsys)  # not total_steps
    assert "--seeds" in error_of(["compare", *SMALL, "--data", corpus, "--seeds", "1,x"], capsys)
    assert "--seeds must be" in error_of(["compare", *SMALL, "--data", corpus, "--seeds", "1,99999999999999999999999"],
                                         capsys)
    assert "--resume" in error_of([*base, "--reschedule"], capsys)
    assert "add --compile" in error_of([*base, "--compile-mode", "reduce-overhead"], capsys)
    # CUDA graphs hold a step's gradients in their own buffers: one micro-batch a step only
    assert "--grad-accum 1" in error_of([*base, "--compile", "--compile-mode", "reduce-overhead", "--grad-accum", "2"],
                                        capsys)
    with pytest.raises(SystemExit):  # argparse names the valid modes
        main([*base, "--compile", "--compile-mode", "fastest"])
    assert "reduce-overhead" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing written for a run that can't start


def test_plain_log_lines_when_not_a_terminal(tmp_path, corpus, capsys):
    """Output to a file or pipe (pytest captures it): one line every --log-interval steps, with
    step, loss, lr, tokens/s and flip rate; the metrics rows follow the same interval."""
    out = tmp_path / "run"
    args = ["train", "--model", "tiny", "--steps", "20", "--batch-size", "4", "--seq-len", "32", "--eval-interval",
            "10", "--eval-iters", "2", "--data", corpus, "--out", str(out), "--log-interval", "5"]
    assert main(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["5/20", "10/20", "15/20", "20/20"]
    assert all(k in lines[0] for k in ("loss ", "lr ", "tok/s", "flip ")) and "val " in lines[1]
    assert "\r" not in "".join(lines)
    assert [r[0] for r in losses(out)] == [5, 10, 15, 20]


def test_help_shows_defaults():
    text = build_parser().commands["train"].format_help()
    for opt in ("--batch-size", "--grad-accum", "--eval-interval", "--ckpt-interval", "--seed", "--weight-decay",
                "--log-interval"):
        assert "default" in text.split(opt, 2)[-1].split("\n  --")[0], opt
    assert "this file" in build_parser().commands["bench"].format_help()


def test_overwrite_export_resume_details(tmp_path, corpus):
    """--overwrite leaves nothing of the old run (its export included); the exported file gets
    the usual permissions; wall time adds up across a resume."""
    out = tmp_path / "run"
    args = ["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste"]
    assert main([*args, "--stop-at", "4"]) == 0
    first = json.loads((out / "summary.json").read_text())["wall_s"]
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["wall_s"] > first
    assert main(["export", str(out)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert main([*args, "--overwrite"]) == 0
    assert not (out / "model.safetensors").exists() and not (out / "model_config.json").exists()


def test_logged_flip_rate_is_the_windows_mean(tmp_path, corpus):
    """A row logged every 5 steps carries the mean flip rate of its 5 steps (masks refreshed every
    2 steps, so single steps alternate between flips and none)."""
    args = ["train", *SMALL[:-3], "--data", corpus, "--recipe", "t-sr-ste", "--opt", "mask_interval=2",
            "--eval-interval", "5", "--steps", "10", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "every"), "--log-interval", "1"]) == 0
    assert main([*args, "--out", str(tmp_path / "five"), "--log-interval", "5"]) == 0
    with open(tmp_path / "every" / "metrics.csv") as fh:
        per_step = [float(r["flip_rate"]) for r in csv.DictReader(fh)]
    with open(tmp_path / "five" / "metrics.csv") as fh:
        windows = [float(r["flip_rate"]) for r in csv.DictReader(fh)]
    assert per_step[0] == 0 and per_step[1] > 0  # no refresh at step 1, one at step 2
    assert windows == pytest.approx([sum(per_step[:5]) / 5, sum(per_step[5:]) / 5])


def test_reschedule_applies_from_the_first_resumed_step(tmp_path, corpus):
    from twofour.training.config import TrainConfig, lr_at

    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--stop-at", "4", "--warmup", "2"]) == 0
    assert main(["train", "--out", str(out), "--resume", "--steps", "20", "--reschedule", "--no-compile"]) == 0
    with open(out / "metrics.csv") as fh:
        lr = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(fh)}
    cfg = TrainConfig(model="tiny", steps=20, warmup=2)
    assert lr[5] == pytest.approx(lr_at(cfg, 4)) and lr[20] == pytest.approx(lr_at(cfg, 19))


def test_a_finished_checkpoint_without_summary_completes(tmp_path, corpus):
    """Interrupted while writing the summary (after the last checkpoint): --resume finishes it."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste"]) == 0
    (out / "summary.json").unlink()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_compare_restarts_a_run_that_died_before_its_first_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "cmp"
    args = ["compare", *SMALL, "--data", corpus, "--out", str(out), "--recipes", "dense,ste"]
    assert main(args) == 0
    dense = (out / "dense-s1337" / "ckpt.pt").stat().st_mtime_ns
    for name in ("ckpt.pt", "summary.json"):  # killed hard: metrics and config, no checkpoint
        (out / "ste-s1337" / name).unlink()
    assert main(args) == 0
    assert (out / "dense-s1337" / "ckpt.pt").stat().st_mtime_ns == dense
    assert json.loads((out / "ste-s1337" / "summary.json").read_text())["steps"] == 8
    err = error_of([*args[:-2], "--recipes", "dense", "--weight-decay", "0.2"], capsys)
    assert "other settings" in err and "--overwrite" in err


@pytest.mark.parametrize("recipe", ["dense", "s-ste"])
def test_train_fp8(tmp_path, corpus, recipe, capsys):
    """--fp8 (dense included): finite, falling losses; the option is saved, resumes and must agree."""
    out = tmp_path / recipe
    args = [*SMALL, "--data", corpus, "--recipe", recipe, "--fp8", "--out", str(out)]
    assert main(["train", *args, "--stop-at", "6"]) == 0
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["config"]["precision"] == "fp8" and ck["config"]["recipe_options"] == {}
    train = [float(r[1]) for r in losses(out)]
    assert all(math.isfinite(v) for v in train) and train[-1] < train[0]
    assert main(["train", *args, "--resume"]) == 0 and losses(out)[-1][0] == 8
    capsys.readouterr()
    plain = tmp_path / "plain"
    assert main(["train", *SMALL, "--data", corpus, "--recipe", recipe, "--out", str(plain), "--stop-at", "1"]) == 0
    assert main(["train", *SMALL, "--data", corpus, "--out", str(plain), "--resume", "--fp8"]) == 2
    assert "contradicts" in capsys.readouterr().err
    assert main(["train", *args, "--overwrite", "--opt", "fp8=false"]) == 2
    assert "--precision" in capsys.readouterr().err


def test_compare_reuses_a_run_saved_before_a_setting_existed(tmp_path, corpus, capsys):
    """A finished run whose config.json lacks a setting (saved before it existed) counts it as its
    default and is reused; one that differs in a setting is not."""
    out = tmp_path / "cmp"
    args = ["compare", *SMALL, "--steps", "2", "--eval-interval", "2", "--data", corpus, "--out", str(out),
            "--recipes", "s-ste"]
    assert main(args) == 0
    run = next(p for p in out.iterdir() if p.is_dir())
    saved = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "compile_mode"}))
    stamp = (run / "summary.json").stat().st_mtime_ns
    assert main(args) == 0 and (run / "summary.json").stat().st_mtime_ns == stamp
    (run / "config.json").write_text(json.dumps({**saved, "weight_decay": 0.5}))
    capsys.readouterr()
    assert main(args) == 2 and "other settings" in capsys.readouterr().err


def test_compare_counts_a_run_once_when_an_older_folder_repeats_it(tmp_path, corpus, caplog):
    """A run whose folder has an older label's name (FP8 as recipe options, its summary in the older
    form) and the same run in its label's folder: the table has one row of it, the one in its
    label's folder."""
    out = tmp_path / "cmp"
    args = ["compare", *SMALL, "--steps", "2", "--eval-interval", "2", "--data", corpus, "--out", str(out),
            "--recipes", "dense", "--fp8"]
    assert main(args) == 0
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    assert run.name == "dense-precision=fp8-s1337"
    old = out / "dense-fp8=true-fp8_grad_e4m3=true-s1337"
    shutil.copytree(run, old)
    summary = json.loads((old / "summary.json").read_text())
    del summary["precision"]
    (old / "summary.json").write_text(json.dumps({**summary, "recipe_options": {"fp8": True, "fp8_grad_e4m3": True},
                                                  "final_val_loss": 9.0}))
    with caplog.at_level("WARNING", logger="twofour"):
        assert main(args) == 0
    rows = [ln for ln in (out / "compare.md").read_text().splitlines() if ln.startswith("| dense precision=fp8 |")]
    assert len(rows) == 2 and "9.0000" not in rows[0]  # one run row, one recipe row
    assert "left out of the table" in caplog.text and str(old) in caplog.text


def test_compare_fp8_pairs_with_dense_fp8(tmp_path, corpus):
    out = tmp_path / "cmp"
    assert main(["compare", *SMALL, "--steps", "2", "--eval-interval", "2", "--data", corpus, "--out", str(out),
                 "--recipes", "dense,s-ste", "--opt", "mvue=false", "--fp8"]) == 0
    sparse, dense = "s-ste-precision=fp8-mvue=false-s1337", "dense-precision=fp8-s1337"
    assert {p.name for p in out.iterdir() if p.is_dir()} == {dense, sparse}
    val = {p.name: json.loads((p / "summary.json").read_text())["final_val_loss"] for p in out.iterdir() if p.is_dir()}
    gap = val[sparse] - val[dense]
    assert f"| s-ste precision=fp8 mvue=false | 1337 | {val[sparse]:.4f} | {gap:+.4f} |" \
        in (out / "compare.md").read_text()


def test_source_digest_names_the_code(tmp_path):
    """The digest a summary records changes with any source file's content or name, and only
    with the .py files."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(pkg)
    (pkg / "notes.txt").write_text("not code")
    assert source_digest(pkg) == first and len(first) == 16
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert source_digest(pkg) != first
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert source_digest(pkg) != first


def test_a_summary_names_the_whole_package_as_imported():
    """The default digest covers every module of twofour (kernels too, not the training folder
    alone) and is the one of the files as the process found them."""
    import twofour  # noqa: PLC0415

    assert source_digest() == source_digest(Path(twofour.__file__).parent)
    assert source_digest() != source_digest(Path(twofour.__file__).parent / "training")


def test_version(capsys):
    from twofour.version import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"twofour {__version__}"


def test_a_folder_that_is_not_a_run_is_left_alone(tmp_path, corpus, capsys):
    """A folder holding files a run writes (the user's own config.json, summary.json, curves.png)
    is refused by name without --overwrite, and its files stay as they were."""
    out = tmp_path / "mine"
    out.mkdir()
    mine = {name: f"my own {name}".encode() for name in ("config.json", "summary.json", "curves.png", "notes.txt")}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    err = error_of(["train", *SMALL, "--data", corpus, "--out", str(out)], capsys)
    assert "curves.png, summary.json, config.json" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == mine
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_bytes() == mine["notes.txt"]  # only what a run writes is replaced
    assert json.loads((out / "summary.json").read_text())["steps"] == 8


def test_export_replaces_nothing_without_overwrite(tmp_path, corpus, capsys):
    """twofour export writes model.safetensors by default, model.pt on request, and refuses to
    replace an export (in the run's folder or --out) unless --overwrite."""
    from safetensors.torch import load_file

    run, out = tmp_path / "run", tmp_path / "out"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(run), "--recipe", "ste"]) == 0
    assert main(["export", str(run)]) == 0
    assert sorted(p.name for p in run.glob("model*")) == ["model.safetensors", "model_config.json"]
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's model")
    capsys.readouterr()
    err = error_of(["export", str(run), "--out", str(out)], capsys)
    assert "already holds an export (model.safetensors)" in err and "--overwrite" in err
    assert (out / "model.safetensors").read_bytes() == b"someone else's model"
    assert "already holds an export" in error_of(["export", str(run)], capsys)
    assert main(["export", str(run), "--out", str(out), "--overwrite"]) == 0
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(run / "model.safetensors")))
    assert main(["export", str(run), "--out", str(out), "--overwrite", "--weights-format", "pt"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.pt", "model_config.json"]  # one weights file
    assert json.loads((out / "model_config.json").read_text())["weights"] == "model.pt"
    from twofour import load_for_inference

    assert load_for_inference(out, "cpu").vocab_size == 256


def _diverging(corpus, out):
    """A run whose weight decay makes its weights grow ~2.5x a step until the loss is NaN (step 12)."""
    return ["train", *SMALL[:-3], "--data", corpus, "--out", str(out), "--steps", "200", "--warmup", "0",
            "--min-lr-ratio", "1", "--lr", "1e-3", "--weight-decay", "3500", "--log-interval", "5",
            "--ckpt-interval", "5", "--eval-interval", "100", "--no-progress"]


def test_a_diverged_run_stops_and_keeps_its_last_good_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    err = error_of(_diverging(corpus, out), capsys)
    bad = int(err.split("not finite at step ")[1].split(";")[0])
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert 5 <= ck["step"] < bad and f"last good checkpoint (step {ck['step']})" in err and "--skip-nonfinite" in err
    assert all(torch.isfinite(t).all() for t in ck["model"].values() if t.is_floating_point())
    assert not (out / "summary.json").exists()  # no summary of a diverged run
    assert all(math.isfinite(float(r[1])) for r in losses(out))  # the diverged window is not logged
    assert not (out / ".twofour.lock").exists()


def test_skip_nonfinite_skips_steps_up_to_its_limit(tmp_path, corpus, capsys, caplog):
    """--resume --skip-nonfinite N (an option a resumed run may change) goes on from the last good
    checkpoint, skipping each step whose loss or gradient norm is not finite with a log line,
    applying none of them, and stops at the (N+1)-th."""
    out = tmp_path / "run"
    assert main(_diverging(corpus, out)) == 2
    saved = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    capsys.readouterr()
    with caplog.at_level("WARNING", logger="twofour"):
        err = error_of(["train", "--out", str(out), "--resume", "--skip-nonfinite", "3", "--log-interval", "1"],
                       capsys)
    skips = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skips) == 3 and "(3 of at most 3)" in skips[-1]
    assert "after 3 skipped (--skip-nonfinite)" in err
    rows = losses(out)
    skipped = {int(m.split("step ")[1].split(":")[0]) for m in skips}
    assert rows[-1][0] > saved and not skipped & {r[0] for r in rows if r[1]}  # no loss logged for a skipped step
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in ck["model"].values() if t.is_floating_point())
    assert json.loads((out / "config.json").read_text())["skip_nonfinite"] == 3


def _refuse_writes(monkeypatch, folder):
    """What a read-only ``folder`` does to root too, who writes into it anyway: every file opened
    or created there for writing fails with EACCES (reads go on)."""
    import builtins
    import errno
    import io

    import twofour.inference.format as fmt

    def inside(path):
        return isinstance(path, (str, os.PathLike)) and Path(os.fspath(path)).absolute().is_relative_to(folder)

    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

    real_open, real_os_open, real_save = builtins.open, os.open, fmt.save_file

    def open_(file, mode="r", *args, **kwargs):
        if inside(file) and set(mode) & set("wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(fmt, "save_file", lambda tensors, path, *a, **k: refuse(path) if inside(path) else
                        real_save(tensors, path, *a, **k))


@pytest.mark.parametrize("how", ["read-only", "in-the-way"])
def test_unwritable_outputs_end_in_one_line(tmp_path, corpus, capsys, monkeypatch, how):
    """An export into a folder that can't be written, and a run whose folder becomes unwritable
    mid-run: one line and exit 2, the previous checkpoint intact. Read-only: the folder's mode
    (and, since root writes into read-only folders and CI runs as root, every write there refused);
    in the way: a folder where the file goes, which fails for anyone."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste", "--stop-at", "4"]) == 0
    before = (out / "ckpt.pt").read_bytes()
    if how == "read-only":
        out.chmod(0o555)
        if os.geteuid() == 0:
            _refuse_writes(monkeypatch, out)
    else:
        (out / "model.safetensors.tmp").mkdir()
        (out / "ckpt.pt.tmp").mkdir()
    try:
        capsys.readouterr()
        assert "cannot write" in error_of(["export", str(out)], capsys)
        err = error_of(["train", "--out", str(out), "--resume", "--no-progress"], capsys)
        assert "cannot write" in err and ("intact" in err or how == "read-only")  # read-only: refused at the start
    finally:
        monkeypatch.undo()
        out.chmod(0o755)
    assert (out / "ckpt.pt").read_bytes() == before
    assert not (out / "model.safetensors").exists()


def test_compare_names_what_a_copied_in_run_lacks(tmp_path, corpus, capsys):
    out = tmp_path / "cmp"
    args = ["compare", *SMALL, "--steps", "2", "--eval-interval", "2", "--data", corpus, "--out", str(out),
            "--recipes", "dense"]
    assert main(args) == 0
    copied = out / "ste-s1337"  # a finished run copied in from elsewhere, without its metrics.csv
    shutil.copytree(out / "dense-s1337", copied)
    summary = json.loads((copied / "summary.json").read_text())
    (copied / "summary.json").write_text(json.dumps({**summary, "recipe": "ste"}))
    (copied / "metrics.csv").unlink()
    capsys.readouterr()
    err = error_of(args, capsys)
    assert str(copied) in err and "without its metrics.csv" in err
    (copied / "summary.json").write_text('{"recipe": "ste", ')  # torn
    assert f"{copied / 'summary.json'} is corrupt" in error_of(args, capsys)


def test_a_step_too_large_for_memory_is_refused_before_it_starts(tmp_path, corpus, capsys, monkeypatch):
    """A batch that can't fit in the memory the device has free is refused before the run folder is
    touched, with one line saying how many sequences could fit; the same command with a batch that
    fits then runs in that folder. The estimate is a lower bound: nothing that fits is refused."""
    import twofour.training.memory as memory
    from twofour.training.config import TrainConfig

    cfg = TrainConfig(batch_size=4, seq_len=32)
    need = memory.step_memory(cfg, 256, torch.device("cpu"))
    model = twofour.models.build_model("tiny", "dense", vocab_size=256, block_size=32)
    assert need.state == 16 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(memory, "available_bytes", lambda device: need.state + 2 * need.per_sequence)
    out = tmp_path / "run"
    args = ["train", *SMALL, "--data", corpus, "--out", str(out)]
    err = error_of([*args, "--batch-size", "4"], capsys)
    assert err.startswith("twofour train: error: out of memory") and "--batch-size 4" in err
    assert "at most 2 sequences could fit" in err and not out.exists()
    assert main([*args, "--batch-size", "2"]) == 0  # no lock, no config.json left in the way
    monkeypatch.undo()
    with pytest.raises(twofour.TrainError, match="try a smaller --batch-size"):  # no machine holds this one
        memory.check_memory(TrainConfig(batch_size=100_000_000, seq_len=32), 256, torch.device("cpu"))
    huge = TrainConfig(model="llama-7b")  # weights and AdamW state: 108 GiB
    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 << 30)
    with pytest.raises(twofour.TrainError, match="smaller --model .* a smaller --batch-size does not help"):
        memory.check_memory(huge, 32000, torch.device("cpu"))


def test_out_of_memory_during_the_run_is_one_line():
    """What the estimate lets through and the allocator then refuses still ends in one line."""
    from twofour.errors import out_of_memory_message

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 2199023255552 bytes. Error code 12 (Cannot allocate memory)")
    assert out_of_memory_message(cpu) == ("out of memory (it asked for 2.0 TiB more): try a smaller --batch-size "
                                          "(or --seq-len, or a smaller --model)")
    assert "20.00 MiB" in out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                                       "20.00 MiB"))
    assert out_of_memory_message(RuntimeError("shapes cannot be multiplied")) is None


def test_ckpt_interval_zero_writes_no_checkpoint(tmp_path, corpus, capsys):
    """--ckpt-interval 0 (throughput runs of large models): the run ends with its summary and no
    checkpoint, so there is nothing to resume; a negative interval is a one-line error."""
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--ckpt-interval", "0"]) == 0
    assert (out / "summary.json").exists() and [r[0] for r in losses(out)] == list(range(1, 9))
    assert not (out / "ckpt.pt").exists() and not (out / "ckpt").exists()
    assert "(metrics.csv, summary.json" in capsys.readouterr().out  # no checkpoint named
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert main(["train", *SMALL, "--data", corpus, "--out", str(tmp_path / "bad"), "--ckpt-interval", "-1"]) == 2
    assert "--ckpt-interval must be a whole number of steps >= 0" in capsys.readouterr().err
    assert main(["train", *SMALL, "--data", corpus, "--out", str(tmp_path / "bad"), "--ckpt-interval", "0",
                 "--stop-at", "4"]) == 2
    assert "--ckpt-interval 0 writes no checkpoint" in capsys.readouterr().err


def test_a_run_without_a_checkpoint_leads_to_overwrite(tmp_path, corpus, capsys):
    """A run killed before its first checkpoint: a plain re-run and --resume both say that
    --overwrite starts it again (not "pass --resume", not a bare "no checkpoint"), the folder as it
    was; --resume of a folder holding no run says to leave --resume out."""
    dead = tmp_path / "dead"
    dead.mkdir()
    files = {"config.json": b"{}", "metrics.csv": b"step,tokens\n1,512\n"}
    for name, data in files.items():
        (dead / name).write_bytes(data)
    err = error_of(["train", *SMALL, "--data", corpus, "--out", str(dead)], capsys)
    assert "wrote no checkpoint" in err and "--overwrite" in err and "pass --resume" not in err
    err = error_of(["train", "--out", str(dead), "--resume"], capsys)
    assert "wrote no checkpoint" in err and "--overwrite instead of --resume" in err
    assert {p.name: p.read_bytes() for p in dead.iterdir()} == files
    assert "leave out --resume" in error_of(["train", "--out", str(tmp_path / "none"), "--resume"], capsys)


def test_resume_of_a_folder_a_live_run_holds_names_that_run(tmp_path, capsys):
    """The live run may not have written a checkpoint yet: its lock is the reason, not the checkpoint."""
    from twofour.training.lock import LOCK, _started  # noqa: PLC0415

    out = tmp_path / "busy"
    out.mkdir()
    owner = os.getppid()  # a live process, not this one
    (out / LOCK).write_text(json.dumps({"pid": owner, "host": socket.gethostname(), "started": _started(owner)}))
    err = error_of(["train", "--out", str(out), "--resume"], capsys)
    assert f"in use by another twofour run (process {owner}" in err and (out / LOCK).exists()


def test_an_out_that_links_to_nothing_says_so(tmp_path, corpus, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    err = error_of(["train", *SMALL, "--data", corpus, "--out", str(link)], capsys)
    assert f"symbolic link to {tmp_path / 'gone'}, which does not exist" in err and "File exists" not in err
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_export_of_a_corrupt_checkpoint_gives_no_advice_meant_for_train(tmp_path, capsys):
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "ckpt.pt").write_bytes(b"PK\x03\x04 half a checkpoint")
    err = error_of(["export", str(torn)], capsys)
    assert "ckpt.pt is unreadable or corrupt" in err and "--overwrite" not in err and "--out" not in err
    assert "--overwrite instead of --resume" in error_of(["train", "--out", str(torn), "--resume"], capsys)


@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 96 vs 84")],
                         ids=["ENOSPC", "torch-short-write"])
def test_a_full_disk_says_so_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, fault):
    from twofour.errors import TrainError  # noqa: PLC0415
    from twofour.training.checkpoint import save_checkpoint  # noqa: PLC0415

    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 4})
    before = path.read_bytes()

    def full(obj, fh):
        fh.write(b"part of it")
        raise fault

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(TrainError) as info:
        save_checkpoint(path, {"step": 8})
    assert "the disk is full" in str(info.value) and f"the last checkpoint {path} is intact" in str(info.value)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
