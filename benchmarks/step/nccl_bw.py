"""The collectives' bandwidth between the GPUs of one host, at the sizes the scale-out runs move: an
FSDP2 unit's all-gather (bf16) and reduce-scatter (fp32) at gpt2-124m's, gpt2-774m's, llama-1b's
and the Llama-3-8B shape's block, and DDP's all-reduce of gpt2-124m's fp32 gradients. What bounds
FSDP2's step against DDP's when the collectives do not hide behind compute.

    torchrun --standalone --nproc-per-node 2 benchmarks/step/nccl_bw.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import steps_ms  # noqa: E402

# (collective, dtype, bytes each rank holds whole): the blocks of gpt2-124m, gpt2-774m, llama-1b and
# the 8B shape hold 7.1M, 19.7M, 51.4M and 218.1M weights
BLOCKS = (7.1e6, 19.7e6, 51.4e6, 218.1e6)
CASES = [*(("all_gather", torch.bfloat16, n * 2) for n in BLOCKS),
         *(("reduce_scatter", torch.float32, n * 4) for n in BLOCKS),
         ("all_reduce", torch.float32, 85e6 * 4)]


def time_ms(fn) -> float:
    """Median ms of one call over 20, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return steps_ms(fn, n=20)


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    lines = [f"{world} GPUs, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, median of 20; "
             "bus bandwidth as nccl-tests define it", "",
             "| collective | dtype | MB (whole) | ms | bus GB/s |", "|---|---|---|---|---|"]
    for kind, dtype, nbytes in CASES:
        n = int(nbytes // dtype.itemsize) // world * world
        whole = torch.randn(n, device="cuda").to(dtype)
        part = torch.empty(n // world, device="cuda", dtype=dtype)
        fn = {"all_gather": lambda w=whole, p=part: dist.all_gather_into_tensor(w, p),
              "reduce_scatter": lambda w=whole, p=part: dist.reduce_scatter_tensor(p, w),
              "all_reduce": lambda w=whole: dist.all_reduce(w)}[kind]
        ms = time_ms(fn)
        factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
        lines.append(f"| {kind} | {str(dtype).split('.')[1]} | {n * dtype.itemsize / 1e6:.1f} | {ms:.3f} | "
                     f"{n * dtype.itemsize * factor / ms / 1e6:.0f} |")
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
