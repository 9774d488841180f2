"""cuSPARSELt's algorithm configurations at the GEMMs twofour's layers run (GPU).

    PYTHONPATH=src python benchmarks/gemm/spmm_configs.py [--quick]

For each linear of the presets below and each of its three GEMMs (forward D = W x^T, dX = W^T
dY^T, dW = dY^T x, the 2:4 operand first; no bias), in every order of B and D (``--quick``: B
column-major, as from a row-major x or dY, with both orders of D for the forward and dX; both
orders of B with a row-major D for dW): every algorithm configuration cuSPARSELt offers for the
shape is checked against the dense product, then timed (``common.bench_ms``,
median). The table gives the library's default configuration, the fastest, and dense cuBLAS on
the same operands; the summary the geometric mean of default / fastest per GEMM kind, and then
the dispatch's own pick through ``ops.spmm`` (which measures the configurations once per shape and keeps the fastest).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from twofour import dispatch
from twofour.kernels import compress as ck
from twofour.kernels import cusparselt as cs
from twofour.kernels import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, gpu_line  # noqa: E402

DT = torch.bfloat16
#: (name, tokens, in, out) of the linears timed; tokens as `twofour train`'s micro-batches x 1024
LINEARS = [
    ("gpt2-124m fc", 32768, 768, 3072),
    ("gpt2-124m proj", 32768, 3072, 768),
    ("gpt2-774m fc", 16384, 1280, 5120),
    ("gpt2-774m proj", 16384, 5120, 1280),
    ("llama-7b gate|up", 16384, 4096, 22016),
    ("llama-7b down", 16384, 11008, 4096),
]


def operand(rows: int, cols: int, col: bool) -> torch.Tensor:
    return (torch.randn(cols, rows, device="cuda").to(DT).t() if col
            else torch.randn(rows, cols, device="cuda").to(DT))


def case(kind: str, m: int, k: int, n: int, b_col: bool, d_col: bool, rep: int) -> dict:
    buf, dense = ck.compress(torch.randn(m, k, device="cuda"), "hard", dense_out=True)
    b = operand(k, n, b_col)
    ref = torch.mm(dense, b)
    base = cs.get_plan(m, k, n, cs.COL if b_col else cs.ROW, cs.COL if d_col else cs.ROW, DT)
    out = torch.empty((n, m) if d_col else (m, n), dtype=DT, device="cuda")
    times, bad = {}, []
    for config in range(base.num_configs):
        try:
            p = cs.get_plan(m, k, n, base.key.b_order, base.key.d_order, DT, config=config)
            if p.config_id != config:
                continue
            p.matmul(buf, b, out)
        except Exception:  # noqa: BLE001 - this configuration cannot run this shape
            continue
        got = out.t() if d_col else out
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        if err > 1e-2 or p.compressed_size != base.compressed_size:
            bad.append(f"#{config} err {err:.1e}")
            continue
        times[config] = bench_ms(lambda p=p: p.matmul(buf, b, out), warmup=5, rep=rep)
    dense_ms = bench_ms((lambda: torch.mm(b.t(), dense.t())) if d_col else (lambda: torch.mm(dense, b)), warmup=5,
                        rep=rep)
    if not times:
        raise RuntimeError(f"no cuSPARSELt configuration ran {m}x{k}x{n} (B {b_col=}, D {d_col=}) correctly: {bad}")
    best = min(times, key=times.get)
    return {"kind": kind, "shape": f"{m}x{k}x{n}", "b": "col" if b_col else "row", "d": "col" if d_col else "row",
            "n_configs": base.num_configs, "default": base.config_id, "default_ms": times.get(base.config_id, math.nan),
            "best": best, "best_ms": times[best], "dense_ms": dense_ms, "bad": bad, "all": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer operand orders (module doc), fewer repetitions")
    args = ap.parse_args()
    rep = 10 if args.quick else 40
    print(f"{gpu_line()}\n")
    print("| linear | GEMM | M x K x N | B | D | configs | default ms | fastest (id) ms | default / fastest | "
          "dense ms | dense / default | dense / fastest |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    gains: dict[str, list[float]] = {}
    bad = []
    for name, t, fin, fout in LINEARS:
        for kind, (m, k, n) in (("fwd", (fout, fin, t)), ("dX", (fin, fout, t)), ("dW", (fout, t, fin))):
            orders = ([(False, False), (True, False)] if kind == "dW" else [(True, False), (True, True)]) \
                if args.quick else [(b, d) for b in (False, True) for d in (False, True)]
            for b_col, d_col in orders:
                r = case(kind, m, k, n, b_col, d_col, rep)
                gains.setdefault(kind, []).append(r["default_ms"] / r["best_ms"])
                bad += [f"{name} {kind} B{r['b']} D{r['d']}: {x}" for x in r["bad"]]
                print(f"| {name} | {kind} | {r['shape']} | {r['b']} | {r['d']} | {r['n_configs']} | "
                      f"{r['default_ms']:.3f} (#{r['default']}) | {r['best_ms']:.3f} (#{r['best']}) | "
                      f"{r['default_ms'] / r['best_ms']:.2f}x | {r['dense_ms']:.3f} | "
                      f"{r['dense_ms'] / r['default_ms']:.2f}x | {r['dense_ms'] / r['best_ms']:.2f}x |", flush=True)
                torch.cuda.empty_cache()
    print("\nall configurations, ms, of the last case:", {c: round(v, 3) for c, v in r["all"].items()})
    print("\n## summary\n")
    for kind, g in gains.items():
        mean = math.exp(sum(map(math.log, g)) / len(g))
        print(f"- {kind}: default / fastest configuration, geometric mean {mean:.3f} (max {max(g):.2f}x) over "
              f"{len(g)} cases")
    print(f"- configurations that did not match the dense product: {bad or 'none'}")
    # the dispatch's own pick, through the op the layers call
    buf, dense = ck.compress(torch.randn(22016, 4096, device="cuda"), "hard", dense_out=True)
    x = operand(16384, 4096, False)
    dispatch.clear_choices()
    y = ops.spmm(buf, x.t(), 22016, True)
    err = ((y.float() - (dense @ x.t()).float()).norm() / (dense @ x.t()).float().norm()).item()
    print(f"- ops.spmm at llama-7b gate|up fwd: relative error {err:.1e}; dispatch: {dispatch.choice_lines('spmm')}")


if __name__ == "__main__":
    main()
