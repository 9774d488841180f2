"""Sharded checkpoints of FSDP2 runs (torch.distributed.checkpoint), 2 processes over gloo on the
CPU (NCCL on 2 GPUs): bit-exact resume on the same world size, a kill mid-save, N -> M, export."""

import contextlib
import csv
import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from twofour.training.checkpoint import CKPT, SHARDED, checkpoint_path, read_checkpoint
from twofour.training.checkpoint_sharded import sharded_folder
from twofour.training.config import TrainConfig
from twofour.training.export import export
from twofour.training.parallel import DEFAULT_FSDP

from .helpers import error_of, free_port


def _fsdp_on_cpu() -> bool:
    """Whether this torch has FSDP2 and DCP's state-dict helpers and a gloo backend."""
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


pytestmark = pytest.mark.skipif(not _fsdp_on_cpu(), reason="needs FSDP2 (fully_shard), DCP and gloo")


def _worker(rank: int, world: int, job: tuple[dict, tuple[str, int] | None, int]) -> None:
    """One rank of a torchrun-like run: ``job`` is a config, a fault at a step's save
    (``("kill", step)``: rank 0 dies, exit 3, when the save has written every file but not yet
    switched ``latest``; ``("fail", step)``: rank 1's DCP write fails as on a full disk, and each
    rank's TrainError goes to ``<out>.rank<r>.err``) or None, and the port of its process group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: PLC0415

    from twofour.errors import TrainError  # noqa: PLC0415
    from twofour.training import checkpoint_sharded, loop  # noqa: PLC0415
    from twofour.training.checkpointer import Checkpointer  # noqa: PLC0415

    switch, save, write = checkpoint_sharded._switch, Checkpointer.save, FileSystemWriter.write_data

    def checked_save(self, *args, **kw):
        """Every save (on resumed runs too) first checks that each rank holds the very same masks,
        scales and step counters, whole tensors compared (the loop compares checksums)."""
        from twofour.sparse.convert import sparse_layers  # noqa: PLC0415

        for name, layer in sparse_layers(self.model):
            for buf in (layer.mask, layer.beta, layer.step):
                if buf is not None:
                    everyone = [torch.empty_like(buf) for _ in range(world)]
                    dist.all_gather(everyone, buf.contiguous())
                    assert all(torch.equal(b, everyone[0]) for b in everyone), f"{name} differs across ranks"
        return save(self, *args, **kw)

    Checkpointer.save = checked_save
    cfg, fault, port = job
    os.environ["MASTER_PORT"] = str(port)
    kind, at = fault or ("", 0)

    def dying_switch(root, name):
        if name == f"step-{at:08d}":
            os._exit(3)  # killed mid-save: the new step folder is written, latest still names the old
        switch(root, name)

    def failing_write(self, plan, planner):
        if f"step-{at:08d}" in str(self.path):
            raise OSError(28, "No space left on device")
        return write(self, plan, planner)

    checkpoint_sharded._switch = dying_switch if kind == "kill" and rank == 0 else switch
    FileSystemWriter.write_data = failing_write if kind == "fail" and rank == 1 else write
    try:
        loop.train(TrainConfig.from_dict(cfg))
    except TrainError as e:
        if kind != "fail":
            raise
        Path(f"{cfg['out_dir']}.rank{rank}.err").write_text(str(e))
    finally:
        dist.destroy_process_group()
    # done: leave without the interpreter's teardown, where a gloo thread still alive now and then
    # ends the process by SIGABRT ("terminate called without an active exception") after a good run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(*jobs: tuple[TrainConfig, tuple[str, int] | None]) -> None:
    """Run ``jobs`` (config, fault) one after another, each in its own pair of spawned processes, as
    torchrun runs them (processes that ran several jobs over gloo now and then died by SIGABRT,
    "terminate called without an active exception"); CPU runs see no GPU (else the loop would pick
    NCCL for them)."""
    cpu, seen = jobs[0][0].device == "cpu", os.environ.get("CUDA_VISIBLE_DEVICES")
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by the children as they start
    try:
        for cfg, fault in jobs:
            job = (cfg.to_dict(), fault, free_port())
            mp.start_processes(_worker, args=(2, job), nprocs=2, start_method="spawn")
    finally:
        if cpu and seen is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif cpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = seen


def _losses(run: Path) -> dict[int, str]:
    with open(run / "metrics.csv") as fh:
        return {int(r["step"]): r["train_loss"] for r in csv.DictReader(fh)}


def _val_loss(run: Path, step: int) -> float:
    with open(run / "metrics.csv") as fh:
        return next(float(r["val_loss"]) for r in csv.DictReader(fh) if int(r["step"]) == step)


def _cfg(corpus: str, out: Path, device: str = "cpu", **kw) -> TrainConfig:
    """An FSDP2 run (fp32 on the CPU, the default mixed-precision policy on GPUs) of 8 tiny steps."""
    policy = "fp32" if device == "cpu" else DEFAULT_FSDP
    return TrainConfig(model="tiny", recipe="s-ste", data=corpus, steps=8, batch_size=4, seq_len=32,
                       eval_interval=4, eval_iters=2, log_interval=1, ckpt_interval=4, progress=False,
                       fsdp=policy, device=device, out_dir=str(out), **kw)


def _runs(root: Path, corpus: str, device: str) -> Path:
    """Every run the tests look at, each a spawn of 2 processes (each costs seconds of imports):
    ``full`` (8 steps on 2), ``part`` (stopped at 4 on 2, copied to ``one``, ``two`` and
    ``full-disk``, then resumed on 2, killed mid-save at step 8, resumed again), ``full-disk``
    (resumed on 2, rank 1's write of step 8 fails), ``back`` (stopped at 4 in one process,
    resumed on 2 with activation checkpointing). Returns ``root``."""
    from twofour.training.loop import train  # noqa: PLC0415

    one_process = dataclasses.replace(_cfg(corpus, root / "back", device), fsdp=None, stop_at=4)
    train(one_process)
    _spawn((_cfg(corpus, root / "full", device), None), (_cfg(corpus, root / "part", device, stop_at=4), None),
           (_cfg(corpus, root / "back", device, resume=True, activation_checkpointing=True), None))
    for name in ("one", "two", "full-disk"):
        shutil.copytree(root / "part", root / name)
    with pytest.raises(mp.ProcessExitedException):  # rank 0 dies between writing step 8 and switching to it
        _spawn((_cfg(corpus, root / "part", device, resume=True), ("kill", 8)))
    shutil.copytree(root / "part", root / "killed")  # as the kill left it
    _spawn((_cfg(corpus, root / "part", device, resume=True), None),
           (_cfg(corpus, root / "full-disk", device, resume=True), ("fail", 8)))
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus) -> Path:
    return _runs(tmp_path_factory.mktemp("sharded"), corpus, "cpu")


def _check_same_world_and_kill(runs: Path) -> None:
    full, part, killed = runs / "full", runs / "part", runs / "killed"
    folder = sharded_folder(runs / "two")
    assert folder is not None and folder.name == "step-00000004" and not (runs / "two" / CKPT).exists()
    assert len(list(folder.glob("*.distcp"))) == 2  # each rank wrote its own shards
    assert (killed / SHARDED / "step-00000008" / "meta.pt").exists()  # complete, but never pointed at
    assert sharded_folder(killed).name == "step-00000004" and read_checkpoint(killed)["step"] == 4
    assert _losses(part) == _losses(full) and sorted(_losses(full)) == list(range(1, 9))
    assert [p.name for p in (part / SHARDED).glob("step-*")] == ["step-00000008"]  # stale and old ones removed
    ck = read_checkpoint(part)
    assert ck["step"] == 8 and len(ck["rng"]) == 2 and "model" not in ck
    for r in range(2):  # a failed write on one rank: a one-line TrainError on every rank, step 4 kept
        err = (runs / f"full-disk.rank{r}.err").read_text()
        assert "cannot write the sharded checkpoint" in err and "the disk is full" in err
        assert "the last checkpoint" in err and "step-00000004 is intact" in err
    assert sharded_folder(runs / "full-disk").name == "step-00000004"


def test_resume_on_two_is_bit_exact_and_survives_a_kill_mid_save(runs):
    """Saved on 2, killed mid-save, resumed on 2: every step's loss equals the uninterrupted run's,
    and the partial step folder the kill left is removed."""
    _check_same_world_and_kill(runs)


def test_two_to_one_and_one_to_two(runs, corpus, caplog):
    """A sharded checkpoint of 2 ranks resumes in one process (ckpt.pt replaces it); a
    one-process ckpt.pt resumes on 2 FSDP2 ranks (the sharded form replaces it)."""
    from twofour.training.loop import train  # noqa: PLC0415

    one = runs / "one"
    with caplog.at_level(logging.WARNING, logger="twofour"):
        train(dataclasses.replace(_cfg(corpus, one), fsdp=None, resume=True))
    assert "saved by 2 process(es), on 1" in caplog.text and "not bit-exact" in caplog.text
    assert checkpoint_path(one) == one / CKPT and not (one / SHARDED).exists()
    losses = _losses(one)
    assert sorted(losses) == list(range(1, 9)) and all(0 < float(v) < 10 for v in losses.values())
    assert [losses[s] for s in range(1, 5)] == [_losses(runs / "full")[s] for s in range(1, 5)]
    back = runs / "back"
    assert checkpoint_path(back) == sharded_folder(back) and not (back / CKPT).exists()
    assert read_checkpoint(back)["step"] == 8 and len(read_checkpoint(back)["rng"]) == 2
    assert sorted(_losses(back)) == list(range(1, 9))


def test_export_reads_a_sharded_checkpoint(runs, corpus, tmp_path):
    """``twofour export`` of an FSDP2 run loads its shards into the whole model on one process:
    the exported model scores the validation windows as the run did at that step."""
    from twofour.inference.format import load_for_inference  # noqa: PLC0415
    from twofour.training.data import load_data  # noqa: PLC0415
    from twofour.training.loop import evaluate  # noqa: PLC0415

    two = runs / "two"
    out = export(two, tmp_path / "export", dtype="float32")
    model = load_for_inference(out["out"], device="cpu", dtype=torch.float32)
    cfg = _cfg(corpus, two)
    loss = evaluate(model, load_data(corpus, None), cfg, torch.device("cpu"), contextlib.nullcontext())
    assert loss == pytest.approx(_val_loss(two, 4), rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_resume_on_two_gpus_is_bit_exact_and_survives_a_kill_mid_save(tmp_path, corpus, monkeypatch):
    """The same on 2 GPUs through NCCL, every GEMM on the 2:4 side: a route chosen by timing could
    differ between the uninterrupted and the resumed processes, and so could the losses."""
    monkeypatch.setenv("TWOFOUR_GEMM", "sparse")  # read by the spawned ranks as they import twofour
    _check_same_world_and_kill(_runs(tmp_path, corpus, "cuda"))


def _fake_sharded(out: Path, step: int, latest: bool = True) -> Path:
    """A step folder holding only meta.pt (what the run-folder logic reads), named by latest or not."""
    folder = out / SHARDED / f"step-{step:08d}"
    folder.mkdir(parents=True)
    torch.save({"config": TrainConfig().to_dict(), "step": step, "rng": [{}]}, folder / "meta.pt")
    if latest:
        (out / SHARDED / "latest").write_text(folder.name + "\n")
    return folder


def test_run_folder_logic_knows_the_sharded_form(tmp_path):
    """A folder holding a sharded checkpoint is a run (refused without --resume or --overwrite;
    --overwrite removes it); one holding only a partial step folder has no checkpoint to resume;
    with both forms the later step is the checkpoint; a meta.pt holding code is refused."""
    from twofour.errors import TrainError  # noqa: PLC0415
    from twofour.training.runs import prepare_run_dir  # noqa: PLC0415

    out = tmp_path / "run"
    _fake_sharded(out, 4, latest=False)  # killed before its first switch
    assert checkpoint_path(out) is None
    with pytest.raises(TrainError, match="no checkpoint"):
        prepare_run_dir(TrainConfig(out_dir=str(out), resume=True))
    folder = _fake_sharded(out, 8)
    assert checkpoint_path(out) == folder and read_checkpoint(out)["sharded"] == str(folder)
    with pytest.raises(TrainError, match="already holds a run"):
        prepare_run_dir(TrainConfig(out_dir=str(out)))
    torch.save({"config": {}, "model": {}, "step": 6}, out / CKPT)
    assert checkpoint_path(out) == folder  # step 8 beats ckpt.pt's 6
    torch.save({"config": {}, "model": {}, "step": 9}, out / CKPT)
    assert checkpoint_path(out) == out / CKPT
    prepare_run_dir(TrainConfig(out_dir=str(out), overwrite=True))
    assert not (out / SHARDED).exists() and not (out / CKPT).exists()
    folder = _fake_sharded(out, 4)
    torch.save({"config": {}, "step": 4, "rng": [], "x": Path("x")}, folder / "meta.pt")
    with pytest.raises(TrainError, match="refused and was not loaded"):
        read_checkpoint(out)


@pytest.mark.parametrize(("broken", "says"), [
    ("empty", "ckpt/latest is empty"),
    ("missing-step", "ckpt/latest names step-00000012, which is not in"),
    ("outside", "ckpt/latest names '../../elsewhere', outside"),
    ("absolute", "ckpt/latest names '/tmp', outside"),
    ("no-meta", "ckpt/step-00000010 has no meta.pt")])
def test_a_broken_sharded_pointer_says_what_is_wrong(tmp_path, corpus, capsys, broken, says):
    """A ``ckpt/latest`` that names nothing readable, or a step folder without its meta.pt: --resume,
    a plain re-run and ``twofour export`` each say exactly that and name the step folders there, in
    one line, and leave the folder as it was."""
    out = tmp_path / "f1"
    folder = _fake_sharded(out, 10)
    latest = out / SHARDED / "latest"
    text = {"empty": "", "missing-step": "step-00000012\n", "outside": "../../elsewhere\n", "absolute": "/tmp\n"}
    if broken in text:
        latest.write_text(text[broken])
    else:
        (folder / "meta.pt").unlink()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for args in (["train", "--out", str(out), "--resume"], ["train", "--data", corpus, "--out", str(out)],
                 ["export", str(out)]):
        err = error_of(args, capsys)
        assert says in err and f"{out / SHARDED} holds step-00000010" in err, err
        assert ("--overwrite" in err) == (args[0] == "train"), err  # export's --overwrite is for the export
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and checkpoint_path(out) is None
