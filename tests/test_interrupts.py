"""Ctrl-C and SIGTERM never lose work: `twofour train` checkpoints the step it is on before it
exits, and `twofour compare` picks up where it was stopped (real processes, real signals)."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from twofour.cli import main

RUN = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-iters", "2", "--log-interval", "1"]


def start(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "twofour", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)


def rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    with metrics.open() as fh:
        return list(csv.DictReader(fh))


def wait_for(cond, proc, timeout=120):
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_checkpoints_the_current_step(tmp_path, corpus, sig):
    """Default checkpoint interval (500) beyond the run's steps: the interrupt still saves, and
    --resume (with no other option: data, steps, recipe come from the checkpoint) finishes it."""
    out = tmp_path / "run"
    proc = start(["train", *RUN, "--steps", "400", "--data", corpus, "--out", str(out)], tmp_path)
    wait_for(lambda: len(rows(out / "metrics.csv")) >= 3, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    step = ck["step"]
    assert 3 <= step < 400 and f"step {step} is saved" in err and "--resume" in err
    assert int(rows(out / "metrics.csv")[-1]["step"]) == step
    # a second run from another folder, with only --out and --resume: the run's own settings
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    done = rows(out / "metrics.csv")
    assert int(done[-1]["step"]) == 400 and [int(r["step"]) for r in done] == list(range(1, 401))
    assert json.loads((out / "config.json").read_text())["data"] == corpus


def test_interrupted_compare_resumes(tmp_path, corpus):
    """Finished runs are kept, the interrupted one resumes from its checkpoint, none restarts."""
    root = tmp_path / "cmp"
    args = ["compare", *RUN, "--recipes", "dense,s-ste", "--steps", "300", "--data", corpus, "--out", str(root)]
    proc = start(args, tmp_path)
    wait_for(lambda: len(rows(root / "s-ste-s1337" / "metrics.csv")) >= 3, proc, timeout=240)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "run the same command again" in err, err[-2000:]
    assert (root / "dense-s1337" / "summary.json").exists() and not (root / "s-ste-s1337" / "summary.json").exists()
    dense_ckpt = (root / "dense-s1337" / "ckpt.pt").stat().st_mtime_ns
    stopped = torch.load(root / "s-ste-s1337" / "ckpt.pt", weights_only=True)["step"]
    assert 3 <= stopped < 300
    assert main([*args, "--no-progress"]) == 0
    assert (root / "dense-s1337" / "ckpt.pt").stat().st_mtime_ns == dense_ckpt  # not retrained
    steps = [int(r["step"]) for r in rows(root / "s-ste-s1337" / "metrics.csv")]
    assert steps == list(range(1, 301))  # went on from `stopped`, no step twice
    assert "| s-ste |" in (root / "compare.md").read_text()


def test_a_run_folder_takes_one_run_at_a_time(tmp_path, corpus, capsys):
    """While a run trains, a second `twofour train` on its --out (plain, --overwrite or --resume)
    is refused with one line and changes nothing; the lock goes when the run ends on SIGTERM."""
    out = tmp_path / "run"
    proc = start(["train", *RUN, "--steps", "400", "--ckpt-interval", "2", "--data", corpus, "--out", str(out)],
                 tmp_path)
    try:
        wait_for(lambda: (out / "ckpt.pt").exists() and len(rows(out / "metrics.csv")) >= 2, proc)
        for extra in ([], ["--overwrite"], ["--resume"]):
            assert main(["train", *RUN, "--steps", "400", "--ckpt-interval", "2", "--data", corpus, "--out", str(out),
                         *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and f"process {proc.pid}" in err and "in use" in err, err
        assert (out / "metrics.csv").exists() and len(rows(out / "metrics.csv")) >= 2  # nothing removed
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err[-2000:]
    finally:
        proc.kill()
    assert not (out / ".twofour.lock").exists()
    steps = [int(r["step"]) for r in rows(out / "metrics.csv")]
    assert steps == list(range(1, steps[-1] + 1))  # one run's rows, none twice


def test_a_crashed_runs_lock_does_not_block_its_resume(tmp_path, corpus, caplog):
    """A run killed outright (SIGKILL: no cleanup) leaves its lock behind; --resume takes it over
    with one log line, since its process is gone."""
    out = tmp_path / "run"
    proc = start(["train", *RUN, "--steps", "400", "--ckpt-interval", "2", "--data", corpus, "--out", str(out)],
                 tmp_path)
    wait_for(lambda: (out / "ckpt.pt").exists() and len(rows(out / "metrics.csv")) >= 3, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert json.loads((out / ".twofour.lock").read_text())["pid"] == proc.pid
    with caplog.at_level("WARNING", logger="twofour"):
        assert main(["train", "--out", str(out), "--resume", "--stop-at", "300", "--no-progress"]) == 0
    assert f"left by process {proc.pid}, which is no longer running" in caplog.text
    assert not (out / ".twofour.lock").exists() and int(rows(out / "metrics.csv")[-1]["step"]) == 300


def test_a_comparison_folder_takes_one_comparison_at_a_time(tmp_path, corpus, capsys):
    root = tmp_path / "cmp"
    args = ["compare", *RUN, "--recipes", "dense", "--steps", "300", "--data", corpus, "--out", str(root)]
    proc = start(args, tmp_path)
    try:
        wait_for(lambda: len(rows(root / "dense-s1337" / "metrics.csv")) >= 2, proc)
        assert main([*args, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{root} is in use" in err and f"process {proc.pid}" in err, err
        # a plain run into the comparison's run folder is refused too
        assert main(["train", *RUN, "--steps", "300", "--data", corpus, "--out", str(root / "dense-s1337"),
                     "--overwrite"]) == 2
        assert "dense-s1337 is in use" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def test_interrupt_without_checkpoints_says_so(tmp_path, corpus):
    """--ckpt-interval 0: Ctrl-C stops the run after its step, saves nothing and says so."""
    out = tmp_path / "run"
    proc = start(["train", *RUN, "--steps", "400", "--ckpt-interval", "0", "--data", corpus, "--out", str(out)],
                 tmp_path)
    wait_for(lambda: len(rows(out / "metrics.csv")) >= 3, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "nothing saved (--ckpt-interval 0)" in err and not (out / "ckpt.pt").exists()


def test_a_second_ctrl_c_stops_at_once(monkeypatch):
    """The first SIGINT asks for a checkpoint; the second, however soon, stops at once. Under
    torchrun only, one within a second of the first is its echo (torchrun passes the terminal's
    Ctrl-C on to workers that got it already) and is not taken for a second."""
    from twofour.training.console import StopRequest

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a shell's background job
    with StopRequest(verbose=False) as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with StopRequest(verbose=False) as stop:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the echo: ignored
        assert stop.requested
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are given back
