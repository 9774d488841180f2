"""cuSPARSELt's bias epilogue (CUSPARSELT_MATMUL_BIAS_POINTER) with plans built once (GPU).

    PYTHONPATH=src python benchmarks/bias_epilogue.py

Checks, on random data, (1) that a plan built with a bias pointer adds that bias to each row of
D, for row- and column-major D; (2) whether a plan follows a bias pointer changed after it was
built (set on the matmul descriptor only), and what that costs in host time (re-initialising
the plan instead ended the first run of this script without a traceback, so it is not tried);
(3) which bias dtype it reads (bf16 like D, or fp32); then times the sparse
forward with the bias in the epilogue against the same GEMM without bias, with the bias added
afterwards in place, and dense ``addmm``.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from triton.testing import do_bench

from twofour.kernels import cusparselt as cs
from twofour.kernels import ops

L = cs._lib()
DT = torch.bfloat16


def plan_with_bias(m: int, k: int, n: int, d_order: int, bias: torch.Tensor | None):
    """A raw plan D (m x n) = A (m x k, 2:4) @ B (k x n, column-major), the bias pointer set
    before the plan is built (as torch's _cslt_sparse_mm does)."""
    h = cs._handle(torch.cuda.current_device())
    dt = cs._CUDA_DTYPE[DT]

    def dense(rows, cols, order):
        return L.dense_descriptor_init(h, rows, cols, cols if order == cs.ROW else rows, 16, dt, order)

    a = L.structured_descriptor_init(h, m, k, k, 16, dt, cs.ROW, L.Sparsity.SPARSITY_50_PERCENT)
    b, d = dense(k, n, cs.COL), dense(m, n, d_order)
    mm = L.matmul_descriptor_init(h, 0, 0, a, b, d, d, L.ComputeType.COMPUTE_32F)
    ptr = np.zeros(1, dtype=np.int64)
    if bias is not None:
        ptr[0] = bias.data_ptr()
        L.matmul_desc_set_attribute(h, mm, L.MatmulDescAttribute.BIAS_POINTER, ptr.ctypes.data, 8)
    alg = L.matmul_alg_selection_init(h, mm, L.MatmulAlg.DEFAULT)
    plan = L.matmul_plan_init(h, mm, alg)
    ws = torch.empty(max(1, L.matmul_get_workspace(h, plan)), dtype=torch.uint8, device="cuda")
    return dict(h=h, mm=mm, alg=alg, plan=plan, ws=ws, ptr=ptr, alpha=np.ones(1, np.float32),
                beta=np.zeros(1, np.float32), streams=np.zeros(1, np.int64))


def run(p, ac, b, d):
    p["streams"][0] = torch.cuda.current_stream().cuda_stream
    L.matmul(p["h"], p["plan"], p["alpha"].ctypes.data, ac.data_ptr(), b.data_ptr(), p["beta"].ctypes.data,
             d.data_ptr(), d.data_ptr(), p["ws"].data_ptr(), p["streams"].ctypes.data, 1)
    return d


def set_bias(p, bias: torch.Tensor) -> None:
    p["ptr"][0] = bias.data_ptr()
    L.matmul_desc_set_attribute(p["h"], p["mm"], L.MatmulDescAttribute.BIAS_POINTER, p["ptr"].ctypes.data, 8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def out_tensor(m: int, n: int, d_col: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw memory for D, D as an (m, n) view)."""
    raw = torch.empty((n, m) if d_col else (m, n), dtype=DT, device="cuda")
    return raw, raw.t() if d_col else raw


def checks() -> None:
    m, k, n = 1024, 768, 2048  # D = W (m=out, k=in) @ x^T (k, n=tokens)
    w = torch.randn(m, k, device="cuda")
    wc, wd = ops.compress(w, "hard", None, None, None, True, DT)
    x = torch.randn(n, k, device="cuda", dtype=DT)
    ref = (wd.float() @ x.float().t())
    b1, b2 = torch.randn(m, device="cuda", dtype=DT) * 4, torch.randn(m, device="cuda", dtype=DT) * 4
    print("| check | rel. error vs +b1 | vs +b2 | vs no bias |\n|---|---|---|---|")
    for d_col in (False, True):
        order = "D col-major" if d_col else "D row-major"
        raw, dv = out_tensor(m, n, d_col)
        p = plan_with_bias(m, k, n, cs.COL if d_col else cs.ROW, b1)
        run(p, wc, x.t(), raw)
        torch.cuda.synchronize()
        errs = [rel(dv, ref + bb.float()[:, None]) for bb in (b1, b2)] + [rel(dv, ref)]
        print(f"| {order}, bias b1 set before plan init | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
        set_bias(p, b2)
        raw.zero_()
        run(p, wc, x.t(), raw)
        torch.cuda.synchronize()
        errs = [rel(dv, ref + bb.float()[:, None]) for bb in (b1, b2)] + [rel(dv, ref)]
        print(f"| {order}, pointer changed to b2 on the descriptor | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
        b32 = b1.float()
        p32 = plan_with_bias(m, k, n, cs.COL if d_col else cs.ROW, b32)
        run(p32, wc, x.t(), raw)
        torch.cuda.synchronize()
        print(f"| {order}, fp32 bias buffer | {rel(dv, ref + b32[:, None]):.2e} | - | {rel(dv, ref):.2e} |")
    # host cost of changing the pointer
    p = plan_with_bias(m, k, n, cs.ROW, b1)
    t0 = time.perf_counter()
    for i in range(1000):
        set_bias(p, b1 if i % 2 else b2)
    print(f"\nhost cost of a bias pointer change: {(time.perf_counter() - t0) * 1e3:.2f} us")


COLS = ["dense mm", "dense addmm", "sparse_dr", "sparse_dr + epilogue bias", "sparse_dr + torch add_",
        "sparse_dc + epilogue bias", "sparse_dc"]


def time_shape(t: int, k: int, n: int) -> dict[str, float]:
    """Milliseconds of each way to compute y^T = W x^T + b (or y = x W^T + b) at one shape."""
    w = torch.randn(n, k, device="cuda")
    wc, wd = ops.compress(w, "hard", None, None, None, True, DT)
    x = torch.randn(t, k, device="cuda", dtype=DT)
    bias = torch.randn(n, device="cuda", dtype=DT)
    res = {"dense mm": do_bench(lambda: x @ wd.t(), return_mode="median"),
           "dense addmm": do_bench(lambda: torch.addmm(bias, x, wd.t()), return_mode="median")}
    for d_col in (False, True):
        raw, _ = out_tensor(n, t, d_col)
        pb = plan_with_bias(n, k, t, cs.COL if d_col else cs.ROW, bias)
        p0 = plan_with_bias(n, k, t, cs.COL if d_col else cs.ROW, None)
        tag = "sparse_dc" if d_col else "sparse_dr"
        res[tag] = do_bench(lambda p0=p0, raw=raw: run(p0, wc, x.t(), raw), return_mode="median")
        res[tag + " + epilogue bias"] = do_bench(lambda pb=pb, raw=raw: run(pb, wc, x.t(), raw), return_mode="median")
        if not d_col:
            res[tag + " + torch add_"] = do_bench(
                lambda p0=p0, raw=raw: run(p0, wc, x.t(), raw).add_(bias[:, None]), return_mode="median")
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
