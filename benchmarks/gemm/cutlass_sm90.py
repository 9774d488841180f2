"""CUTLASS's sm90 2:4 GEMM (``benchmarks/gemm/sm90/``) against cuBLAS dense and cuSPARSELt (H100/H200).

    PYTHONPATH=src python benchmarks/gemm/cutlass_sm90.py [--tokens 16384] [--ncu] [--quick]

1. Builds the library if it is not built yet (``sm90/cutlass/``, minutes of nvcc;
   ``TWOFOUR_SM90_LIB`` loads one built before)
   and checks the layout: twofour's compression (cuSPARSELt's buffer, metadata reordered) against
   CUTLASS's own compressor, byte for byte.
2. Checks every configuration's product against the dense one on random inputs, odd token counts
   included; a configuration that fails is reported and not timed.
3. Times the forward ``y = x W^T`` (x: tokens x in, row-major; y row-major) at the 7B and
   gpt2-774m FFN shapes: cuBLAS dense, cuSPARSELt (fastest configuration and output order) and
   every CUTLASS configuration; TFLOP/s counted as the dense GEMM's 2MNK, the share of the 2:4
   peak (twice the dense spec: 989 TFLOP/s on an H100 SXM, 989 on an H200), and the speed-up
   over cuBLAS in the same run.
4. With ``--ncu`` and Nsight Compute on PATH: the tensor pipe, shared-memory wavefronts, DRAM
   throughput and occupancy of the best CUTLASS configuration and of cuSPARSELt at one shape.

Writes ``results.json`` and ``results.md`` to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from twofour import dispatch
from twofour.kernels import compress as ck
from twofour.kernels import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, gemm_tflops, gpu_line, md_head, md_row  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/gemm/: the sm90 package
from sm90 import cutlass  # noqa: E402
from sm90 import gemm as sm90  # noqa: E402
from sm90 import layout as sm90_layout  # noqa: E402

SHAPES = [("llama-7b up", 4096, 11008), ("llama-7b down", 11008, 4096), ("llama-3-8b up", 4096, 14336),
          ("llama-3-8b down", 14336, 4096), ("gpt2-774m fc", 1280, 5120), ("gpt2-774m proj", 5120, 1280)]
DENSE_SPEC = 989.0  # TFLOP/s, H100 SXM / H200 dense bf16 (NVIDIA's datasheet, without sparsity)
NCU_BASES = ["sm__pipe_tensor_op_gmma_cycles_active", "sm__pipe_tensor_op_hmma_cycles_active",
             "l1tex__data_pipe_lsu_wavefronts_mem_shared", "dram__throughput", "sm__warps_active",
             "gpu__time_duration", "sm__throughput", "launch__registers_per_thread"]
NCU_SUFFIX = {"sm__pipe_tensor_op_gmma_cycles_active": ".avg.pct_of_peak_sustained_active",
              "sm__pipe_tensor_op_hmma_cycles_active": ".avg.pct_of_peak_sustained_active",
              "l1tex__data_pipe_lsu_wavefronts_mem_shared": ".sum",
              "dram__throughput": ".avg.pct_of_peak_sustained_elapsed",
              "sm__warps_active": ".avg.pct_of_peak_sustained_active", "gpu__time_duration": ".sum",
              "sm__throughput": ".avg.pct_of_peak_sustained_elapsed", "launch__registers_per_thread": ""}


def operands(t: int, k: int, m: int, seed: int = 0):
    """x (t, k), the pruned weight's dense form (m, k), cuSPARSELt's buffer and CUTLASS's (values, E),
    both written by twofour's compression kernel."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(m, k, device="cuda", generator=g)
    buf, wd = ops.compress(w, "hard", dense_out=True)
    vals, e = sm90_layout.split(ck.compress(w, "hard", layout=ck.SM90)[0], m, k)
    return x, wd, buf, vals, e


def check_layout() -> dict:
    """twofour's (values, E), from its compression kernel and reordered from cuSPARSELt's buffer,
    against CUTLASS's compressor at a few shapes."""
    out = {}
    for m, k in ((64, 128), (256, 1280), (1000, 4096), (11008, 4096)):
        _, wd, buf, vals, e = operands(1, k, m)
        cv, ce = sm90.compress_cutlass(wd)
        rv, re_ = sm90_layout.from_cusparselt(buf, m, k)
        out[f"{m}x{k}"] = {"values": torch.equal(cv[:m, : k // 2].view(torch.int16), vals.view(torch.int16)),
                           "meta_bytes": torch.equal(ce, e),
                           "meta_codes": torch.equal(sm90_layout.unpack_meta(e, m, k),
                                                     sm90_layout.unpack_meta(ce, m, k)),
                           "reordered_cusparselt": torch.equal(rv, vals) and torch.equal(re_, e),
                           "decompress": torch.equal(sm90_layout.decompress_reference(vals, e, m, k), wd)}
    return out


def check_configs(cfgs) -> dict:
    """Max relative error of each configuration against the dense product (fp32 reference)."""
    res = {}
    cases = [(1, 128, 64), (77, 1280, 5120), (1000, 4096, 1104), (4097, 11008, 4096), (16383, 1280, 256)]
    data = {c: operands(*c) for c in cases}
    refs = {c: (d[0].float() @ d[1].float().t()) for c, d in data.items()}
    for cfg in cfgs:
        worst, err_msg = 0.0, None
        for c, (x, _wd, _buf, vals, e) in data.items():
            try:
                y = sm90.gemm(vals, e, x, cfg).float()
            except (RuntimeError, ValueError) as ex:
                err_msg = f"{c}: {ex}"
                break
            ref = refs[c]
            worst = max(worst, ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        torch.cuda.synchronize()
        res[cfg.name] = {"max_rel_err": worst, "ok": err_msg is None and worst < 2e-2, "error": err_msg}
    return res


def time_shape(t: int, k: int, m: int, cfgs, rep: int) -> dict:
    x, wd, buf, vals, e = operands(t, k, m)
    ms = {"cublas": bench_ms(lambda: x @ wd.t(), rep=rep)}
    ms["cusparselt"] = min(bench_ms(lambda d=d: ops.spmm(buf, x.t(), m, d), rep=rep) for d in (False, True))
    out = torch.empty(t, m, device="cuda", dtype=torch.bfloat16)
    for cfg in cfgs:
        try:
            ms[cfg.name] = bench_ms(lambda c=cfg: sm90.gemm(vals, e, x, c, out=out), rep=rep)
        except (RuntimeError, ValueError) as ex:
            print(f"  {cfg.name} at {t}x{k}->{m}: {ex}")
    w = wd.float()
    compress_ms = {"cusparselt layout": bench_ms(lambda: ck.compress(w, "hard"), rep=rep),
                   "sm90 layout": bench_ms(lambda: ck.compress(w, "hard", layout=ck.SM90), rep=rep)}
    return ms, compress_ms


def ncu_profile(t: int, k: int, m: int, cfg_name: str) -> dict:
    """Nsight Compute metrics of one call of each route (NVTX ranges), or why there are none."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"skipped": "ncu not on PATH"}
    known = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    metrics = [b + NCU_SUFFIX[b] for b in NCU_BASES if b in known]
    cmd = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "prof/", "--csv", "--page", "raw",
           "--metrics", ",".join(metrics), sys.executable, __file__, "--ncu-child", f"{t},{k},{m},{cfg_name}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith('"')]
    if res.returncode != 0 or len(rows) < 3:
        return {"error": (res.stderr or res.stdout)[-1500:]}
    import csv  # noqa: PLC0415

    table = list(csv.reader(rows))
    head = table[0]
    found = []
    for row in table[2:]:  # row 1 holds the units
        rec = dict(zip(head, row))
        found.append({"kernel": rec.get("Kernel Name", "")[:90], **{mm: rec.get(mm) for mm in metrics}})
    return {"metrics": metrics, "kernels": found}


def ncu_child(spec: str) -> None:
    t, k, m, name = spec.split(",")
    t, k, m = int(t), int(k), int(m)
    cfg = next(c for c in sm90.configs() if c.name == name)
    x, wd, buf, vals, e = operands(t, k, m)
    routes = (lambda: sm90.gemm(vals, e, x, cfg), lambda: ops.spmm(buf, x.t(), m, True), lambda: x @ wd.t())
    for fn in routes:  # warm-up (cuSPARSELt's first call picks its configuration) outside the range
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    for fn in routes:  # profiled: the CUTLASS kernel, cuSPARSELt's, cuBLAS's, in this order
        fn()
        torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, 7B up/down and 774m only")
    ap.add_argument("--ncu", action="store_true", help="Nsight Compute metrics of the best configuration")
    ap.add_argument("--ncu-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ncu_child:
        return ncu_child(args.ncu_child)
    t0 = time.time()
    cutlass.set_build_kernels(True)  # this benchmark builds the library where it is not built yet
    if not sm90.available():
        sys.exit(f"the sm90 2:4 GEMM is not available here (an H100/H200, nvcc and the CUTLASS headers are needed): "
                 f"{dispatch.failures()}")
    cfgs = sm90.configs()
    dense_rate = gemm_tflops()
    print(f"{gpu_line()}; dense bf16 {dense_rate:.0f} TFLOP/s (8192^3); library built/loaded in "
          f"{time.time() - t0:.0f} s with {len(cfgs)} configurations\n")
    layout = check_layout()
    print("layout vs CUTLASS's compressor:", json.dumps(layout))
    correct = check_configs(cfgs)
    print(md_head("configuration", "max rel. error", "ok"))
    for name, r in correct.items():
        print(md_row(name, f"{r['max_rel_err']:.2e}", "yes" if r["ok"] else f"NO {r['error'] or ''}"))
    good = [c for c in cfgs if correct[c.name]["ok"]]
    rep = 30 if args.quick else 100
    shapes = [SHAPES[i] for i in (0, 1, 4, 5)] if args.quick else SHAPES
    rows, table = [], [md_head("shape", "in -> out", "route", "ms", "TFLOP/s", "% 2:4 spec peak", "x cuBLAS")]
    for name, k, m in shapes:
        ms, compress_ms = time_shape(args.tokens, k, m, good, rep)
        flop = 2.0 * args.tokens * k * m
        best = min((c.name for c in good if c.name in ms), key=ms.get, default=None)
        for route, v in ms.items():
            tf = flop / v / 1e9
            tag = route + (" (best)" if route == best else "")
            table.append(md_row(name, f"{k} -> {m}", tag, f"{v:.4f}", f"{tf:.0f}", f"{100 * tf / (2 * DENSE_SPEC):.1f}",
                                f"{ms['cublas'] / v:.2f}x"))
        table += [md_row(name, f"{k} -> {m}", f"weight compression, {lay}", f"{v:.4f}", "", "", "")
                  for lay, v in compress_ms.items()]
        rows.append({"shape": name, "k": k, "m": m, "tokens": args.tokens, "ms": ms, "best": best,
                     "compress_ms": compress_ms})
        print("\n".join(table[-len(ms) - 2:]), flush=True)
        torch.cuda.empty_cache()
    prof = {}
    if args.ncu and rows and rows[0]["best"]:
        r = rows[0]
        prof = ncu_profile(args.tokens, r["k"], r["m"], r["best"])
        print("ncu:", json.dumps(prof, indent=1))
    print(f"\ntotal {time.time() - t0:.0f} s")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "results.json").write_text(json.dumps(
            {"gpu": gpu_line(), "dense_tflops_8192": dense_rate, "layout": layout, "correct": correct,
             "timings": rows, "ncu": prof}, indent=1))
        Path(out, "results.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
