"""How exactly each FP8 GEMM route sums its products, against the exact sum (GPU).

    PYTHONPATH=src python benchmarks/fp8/fp8_accuracy.py [--ks 1024,4096,16384,65536]

Operands are e4m3 values with scale 1, so the exact product is the float64 product of their
values: what remains is the GEMM's accumulation and its output's rounding. At each contraction
length K (for the weight gradient, K is the tokens of a step's micro-batch), and for zero-mean
operands and for a positive dense operand (post-GELU activations are mostly positive, so the
partial sums grow along K), the relative error (Frobenius norm) of: ``torch._scaled_mm`` with
cuBLAS's two accumulation modes (``use_fast_accum`` False, what twofour calls, and True), the
FP8 2:4 GEMM through cuSPARSELt (what the forward's and the MVUE weight gradient's 2:4 routes
run), each with a float32 and a bf16 output, and the bf16 GEMM of the same values (what bf16
training computes).
"""

from __future__ import annotations

import argparse

import torch

from twofour import fp8 as F8
from twofour.functional import hard_threshold_24
from twofour.kernels import ops
from twofour.kernels.compress import compress_e4m3

M, N = 1024, 768  # the 2:4 operand's rows, the dense operand's rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def operands(k: int, positive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A (M, K) 2:4 along K and B (N, K), e4m3 with scale 1 (values near 1)."""
    a = hard_threshold_24(torch.randn(M, k, device="cuda")).to(F8.E4M3)
    b = torch.randn(N, k, device="cuda")
    return a, (b.abs() if positive else b).to(F8.E4M3)


def routes(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    one = torch.ones((), device="cuda")
    out = {}
    for dt, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        for fast in (False, True):
            out[f"cuBLAS FP8 fast_accum={fast:d} ->{name}"] = torch._scaled_mm(
                a, b.t(), one, one, out_dtype=dt, use_fast_accum=fast)
        out[f"cuSPARSELt FP8 2:4 ->{name}"] = ops.spmm(compress_e4m3(a), b.t(), M, False, out_dtype=dt)
    out["cuBLAS bf16 ->bf16"] = a.to(torch.bfloat16) @ b.to(torch.bfloat16).t()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1024,4096,16384,65536")
    ks = [int(k) for k in ap.parse_args().ks.split(",")]
    torch.manual_seed(0)
    rows: dict[str, dict[tuple[int, bool], float]] = {}
    for positive in (False, True):
        for k in ks:
            a, b = operands(k, positive)
            exact = a.double() @ b.double().t()
            for name, got in routes(a, b).items():
                assert got.shape == exact.shape, (name, got.shape)
                rows.setdefault(name, {})[(k, positive)] = rel(got, exact)
    cols = [(k, p) for p in (False, True) for k in ks]
    print(f"relative error against the exact sum, A {M} x K 2:4, B {N} x K (zero-mean | B positive)")
    print("| route | " + " | ".join(f"K={k}{' B>0' if p else ''}" for k, p in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, errs in rows.items():
        print(f"| {name} | " + " | ".join(f"{errs[c]:.1e}" for c in cols) + " |")


if __name__ == "__main__":
    main()
