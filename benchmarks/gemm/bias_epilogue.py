"""cuSPARSELt's bias epilogue (CUSPARSELT_MATMUL_BIAS_POINTER) with plans built once (GPU).

    PYTHONPATH=src python benchmarks/gemm/bias_epilogue.py

Checks, on random data and through twofour's own ``cusparselt.Plan``, (1) that a plan built
with a bias epilogue (a placeholder bias at build time) adds the bias given at the call to each
row of D, for row- and column-major D; (2) that it follows a bias pointer changed after it was
built (reset on the matmul descriptor only), and what that costs in host time; (3) what a
float32 buffer behind the pointer gives (it is read in D's dtype); then times the sparse forward
with the bias in the epilogue against the same GEMM without bias, with the bias added
afterwards in place, and dense ``addmm``. (The "Bias" section of
docs/notes/fastpath-experiments.md records this script's numbers; its first form, which built
its plans from raw descriptors before ``Plan`` took a bias, also tried re-initialising a plan
after the pointer change and ended without a traceback.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from twofour.kernels import cusparselt as cs
from twofour.kernels import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, host_ms  # noqa: E402

DT = torch.bfloat16


def plan(m: int, k: int, n: int, d_col: bool, bias: bool) -> cs.Plan:
    """twofour's cached plan D (m x n) = A (m x k, 2:4) @ B (k x n, column-major); with ``bias``
    it is built with a placeholder bias and each call resets the descriptor's pointer."""
    return cs.get_plan(m, k, n, cs.COL, cs.COL if d_col else cs.ROW, DT, bias=bias)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def out_tensor(m: int, n: int, d_col: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw memory for D, D as an (m, n) view)."""
    raw = torch.empty((n, m) if d_col else (m, n), dtype=DT, device="cuda")
    return raw, raw.t() if d_col else raw


def checks() -> None:
    m, k, n = 1024, 768, 2048  # D = W (m=out, k=in) @ x^T (k, n=tokens)
    w = torch.randn(m, k, device="cuda")
    wc, wd = ops.compress(w, "hard", dense_out=True, out_dtype=DT)
    x = torch.randn(n, k, device="cuda", dtype=DT)
    ref = (wd.float() @ x.float().t())
    b1, b2 = torch.randn(m, device="cuda", dtype=DT) * 4, torch.randn(m, device="cuda", dtype=DT) * 4
    print("| check | rel. error vs +b1 | vs +b2 | vs no bias |\n|---|---|---|---|")
    for d_col in (False, True):
        order = "D col-major" if d_col else "D row-major"
        raw, dv = out_tensor(m, n, d_col)
        p = plan(m, k, n, d_col, True)
        for name, bias in (("b1 given to a plan built with a placeholder", b1), ("then b2 (pointer reset)", b2)):
            raw.zero_()
            p.matmul(wc, x.t(), raw, bias)
            torch.cuda.synchronize()
            errs = [rel(dv, ref + bb.float()[:, None]) for bb in (b1, b2)] + [rel(dv, ref)]
            print(f"| {order}, {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
        b32 = b1.float()  # a float32 buffer behind the pointer: a bf16 view of its first bytes has its address
        p.matmul(wc, x.t(), raw, b32.view(DT)[:m])
        torch.cuda.synchronize()
        print(f"| {order}, fp32 bias buffer | {rel(dv, ref + b32[:, None]):.2e} | - | {rel(dv, ref):.2e} |")
    # host cost of changing the pointer: a GEMM call with the bias it was last given against one
    # with another bias each time (Plan.matmul resets the pointer only when it changes)
    p = plan(m, k, n, False, True)
    raw, _ = out_tensor(m, n, False)
    flips = [b1, b2]

    def flip() -> None:
        flips.reverse()
        p.matmul(wc, x.t(), raw, flips[0])

    same = host_ms(lambda: p.matmul(wc, x.t(), raw, b1), 1000)
    changed = host_ms(flip, 1000)
    print(f"\nhost cost of a bias pointer change: {(changed - same) * 1e3:.2f} us a call "
          f"(GEMM call {same * 1e3:.1f} us with the same bias)")


COLS = ["dense mm", "dense addmm", "sparse_dr", "sparse_dr + epilogue bias", "sparse_dr + torch add_",
        "sparse_dc + epilogue bias", "sparse_dc"]


def time_shape(t: int, k: int, n: int) -> dict[str, float]:
    """Milliseconds of each way to compute y^T = W x^T + b (or y = x W^T + b) at one shape."""
    w = torch.randn(n, k, device="cuda")
    wc, wd = ops.compress(w, "hard", dense_out=True, out_dtype=DT)
    x = torch.randn(t, k, device="cuda", dtype=DT)
    bias = torch.randn(n, device="cuda", dtype=DT)
    res = {"dense mm": bench_ms(lambda: x @ wd.t()),
           "dense addmm": bench_ms(lambda: torch.addmm(bias, x, wd.t()))}
    for d_col in (False, True):
        raw, _ = out_tensor(n, t, d_col)
        pb, p0 = plan(n, k, t, d_col, True), plan(n, k, t, d_col, False)
        tag = "sparse_dc" if d_col else "sparse_dr"
        res[tag] = bench_ms(lambda p0=p0, raw=raw: p0.matmul(wc, x.t(), raw))
        res[tag + " + epilogue bias"] = bench_ms(lambda pb=pb, raw=raw: pb.matmul(wc, x.t(), raw, bias))
        if not d_col:
            res[tag + " + torch add_"] = bench_ms(lambda p0=p0, raw=raw: p0.matmul(wc, x.t(), raw).add_(bias[:, None]))
    return res


def timings() -> None:
    print("\n| tokens x in -> out | " + " | ".join(COLS) + " |\n|---|" + "---|" * len(COLS))
    for t, k, n in ((16384, 768, 3072), (32768, 768, 3072), (16384, 1280, 5120), (32768, 1280, 5120),
                    (16384, 5120, 1280), (32768, 1600, 6400), (16384, 4096, 11008)):
        res = time_shape(t, k, n)
        print(f"| {t} x {k} -> {n} | " + " | ".join(f"{res[c]:.3f}" for c in COLS) + " |", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    checks()
    timings()
