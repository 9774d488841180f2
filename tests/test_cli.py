"""twofour train / compare / export end to end on the CPU: outputs, resume, bad input, torchrun."""

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twofour.cli import main
from twofour.pruning import mask_24

SMALL = ["--model", "tiny", "--steps", "8", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "4",
         "--eval-iters", "2", "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text file, so the tests don't read the whole standard library each time."""
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    src = Path(torch.__file__).parent / "nn" / "modules"
    path.write_bytes(b"".join(p.read_bytes() for p in sorted(src.glob("*.py"))[:8]))
    return str(path)


def losses(run):
    with open(Path(run) / "metrics.csv") as fh:
        return [(int(r["step"]), r["train_loss"], r["val_loss"]) for r in csv.DictReader(fh)]


def test_train_writes_its_outputs(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out)]) == 0
    for name in ("metrics.csv", "ckpt.pt", "summary.json", "curves.png", "config.json"):
        assert (out / name).exists(), name
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 8 and s["recipe"] == "s-ste" and s["final_val_loss"] > 0 and s["tokens"] == 8 * 4 * 32
    assert "final train loss" in capsys.readouterr().out
    rows = losses(out)
    assert [r[0] for r in rows] == list(range(1, 9)) and rows[3][2] and rows[7][2]


def test_resume_is_bit_identical(tmp_path, corpus):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "--data", corpus, "--ckpt-interval", "4", "--recipe", "t-sr-ste", "--opt", "mask_interval=2"]
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
    # the regime is part of a run's identity: resuming it under another regime is refused
    assert "another run" in error_of(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "sr-ste",
                                      "--resume", "--steps", "20", "--eval-interval", "10"], capsys)


def test_export_writes_24_weights(tmp_path, corpus):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--data", corpus, "--out", str(out), "--recipe", "ste"]) == 0
    assert main(["export", str(out)]) == 0
    from safetensors.torch import load_file

    w = load_file(str(out / "model.safetensors"))
    fc = w["h.0.mlp.fc.weight"]
    assert torch.equal(fc != 0, mask_24(fc) & (fc != 0)) and ((fc.reshape(-1, 4) != 0).sum(1) <= 2).all()
    assert json.loads((out / "model_config.json").read_text())["sparse_layers"] == 8


def error_of(args, capsys):
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


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


def test_never_overwrites_and_checks_checkpoints(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    args = ["train", *SMALL, "--data", corpus, "--out", str(out)]
    assert main(args) == 0
    before = (out / "ckpt.pt").read_bytes()
    assert "already holds a run" in error_of(args, capsys)
    assert "another run" in error_of([*args, "--resume", "--recipe", "ste"], capsys)
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
    assert "refused" in err and "could run code" in err
    assert "refused" in error_of(["export", str(out)], capsys)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_torchrun_two_processes(tmp_path, corpus, fsdp):
    """2 CPU processes over gloo: trains, only rank 0 writes, replicas stay identical (checked in-run)."""
    out = tmp_path / "ddp"
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           "-m", "twofour", "train", *SMALL, "--data", corpus, "--out", str(out), "--ckpt-interval", "4",
           "--recipe", "t-sr-ste", "--opt", "mask_interval=2"] + (["--fsdp"] if fsdp else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("final train loss") == 1  # only rank 0 reports
    s = json.loads((out / "summary.json").read_text())
    assert s["tokens"] == 8 * 4 * 32 * 2
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert len(ck["rng"]) == 2 and ck["step"] == 8
