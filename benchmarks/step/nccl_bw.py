"""The collectives' bandwidth between the GPUs of one host, at the sizes the scale-out runs move: an
FSDP2 unit's all-gather (bf16) and reduce-scatter (fp32) at gpt2-124m's and gpt2-774m's block, and
DDP's all-reduce of gpt2-124m's fp32 gradients. What bounds FSDP2's step against DDP's when the
collectives do not hide behind compute.

    torchrun --standalone --nproc-per-node 2 benchmarks/step/nccl_bw.py
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

# (collective, dtype, bytes each rank holds whole): gpt2-124m's block is 7.1M weights, gpt2-774m's 19.7M
CASES = [("all_gather", torch.bfloat16, 7.1e6 * 2), ("all_gather", torch.bfloat16, 19.7e6 * 2),
         ("reduce_scatter", torch.float32, 7.1e6 * 4), ("reduce_scatter", torch.float32, 19.7e6 * 4),
         ("all_reduce", torch.float32, 85e6 * 4)]


def time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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
