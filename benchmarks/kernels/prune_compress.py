"""How close the fused pruning + compression kernels come to copy bandwidth (GPU).

    PYTHONPATH=src python benchmarks/kernels/prune_compress.py [--quick]

At the FFN shapes of GPT-2 774M, 1.5B and Llama 7B (one linear, d -> FFN width): S-STE's soft
threshold + scale + compression of the weight, the hard mask + compression with the dense
effective weight written too (the recipes that keep W_eff for dX), and MVUE + compression of
dY^T read in place from dY. For each: GB/s of the bytes it must read and write (kernel time by
CUDA graph replay, ``common.graph_ms``), that as a share of the copy bandwidth measured in the
same run, and the eager call's ms (``common.bench_ms``: the host's launch cost included).
``benchmarks/kernels/mvue_kernel.py`` takes the MVUE kernel apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from twofour.kernels import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line, graph_ms, md_head, md_row  # noqa: E402

SHAPES = [("gpt2-774m", 1280, 5120, 32768), ("gpt2-1.5b", 1600, 6400, 32768), ("llama-7b", 4096, 11008, 16384)]


def kernels(t: int, k: int, n: int) -> dict[str, tuple[object, int]]:
    """Each kernel at a (k -> n) linear on t tokens, and the bytes it must read and write."""
    w = torch.randn(n, k, device="cuda")
    beta = torch.ones(1, device="cuda")
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([3], device="cuda")
    cbytes = n * k // 2 * 2 + n * k // 8  # half the values in bf16, 4 bits of metadata per group
    return {"soft threshold + scale + compress W": (lambda: ops.compress(w, "soft", scale=beta), n * k * 4 + cbytes),
            "hard mask + compress W (+ dense W_eff)": (lambda: ops.compress(w, "hard", dense_out=True),
                                                       n * k * 6 + cbytes),
            "MVUE + compress dY^T, read in place from dY": (lambda: ops.compress(dy.t(), "mvue", seed=seed),
                                                            t * n * 2 + t * n // 2 * 2 + t * n // 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{gpu_line()}; copy bandwidth {bw:.0f} GB/s (bytes read + written)\n")
    print(md_head("kernel", "shape", "GB/s", "of copy bandwidth", "eager call ms"))
    for name, d, h, t in SHAPES:
        for kernel, (fn, nbytes) in kernels(t, d, h).items():
            fn()  # autotune outside the graph
            gbs = nbytes / graph_ms(fn, inner=10, reps=5 if args.quick else 20) / 1e6
            eager = bench_ms(fn, warmup=10 if args.quick else 25, rep=50 if args.quick else 200)
            print(md_row(kernel, f"{name} ({t} tokens, {d} -> {h})", f"{gbs:.0f}", f"{gbs / bw:.0%}",
                         f"{eager:.3f}"), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
