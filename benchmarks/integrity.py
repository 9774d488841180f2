"""What the integrity checks cost: a gpt2-124m checkpoint (model, AdamW state) saved, checked
(every tensor's CRC-32) and loaded, and the whole-shard vocabulary check over a 1 GB uint16
token shard. Runs on the CPU; prints a markdown table (docs/checkpoints.md quotes it).

    PYTHONPATH=src python benchmarks/integrity.py [--dir /tmp]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from twofour.models import build_model
from twofour.training.checkpoint import check_intact, read_checkpoint, save_checkpoint
from twofour.training.data import check_shard


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        model = build_model("gpt2-124m", "ste", vocab_size=50304, block_size=1024)
        opt = torch.optim.AdamW(model.parameters())
        for param in model.parameters():  # AdamW's two moments, as after a step
            param.grad = torch.zeros_like(param)
        opt.step()
        payload = {"config": {}, "step": 1, "model": model.state_dict(), "optimizer": opt.state_dict()}
        path = tmp / "ckpt.pt"
        save_s = seconds(lambda: save_checkpoint(path, payload))
        ckpt = read_checkpoint(path)
        check_s = seconds(lambda: check_intact(ckpt, ""))
        load_s = seconds(lambda: model.load_state_dict(torch.load(path, weights_only=True)["model"]))
        size = path.stat().st_size
        shard = tmp / "train.bin"
        tokens = np.memmap(shard, dtype=np.uint16, mode="w+", shape=(1 << 29,))
        tokens[:] = np.arange(1 << 29, dtype=np.uint32) % 50257
        tokens.flush()
        del tokens
        mapped = np.memmap(shard, dtype=np.uint16, mode="r")
        shard_s = seconds(lambda: check_shard(mapped, 50257, shard))
        shard_gb = shard.stat().st_size / 1e9
    cpu = platform.processor() or platform.machine()
    print(f"CPU: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| what | size | seconds |\n|---|---|---|")
    print(f"| gpt2-124m checkpoint: save (torch.save, CRC-32 included, fsync) | {size / 1e9:.2f} GB | {save_s:.2f} |")
    print(f"| the same: check every tensor's CRC-32 (page cache) | {size / 1e9:.2f} GB | {check_s:.2f} |")
    print(f"| the same: torch.load + load_state_dict of the model | {size / 1e9:.2f} GB | {load_s:.2f} |")
    print(f"| 1 GB uint16 token shard: every id below the vocabulary | {shard_gb:.2f} GB | "
          f"{shard_s:.2f} |")


if __name__ == "__main__":
    main()
