"""The data sources behind --data: the standard library corpus, text, .bin shards, local HF datasets."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from twofour.cli import main
from twofour.errors import DataError
from twofour.training.data import load_data, stdlib_files

SMALL = ["train", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-interval", "3", "--eval-iters", "1",
         "--no-progress"]


def test_stdlib_corpus_is_deterministic_and_split_by_file():
    files = stdlib_files()
    assert files and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    a, b = load_data(), load_data("stdlib")
    assert a.vocab_size == 256 and np.array_equal(a.val, b.val) and len(a.train) > 10 * len(a.val) > 0


def test_batches_are_next_token_windows():
    data = load_data()
    g = torch.Generator().manual_seed(0)
    x, y = data.batch("train", 4, 32, g)
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


def _assert_split_by_file(data, contents: list[bytes]) -> None:
    """Every byte of ``contents`` (in file order) is in exactly one split, each file wholly in one."""
    train, val = bytes(data.train), bytes(data.val)
    assert len(train) + len(val) == sum(map(len, contents))
    i = j = 0
    for c in contents:  # walk both splits in file order: each file must continue one of them
        if train[i : i + len(c)] == c:
            i += len(c)
        elif val[j : j + len(c)] == c:
            j += len(c)
        else:
            raise AssertionError(f"a file's bytes straddle the splits: {c[:20]!r}...")
    assert i == len(train) and j == len(val)


def test_folder_of_text_files(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    data = load_data(str(tmp_path))
    assert data.vocab_size == 256 and len(data.train) and len(data.val)
    files = sorted(tmp_path.iterdir())
    _assert_split_by_file(data, [f.read_bytes() for f in files])


def _corpus(folder, n=30):
    """``n`` text files (doc6.txt hashes to validation); their bytes in the order they are read."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i}.txt").write_bytes(f"text {i} ".encode() * 40)
    return [p.read_bytes() for p in sorted(folder.glob("doc*.txt"))]


def test_data_folder_inside_a_hidden_folder(tmp_path):
    # --data ~/.cache/corpus: the dot-folder above the data folder doesn't count; those below it do
    folder = tmp_path / ".cache" / "corpus"
    contents = _corpus(folder)
    (folder / ".git").mkdir()
    (folder / ".git" / "objects.txt").write_text("hidden " * 500)
    (folder / ".notes.txt").write_text("hidden " * 500)
    data = load_data(str(folder))
    assert len(data.train) and len(data.val)
    _assert_split_by_file(data, contents)


def test_data_folder_as_a_relative_path(tmp_path, monkeypatch):
    _corpus(tmp_path / "corp")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    rel, ab = load_data("../corp"), load_data(str(tmp_path / "corp"))
    assert np.array_equal(rel.train, ab.train) and np.array_equal(rel.val, ab.val) and len(rel.train)
    monkeypatch.chdir(tmp_path)
    assert np.array_equal(load_data("./corp").train, ab.train)


@pytest.mark.parametrize("name", ["data.txt", "train.txt", "tiny.txt", "input.txt"])
def test_single_file_is_split_by_position(tmp_path, name):
    # these names used to hash to validation, leaving training "no bytes"
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(400)).encode()
    (tmp_path / name).write_bytes(text)
    data = load_data(str(tmp_path / name))
    train, val = bytes(data.train), bytes(data.val)
    assert train + val == text and val == text[len(train):]
    assert len(val) == len(text) - int(len(text) * 0.95) > 0


def test_single_file_through_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "data.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(400)))
    monkeypatch.chdir(tmp_path)
    assert main([*SMALL, "--data", "data.txt", "--out", "run"]) == 0


def test_few_files_all_hashed_to_one_split_fall_back_to_position(tmp_path):
    # "data.txt" and "train.txt" both hash to validation: training keeps the head, validation the tail
    (tmp_path / "data.txt").write_bytes(b"a" * 1000)
    (tmp_path / "train.txt").write_bytes(b"b" * 1000)
    data = load_data(str(tmp_path))
    assert bytes(data.train) + bytes(data.val) == b"a" * 1000 + b"b" * 1000 and len(data.val) == 100


def test_binary_files_are_skipped_with_a_warning(tmp_path):
    contents = _corpus(tmp_path)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 100)
    (tmp_path / "latin1.bin.dat").write_bytes("caf\xe9 ".encode("latin-1") * 100)  # not UTF-8
    # a UTF-8 character cut by the 8 KiB probe is still text
    edge = b"x" * 8191 + "é and more".encode()
    (tmp_path / "edge.txt").write_bytes(edge)
    with pytest.warns(UserWarning, match=r"skipped 2 binary files.*image\.png"):
        data = load_data(str(tmp_path))
    _assert_split_by_file(data, [*contents, edge])  # doc*.txt sort before edge.txt


def test_folder_of_binary_files_is_an_error(tmp_path, capsys):
    for i in range(3):
        (tmp_path / f"blob{i}.dat").write_bytes(bytes(range(256)) * 10)
    with pytest.raises(DataError, match="no text: all 3 files look binary"):
        load_data(str(tmp_path))
    with pytest.raises(DataError, match="looks binary"):
        load_data(str(tmp_path / "blob0.dat"))
    assert main([*SMALL, "--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "look binary" in capsys.readouterr().err


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_meta_pkl_is_read_as_plain_data_only(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 65, 5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 65, 500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    chars = [chr(32 + i) for i in range(65)]  # nanoGPT's shakespeare_char meta.pkl: vocab_size, itos, stoi
    with open(tmp_path / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}, fh)
    assert load_data(str(tmp_path)).vocab_size == 65
    marker = tmp_path / "pwned"
    with open(tmp_path / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 65, "x": _Evil(marker)}, fh)
    with pytest.raises(DataError, match="something other than plain data"):
        load_data(str(tmp_path))
    assert not marker.exists()
    (tmp_path / "meta.pkl").write_bytes(b"not a pickle")
    with pytest.raises(DataError, match="meta.pkl"):
        load_data(str(tmp_path))


def test_bin_shards_with_meta_and_vocab_size(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rng.integers(0, 1000, 5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 1000, 500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match="--vocab-size"):
        load_data(str(tmp_path))
    data = load_data(str(tmp_path), vocab_size=1000)
    assert data.vocab_size == 1000 and len(data.train) == 5000
    with pytest.raises(DataError, match="outside the vocabulary"):
        load_data(str(tmp_path), vocab_size=100)
    with pytest.raises(DataError, match="a vocabulary of 70,000 ids does not fit uint16 token shards"):
        load_data(str(tmp_path), vocab_size=70_000)
    with open(tmp_path / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 1024}, fh)
    assert load_data(str(tmp_path)).vocab_size == 1024
    assert main([*SMALL, "--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 0
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["model"]["wte.weight"].shape[0] == 1024


def test_uint32_shards_for_a_large_vocabulary(tmp_path, capsys):
    """A tokenizer with more than 65,536 ids (Llama 3's 128,256) writes uint32 shards, which
    meta.pkl names with 'dtype': 'uint32'; the model takes that vocabulary. uint16 shards (nanoGPT's,
    the default) with such a vocabulary are refused, naming the way on."""
    rng = np.random.default_rng(0)
    vocab = 100_000
    rng.integers(0, vocab, 5000, dtype=np.uint32).tofile(tmp_path / "train.bin")
    rng.integers(0, vocab, 500, dtype=np.uint32).tofile(tmp_path / "val.bin")

    def meta(**d):
        with open(tmp_path / "meta.pkl", "wb") as fh:
            pickle.dump({"vocab_size": vocab, **d}, fh)

    meta()  # no dtype: uint16, which can't hold the ids
    with pytest.raises(DataError, match="does not fit uint16 token shards: write them as uint32 and put 'dtype'"):
        load_data(str(tmp_path))
    meta(dtype="int8")
    with pytest.raises(DataError, match="dtype 'int8' is not one of uint16, uint32"):
        load_data(str(tmp_path))
    meta(dtype="uint32")
    data = load_data(str(tmp_path))
    assert data.vocab_size == vocab and len(data.train) == 5000 and int(data.train.max()) >= 65_536
    x, y = data.batch("train", 2, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < vocab
    with pytest.raises(DataError, match="--vocab-size 1000 is below the vocabulary size 100000"):
        load_data(str(tmp_path), vocab_size=1000)
    assert load_data(str(tmp_path), vocab_size=100_096).vocab_size == 100_096  # a padded size
    # the model's output spans the whole vocabulary: its first loss is about ln(100,000), above ln(65,536)
    assert main([*SMALL, "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--steps", "1", "--ckpt-interval",
                 "0", "--eval-interval", "1"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_val_loss"] > 11.3
    with open(tmp_path / "val.bin", "ab") as fh:
        fh.write(b"\0\0")  # half a uint32 token
    with pytest.raises(DataError, match="not a whole number of uint32 tokens"):
        load_data(str(tmp_path))


def test_local_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"line {i}: " + "abc " * 20 for i in range(200)]})
    ds.save_to_disk(str(tmp_path / "ds"))
    data = load_data(f"hf:{tmp_path / 'ds'}")
    assert data.vocab_size == 256 and len(data.val) > 0
    assert main([*SMALL, "--data", f"hf:{tmp_path / 'ds'}", "--out", str(tmp_path / "run")]) == 0
    with pytest.raises(DataError, match="never downloads"):
        load_data("hf:no-such-user/no-such-dataset-twofour")


def test_make_corpus_keeps_one_copy_of_each_source(tmp_path):
    """scripts/make_corpus.py: every distinct UTF-8 .py file once (no file in both splits),
    empty and undecodable ones left out, and a size check that fails loudly."""
    a, b = tmp_path / "a", tmp_path / "b" / "pkg"
    b.mkdir(parents=True)
    a.mkdir()
    (a / "x.py").write_text("print('x')\n")
    (b / "x_copy.py").write_text("print('x')\n")  # the same content under another name
    (b / "y.py").write_text("def y():\n    return 1\n")
    (b / "empty.py").write_text("  \n")
    (b / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (b / "notes.txt").write_text("not python")
    script = Path(__file__).parents[1] / "scripts" / "make_corpus.py"
    out = tmp_path / "corpus"
    res = subprocess.run([sys.executable, str(script), str(out), "--roots", str(a), str(tmp_path / "b")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(p.read_text() for p in out.iterdir()) == ["def y():\n    return 1\n", "print('x')\n"]
    assert "1 duplicates dropped" in res.stdout
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "c"), "--roots", str(a), "--min-bytes", "1e6"],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "fewer than" in res.stderr


def test_a_stray_bin_file_does_not_make_a_shard_folder(tmp_path):
    """A text folder with some other .bin file in it is read as text (the .bin skipped as binary);
    a folder is one of token shards when it holds train*.bin or val*.bin."""
    contents = _corpus(tmp_path)
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.warns(UserWarning, match=r"skipped 1 binary file.*weights\.bin"):
        data = load_data(str(tmp_path))
    assert data.vocab_size == 256
    _assert_split_by_file(data, contents)
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(DataError, match="val\\*.bin"):  # a shard folder now, missing its val shard
        load_data(str(tmp_path), vocab_size=100)


def test_an_odd_sized_shard_is_named(tmp_path, capsys):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes() + b"\x01")  # cut mid-token
    with pytest.raises(DataError, match=r"val\.bin: 201 bytes is not a whole number of uint16 tokens"):
        load_data(str(tmp_path), vocab_size=1000)
    assert main([*SMALL, "--data", str(tmp_path), "--vocab-size", "1000", "--out", str(tmp_path / "run")]) == 2
    assert "val.bin" in capsys.readouterr().err
