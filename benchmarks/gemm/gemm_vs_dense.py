"""Each GEMM of a linear layer alone, 2:4 against dense bf16, operands already compressed (GPU).

    PYTHONPATH=src python benchmarks/gemm/gemm_vs_dense.py [--quick]

At the FFN shapes of GPT-2 124M to 1.5B and Llama 7B, both linears of each: the forward
y = x W^T with W hard-pruned 2:4, dX = dY W with W^T 2:4 (a transposable mask), and dW = dY^T x
with dY^T's MVUE estimate 2:4; the ratio dense cuBLAS time / the 2:4 GEMM's (the faster of
both output orders where there are two), each a ``common.bench_ms`` median. What bounds a
layer's gain: pruning, compression and MVUE are not counted here (``twofour bench`` times whole
layers). The header gives the copy bandwidth and the dense GEMM rate measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from twofour import dispatch
from twofour.functional import transposable_mask_24
from twofour.kernels import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gemm_tflops, gpu_line, md_head, md_row  # noqa: E402

# (name, d_model, FFN width, tokens = seq 1024 x micro-batch)
SHAPES = [("gpt2-124m", 768, 3072, 32768), ("gpt2-350m", 1024, 4096, 32768), ("gpt2-774m", 1280, 5120, 32768),
          ("gpt2-1.5b", 1600, 6400, 32768), ("llama-7b", 4096, 11008, 16384)]


def gemms(t: int, k: int, n: int, rep: int) -> dict[str, float]:
    """Dense time / the best 2:4 time of each GEMM of a (k -> n) linear on t tokens."""
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda")
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    wc, wd = ops.compress(w, "hard", dense_out=True)
    m = transposable_mask_24(w)
    wtc = ops.compress(w.t(), "mask", mask=m.t())[0]
    wtd = (w * m).bfloat16()
    dyc = ops.compress(dy.t(), "mvue", seed=torch.tensor([1], device="cuda"))[0]

    def best(fn) -> float:
        return min(bench_ms(lambda d=d: fn(d), rep=rep) for d in (False, True))

    return {"fwd": bench_ms(lambda: x @ wd.t(), rep=rep) / best(lambda d: ops.spmm(wc, x.t(), n, d)),
            "dX": bench_ms(lambda: dy @ wtd, rep=rep) / best(lambda d: ops.spmm(wtc, dy.t(), k, d)),
            "dW": bench_ms(lambda: dy.t() @ x, rep=rep) / bench_ms(lambda: ops.spmm(dyc, x, n, False), rep=rep)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 774M's shapes and up, fewer repetitions")
    args = ap.parse_args()
    rep = 50 if args.quick else 200
    print(f"{gpu_line()}; copy bandwidth {copy_bandwidth():.0f} GB/s, dense bf16 {gemm_tflops():.0f} TFLOP/s "
          "(8192^3). Ratios: dense bf16 time / 2:4 time.\n")
    print(md_head("shape", "tokens x in -> out", "fwd", "dX (W^T 2:4)", "dW (MVUE dY^T)"))
    for name, d, h, t in SHAPES[2:] if args.quick else SHAPES:
        for k, n in ((d, h), (h, d)):
            r = gemms(t, k, n, rep)
            print(md_row(name, f"{t} x {k} -> {n}", *(f"{r[g]:.2f}x" for g in ("fwd", "dX", "dW"))), flush=True)
            torch.cuda.empty_cache()
    print("\n" + "\n".join(dispatch.choice_lines("spmm")))


if __name__ == "__main__":
    main()
