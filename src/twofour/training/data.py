"""Token streams for training: the default corpus (Python's own standard library, as bytes) and
real data (a text file or folder, nanoGPT-style uint16 or uint32 ``.bin`` shards, a local Hugging Face
dataset), all behind one small interface. Nothing is ever fetched from the network.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
import os
import pickle
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, warn

__all__ = ["TokenData", "load_data", "DataError", "stdlib_files", "is_shard_folder", "SHARD_DTYPES", "shard_dtype"]

VAL_FRACTION = 0.05


@dataclass
class TokenData:
    """Train and validation token arrays (1-D numpy arrays or memmaps) and their vocabulary size."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str

    def check(self, seq_len: int) -> None:
        """Raise DataError if either split can't give one sequence of ``seq_len`` + 1 tokens."""
        for split, arr in (("train", self.train), ("val", self.val)):
            if len(arr) <= seq_len + 1:
                raise DataError(f"{self.name}: the {split} split has {len(arr)} tokens, fewer than one "
                                f"sequence of length {seq_len} + 1; use a shorter --seq-len or more data")

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows (inputs and next-token targets); ``generator`` is the data position."""
        arr = self.train if split == "train" else self.val
        starts = torch.randint(0, len(arr) - seq_len - 1, (batch_size,), generator=generator).tolist()
        rows = np.stack([np.asarray(arr[s : s + seq_len + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        if torch.device(device).type == "cuda":  # one pinned window, one copy: x and y are views of it
            t = t.pin_memory().to(device, non_blocking=True)
        else:
            t = t.to(device)
        return t[:, :-1], t[:, 1:]


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files (without site-packages), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _position_split(data: bytes | bytearray, name: str) -> TokenData:
    """Bytes split by position: the last ``VAL_FRACTION`` is validation, the rest training."""
    cut = int(len(data) * (1 - VAL_FRACTION))
    if cut == 0:
        raise DataError(f"{name}: no bytes to train on")
    arr = np.frombuffer(bytes(data), dtype=np.uint8)
    return TokenData(arr[:cut], arr[cut:], 256, name)


def _split_files(files: list[Path], root: Path, name: str) -> TokenData:
    """Bytes of ``files``; each file goes to validation by a stable hash of its path (about 5%).

    If the hash sends every file to one split (a few files), the concatenated bytes are split by
    position instead: the tail is validation.
    """
    train, val = bytearray(), bytearray()
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DataError(unreadable(f, e)) from None
        rel = f.relative_to(root).as_posix() if f.is_relative_to(root) else f.name
        (val if zlib.crc32(rel.encode()) % 1000 < VAL_FRACTION * 1000 else train).extend(data)
    if not train or not val:  # all files landed in one split: hold out the tail instead
        return _position_split(train or val, name)
    return TokenData(np.frombuffer(bytes(train), dtype=np.uint8), np.frombuffer(bytes(val), dtype=np.uint8), 256, name)


BINARY_PROBE = 8192  # bytes read from the start of a file to tell text from binary


def unreadable(path: Path, e: OSError) -> str:
    """The line for a data file that can't be read: named, with the cause (permission denied)."""
    return (f"{path} is unreadable ({e.strerror or type(e).__name__}): give the user running twofour read access "
            "to it, or move it out of the data")


def _is_binary(path: Path) -> bool:
    """True if the first 8 KiB hold a NUL byte or aren't UTF-8 (a multi-byte character cut off at
    the end of the probe is fine). DataError naming the file when it can't be read."""
    try:
        with path.open("rb") as fh:
            head = fh.read(BINARY_PROBE)
    except OSError as e:
        raise DataError(unreadable(path, e)) from None
    if b"\0" in head:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return True
    return False


def _text_files(folder: Path, spec: str) -> list[Path]:
    """The non-empty text files below ``folder``, in a fixed order. Hidden files and folders
    (a name starting with ".") below ``folder`` are skipped; binary files are skipped with one warning."""
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    files = sorted(p for p in files if p.is_file() and p.stat().st_size > 0)
    if not files:
        raise DataError(f"{spec}: the folder holds no data")
    binary = [p for p in files if _is_binary(p)]
    if binary:
        if len(binary) == len(files):
            raise DataError(f"{spec}: the folder holds no text: all {len(files)} files look binary (a NUL byte or "
                            "not UTF-8 in their first 8 KiB); pass a folder of text files, or .bin token shards")
        names = ", ".join(p.relative_to(folder).as_posix() for p in binary[:3]) + (", ..." if len(binary) > 3 else "")
        warn(f"{spec}: skipped {len(binary)} binary file{'s' if len(binary) > 1 else ''} "
             f"(a NUL byte or not UTF-8 in the first 8 KiB): {names}")
        skip = set(binary)
        files = [p for p in files if p not in skip]
    return files


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds plain data only (dict, list, tuple, str, int, float, bool, None, ...):
    any global (a class or function, the way a pickle runs code) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load the global {module}.{name}")


def read_meta(meta: Path) -> dict:
    """nanoGPT's ``meta.pkl`` (``vocab_size``, and ``stoi``/``itos`` for character-level data),
    read without running code: a pickle holding anything but plain data is refused."""
    try:
        obj = _PlainUnpickler(io.BytesIO(meta.read_bytes())).load()
    except OSError as e:
        raise DataError(unreadable(meta, e)) from None
    except pickle.UnpicklingError as e:
        raise DataError(f"{meta}: holds something other than plain data ({e}); twofour reads only "
                        "dicts, lists, strings and numbers from meta.pkl, so that a pickle can't run code") from e
    except Exception as e:  # truncated or not a pickle at all
        raise DataError(f"{meta}: not a readable pickle ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict) or "vocab_size" not in obj:
        raise DataError(f"{meta}: expected a dict with 'vocab_size' (as nanoGPT writes it)")
    try:
        vocab_size = int(obj["vocab_size"])
    except (TypeError, ValueError) as e:
        raise DataError(f"{meta}: vocab_size {obj['vocab_size']!r} is not an integer") from e
    if vocab_size < 1:
        raise DataError(f"{meta}: vocab_size {vocab_size} must be positive")
    return {**obj, "vocab_size": vocab_size}


def is_shard_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of nanoGPT-style token shards: it holds a ``train*.bin`` or
    ``val*.bin`` file (a text folder with some other stray ``.bin`` file is not one)."""
    return path.is_dir() and any(p.is_file() for pattern in ("*train*.bin", "*val*.bin") for p in path.glob(pattern))


#: The token shards' element types, named by ``dtype`` in ``meta.pkl``: nanoGPT's uint16 (the
#: default, ids below 65,536), or uint32 for a larger vocabulary (Llama 3's tokenizer: 128,256).
SHARD_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def shard_dtype(meta: dict | None, where: Path) -> type[np.unsignedinteger]:
    """The token shards' dtype that ``meta`` (a ``meta.pkl``'s dict, None without one) names."""
    name = "uint16" if meta is None else meta.get("dtype", "uint16")
    if not isinstance(name, str) or name not in SHARD_DTYPES:
        raise DataError(f"{where}: dtype {name!r} is not one of {', '.join(SHARD_DTYPES)} (the token shards' type)")
    return SHARD_DTYPES[name]


def _bin_shards(folder: Path, vocab_size: int | None) -> TokenData:
    train = sorted(folder.glob("*train*.bin"))
    val = sorted(folder.glob("*val*.bin"))
    if not train or not val:
        raise DataError(f"{folder}: expected train*.bin and val*.bin token shards (uint16 or uint32)")
    meta_path = folder / "meta.pkl"
    meta = read_meta(meta_path) if meta_path.exists() else None
    if meta is None and vocab_size is None:
        raise DataError(f"{folder}: .bin shards need their vocabulary size: pass --vocab-size "
                        "(50257 for GPT-2's tokenizer) or put nanoGPT's meta.pkl beside them")
    if meta is not None and vocab_size is not None and vocab_size < meta["vocab_size"]:
        raise DataError(f"--vocab-size {vocab_size} is below the vocabulary size {meta['vocab_size']} in {meta_path}: "
                        "leave it out, or give a larger one (a tokenizer's padded size)")
    vocab_size = vocab_size or meta["vocab_size"]
    dtype = shard_dtype(meta, meta_path)
    width = np.dtype(dtype).itemsize
    if vocab_size > 1 << 8 * width:
        raise DataError(f"{folder}: a vocabulary of {vocab_size:,} ids does not fit {np.dtype(dtype).name} token "
                        "shards: " + ("write them as uint32 and put 'dtype': 'uint32' in meta.pkl beside them"
                                      if dtype is np.uint16 else f"at most {1 << 8 * width:,} ids fit"))

    def load(paths: list[Path]) -> np.ndarray:
        for p in paths:
            if p.stat().st_size % width:
                raise DataError(f"{p}: {p.stat().st_size} bytes is not a whole number of {np.dtype(dtype).name} "
                                f"tokens ({width} bytes each): the shard is truncated or not a token shard")
        arrs = []
        for p in paths:
            if p.stat().st_size >= width:
                try:
                    arrs.append(np.memmap(p, dtype=dtype, mode="r"))
                except OSError as e:
                    raise DataError(unreadable(p, e)) from None
                check_shard(arrs[-1], vocab_size, p)
        if not arrs:
            raise DataError(f"{folder}: the shards {', '.join(p.name for p in paths)} are empty")
        return arrs[0] if len(arrs) == 1 else np.concatenate(arrs)

    return TokenData(load(train), load(val), vocab_size, str(folder))


_CHUNK = 1 << 26  # tokens per slice of the whole-shard check: a bounded read, however large the shard


def check_shard(tokens: np.ndarray, vocab_size: int, where: Path) -> None:
    """DataError naming shard ``where``, the id and its position when any token of ``tokens`` (the
    whole shard, a memory map) is not below ``vocab_size``: checked once before training, in
    vectorized slices, rather than failing mid-run as an index error."""
    for start in range(0, len(tokens), _CHUNK):
        part = tokens[start:start + _CHUNK]
        if int(part.max()) >= vocab_size:
            at = start + int(np.argmax(part >= vocab_size))
            raise DataError(f"{where}: token {at:,} is id {int(tokens[at])}, outside the vocabulary of {vocab_size} "
                            "ids (meta.pkl's vocab_size or --vocab-size): the shard was written with another "
                            "tokenizer, or is damaged")


def _hf_dataset(spec: str) -> TokenData:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach for the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets  # noqa: PLC0415
    except ImportError as e:
        raise DataError("hf: data needs the 'datasets' package: pip install 'twofour[hf]'") from e
    for mod, flag in (("datasets.config", "HF_DATASETS_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                      ("huggingface_hub.constants", "HF_HUB_OFFLINE")):
        with contextlib.suppress(Exception):  # also when datasets was imported before twofour
            setattr(importlib.import_module(mod), flag, True)
    path = spec[len("hf:"):]
    try:
        ds = datasets.load_from_disk(path) if Path(path).exists() else datasets.load_dataset(path)
    except Exception as e:  # offline and not cached, or not a dataset
        raise DataError(f"{spec}: no local copy of this Hugging Face dataset ({type(e).__name__}: {e}); "
                        "twofour never downloads: save it with dataset.save_to_disk(path) and pass hf:path") from e
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{spec}: the dataset has no 'train' split (has {', '.join(ds)})")
        train = ds["train"]
        val = ds.get("validation") or ds.get("test")
    else:
        train, val = ds, None
    if "text" not in train.column_names:
        raise DataError(f"{spec}: expected a 'text' column, found {', '.join(train.column_names)}")

    def as_bytes(d) -> np.ndarray:
        return np.frombuffer("\n".join(d["text"]).encode("utf-8"), dtype=np.uint8)

    tr = as_bytes(train)
    va = as_bytes(val) if val is not None else tr[int(len(tr) * (1 - VAL_FRACTION)):]
    if val is None:
        tr = tr[: int(len(tr) * (1 - VAL_FRACTION))]
    return TokenData(tr, va, 256, spec)


def _as_bytes(vocab_size: int | None, name: str) -> None:
    """DataError when a vocabulary size is given for data read as bytes, where it would go unused."""
    if vocab_size is not None:
        raise DataError(f"--vocab-size {vocab_size} sets the vocabulary of .bin token shards; {name} is text, read as "
                        "bytes (vocabulary 256): leave --vocab-size out")


def load_data(spec: str | None = None, vocab_size: int | None = None) -> TokenData:
    """The data named by ``spec``.

    ``None`` or ``"stdlib"``: Python's standard library source, as bytes (vocabulary 256);
    a text file: its bytes, the last 5% for validation; a folder of text files: their bytes, split
    by file (hidden files and folders below it are skipped, binary files skipped with a warning);
    a folder with ``train*.bin`` and ``val*.bin``: token shards, uint16 or as ``meta.pkl`` names
    its ``dtype`` (:data:`SHARD_DTYPES`), of ``vocab_size`` ids, else ``meta.pkl``'s (read as plain
    data only); ``hf:NAME_OR_PATH``: the ``text`` column of a local Hugging Face dataset, as bytes.
    ``vocab_size`` is refused for data read as bytes.
    """
    if spec is None or spec == "stdlib":
        _as_bytes(vocab_size, "the standard library corpus")
        files = stdlib_files()
        if not files:
            raise DataError("stdlib: found no .py files in this Python's standard library")
        return _split_files(files, Path(sysconfig.get_paths()["stdlib"]), "stdlib")
    if spec.startswith("hf:"):
        _as_bytes(vocab_size, spec)
        return _hf_dataset(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"{spec}: no such file or folder")
    path = path.resolve()  # "../corp" and "./x": hidden parts are only looked for below the data folder
    if is_shard_folder(path):
        return _bin_shards(path, vocab_size)
    _as_bytes(vocab_size, spec)
    if path.is_file():
        if path.stat().st_size == 0:
            raise DataError(f"{spec}: the file is empty")
        if _is_binary(path):  # (an unreadable file is named as such)
            raise DataError(f"{spec}: the file looks binary (a NUL byte or not UTF-8 in its first 8 KiB); "
                            "pass a text file, or a folder of .bin token shards")
        return _position_split(path.read_bytes(), str(path))
    return _split_files(_text_files(path, spec), path, str(path))
