"""The FP8 transpose of FP8 dW's exact route: Triton tiles against torch's strided copy (GPU).

    PYTHONPATH=src python benchmarks/fp8/fp8_transpose.py

dW = dY^T X in FP8 multiplies dY's e4m3 copy (the dX GEMM's) transposed, since ``_scaled_mm``
takes its first operand row-major only. For each dY shape (tokens x features, GPT-2 124M's and
774M's FFN at their training batches): the check that each tile writes exactly q^T, then the
time of ``fp8cast.transpose`` with each tile (BM, BN, warps) and of ``q.t().contiguous()``, with
the share of copy bandwidth (1 byte read and 1 written per element), and the exact dW route whole
(transpose + ``_scaled_mm``) with torch's copy and with the kernel's default tile.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from twofour import fp8 as F8
from twofour.kernels import fp8cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line  # noqa: E402

SHAPES = [  # (tokens, dY features, X features): c_fc's and c_proj's dW
    ("gpt2-124m fc", 32768, 3072, 768), ("gpt2-124m proj", 32768, 768, 3072),
    ("gpt2-774m fc", 16384, 5120, 1280), ("gpt2-774m proj", 16384, 1280, 5120),
]
TILES = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 64, 8), (64, 256, 8)]


def shape(name: str, t: int, n: int, k: int) -> tuple[dict, float, float, int]:
    """One dY shape: each transpose's time (ms), the exact dW route with torch's copy and with the
    kernel, and how many tiles did not write q^T exactly."""
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    qd, sd = F8.quantize(dy, F8.E4M3)
    qxt, sxt = F8.quantize(torch.randn(k, t, device="cuda", dtype=torch.bfloat16), F8.E4M3)
    want = qd.t().contiguous().view(torch.uint8)
    ms, failures = {"torch": bench_ms(lambda: qd.t().contiguous(), warmup=10, rep=60)}, 0
    for tile in TILES:
        if not torch.equal(fp8cast.transpose(qd, tile).view(torch.uint8), want):
            failures += 1
            print(f"MISMATCH {name} tile {tile}")
        ms[tile] = bench_ms(lambda tile=tile: fp8cast.transpose(qd, tile), warmup=10, rep=60)
    old = bench_ms(lambda: F8.scaled_mm(qd.t().contiguous(), sd, qxt, sxt, torch.bfloat16), warmup=10, rep=60)
    new = bench_ms(lambda: F8.scaled_mm(fp8cast.transpose(qd), sd, qxt, sxt, torch.bfloat16), warmup=10, rep=60)
    return ms, old, new, failures


def main() -> None:
    print(f"{gpu_line()}; default tile {fp8cast.TRANSPOSE_TILE}\n")
    bw = copy_bandwidth()
    rows, failures = [], 0
    for name, t, n, k in SHAPES:
        ms, old, new, bad = shape(name, t, n, k)
        rows.append((name, t, n, ms, old, new))
        failures += bad
    gb = lambda t, n, m: 2 * t * n / m / 1e6  # noqa: E731 - GB/s of one transpose
    head = "| dY (tokens x features) | torch | " + " | ".join(f"{bm}x{bn}/{w}" for bm, bn, w in TILES)
    print(head + " | exact dW route: torch copy | with the kernel |")
    print("|---" * (len(TILES) + 4) + "|")
    for name, t, n, ms, old, new in rows:
        cells = [f"{v:.3f} ms ({gb(t, n, v) / bw:.0%})" for v in ms.values()]
        print(f"| {name} {t}x{n} | " + " | ".join(cells) + f" | {old:.3f} ms | {new:.3f} ms |")
    print(f"\ncopy bandwidth measured here: {bw:.0f} GB/s; in brackets: each transpose's share of it")
    print("all tiles wrote q^T exactly" if not failures else f"{failures} MISMATCHES")


if __name__ == "__main__":
    main()
