"""Faults and bad inputs a hostile user tries: damaged checkpoints and exports, a checkpoint from
another run, token ids outside the vocabulary anywhere in a shard, unreadable data, a WORLD_SIZE
without torchrun, twofour's warnings. Each ends in one line naming the file and the way on, with
nothing lost; none trains on silently."""

import json
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import twofour
from twofour.cli import main
from twofour.errors import DataError, TrainError, TwofourWarning, warn
from twofour.training.checkpoint import check_intact, read_checkpoint, save_checkpoint
from twofour.training.checkpoint_sharded import CRCS, save_sharded
from twofour.training.data import load_data

from .helpers import error_of

RUN = ["--model", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-interval", "2",
       "--eval-iters", "1", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Finished 2-step runs: the reference, and others differing in one identity each."""
    root = tmp_path_factory.mktemp("runs")
    variants = {"ref": [], "seed": ["--seed", "7"], "dense": ["--recipe", "dense"], "seq": ["--seq-len", "8"],
                "llama": ["--model", "llama-tiny"]}
    for name, extra in variants.items():
        args = ["train", *RUN, "--data", corpus, "--out", str(root / name), *extra]
        assert main(args) == 0
    return root


def copy_run(runs, tmp_path, name="ref"):
    out = tmp_path / name
    shutil.copytree(runs / name, out)
    return out


def resume(out, *extra):
    return ["train", "--out", str(out), "--resume", "--steps", "3", "--reschedule", *extra]


def damage(path, at=0.5, n=4000):
    """``n`` bytes of ``path`` overwritten in place at fraction ``at`` of it: the size unchanged."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + n] = bytes((i * 7 + 1) % 256 for i in range(min(n, len(data) - start)))
    path.write_bytes(bytes(data))


# --- the cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("at", [0.5, 0.9])
def test_a_checkpoint_damaged_in_place_is_refused(runs, tmp_path, capsys, at):
    out = copy_run(runs, tmp_path)
    damage(out / "ckpt.pt", at)
    err = error_of(resume(out), capsys)
    assert "ckpt.pt" in err and ("damaged" in err or "corrupt" in err) and "--overwrite" in err
    assert not (out / "ckpt.pt.tmp").exists()


def test_another_models_checkpoint_is_refused_naming_both(runs, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    shutil.copy(runs / "llama" / "ckpt.pt", out / "ckpt.pt")
    before = (out / "metrics.csv").read_text()
    err = error_of(resume(out), capsys)
    assert "not this run's" in err and "llama-tiny" in err and "tiny" in err and "config.json" in err
    assert (out / "metrics.csv").read_text() == before
    assert json.loads((out / "config.json").read_text())["model"] == "tiny"


@pytest.mark.parametrize("variant, option", [("seed", "--seed"), ("dense", "--recipe"), ("seq", "--seq-len")])
def test_a_checkpoint_of_another_run_is_named_by_the_option_that_differs(runs, tmp_path, capsys, variant, option):
    out = copy_run(runs, tmp_path)
    shutil.copy(runs / variant / "ckpt.pt", out / "ckpt.pt")
    assert f"it trains {option}" in error_of(resume(out), capsys)


def shards(folder, train, val, vocab=300, dtype="uint16"):
    folder.mkdir(exist_ok=True)
    for name, arrays in (("train", train), ("val", val)):
        for i, a in enumerate(arrays):
            np.asarray(a, dtype=dtype).tofile(folder / f"{name}{i:02d}.bin")
    (folder / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab, "dtype": dtype}))
    return folder


def test_a_token_id_past_the_first_million_is_found_before_training(tmp_path):
    train = np.random.default_rng(0).integers(0, 300, (1 << 20) + 5000)
    train[(1 << 20) + 4000] = 4321
    folder = shards(tmp_path / "s", [train], [np.arange(300)])
    with pytest.raises(DataError, match=r"train00\.bin: token 1,052,576 is id 4321, outside the vocabulary of 300"):
        load_data(str(folder))


def refuse_reading(monkeypatch, name):
    """Reading any file called ``name`` fails as a file without read permission does (as root too)."""
    def refused(method):
        def guarded(self, *args, **kwargs):
            if self.name == name:
                raise PermissionError(13, "Permission denied", str(self))
            return method(self, *args, **kwargs)
        return guarded

    monkeypatch.setattr(Path, "open", refused(Path.open))
    monkeypatch.setattr(Path, "read_bytes", refused(Path.read_bytes))


def test_an_unreadable_file_is_called_unreadable(tmp_path, monkeypatch):
    text = tmp_path / "a.txt"
    text.write_text("some text to train on\n" * 50)
    refuse_reading(monkeypatch, "a.txt")
    with pytest.raises(DataError, match=r"a\.txt is unreadable \(Permission denied\)"):
        load_data(str(text))
    (tmp_path / "b.txt").write_text("more text\n" * 50)
    with pytest.raises(DataError, match=r"a\.txt is unreadable") as e:  # one among text files
        load_data(str(tmp_path))
    assert "binary" not in str(e.value)


def test_a_folder_of_unreadable_files_is_not_called_binary(tmp_path, monkeypatch):
    for name in ("x.txt", "y.txt"):
        (tmp_path / name).write_text("text\n" * 20)
    refuse_reading(monkeypatch, "y.txt")
    with pytest.raises(DataError, match=r"y\.txt is unreadable"):
        load_data(str(tmp_path))


def test_world_size_without_torchrun_says_to_launch_with_torchrun(monkeypatch, capsys, corpus, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(var, raising=False)
    err = error_of(["train", *RUN, "--data", corpus, "--out", str(tmp_path / "w")], capsys)
    assert "WORLD_SIZE=2" in err and "torchrun" in err and "unset WORLD_SIZE" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_world_size_that_is_no_number_is_one_line(monkeypatch, capsys, tmp_path, value):
    monkeypatch.setenv("WORLD_SIZE", value)
    assert "is not a number of processes" in error_of(["train", *RUN, "--out", str(tmp_path / "w")], capsys)


def test_world_size_with_part_of_a_rendezvous_names_what_is_missing(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("RANK", raising=False)
    assert "RANK is not" in error_of(["train", *RUN, "--out", str(tmp_path / "w")], capsys)


def test_a_twofour_warning_prints_as_one_twofour_line(tmp_path):
    (tmp_path / "a.txt").write_text("text\n" * 100)
    (tmp_path / "b.png").write_bytes(b"\x89PNG\0\0")
    code = f"from twofour.training.data import load_data; load_data({str(tmp_path)!r})"
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.splitlines() == [f"twofour: {tmp_path}: skipped 1 binary file (a NUL byte or not UTF-8 in the first "
                                "8 KiB): b.png"]


def test_warning_lines_are_twofour_lines_and_others_keep_pythons_form():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("twofour.sparsify left these layers dense: x")
        warn("a skipped file")
        twofour.sparsify(torch.nn.Sequential(torch.nn.Linear(6, 6)), "ste")
        warnings.warn("not ours", UserWarning, stacklevel=1)
    lines = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught]
    assert lines[0] == "twofour.sparsify left these layers dense: x\n"  # no doubled prefix
    assert lines[1] == "twofour: a skipped file\n"
    assert all(line.count("\n") == 1 and line.startswith("twofour") for line in lines[:-1])
    assert issubclass(caught[2].category, TwofourWarning)
    assert "UserWarning: not ours" in lines[-1] and "test_faults.py" in lines[-1]


def test_the_header_line_names_the_device_and_precision(tmp_path, corpus, capsys):
    assert main(["train", *RUN, "--data", corpus, "--out", str(tmp_path / "h"), "--steps", "1", "--device", "cpu"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("ste tiny: steps 1-1, on cpu, float32"), first


# --- more faults, kept -------------------------------------------------------------------------------


def test_a_damaged_checkpoint_is_refused_by_export_too(runs, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    damage(out / "ckpt.pt", 0.7)
    err = error_of(["export", str(out)], capsys)
    assert "ckpt.pt" in err and ("damaged" in err or "corrupt" in err)
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("how", ["empty", "head", "pickle"])
def test_checkpoints_broken_other_ways_are_one_line(runs, tmp_path, capsys, how):
    out = copy_run(runs, tmp_path)
    path = out / "ckpt.pt"
    if how == "empty":
        path.write_bytes(b"")
    elif how == "head":
        damage(path, 0.0, 64)
    else:  # the pickled settings and structure, the zip's first entry
        damage(path, 0.0, 2000)
    err = error_of(resume(out), capsys)
    assert "ckpt.pt" in err and ("damaged" in err or "corrupt" in err or "unreadable" in err)


def test_damage_after_a_check_is_still_found(runs, tmp_path):
    out = copy_run(runs, tmp_path)
    ckpt = read_checkpoint(out)
    check_intact(ckpt, "way on")
    damage(out / "ckpt.pt", 0.6)
    with pytest.raises(TrainError, match="is damaged"):
        check_intact(read_checkpoint(out), "way on")


def test_a_checkpoint_is_checksummed_even_if_torch_was_told_not_to(tmp_path):
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        save_checkpoint(tmp_path / "ckpt.pt", {"config": {}, "model": {"w": torch.randn(4096)}, "step": 1})
        assert config.save.compute_crc32 is False  # the user's setting given back
    finally:
        config.save.compute_crc32 = before
    check_intact(read_checkpoint(tmp_path / "ckpt.pt"), "way on")
    damage(tmp_path / "ckpt.pt", 0.5, 16)  # inside the tensor's bytes
    with pytest.raises(TrainError, match="is damaged"):
        check_intact(read_checkpoint(tmp_path / "ckpt.pt"), "way on")


def test_a_checkpoint_whose_tensors_do_not_fit_names_the_tensor(runs, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    name = next(k for k in ckpt["model"] if k.endswith("mlp.fc.weight"))
    ckpt["model"][name] = torch.zeros(8, 8)
    save_checkpoint(out / "ckpt.pt", ckpt)
    err = error_of(resume(out), capsys)
    assert "does not fit this run's model" in err and name in err


def test_a_missing_or_broken_config_json_still_resumes(runs, tmp_path):
    gone = copy_run(runs, tmp_path, "ref")
    (gone / "config.json").unlink()
    assert main(resume(gone, "--no-progress")) == 0
    broken = tmp_path / "broken"
    shutil.copytree(runs / "ref", broken)
    (broken / "config.json").write_text("{not json")
    assert main(resume(broken, "--no-progress")) == 0
    assert json.loads((broken / "config.json").read_text())["steps"] == 3  # written anew, whole


def test_another_runs_data_is_named(runs, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "data": str(tmp_path / "elsewhere.txt")}))
    assert "it trains --data" in error_of(resume(out), capsys)


def sharded_run(tmp_path):
    """A one-process sharded checkpoint: DCP files, meta.pt with their CRC-32s."""
    state = {"model": {"w": torch.randn(256), "b": torch.randn(16)}}
    meta = {"config": {}, "step": 1, "rng": [{}]}
    with warnings.catch_warnings():  # DCP's "assuming ... a single process": meant so
        warnings.simplefilter("ignore", UserWarning)
        return save_sharded(tmp_path, 1, state, meta, 0, 1)


def test_sharded_checkpoints_record_and_check_each_files_crc(tmp_path):
    folder = sharded_run(tmp_path)
    ckpt = read_checkpoint(tmp_path)
    assert set(ckpt[CRCS]) == {p.name for p in folder.iterdir() if p.name != "meta.pt"}
    check_intact(ckpt, "way on")
    data = next(folder.glob("*.distcp"))
    damage(data, 0.5, 8)
    with pytest.raises(TrainError, match=rf"{data.name} fail their CRC-32.*way on"):
        check_intact(read_checkpoint(tmp_path), "way on")


@pytest.mark.parametrize("what", [".metadata", "distcp-missing"])
def test_a_sharded_checkpoints_damaged_or_missing_file_is_named(tmp_path, what):
    folder = sharded_run(tmp_path)
    if what == ".metadata":
        damage(folder / ".metadata", 0.5, 4)
        match = r"\.metadata fail"
    else:
        victim = next(folder.glob("*.distcp"))
        victim.unlink()
        match = rf"{victim.name} is missing"
    with pytest.raises(TrainError, match=match):
        check_intact(read_checkpoint(tmp_path), "way on")


def test_a_sharded_checkpoint_of_a_version_without_crcs_loads(tmp_path):
    folder = sharded_run(tmp_path)
    meta = torch.load(folder / "meta.pt", weights_only=True)
    del meta[CRCS]
    torch.save(meta, folder / "meta.pt")
    check_intact(read_checkpoint(tmp_path), "way on")


def test_an_export_whose_crc_is_not_a_number_is_malformed(runs, tmp_path, capsys):
    out = copy_run(runs, tmp_path)
    assert main(["export", str(out)]) == 0
    capsys.readouterr()
    cfg_path = out / "model_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "weights_crc32": "abc"}))
    err = error_of(["generate", str(out), "--max-new-tokens", "2"], capsys)
    assert "malformed" in err and "weights_crc32" in err


@pytest.mark.parametrize("where", ["val", "second-train", "boundary"])
def test_out_of_vocabulary_ids_are_named_with_their_shard(tmp_path, where):
    rng = np.random.default_rng(1)
    train = [rng.integers(0, 300, 4000), rng.integers(0, 300, 4000)]
    val = [rng.integers(0, 300, 2000)]
    shard = {"val": "val00.bin", "second-train": "train01.bin", "boundary": "train00.bin"}[where]
    target = val[0] if where == "val" else train[1] if where == "second-train" else train[0]
    target[1234] = 300 if where == "boundary" else 65535
    with pytest.raises(DataError, match=rf"{shard}: token 1,234 is id"):
        load_data(str(shards(tmp_path / "s", train, val)))
    target[1234] = 299  # the largest id the vocabulary holds is fine
    assert load_data(str(shards(tmp_path / "s", train, val))).vocab_size == 300


def test_uint32_shards_are_checked_whole_too(tmp_path):
    train = np.arange(5000) % 70000
    train[4999] = 80000
    with pytest.raises(DataError, match=r"train00\.bin: token 4,999 is id 80000"):
        load_data(str(shards(tmp_path / "s", [train], [np.arange(100)], vocab=70000, dtype="uint32")))


@pytest.mark.parametrize("name", ["meta.pkl", "train00.bin"])
def test_unreadable_shard_files_are_named(tmp_path, monkeypatch, name):
    folder = shards(tmp_path / "s", [np.arange(300)], [np.arange(300)])
    if name == "meta.pkl":
        refuse_reading(monkeypatch, name)
    else:
        real = np.memmap.__new__

        def refuse(cls, filename, *args, **kwargs):
            if Path(filename).name == name:
                raise PermissionError(13, "Permission denied", str(filename))
            return real(cls, filename, *args, **kwargs)

        monkeypatch.setattr(np.memmap, "__new__", refuse)
    with pytest.raises(DataError, match=rf"{name} is unreadable \(Permission denied\)"):
        load_data(str(folder))


def test_world_size_one_runs_as_one_process(monkeypatch, tmp_path, corpus):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", *RUN, "--data", corpus, "--out", str(tmp_path / "one"), "--steps", "1"]) == 0
