"""FP8 GEMMs and layers through ``torch._scaled_mm`` against bf16 (GPU).

    PYTHONPATH=src python benchmarks/fp8_bench.py [--skip-step]

1. Correctness: the FP8 linear (forward, dX, dW) against its plain-torch reference (operands
   dequantized, multiplied in float32) and against the dense bf16 product, tensorwise and
   rowwise, at a shape ``_scaled_mm`` takes and one it refuses (dims not multiples of 16).
2. Kernels at GPT-2 774M FFN shapes (16384 tokens, 1280->5120, 5120->1280) and Llama 7B's
   (4096->11008, 11008->4096): the bf16 GEMM, the FP8 GEMM alone (tensorwise, rowwise), the
   quantization of both operands (as dispatched, and each route: the Triton kernels, the
   compiled plain-torch passes, with their share of copy bandwidth at the least traffic), and
   one layer's forward + backward (nn.Linear bf16 autocast, dense FP8 tensorwise and rowwise,
   s-ste bf16, s-ste FP8).
3. A whole gpt2-774m training step (16 x 1024 tokens, AdamW): dense bf16, dense FP8, s-ste bf16,
   s-ste FP8, with ratios against dense bf16 and dense FP8.

Every row catches its own errors and prints them in place of a number. Any GEMM that
``_scaled_mm`` refused (and so ran the reference) is listed at the end.
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch
from torch import nn
from triton.testing import do_bench

from twofour import SparseLinear, make_recipe
from twofour import fp8 as F8
from twofour.bench import copy_bandwidth, fwd_bwd_step, train_step_ms
from twofour.kernels import fp8cast

SHAPES = [("gpt2-774m fc", 16384, 1280, 5120), ("gpt2-774m proj", 16384, 5120, 1280),
          ("llama-7b up", 16384, 4096, 11008), ("llama-7b down", 16384, 11008, 4096)]
BF = torch.bfloat16
COPY_BW = 0.0  # GB/s, measured in main()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def ms(fn, rep: int = 60) -> float:
    return do_bench(fn, warmup=15, rep=rep)


# ------------------------------------------------------------------------------------------------


def correctness() -> None:
    print("## 1. correctness: FP8 linear vs its reference (dequantized operands, float32) and vs dense\n")
    print("| scaling | T x K -> N | y vs ref | dX vs ref | dW vs ref | y vs dense | dX vs dense | dW vs dense "
          "| _scaled_mm used |")
    print("|---|---|---|---|---|---|---|---|---|")
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

                def fq(v, fmt, s=scaling):
                    return F8.dequantize(*F8.quantize(v, fmt, s))

                xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
                ry = fq(xf, F8.E4M3) @ fq(wf, F8.E4M3).t() + b.float()
                rdx = fq(dyf, F8.E5M2) @ fq(wf.t().contiguous(), F8.E4M3).t()
                rdw = fq(dyf.t().contiguous(), F8.E5M2) @ fq(xf.t().contiguous(), F8.E4M3).t()
                used = "yes" if len(F8.refusals()) == before else f"no ({len(F8.refusals()) - before} refused)"
                print(f"| {scaling.name} | {t} x {k} -> {n} | {rel(y, ry):.1e} | {rel(x.grad, rdx):.1e} "
                      f"| {rel(w.grad, rdw):.1e} | {rel(y, xf @ wf.t() + b.float()):.1e} "
                      f"| {rel(x.grad, dyf @ wf):.1e} | {rel(w.grad, dyf.t() @ xf):.1e} | {used} |")
            except Exception as e:  # noqa: BLE001
                print(f"| {scaling.name} | {t} x {k} -> {n} | {err(e)} |")
            free()
    print()


# ------------------------------------------------------------------------------------------------


class RowwiseFP8Linear(nn.Linear):
    """A dense linear through the FP8 linear with rowwise scales."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F8.fp8_linear(x, self.weight, self.bias, scaling=F8.ROWWISE)


def gemm_rows(t: int, k: int, n: int, row, rows: list[tuple[str, str]]) -> None:
    """The bf16 GEMM, the FP8 GEMM alone and the quantization of its operands."""
    x = torch.randn(t, k, device="cuda", dtype=BF)
    w = torch.randn(n, k, device="cuda", dtype=BF)
    gemm = row("bf16 GEMM x W^T", lambda: x @ w.t())
    for sc in F8.SCALINGS.values():
        try:
            qx, sx = F8.quantize(x, F8.E4M3, sc)
            qw, sw = F8.quantize(w, F8.E4M3, sc)
            before = len(F8.refusals())
            F8.scaled_mm(qx, sx, qw, sw, BF)
            if len(F8.refusals()) != before:
                raise RuntimeError("_scaled_mm refused these operands (the reference would run)")
            row(f"fp8 GEMM {sc.name} (operands quantized)",
                lambda qx=qx, sx=sx, qw=qw, sw=sw: F8.scaled_mm(qx, sx, qw, sw, BF), gemm)
            row(f"quantize x and W {sc.name} (dispatch)",
                lambda sc=sc: (F8.quantize(x, F8.E4M3, sc), F8.quantize(w, F8.E4M3, sc)))
            # the least traffic: tensorwise reads each operand twice (amax, then cast), rowwise once
            nbytes = (x.numel() + w.numel()) * (2 * (1 if sc.rowwise else 2) + 1)
            for route, fn in (("triton", fp8cast.quantize), ("compiled", F8._run_compiled)):
                v = row(f"quantize x and W {sc.name}: {route}",
                        lambda sc=sc, fn=fn: (fn(x, F8.E4M3, sc.rowwise, False), fn(w, F8.E4M3, sc.rowwise, False)))
                if v:
                    rows.append((f"... {route}: share of copy bandwidth ({COPY_BW:.0f} GB/s)",
                                 f"{nbytes / v / 1e6 / COPY_BW:.0%}"))
        except Exception as e:  # noqa: BLE001
            rows.append((f"fp8 GEMM {sc.name}", err(e)))


def kernel_rows(t: int, k: int, n: int) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []

    def row(name: str, fn, base: float | None = None) -> float | None:
        try:
            v = ms(fn)
            rows.append((name, f"{v:.3f}" + (f" ({base / v:.2f}x)" if base else "")))
            return v
        except Exception as e:  # noqa: BLE001
            rows.append((name, err(e)))
            return None

    gemm_rows(t, k, n, row, rows)
    free()
    xg = torch.randn(t, k, device="cuda", requires_grad=True)
    g = torch.randn(t, n, device="cuda", dtype=BF)
    layers = [("layer fwd+bwd: nn.Linear bf16", lambda: nn.Linear(k, n, device="cuda")),
              ("layer fwd+bwd: dense FP8 tensorwise", lambda: SparseLinear(k, n, device="cuda", recipe="dense",
                                                                           fp8=True)),
              ("layer fwd+bwd: dense FP8 rowwise", lambda: RowwiseFP8Linear(k, n, device="cuda")),
              ("layer fwd+bwd: s-ste bf16", lambda: SparseLinear(k, n, device="cuda", recipe="s-ste")),
              ("layer fwd+bwd: s-ste FP8 tensorwise", lambda: SparseLinear(k, n, device="cuda", recipe="s-ste",
                                                                           fp8=True))]
    base = None
    for name, make in layers:
        try:
            step = fwd_bwd_step(make(), xg, g)
            step()  # the fast path's dispatch choices, measured once
            v = row(name, step, base)
            base = base or v
        except Exception as e:  # noqa: BLE001
            rows.append((name, err(e)))
        free()
    return rows


def kernels() -> None:
    print("## 2. kernels and layers: ms (x: speed-up over the bf16 GEMM, or over the nn.Linear bf16 layer)\n")
    for label, t, k, n in SHAPES:
        print(f"### {label}: {t} tokens, {k} -> {n}\n\n| what | ms |\n|---|---|")
        try:
            for name, val in kernel_rows(t, k, n):
                print(f"| {name} | {val} |")
        except Exception as e:  # noqa: BLE001
            print(f"| (shape) | {err(e)} |")
        free()
        print()


# ------------------------------------------------------------------------------------------------


def train_step(preset: str = "gpt2-774m") -> None:
    variants = [("dense bf16", make_recipe("dense")), ("dense fp8", make_recipe("dense", fp8=True)),
                ("s-ste bf16", make_recipe("s-ste")), ("s-ste fp8", make_recipe("s-ste", fp8=True))]
    for batch in (16, 8):
        res: dict[str, float | str] = {}
        oom = False
        for name, recipe in variants:
            try:
                res[name] = train_step_ms(preset, batch, recipe)
            except torch.OutOfMemoryError as e:
                res[name], oom = err(e), True
            except Exception as e:  # noqa: BLE001
                res[name] = err(e)
                traceback.print_exc(limit=3)
            free()
        if oom and batch != 8:
            continue  # try a smaller micro-batch
        print(f"## 3. whole {preset} training step, {batch} x 1024 tokens, FFN linears as the recipe says\n")
        print("| variant | ms | vs dense bf16 | vs dense fp8 |\n|---|---|---|---|")
        for name, v in res.items():
            if isinstance(v, str):
                print(f"| {name} | {v} | | |")
                continue
            ratio = [f"{res[b] / v:.2f}x" if isinstance(res[b], float) else "n/a" for b in ("dense bf16", "dense fp8")]
            print(f"| {name} | {v:.1f} | {ratio[0]} | {ratio[1]} |")
        print()
        return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-step", action="store_true", help="leave out the whole training step")
    a = p.parse_args()
    t0 = time.perf_counter()
    global COPY_BW
    COPY_BW = copy_bandwidth()
    print(f"# FP8 bench: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"_scaled_mm {'present' if F8.scaled_mm_available() else 'missing'}, copy bandwidth {COPY_BW:.0f} GB/s\n")
    for part in (correctness, kernels, None if a.skip_step else train_step):
        if part is None:
            continue
        try:
            part()
        except Exception as e:  # noqa: BLE001
            print(f"{part.__name__}: {err(e)}\n")
            traceback.print_exc(limit=5)
        free()
    if F8.refusals():
        print("_scaled_mm refused (the reference ran instead):")
        for key in sorted(F8.refusals(), key=str):
            print(f"  {key}")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
