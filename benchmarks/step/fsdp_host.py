"""Where an FSDP2 step's time goes, against DDP's, on the GPUs of one host: each variant's step as
the training loop runs it (bf16 autocast, forward and backward, clip, fused AdamW, the sparse
layers advanced by ``attach``), timed three ways: the wall time per step (a sync every 10 steps),
the host's time to issue a step (no sync: when it is close to the wall time, the step waits on
its host), and the GPU's kernel time per step split into NCCL and the rest (torch.profiler).

    torchrun --standalone --nproc-per-node 2 benchmarks/step/fsdp_host.py --model gpt2-124m --batch 16 \\
        --variants ddp,fsdp:bf16,fsdp:bf16-flat,fsdp:bf16+compile [--recipes dense,s-ste] [--out FILE]

A variant is ``ddp`` or ``fsdp:POLICY`` (a ``--fsdp`` policy), optionally ``+compile`` (each block
compiled before sharding, as torchtitan does) and ``+busy`` (8 CPU-busy processes beside each
rank). Tokens/s here is this loop's; the real loop's numbers come from ``dist_loop.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from twofour.models.presets import build_model
from twofour.sparse import attach
from twofour.sparse.recipes import make_recipe
from twofour.training.parallel import fsdp_policy, grad_norm, shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import busy_cpus, kernel_times  # noqa: E402


def setup(variant: str, recipe: str, a, device):
    """(step function, model) of one variant: the model built, wrapped, its optimizer attached."""
    kind, *extras = variant.split("+")
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(a.model, make_recipe(recipe), vocab_size=256, block_size=a.seq_len,
                            n_layer=a.n_layer)
    raw = model
    if "compile" in extras:  # each block its own compiled module, FSDP2's hooks around it
        for i, block in enumerate(model.h):
            model.h[i] = torch.compile(block)
    if kind == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    else:
        shard(model, fsdp_policy(kind.split(":", 1)[1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    attach(raw, opt)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (a.batch, a.seq_len + 1), device=device, generator=gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    def step() -> None:
        with autocast:
            loss = model(x[:, :-1], x[:, 1:])[1]
        loss.backward()
        grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, model


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def measure(variant: str, recipe: str, a, device) -> dict:
    step, model = setup(variant, recipe, a, device)
    for _ in range(a.warmup):
        step()
    sync(device)
    walls, hosts = [], []
    with busy_cpus(8 if "busy" in variant.split("+") else 0):
        for _ in range(a.repeats):
            t0, host = time.perf_counter(), 0.0
            for _ in range(10):
                h = time.perf_counter()
                step()
                host += time.perf_counter() - h
            sync(device)
            walls.append((time.perf_counter() - t0) / 10)
            hosts.append(host / 10)
    row = {"wall": statistics.median(walls), "host": statistics.median(hosts)}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                step()
            sync(device)
        nccl = other = 0.0
        for key, (us, _) in kernel_times(prof, 4).items():  # each kernel once (not its launching op too)
            if "nccl" in key.lower():
                nccl += us / 1e3
            else:
                other += us / 1e3
        row.update(nccl=nccl, other=other)
    del step, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--variants", default="ddp,fsdp:bf16,fsdp:bf16-flat,fsdp:bf16+compile")
    ap.add_argument("--recipes", default="dense,s-ste")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:  # a CPU check of the script, over gloo
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lines = [f"{a.model}{f' ({a.n_layer} blocks)' if a.n_layer else ''}, {a.batch} x {a.seq_len} per GPU, "
             f"{world} processes; ms per step (median of {a.repeats} x 10 steps), host = time to issue a step",
             "", "| variant | recipe | wall ms | host ms | GPU NCCL ms | GPU other ms | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for variant in a.variants.split(","):
        for recipe in a.recipes.split(","):
            try:
                r = measure(variant, recipe, a, device)
            except Exception as e:  # noqa: BLE001 - reported, the other variants go on
                if rank == 0:
                    print(f"{variant} {recipe}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            tps = a.batch * a.seq_len * world / r["wall"]
            line = (f"| {variant} | {recipe} | {r['wall'] * 1e3:.1f} | {r['host'] * 1e3:.1f} | "
                    f"{r.get('nccl', float('nan')):.1f} | {r.get('other', float('nan')):.1f} | {tps:,.0f} |")
            lines.append(line)
            if rank == 0:
                print(line, flush=True)
                if a.out:  # written as it goes: a time limit keeps the rows that finished
                    Path(a.out).write_text("\n".join(lines) + "\n")
    if rank == 0:
        print("\n" + "\n".join(lines) + "\n", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
