"""FP8 2:4 GEMMs through cuSPARSELt against dense FP8 and bf16, at the FFN shapes (GPU).

    PYTHONPATH=src python benchmarks/fp8/fp8_spmm.py [--quick] [--sections 1,2,3,4]

1. Which FP8 plans cuSPARSELt builds and runs (e4m3 or e5m2 operands; bf16, float32 or e4m3
   output; B and D row- or column-major), each checked against the dequantized product; then,
   in plans built from raw descriptors, its ways to scale an FP8 product on the device (a
   per-row alpha vector; A and B scale modes with device pointers) and mixed formats (A e5m2,
   B e4m3).
2. At GPT-2 774M's and Llama 7B's FFN shapes (16384 tokens; ``--quick``: 774M only), the forward
   GEMM y = x W^T + b with a 2:4 W: bf16 dense (cuBLAS), bf16 2:4 (cuSPARSELt), FP8 dense
   (``torch._scaled_mm``, without and with the bias in its epilogue), the FP8 2:4 GEMM alone (in
   the configuration the dispatch keeps), the compression of the e4m3 weight by cuSPARSELt and by
   twofour's Triton kernel (``compress_e4m3``, what the route runs), the pass that scales the
   output and adds the bias (``fp8cast.rescale_``), and the FP8 2:4 route as ``fp8.scaled_mm``
   runs it with the bias (compression, GEMM, scaling pass); with each one's share of its limit:
   the dense tensor-core peaks (H100 SXM: 989 TFLOP/s bf16, 1979 FP8; 2:4 GEMMs against twice
   those) and copy bandwidth (measured here, ``common.copy_bandwidth``) for the
   compression (read W, write half of it and the metadata) and the scaling pass (read and write
   the output).
3. ``fp8.scaled_mm(..., sparse_b=True)`` with the dispatch free (``gemm=auto``), without and with a
   bias: the route it picked, the times it measured, and the error of each route against the
   reference.
4. dW with MVUE and e4m3 gradients: the dense route (the exact GEMM dY^T X: the dX GEMM's e4m3
   copy of dY transposed, then ``_scaled_mm``) and the FP8 2:4 route on the estimate
   (``kernels/mvue_fp8.py`` writing the estimate compressed in e4m3, the FP8 2:4 GEMM, the
   scaling pass), each part against its limit (copy bandwidth: the fused kernel reads dY once and
   writes the compressed bytes, the scaling pass reads and writes dW; the GEMMs, and the dense
   route whole, against the FP8 peaks), the routes whole and the dispatch's choice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from twofour import dispatch
from twofour import fp8 as F8
from twofour.functional import hard_threshold_24
from twofour.kernels import cusparselt as cs
from twofour.kernels import fp8cast, ops
from twofour.kernels.compress import compress_e4m3
from twofour.kernels.layout import compressed_size
from twofour.kernels.mvue_fp8 import SCALE_BOUND, mvue_e4m3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line  # noqa: E402

BF = torch.bfloat16
SHAPES = [("gpt2-774m fc", 16384, 1280, 5120), ("gpt2-774m proj", 16384, 5120, 1280),
          ("llama-7b up", 16384, 4096, 11008), ("llama-7b down", 16384, 11008, 4096)]
PEAK = {"bf16": 989e12, "fp8": 1979e12}  # H100 SXM dense tensor-core peaks (NVIDIA's data sheet)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def operands(t: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(t, k, device="cuda", dtype=BF)
    w = hard_threshold_24(torch.randn(n, k, device="cuda") / k ** 0.5).to(BF)
    return x, w


def kinds() -> list[str]:
    """Section 1: build and run FP8 plans of each kind at one shape (output unscaled); where one
    fails, at which step (building the plan, or the GEMM)."""
    lines = ["| A, B | D | B order | D order | result |", "|---|---|---|---|---|"]
    t, k, n = 256, 512, 384
    x, w = operands(t, k, n)
    for fmt in (F8.E4M3, F8.E5M2):
        qx, sx = F8.quantize(x, fmt)
        qw, sw = F8.quantize(w, fmt)
        ref = F8.dequantize(qw, sw) @ F8.dequantize(qx, sx).t()  # (n, t) = W x^T
        for out_dtype in (BF, torch.float32, F8.E4M3):
            for b_col, d_col in ((True, True), (True, False), (False, True), (False, False)):
                b = qx.t() if b_col else qx.t().contiguous()  # x^T (k, t)
                step = "plan"
                try:
                    plan = cs.get_plan(n, k, t, cs.COL if b_col else cs.ROW, cs.COL if d_col else cs.ROW, fmt,
                                       out_dtype=out_dtype)
                    step = "matmul"
                    out = torch.empty((t, n) if d_col else (n, t), dtype=out_dtype, device="cuda")
                    plan.matmul(cs.compress(qw), b, out)
                    torch.cuda.synchronize()
                    result = f"ok, error {rel((out.t() if d_col else out).float() * (sw * sx), ref):.1e}"
                except Exception as e:  # noqa: BLE001 - what this section reports
                    result = f"{step} refused: {type(e).__name__}: {str(e).splitlines()[0][:50] if str(e) else ''}"
                lines.append(f"| {str(fmt).split('_')[1]} | {str(out_dtype).split('.')[1]} | "
                             f"{'col' if b_col else 'row'} | {'col' if d_col else 'row'} | {result} |")
    return lines


def scaling_modes() -> list[str]:
    """Section 1b: the ways cuSPARSELt offers to scale an FP8 product on the device, and mixed
    formats, each in a plan built from raw descriptors (e4m3 A 2:4, B column-major, bf16 D
    column-major): a per-row alpha vector; A and B scale modes (a float32 scalar each, read
    through device pointers set before the plan is built); A e5m2 with B e4m3."""
    from nvmath.bindings import cusparseLt as L  # the library's own bindings: these plans are not twofour's

    h = L.init()
    t, k, n = 256, 512, 384
    x, w = operands(t, k, n)
    lines = ["| variant | result |", "|---|---|"]
    for variant in ("alpha vector", "A and B scale pointers", "A e5m2, B e4m3"):
        qx, sx = F8.quantize(x, F8.E4M3)
        qw, sw = F8.quantize(w, F8.E5M2 if variant.startswith("A e5m2") else F8.E4M3)
        ref = F8.dequantize(qw, sw) @ F8.dequantize(qx, sx).t()
        step = "plan"
        try:
            a = L.structured_descriptor_init(h, n, k, k, 16, 29 if qw.dtype == F8.E5M2 else 28, cs.ROW,
                                             L.Sparsity.SPARSITY_50_PERCENT)
            b = L.dense_descriptor_init(h, k, t, k, 16, 28, cs.COL)
            d = L.dense_descriptor_init(h, n, t, n, 16, 14, cs.COL)
            mm = L.matmul_descriptor_init(h, 0, 0, a, b, d, d, L.ComputeType.COMPUTE_32F)
            keep = []

            def attr(name, value, dtype=np.int32, keep=keep, mm=mm):
                arr = np.array([value], dtype=dtype)
                keep.append(arr)
                L.matmul_desc_set_attribute(h, mm, getattr(L.MatmulDescAttribute, name), arr.ctypes.data, arr.itemsize)

            alpha_vec = (sw * sx).float().expand(n).contiguous()
            scales = torch.stack([sw, sx]).float()
            if variant == "alpha vector":
                attr("ALPHA_VECTOR_SCALING", 1)
            elif variant.startswith("A and B"):
                attr("A_SCALE_MODE", int(L.MatmulMatrixScale.SCALAR_32F))
                attr("B_SCALE_MODE", int(L.MatmulMatrixScale.SCALAR_32F))
                attr("A_SCALE_POINTER", scales[0:].data_ptr(), np.int64)
                attr("B_SCALE_POINTER", scales[1:].data_ptr(), np.int64)
            alg = L.matmul_alg_selection_init(h, mm, L.MatmulAlg.DEFAULT)
            plan = L.matmul_plan_init(h, mm, alg)
            step = "matmul"
            work = torch.empty(max(1, L.matmul_get_workspace(h, plan)), dtype=torch.uint8, device="cuda")
            size, tmp_size = L.sp_mma_compressed_size(h, plan)
            wc = torch.empty(size, dtype=torch.uint8, device="cuda")
            tmp = torch.empty(max(1, tmp_size), dtype=torch.uint8, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            L.sp_mma_compress(h, plan, qw.data_ptr(), wc.data_ptr(), tmp.data_ptr(), stream)
            out = torch.empty(t, n, dtype=BF, device="cuda")
            one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
            streams = np.array([stream], dtype=np.int64)
            alpha_ptr = alpha_vec.data_ptr() if variant == "alpha vector" else one.ctypes.data
            L.matmul(h, plan, alpha_ptr, wc.data_ptr(), qx.data_ptr(), zero.ctypes.data, out.data_ptr(),
                     out.data_ptr(), work.data_ptr(), streams.ctypes.data, 1)
            torch.cuda.synchronize()
            got = out.t().float()
            result = (f"runs; error against the scaled product {rel(got, ref):.1e}, "
                      f"against the unscaled one {rel(got * (sw * sx), ref):.1e}")
        except Exception as e:  # noqa: BLE001 - what this section reports
            result = f"{step} refused: {type(e).__name__}: {str(e).splitlines()[0][:50] if str(e) else ''}"
        lines.append(f"| {variant} | {result} |")
    return lines


def fastest_plan_ms(wc: torch.Tensor, b: torch.Tensor, n: int, out_dtype: torch.dtype) -> float:
    """The FP8 or bf16 2:4 GEMM alone (B column-major, D column-major) in the configuration the
    dispatch keeps (``ops.spmm`` times them all at its first call)."""
    k, t = b.shape
    ops.spmm(wc, b, n, True, out_dtype=out_dtype)
    plan = cs.get_plan(n, k, t, cs.COL, cs.COL, b.dtype, out_dtype=out_dtype)
    plan = plan.tuned or plan
    out = torch.empty((t, n), dtype=out_dtype, device="cuda")
    return bench_ms(lambda: plan.matmul(wc, b, out), warmup=10, rep=60)


def timings(shapes) -> list[str]:
    names = ["bf16 dense", "bf16 2:4", "FP8 dense", "FP8 dense + bias", "FP8 2:4 GEMM", "compress e4m3 W, cuSPARSELt",
             "compress e4m3 W, Triton", "scale + bias pass", "FP8 2:4 route + bias"]
    lines = ["| at 16384 tokens | " + " | ".join(names) + " | route vs FP8 dense, with bias |",
             "|---" * (len(names) + 2) + "|"]
    copy_bw = copy_bandwidth() * 1e9
    parts = names[:-1]
    shares = [f"copy bandwidth measured here: {copy_bw / 1e9:.0f} GB/s", "",
              "| share of limit | " + " | ".join(parts) + " |", "|---" * (len(parts) + 1) + "|"]
    for name, t, k, n in shapes:
        ms = shape_timings(t, k, n)
        torch.cuda.empty_cache()
        lines.append(f"| {name} {k}->{n} | " + " | ".join(f"{ms[c]:.3f} ms" for c in names)
                     + f" | {ms['FP8 dense + bias'] / ms['FP8 2:4 route + bias']:.2f}x |")
        flop = 2 * t * k * n
        compress_bytes = n * k + n * k // 2 + n * k // 8  # read W, write half of it and the metadata
        limit = {"bf16 dense": flop / PEAK["bf16"], "bf16 2:4": flop / (2 * PEAK["bf16"]),
                 "FP8 dense": flop / PEAK["fp8"], "FP8 dense + bias": flop / PEAK["fp8"],
                 "FP8 2:4 GEMM": flop / (2 * PEAK["fp8"]),
                 "compress e4m3 W, cuSPARSELt": compress_bytes / copy_bw,
                 "compress e4m3 W, Triton": compress_bytes / copy_bw,
                 "scale + bias pass": (2 * 2 * t * n + 2 * n) / copy_bw}
        shares.append(f"| {name} | " + " | ".join(f"{limit[c] * 1e3 / ms[c]:.0%}" for c in parts) + " |")
    return lines + [""] + shares


def shape_timings(t: int, k: int, n: int) -> dict[str, float]:
    """Section 2's times (ms) at one shape."""
    x, w = operands(t, k, n)
    qx, sx = F8.quantize(x, F8.E4M3)
    qw, sw = F8.quantize(w, F8.E4M3)
    b = torch.randn(n, device="cuda", dtype=BF)
    y = torch.randn(t, n, device="cuda", dtype=BF)
    assert torch.equal(compress_e4m3(qw), cs.compress(qw)), "the Triton compression disagrees with cuSPARSELt's"

    def bench(fn) -> float:
        return bench_ms(fn, warmup=10, rep=60)

    ms = {
        "bf16 dense": bench(lambda: x @ w.t()),
        "bf16 2:4": fastest_plan_ms(cs.compress(w), x.t(), n, BF),
        "FP8 dense": bench(lambda: torch._scaled_mm(qx, qw.t(), sx, sw, out_dtype=BF)),
        "FP8 dense + bias": bench(lambda: torch._scaled_mm(qx, qw.t(), sx, sw, bias=b, out_dtype=BF)),
        "FP8 2:4 GEMM": fastest_plan_ms(cs.compress(qw), qx.t(), n, BF),
        "compress e4m3 W, cuSPARSELt": bench(lambda: cs.compress(qw)),
        "compress e4m3 W, Triton": bench(lambda: compress_e4m3(qw)),
        "scale + bias pass": bench(lambda: fp8cast.rescale_(y, sx, sw, b)),
    }
    with dispatch.override(gemm="sparse"):
        ms["FP8 2:4 route + bias"] = bench(lambda: F8.scaled_mm(qx, sx, qw, sw, BF, sparse_b=True, bias=b))
    return ms


def dispatch_table(shapes) -> list[str]:
    lines = ["| shape | bias | choice | ms (dispatch) | sparse route vs reference | dense vs reference |",
             "|---|---|---|---|---|---|"]
    for name, t, k, n in shapes:
        x, w = operands(t, k, n)
        qx, sx = F8.quantize(x, F8.E4M3)
        qw, sw = F8.quantize(w, F8.E4M3)
        for b in (None, torch.randn(n, device="cuda", dtype=BF)):
            ref = F8.dequantize(qx, sx) @ F8.dequantize(qw, sw).t() + (0 if b is None else b.float())
            errs = {}
            for mode in ("sparse", "dense"):
                with dispatch.override(gemm=mode):
                    errs[mode] = rel(F8.scaled_mm(qx, sx, qw, sw, BF, sparse_b=True, bias=b), ref)
            F8.scaled_mm(qx, sx, qw, sw, BF, sparse_b=True, bias=b)
            kind = "fp8-fwd" if b is None else "fp8-fwd+bias"
            hit = next((v for key, v in dispatch.choices().items() if key.startswith(f"{kind}:{n}x{k}x{t}:")), None)
            ms = ", ".join(f"{c} {v:.3f}" for c, v in hit["ms"].items()) if hit else ""
            lines.append(f"| {name} | {'yes' if b is not None else 'no'} | {hit['choice'] if hit else 'none'} | {ms} | "
                         f"{errs['sparse']:.1e} | {errs['dense']:.1e} |")
    return lines


DW = ["dense route (exact)", "MVUE -> e4m3 compressed (fused)", "FP8 2:4 GEMM", "scale pass", "FP8 2:4 route"]


def dw_timings(shapes) -> list[str]:
    """Section 4: dW with MVUE and e4m3 gradients, each route's parts and the routes whole as the
    layer runs them (``torch.ops.twofour.mvue_dw_e4m3``, forced), with each part's share of its
    limit, and the dispatch's own timing and choice."""
    copy_bw = copy_bandwidth() * 1e9
    lines = ["| at 16384 tokens | " + " | ".join(DW) + " | dense route / 2:4 route | dispatch (ms sparse / dense) |",
             "|---" * (len(DW) + 3) + "|"]
    shares = ["| share of limit | " + " | ".join(DW[:4]) + " |", "|---" * 5 + "|"]
    for name, t, k, n in shapes:
        ms, chosen = dw_shape(t, k, n)
        lines.append(f"| {name} {k}->{n} | " + " | ".join(f"{ms[c]:.3f} ms" for c in DW)
                     + f" | {ms[DW[0]] / ms[DW[4]]:.2f}x | {chosen} |")
        e, flop = t * n, 2 * t * k * n
        limit = {DW[0]: flop / PEAK["fp8"], DW[1]: (2 * e + compressed_size(n, t, 1)) / copy_bw,
                 DW[2]: flop / (2 * PEAK["fp8"]), DW[3]: 4 * n * k / copy_bw}
        shares.append(f"| {name} | " + " | ".join(f"{limit[c] * 1e3 / ms[c]:.0%}" for c in limit) + " |")
        torch.cuda.empty_cache()
    return lines + ["", f"copy bandwidth measured here: {copy_bw / 1e9:.0f} GB/s", ""] + shares


def dw_shape(t: int, k: int, n: int) -> tuple[dict[str, float], str]:
    """Section 4's times (ms) at one shape, and the dispatch's choice with its own times."""
    x = torch.randn(t, k, device="cuda", dtype=BF)
    dy = torch.randn(t, n, device="cuda", dtype=BF)
    qxt, sxt = F8.quantize(x.t().contiguous(), F8.E4M3)
    qd, sd = F8.quantize(dy, F8.E4M3)  # as the dX GEMM quantizes dY
    s2 = sd * SCALE_BOUND
    packed = mvue_e4m3(dy.t(), s2)
    out = ops.spmm(packed, qxt.t(), n, False, out_dtype=BF)
    plan = cs.get_plan(n, t, k, cs.COL, cs.ROW, F8.E4M3, out_dtype=BF)
    plan = plan.tuned or plan

    def bench(fn) -> float:
        return bench_ms(fn, warmup=10, rep=60)

    def dw() -> torch.Tensor:  # the FP8 layer's dW with MVUE, by its registered op
        return torch.ops.twofour.mvue_dw_e4m3(dy, qd, sd, qxt, sxt, BF)

    def route(mode: str) -> float:
        with dispatch.override(gemm=mode):
            return bench(dw)

    ms = {DW[0]: route("dense"), DW[1]: bench(lambda: mvue_e4m3(dy.t(), s2)),
          DW[2]: bench(lambda: plan.matmul(packed, qxt.t(), out)), DW[3]: bench(lambda: fp8cast.rescale_(out, s2, sxt)),
          DW[4]: route("sparse")}
    dispatch.clear_choices()
    dw()
    hit = next((v for key, v in dispatch.choices().items() if key.startswith(f"fp8-dw-mvue:{n}x{t}x{k}:")), None)
    return ms, f"{hit['choice']} ({hit['ms']['sparse']:.3f} / {hit['ms']['dense']:.3f})" if hit else "none"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="GPT-2 774M's shapes only")
    p.add_argument("--sections", default="1,2,3,4", help="the sections to run, of 1,2,3,4 (default: all)")
    args = p.parse_args()
    wanted = {int(v) for v in args.sections.split(",")}
    shapes = SHAPES[:2] if args.quick else SHAPES
    print(f"{gpu_line()}\n")
    for section, title, fn in ((1, "FP8 plans cuSPARSELt builds", kinds),
                               (1, "Scaling on the device, mixed formats", scaling_modes),
                               (2, "Forward GEMM timings", lambda: timings(shapes)),
                               (3, "The dispatch", lambda: dispatch_table(shapes)),
                               (4, "dW with MVUE: exact or FP8 2:4 on the estimate", lambda: dw_timings(shapes))):
        if section not in wanted:
            continue
        print(f"## {title}\n")
        try:
            print("\n".join(fn()) + "\n", flush=True)
        except Exception as e:  # noqa: BLE001 - later sections still run
            print(f"error: {type(e).__name__}: {e}\n", flush=True)


if __name__ == "__main__":
    main()
