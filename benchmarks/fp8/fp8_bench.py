"""FP8 against bf16 beneath and above the layer: correctness, GEMMs, quantization, whole steps (GPU).

    PYTHONPATH=src python benchmarks/fp8/fp8_bench.py [--quick] [--no-step]

1. Correctness: the FP8 linear (forward, dX, dW) against its plain-torch reference (operands
   dequantized, multiplied in float32) and against the dense bf16 product, tensorwise and
   rowwise, at a shape ``_scaled_mm`` takes and one it refuses (dims not multiples of 16).
2. At GPT-2 774M's FFN shapes (16384 tokens, 1280 -> 5120, 5120 -> 1280) and, without
   ``--quick``, Llama 7B's: the bf16 GEMM and the FP8 GEMM alone (tensorwise, rowwise); the
   quantization of both operands as dispatched and by each route forced (Triton kernels,
   compiled plain torch), with its share of copy bandwidth at the least traffic (two reads and
   one write tensorwise, one read and one write rowwise).
3. A whole gpt2-774m training step (FFN linears as the recipe says, fused AdamW, ``attach()``):
   dense and s-ste in bf16 and FP8 (e4m3 and e5m2 gradients), against dense bf16 and dense FP8
   of the same gradient format.

``twofour bench --fp8`` times the FP8 layers themselves. Every row catches its own error and
prints it in place of a number; the GEMMs ``_scaled_mm`` refused are listed at the end.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from twofour import dispatch
from twofour import fp8 as F8
from twofour.sparse import make_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line, md_head, train_step_ms  # noqa: E402

SHAPES = [("gpt2-774m fc", 16384, 1280, 5120), ("gpt2-774m proj", 16384, 5120, 1280),
          ("llama-7b up", 16384, 4096, 11008), ("llama-7b down", 16384, 11008, 4096)]
BF = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def correctness() -> list[str]:
    out = [md_head("scaling", "T x K -> N", "y vs ref", "dX vs ref", "dW vs ref", "y vs dense", "dX vs dense",
                   "dW vs dense", "_scaled_mm used")]
    for scaling in F8.SCALINGS.values():
        for t, k, n in ((2048, 1280, 5120), (1000, 200, 120)):
            try:
                before = len(F8.refusals())
                torch.manual_seed(0)
                x = torch.randn(t, k, device="cuda", dtype=BF, requires_grad=True)
                w = nn.Parameter(torch.randn(n, k, device="cuda") / k ** 0.5)
                b = torch.randn(n, device="cuda", dtype=BF)
                dy = torch.randn(t, n, device="cuda", dtype=BF)
                y = F8.fp8_linear(x, w, b, scaling=scaling)
                y.backward(dy)

                def fq(v: torch.Tensor, s: F8.Scaling = scaling) -> torch.Tensor:
                    return F8.dequantize(*F8.quantize(v, F8.E4M3, s))

                xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
                ry = fq(xf) @ fq(wf).t() + b.float()
                rdx = fq(dyf) @ fq(wf.t().contiguous()).t()
                rdw = fq(dyf.t().contiguous()) @ fq(xf.t().contiguous()).t()
                used = "yes" if len(F8.refusals()) == before else f"no ({len(F8.refusals()) - before} refused)"
                out.append(f"| {scaling.name} | {t} x {k} -> {n} | {rel(y, ry):.1e} | {rel(x.grad, rdx):.1e} "
                           f"| {rel(w.grad, rdw):.1e} | {rel(y, xf @ wf.t() + b.float()):.1e} "
                           f"| {rel(x.grad, dyf @ wf):.1e} | {rel(w.grad, dyf.t() @ xf):.1e} | {used} |")
            except Exception as e:  # noqa: BLE001 - a row's failure is its result
                out.append(f"| {scaling.name} | {t} x {k} -> {n} | {err(e)} | | | | | | |")
            free()
    return out


def force_quantize_route(route: str) -> None:
    """Make every FP8 quantization the dispatch has measured so far take ``route`` (``triton`` or
    ``compiled``) where it is one of its candidates."""
    for key in dispatch.choices():
        if key.startswith("fp8-quantize") and route in key.rsplit(":", 1)[-1].split("|"):
            dispatch.set_choice(key, route)


def timed(lines: list[str], what: str, fn: Callable[[], object], base: float | None = None,
          extra: Callable[[float], str] | None = None) -> float | None:
    """A ``| what | ms | note |`` row: ``fn``'s median ms, base / that, and ``extra(ms)``."""
    try:
        ms = bench_ms(fn)
    except Exception as e:  # noqa: BLE001 - a row's failure is its result
        lines.append(f"| {what} | {err(e)} | |")
        return None
    note = ", ".join(([f"{base / ms:.2f}x"] if base else []) + ([extra(ms)] if extra else []))
    lines.append(f"| {what} | {ms:.3f} | {note} |")
    return ms


def gemm_rows(t: int, k: int, n: int, bw: float) -> list[str]:
    """The bf16 and FP8 GEMMs alone and the quantization of their operands, per route."""
    lines = [md_head("what", "ms", "speed-up over the bf16 GEMM; share of copy bandwidth")]
    x = torch.randn(t, k, device="cuda", dtype=BF)
    w = torch.randn(n, k, device="cuda", dtype=BF)
    gemm = timed(lines, "bf16 GEMM x W^T", lambda: x @ w.t())
    for sc in F8.SCALINGS.values():
        try:
            qx, sx = F8.quantize(x, F8.E4M3, sc)
            qw, sw = F8.quantize(w, F8.E4M3, sc)
            before = len(F8.refusals())
            F8.scaled_mm(qx, sx, qw, sw, BF)
            if len(F8.refusals()) != before:
                raise RuntimeError("_scaled_mm refused these operands (the reference would run)")
        except Exception as e:  # noqa: BLE001
            lines.append(f"| FP8 GEMM {sc.name} | {err(e)} | |")
            continue
        timed(lines, f"FP8 GEMM {sc.name} (operands quantized)", lambda a=(qx, sx, qw, sw): F8.scaled_mm(*a, BF), gemm)
        nbytes = (x.numel() + w.numel()) * (2 * (1 if sc.rowwise else 2) + 1)  # the least traffic

        def share(ms: float, nbytes: int = nbytes) -> str:
            return f"{nbytes / ms / 1e6 / bw:.0%} of copy bandwidth"

        def both(sc: F8.Scaling = sc) -> tuple:
            return F8.quantize(x, F8.E4M3, sc), F8.quantize(w, F8.E4M3, sc)

        timed(lines, f"quantize x and W {sc.name}, as dispatched", both, extra=share)
        for route in ("triton", "compiled"):
            force_quantize_route(route)
            timed(lines, f"quantize x and W {sc.name}, {route}", both, extra=share)
        dispatch.clear_choices()
    return lines


def train_steps(quick: bool) -> list[str]:
    e5m2 = {"precision": "fp8-e5m2"}
    variants = [("dense bf16", make_recipe("dense")), ("dense FP8", make_recipe("dense", precision="fp8")),
                ("dense FP8, e5m2 dY", make_recipe("dense", **e5m2)), ("s-ste bf16", make_recipe("s-ste")),
                ("s-ste FP8", make_recipe("s-ste", precision="fp8")),
                ("s-ste FP8, e5m2 dY", make_recipe("s-ste", **e5m2))]
    for batch in (8,) if quick else (16, 8):
        res: dict[str, float | str] = {}
        oom = False
        for name, recipe in variants:
            try:
                res[name] = train_step_ms("gpt2-774m", batch, recipe)
            except torch.OutOfMemoryError as e:
                res[name], oom = err(e), True
            except Exception as e:  # noqa: BLE001
                res[name] = err(e)
            free()
        if oom and batch != 8:
            continue  # a smaller micro-batch
        out = [f"### Whole gpt2-774m training step, {batch} x 1024 tokens (FFN linears as the recipe says; fused "
               "AdamW, `attach()`; median of 12 steps)", "",
               md_head("variant", "ms", "vs dense bf16", "vs dense FP8 (same dY format)")]
        for name, v in res.items():
            if isinstance(v, str):
                out.append(f"| {name} | {v} | | |")
                continue
            fp8 = "dense FP8, e5m2 dY" if name.endswith("e5m2 dY") else "dense FP8"
            ratio = [f"{res[b] / v:.2f}x" if isinstance(res[b], float) else "n/a" for b in ("dense bf16", fp8)]
            out.append(f"| {name} | {v:.1f} | {ratio[0]} | {ratio[1]} |")
        return out
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 774M's shapes only, one micro-batch for the step")
    ap.add_argument("--no-step", action="store_true", help="skip the whole training step")
    args = ap.parse_args()
    if not F8.scaled_mm_available():
        raise SystemExit(f"fp8_bench.py needs torch._scaled_mm, which torch {torch.__version__} lacks")
    bw = copy_bandwidth()
    print(f"{gpu_line()}; copy bandwidth {bw:.0f} GB/s. FP8: e4m3 operands and gradients (e5m2 where the row says "
          "so), current amax scaling; ratios: the baseline's time / this row's time.\n")
    print("### Correctness: FP8 linear vs its reference (dequantized operands, float32) and vs dense bf16\n")
    print("\n".join(correctness()), flush=True)
    for label, t, k, n in SHAPES[:2] if args.quick else SHAPES:
        print(f"\n### {label}: {t} tokens, {k} -> {n}\n")
        print("\n".join(gemm_rows(t, k, n, bw)), flush=True)
        free()
    if not args.no_step:
        print("\n" + "\n".join(train_steps(args.quick)), flush=True)
    if F8.refusals():
        print("\n`_scaled_mm` refused (the reference ran instead):\n\n```")
        print("\n".join(str(key) for key in sorted(F8.refusals(), key=str)) + "\n```")


if __name__ == "__main__":
    main()
