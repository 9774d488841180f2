"""The data sources behind --data: the standard library corpus, text, .bin shards, local HF datasets."""

import pickle

import numpy as np
import pytest
import torch

from twofour.cli import main
from twofour.data import DataError, load_data, stdlib_files

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


def test_folder_of_text_files(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 50)
    data = load_data(str(tmp_path))
    assert data.vocab_size == 256 and len(data.train) and len(data.val)


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
    with open(tmp_path / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 1024}, fh)
    assert load_data(str(tmp_path)).vocab_size == 1024
    assert main([*SMALL, "--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 0
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    assert ck["model"]["wte.weight"].shape[0] == 1024


def test_local_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": [f"line {i}: " + "abc " * 20 for i in range(200)]})
    ds.save_to_disk(str(tmp_path / "ds"))
    data = load_data(f"hf:{tmp_path / 'ds'}")
    assert data.vocab_size == 256 and len(data.val) > 0
    assert main([*SMALL, "--data", f"hf:{tmp_path / 'ds'}", "--out", str(tmp_path / "run")]) == 0
    with pytest.raises(DataError, match="never downloads"):
        load_data("hf:no-such-user/no-such-dataset-twofour")
