"""``twofour bench --fp8``: FP8 GEMMs, layers and a training step against bf16, on this GPU.

1. Correctness: the FP8 linear (forward, dX, dW) against its plain-torch reference (operands
   dequantized, multiplied in float32) and against the dense bf16 product, tensorwise and
   rowwise, at a shape ``_scaled_mm`` takes and one it refuses (dims not multiples of 16).
2. At GPT-2 774M's FFN shapes (16384 tokens, 1280->5120, 5120->1280) and, without ``--quick``,
   Llama 7B's (4096->11008, 11008->4096): the bf16 GEMM and the FP8 GEMM alone (tensorwise,
   rowwise); the quantization of both operands as dispatched and by each route (Triton kernels,
   compiled plain torch) with its share of copy bandwidth at the least traffic (two reads and one
   write tensorwise, one read and one write rowwise); one layer's forward + backward for dense
   and s-ste, in bf16 and in FP8 (tensorwise, tensorwise with e5m2 gradients, rowwise), with
   ratios to ``nn.Linear`` bf16 and to dense FP8 of the same scaling and gradient format.
3. A whole gpt2-774m training step (FFN linears as the recipe says, fused AdamW, ``attach()``):
   dense and s-ste in bf16 and FP8 (e4m3 and e5m2 gradients), ratios to dense bf16 and to dense
   FP8 of the same gradient format.

Every row catches its own error and prints it in place of a number; GEMMs ``_scaled_mm``
refused (each ran the reference) are listed at the end.
"""

from __future__ import annotations

import argparse
import gc
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from . import fp8 as F8
from .kernels import fp8cast
from .sparse.recipes import make_recipe
from .version import __version__

__all__ = ["fp8_bench", "run_fp8_bench"]

SHAPES = [("gpt2-774m fc", 16384, 1280, 5120), ("gpt2-774m proj", 16384, 5120, 1280),
          ("llama-7b up", 16384, 4096, 11008), ("llama-7b down", 16384, 11008, 4096)]
BF = torch.bfloat16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _correctness(out: list[str]) -> None:
    out += ["### Correctness: FP8 linear vs its reference (dequantized operands, float32) and vs dense bf16", "",
            "| scaling | T x K -> N | y vs ref | dX vs ref | dW vs ref | y vs dense | dX vs dense | dW vs dense "
            "| _scaled_mm used |", "|---|---|---|---|---|---|---|---|---|"]
    for scaling in F8.SCALINGS.values():
        for t, k, n in ((2048, 1280, 5120), (1000, 200, 120)):
            try:
                before = len(F8.refusals())
                torch.manual_seed(0)
                x = torch.randn(t, k, device="cuda", dtype=BF, requires_grad=True)
                w = nn.Parameter(torch.randn(n, k, device="cuda") / k ** 0.5)
                b = torch.randn(n, device="cuda", dtype=BF)
                dy = torch.randn(t, n, device="cuda", dtype=BF)
                y = F8.fp8_linear(x, w, b, precision=F8.Precision(True, F8.E4M3, scaling))
                y.backward(dy)

                def fq(v: torch.Tensor, fmt: torch.dtype, s: F8.Scaling = scaling) -> torch.Tensor:
                    return F8.dequantize(*F8.quantize(v, fmt, s))

                xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
                ry = fq(xf, F8.E4M3) @ fq(wf, F8.E4M3).t() + b.float()
                rdx = fq(dyf, F8.E4M3) @ fq(wf.t().contiguous(), F8.E4M3).t()
                rdw = fq(dyf.t().contiguous(), F8.E4M3) @ fq(xf.t().contiguous(), F8.E4M3).t()
                used = "yes" if len(F8.refusals()) == before else f"no ({len(F8.refusals()) - before} refused)"
                out.append(f"| {scaling.name} | {t} x {k} -> {n} | {_rel(y, ry):.1e} | {_rel(x.grad, rdx):.1e} "
                           f"| {_rel(w.grad, rdw):.1e} | {_rel(y, xf @ wf.t() + b.float()):.1e} "
                           f"| {_rel(x.grad, dyf @ wf):.1e} | {_rel(w.grad, dyf.t() @ xf):.1e} | {used} |")
            except Exception as e:  # noqa: BLE001 - a row's failure is its result
                out.append(f"| {scaling.name} | {t} x {k} -> {n} | {_err(e)} | | | | | | |")
            _free()


class _Rows:
    """``| what | ms | ratio |`` rows, each timed on its own, a failure printed in its place."""

    def __init__(self, quick: bool):
        self.quick, self.lines = quick, []

    def time(self, what: str, fn: Callable[[], object], base: float | None = None, *,
             extra: Callable[[float], str] | None = None) -> float | None:
        from .bench import _bench  # noqa: PLC0415 - the bf16 bench's timing, shared

        try:
            v = _bench(fn, self.quick)
        except Exception as e:  # noqa: BLE001 - a row's failure is its result
            self.lines.append(f"| {what} | {_err(e)} | |")
            return None
        note = f"{base / v:.2f}x" if base else ""
        note += (", " if note and extra else "") + (extra(v) if extra else "")
        self.lines.append(f"| {what} | {v:.3f} | {note} |")
        return v


def _kernel_rows(t: int, k: int, n: int, bw: float, rows: _Rows) -> None:
    """The bf16 and FP8 GEMMs alone and the quantization of their operands."""
    x = torch.randn(t, k, device="cuda", dtype=BF)
    w = torch.randn(n, k, device="cuda", dtype=BF)
    gemm = rows.time("bf16 GEMM x W^T", lambda: x @ w.t())
    for sc in F8.SCALINGS.values():
        try:
            qx, sx = F8.quantize(x, F8.E4M3, sc)
            qw, sw = F8.quantize(w, F8.E4M3, sc)
            before = len(F8.refusals())
            F8.scaled_mm(qx, sx, qw, sw, BF)
            if len(F8.refusals()) != before:
                raise RuntimeError("_scaled_mm refused these operands (the reference would run)")
        except Exception as e:  # noqa: BLE001
            rows.lines.append(f"| FP8 GEMM {sc.name} | {_err(e)} | |")
            continue
        rows.time(f"FP8 GEMM {sc.name} (operands quantized)",
                  lambda a=(qx, sx, qw, sw): F8.scaled_mm(*a, BF), gemm)
        nbytes = (x.numel() + w.numel()) * (2 * (1 if sc.rowwise else 2) + 1)  # the least traffic

        def share(v: float, nbytes: int = nbytes) -> str:
            return f"{nbytes / v / 1e6 / bw:.0%} of copy bandwidth"

        rows.time(f"quantize x and W {sc.name}, as dispatched",
                  lambda sc=sc: (F8.quantize(x, F8.E4M3, sc), F8.quantize(w, F8.E4M3, sc)), extra=share)
        def compiled(t: torch.Tensor, *a: object) -> tuple:
            return F8._compiled_quantize(F8._variant(t, *a))(t, *a)

        for route, fn in (("Triton", fp8cast.quantize), ("compiled", compiled)):
            rows.time(f"quantize x and W {sc.name}, {route}",
                      lambda sc=sc, fn=fn: (fn(x, F8.E4M3, sc.rowwise, False), fn(w, F8.E4M3, sc.rowwise, False)),
                      extra=share)


def _layer_rows(t: int, k: int, n: int, rows: _Rows) -> None:
    """One layer's forward + backward: nn.Linear and s-ste in bf16, dense and s-ste in FP8."""
    from .bench import fwd_bwd_step  # noqa: PLC0415
    from .sparse.layer import SparseLinear  # noqa: PLC0415

    xg = torch.randn(t, k, device="cuda", requires_grad=True)
    g = torch.randn(t, n, device="cuda", dtype=BF)
    variants = [("nn.Linear bf16", lambda: nn.Linear(k, n, device="cuda"), None),
                ("s-ste bf16", lambda: SparseLinear(k, n, device="cuda", recipe="s-ste"), None)]
    for sc in F8.SCALINGS.values():
        for e4m3 in (True, False) if not sc.rowwise else (True,):  # e4m3 dY: the FP8 2:4 dW route
            tag = f"FP8 {sc.name}{'' if e4m3 else ', e5m2 dY'}"
            for recipe, vs in (("dense", None), ("s-ste", f"dense {tag}")):
                variants.append((f"{recipe} {tag}", lambda r=recipe, s=sc, e=e4m3: SparseLinear(
                    k, n, device="cuda", recipe=r, precision=F8.Precision(True, F8.E4M3 if e else F8.E5M2, s)), vs))
    times: dict[str, float | None] = {}
    for name, make, vs in variants:
        try:
            step = fwd_bwd_step(make(), xg, g)  # pruning and compression counted every step
            step()  # the dispatch's measurements, once
        except Exception as e:  # noqa: BLE001
            rows.lines.append(f"| layer fwd+bwd: {name} | {_err(e)} | |")
            continue
        other = times.get(vs) if vs else None
        times[name] = rows.time(f"layer fwd+bwd: {name}", step, times.get("nn.Linear bf16"),
                                extra=(lambda v, o=other, vs=vs: f"{o / v:.2f}x over {vs}") if other else None)
        _free()


def _train_steps(quick: bool, out: list[str]) -> None:
    from .bench import train_step_ms  # noqa: PLC0415

    variants = [("dense bf16", make_recipe("dense")), ("dense FP8", make_recipe("dense", precision="fp8")),
                ("dense FP8, e5m2 dY", make_recipe("dense", precision="fp8-e5m2")),
                ("s-ste bf16", make_recipe("s-ste")), ("s-ste FP8", make_recipe("s-ste", precision="fp8")),
                ("s-ste FP8, e5m2 dY", make_recipe("s-ste", precision="fp8-e5m2"))]
    for batch in (8,) if quick else (16, 8):
        res: dict[str, float | str] = {}
        oom = False
        for name, recipe in variants:
            try:
                res[name] = train_step_ms("gpt2-774m", batch, recipe)
            except torch.OutOfMemoryError as e:
                res[name], oom = _err(e), True
            except Exception as e:  # noqa: BLE001
                res[name] = _err(e)
            _free()
        if oom and batch != 8:
            continue  # a smaller micro-batch
        out += ["", f"### Whole gpt2-774m training step, {batch} x 1024 tokens (FFN linears as the recipe says; "
                "fused AdamW, `attach()`; median of 12 steps)", "",
                "| variant | ms | vs dense bf16 | vs dense FP8 (same dY format) |", "|---|---|---|---|"]
        for name, v in res.items():
            if isinstance(v, str):
                out.append(f"| {name} | {v} | | |")
                continue
            fp8 = "dense FP8, e5m2 dY" if name.endswith("e5m2 dY") else "dense FP8"
            ratio = [f"{res[b] / v:.2f}x" if isinstance(res[b], float) else "n/a" for b in ("dense bf16", fp8)]
            out.append(f"| {name} | {v:.1f} | {ratio[0]} | {ratio[1]} |")
        return


def fp8_bench(*, quick: bool = False, shapes: Sequence[tuple[str, int, int, int]] | None = None, step: bool = True,
              log: Callable[[str], None] = print) -> str:
    """The report of the module doc as markdown (each section also passed to ``log`` as it ends);
    ``shapes``: (label, tokens, in, out) in place of the default ones; ``step``: the training step."""
    if not torch.cuda.is_available():
        raise ValueError("twofour bench --fp8 needs a CUDA GPU; none is available here")
    if not F8.scaled_mm_available():
        raise ValueError(f"twofour bench --fp8 needs torch._scaled_mm, which torch {torch.__version__} lacks")
    from .bench import copy_bandwidth  # noqa: PLC0415

    bw = copy_bandwidth(quick)
    out = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, twofour {__version__}, Python "
           f"{platform.python_version()}; copy bandwidth {bw:.0f} GB/s. FP8: e4m3 forward operands and "
           "gradients (e5m2 where the row says so), current amax scaling; ratios: the baseline's time / this "
           "row's time.", ""]
    _correctness(out)
    log("\n".join(out))
    for label, t, k, n in shapes or (SHAPES[:2] if quick else SHAPES):
        rows = _Rows(quick)
        try:
            _kernel_rows(t, k, n, bw, rows)
            _free()
            _layer_rows(t, k, n, rows)
        except Exception as e:  # noqa: BLE001
            rows.lines.append(f"| (shape) | {_err(e)} | |")
        section = ["", f"### {label}: {t} tokens, {k} -> {n}", "",
                   "| what | ms | speed-up (over the bf16 GEMM or nn.Linear bf16; over dense FP8) |",
                   "|---|---|---|", *rows.lines]
        _free()
        log("\n".join(section))
        out += section
    if step:
        section: list[str] = []
        _train_steps(quick, section)
        log("\n".join(section))
        out += section
    if F8.refusals():
        out += ["", "`_scaled_mm` refused (the reference ran instead):", "", "```"]
        out += [str(key) for key in sorted(F8.refusals(), key=str)] + ["```"]
    return "\n".join(out) + "\n"


def run_fp8_bench(args: argparse.Namespace) -> str:
    """``twofour bench --fp8 [--quick] [--write FILE]``: print the report; ``--write`` puts it
    between the ``<!-- fp8:begin -->`` / ``end`` markers of FILE."""
    from .bench import _write_section  # noqa: PLC0415

    report = fp8_bench(quick=args.quick)
    if args.write:
        _write_section(Path(args.write), report, "fp8")
    return report
