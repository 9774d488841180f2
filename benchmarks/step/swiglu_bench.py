"""The gated FFN (SwiGLU) on the GPU: correctness first, then the times the Llama issue asks for.

    PYTHONPATH=src python benchmarks/step/swiglu_bench.py [--quick] [--no-compile] [--batches 16,8,4] [--profile]

1. The fused SwiGLU kernels against the plain-torch reference (bf16, fp16, fp32; z row-major and
   z^T; odd shapes), and the SwiGLU FFN block on the fast path against the reference path
   (s-ste and t-sr-ste, MVUE off so dW is exact; the gate|up forward route forced each way).
2. The fused activation, forward and backward, at the 7B shape (16384 tokens, 2 x 11008): GB/s
   against copy bandwidth (kernel time by CUDA graph replay), and against torch's unfused eager
   ops and torch.compile's fused reference (eager calls).
3. The SwiGLU FFN block (gate|up -> SwiGLU -> down), forward + backward, at the 7B shapes (and
   llama-1b's without --quick): dense (fused activation; and torch's unfused one) against
   ste, s-ste and t-sr-ste.
4. A whole llama-1b training step (bf16 autocast, fused AdamW, vocabulary 32000, seq 1024):
   dense against s-ste and t-sr-ste on the FFN linears, at the largest of --batches that fits.

``--profile`` runs only this: the 7B block's kernels, dense against s-ste (torch.profiler), by
kind and by kernel.

Each part catches its own errors and prints them, so one failure does not hide the rest; a
summary against the targets (FFN block >= 1.25x, step >= 1.10x, activation >= 70% of copy
bandwidth) ends the output. With --quick it took about 3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from twofour import dispatch
from twofour.activations import swiglu_backward_reference, swiglu_reference
from twofour.bench import fwd_bwd_step
from twofour.kernels import ops
from twofour.kernels.swiglu import swiglu_backward, swiglu_forward
from twofour.models import PRESETS, GatedMLP
from twofour.sparse import make_recipe, sparsify

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line, graph_ms, train_step_ms  # noqa: E402

SUMMARY: list[str] = []


def run_part(title: str, fn, *args) -> None:
    """Run one part, printing its title and, if it fails, the error's last lines (the script
    gets one run: a failure must not hide the other parts)."""
    print(f"\n## {title}\n", flush=True)
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        print("FAILED:\n" + "\n".join(traceback.format_exc().splitlines()[-12:]), flush=True)
        SUMMARY.append(f"{title}: FAILED (see above)")
    gc.collect()
    torch.cuda.empty_cache()
    print(f"({time.perf_counter() - t0:.0f} s)", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def matrix(rows: int, cols: int, col_major: bool, dtype: torch.dtype) -> torch.Tensor:
    if col_major:
        return torch.randn(cols, rows, device="cuda").to(dtype).t()
    return torch.randn(rows, cols, device="cuda").to(dtype)


T7 = 16384  # tokens of the 7B rows: seq 1024 x 16
#: (tokens, H) of the kernel checks (the 7B shape is added); odd sizes leave partial tiles
CHECK_SHAPES = [(4096, 1024), (1000, 352), (37, 96)]
#: (d, H, batch, seq) of the block checked against the reference path
CHECK_BLOCK = (1024, 2048, 8, 512)


def kernels_vs_reference() -> None:
    h7 = PRESETS["llama-7b"].config.hidden
    print("| dtype | z order | tokens x H | fwd max rel err | bwd max rel err | ok |\n|---|---|---|---|---|---|")
    bad = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for col in (False, True):
            for t, h in [*CHECK_SHAPES, (T7, h7)]:
                z, dh = matrix(t, 2 * h, col, dtype), matrix(t, h, col, dtype)
                out, dz = swiglu_forward(z), swiglu_backward(z, dh)
                ref, dref = swiglu_reference(z), swiglu_backward_reference(z, dh)
                try:
                    torch.testing.assert_close(out, ref)
                    torch.testing.assert_close(dz, dref)
                    ok = ops.order(out) == ("col" if col else "row") and dz.stride() == z.stride()
                except AssertionError:
                    ok = False
                bad += not ok
                ef = ((out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max().item()
                eb = ((dz.float() - dref.float()).abs() / dref.float().abs().clamp_min(1e-3)).max().item()
                print(f"| {str(dtype)[6:]} | {'z^T' if col else 'row'} | {t} x {h} | {ef:.1e} | {eb:.1e} | "
                      f"{'yes' if ok else 'NO'} |", flush=True)
    SUMMARY.append(f"kernels vs reference: {'all match' if not bad else f'{bad} MISMATCHES'}")


def block_vs_reference() -> None:
    print("| recipe | gate|up forward route | z order seen | out | dX | dW gate|up | dW down |\n"
          "|---|---|---|---|---|---|---|")
    worst, layout_bad = 0.0, []
    for recipe in ("s-ste", "t-sr-ste"):
        for route in ("auto", "sparse_dr", "sparse_dc", "dense"):
            dispatch.clear_choices()
            torch.manual_seed(0)
            d, h, batch, seq = CHECK_BLOCK
            mlp = sparsify(GatedMLP(d, h).cuda(), recipe, include=("gate_up", "down"),
                           transposed_output=("gate_up",), mvue=False)
            x = torch.randn(batch, seq, d, device="cuda")
            g = torch.randn(batch, seq, d, device="cuda", dtype=torch.bfloat16)
            seen = {}
            hook = mlp.gate_up.register_forward_hook(
                lambda m, a, out, seen=seen: seen.update(z=ops.order(out.reshape(-1, out.shape[-1]))))

            def run(fast, mlp=mlp, x=x, g=g):
                with dispatch.override(fast=fast):
                    mlp.zero_grad(set_to_none=True)
                    xx = x.clone().requires_grad_()
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = mlp(xx)
                    y.backward(g)
                return y.detach(), xx.grad, mlp.gate_up.weight.grad.clone(), mlp.down.weight.grad.clone()

            run(True)  # the dispatch measures
            if route != "auto":
                for key in [k for k in dispatch.choices() if k.startswith(f"fwd:{2 * h}x{d}x{batch * seq}:")]:
                    dispatch.set_choice(key, route)
            fast = run(True)
            order = seen.get("z")
            hook.remove()
            errs = [rel(a, b) for a, b in zip(fast, run(False))]
            worst = max(worst, *errs)
            if route == "sparse_dr" and order != "col":
                layout_bad.append(f"{recipe} {route} left z {order}-major")
            print(f"| {recipe} | {route} | {order} | " + " | ".join(f"{e:.1e}" for e in errs) + " |", flush=True)
    dispatch.clear_choices()  # no forced choice leaks into the timings
    SUMMARY.append(f"FFN block fast path vs reference: worst relative error {worst:.1e} "
                   f"({'ok' if worst < 2e-2 else 'TOO LARGE'}, bound 2e-2); z^T route: "
                   f"{'; '.join(layout_bad) or 'column-major z as planned'}")


def activation_times(bw: float, rep: int, compile_ref: bool) -> None:
    h7 = PRESETS["llama-7b"].config.hidden
    compiled_fwd = compiled_bwd = None
    if compile_ref:
        compiled_fwd = torch.compile(swiglu_reference, dynamic=False)
        compiled_bwd = torch.compile(swiglu_backward_reference, dynamic=False)
    print(f"{T7} tokens, 2 x {h7}, bf16. GB/s: the bytes each pass must move once (forward reads z, writes h; "
          "backward reads z and dh, writes dz), kernel time by CUDA graph replay; ms: eager calls.\n")
    print("| pass | z order | fused GB/s | of copy | fused ms | torch eager ms | torch.compile'd reference ms |\n"
          "|---|---|---|---|---|---|---|")
    fracs = []
    for col in (False, True):
        z, dh = matrix(T7, 2 * h7, col, torch.bfloat16), matrix(T7, h7, col, torch.bfloat16)
        zr = z.detach().requires_grad_()
        yr = F.silu(zr[:, 0::2]) * zr[:, 1::2]
        cases = {"forward": (lambda z=z: swiglu_forward(z), 6 * T7 * h7,
                             lambda z=z: F.silu(z[:, 0::2]) * z[:, 1::2],
                             compiled_fwd and (lambda z=z: compiled_fwd(z))),
                 "backward": (lambda z=z, dh=dh: swiglu_backward(z, dh), 10 * T7 * h7,
                              lambda yr=yr, zr=zr, dh=dh: torch.autograd.grad(yr, zr, dh, retain_graph=True),
                              compiled_bwd and (lambda z=z, dh=dh: compiled_bwd(z, dh)))}
        for name, (fn, nbytes, eager, comp) in cases.items():
            fn()  # autotune outside the graph
            gbs = nbytes / graph_ms(fn, inner=10) / 1e6
            fracs.append(gbs / bw)
            comp_ms = "n/a"
            if comp is not None:
                try:
                    comp_ms = f"{bench_ms(comp, rep=rep):.3f}"
                except Exception as e:  # noqa: BLE001
                    comp_ms = f"failed ({type(e).__name__})"
            print(f"| {name} | {'z^T' if col else 'row'} | {gbs:.0f} | {gbs / bw:.0%} | "
                  f"{bench_ms(fn, rep=rep):.3f} | "
                  f"{bench_ms(eager, rep=rep):.3f} | {comp_ms} |", flush=True)
    SUMMARY.append(f"fused activation: {min(fracs):.0%}-{max(fracs):.0%} of copy bandwidth (target >= 70%)")


def ffn_blocks(rep: int, quick: bool) -> None:
    print("dense: nn.Linear with the fused activation (the baseline), or with torch's unfused ops; sparse: the "
          "recipe on gate|up (transposed_output) and down, pruning, compression and MVUE counted every step.\n")
    print("| shape | variant | ms | dense (fused act.) / variant |\n|---|---|---|---|")
    for preset in ("llama-7b",) if quick else ("llama-7b", "llama-1b"):
        d, h = PRESETS[preset].config.n_embd, PRESETS[preset].config.hidden
        x = torch.randn(T7, d, device="cuda", requires_grad=True)
        g = torch.randn(T7, d, device="cuda", dtype=torch.bfloat16)
        base = None
        for variant in ("dense", "dense, torch's unfused activation", "ste", "s-ste", "t-sr-ste"):
            try:
                ms = block_ms(variant, d, h, x, g, rep)
            except Exception as e:  # noqa: BLE001
                print(f"| {preset} | {variant} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)
                continue
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            base = ms if variant == "dense" else base
            ratio = base / ms if base else float("nan")
            print(f"| {preset} {T7} x {d} -> 2 x {h} | {variant} | {ms:.2f} | {ratio:.2f}x |", flush=True)
            if variant == "s-ste" and preset == "llama-7b":
                SUMMARY.append(f"7B SwiGLU FFN block, s-ste: {ratio:.2f}x dense (target >= 1.25x)")


def block_ms(variant: str, d: int, h: int, x: torch.Tensor, g: torch.Tensor, rep: int) -> float:
    mlp = GatedMLP(d, h).cuda()
    if variant.startswith("dense, torch"):
        mlp.forward = lambda inp: mlp.down(swiglu_reference(mlp.gate_up(inp)))
    elif variant != "dense":
        sparsify(mlp, variant, include=("gate_up", "down"), transposed_output=("gate_up",))
    step = fwd_bwd_step(mlp, x, g)
    step()  # the dispatch measures its GEMMs, the kernels autotune
    return bench_ms(step, rep=rep)


def block_profile(variants: tuple[str, ...] = ("dense", "s-ste"), top: int = 14) -> None:
    """Device time of the 7B block's kernels per call (torch.profiler over 3 calls), dense
    against each sparse variant: by kind, then the kernels whose time changes most."""
    from step_breakdown import KINDS, profile_step  # noqa: PLC0415 - benchmarks/ is the script's folder

    d, h = PRESETS["llama-7b"].config.n_embd, PRESETS["llama-7b"].config.hidden
    x = torch.randn(T7, d, device="cuda", requires_grad=True)
    g = torch.randn(T7, d, device="cuda", dtype=torch.bfloat16)
    results = {}
    for variant in variants:
        mlp = GatedMLP(d, h).cuda()
        if variant != "dense":
            sparsify(mlp, variant, include=("gate_up", "down"), transposed_output=("gate_up",))
        step = fwd_bwd_step(mlp, x, g)
        for _ in range(3):
            step()
        ms = bench_ms(step, rep=100)
        kinds, names, gaps = profile_step(step, 3)
        results[variant] = (ms, kinds, names)
        print(f"{variant}: {ms:.2f} ms a call (bench_ms), kernels {sum(kinds.values()):.2f} ms; {gaps[0]}")
        del mlp, step
        gc.collect()
        torch.cuda.empty_cache()
    print("\n| kernel kind | " + " | ".join(f"{v} ms" for v in results) + " |\n" + "|---" * (len(results) + 1) + "|")
    for kind in [k for k, _ in KINDS] + ["other elementwise and reductions"]:
        print(f"| {kind} | " + " | ".join(f"{r[1].get(kind, 0.0):.3f}" for r in results.values()) + " |")
    dense = results[variants[0]][2]
    for variant in variants[1:]:
        names = results[variant][2]
        print(f"\n{variant}: every kernel, ms a call (dense ms where the name matches):")
        for n, ms in sorted(names.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {ms:7.3f}  ({dense.get(n, 0.0):6.3f})  {n[:120]}")
        print("dense's kernels, ms a call:")
        for n, ms in sorted(dense.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {ms:7.3f}  {n[:120]}")


def step_ms(batch: int, recipe: str) -> float:
    """Median of 12 llama-1b training steps, each timed by CUDA events, after 3 warm-up steps."""
    return train_step_ms("llama-1b", batch, make_recipe(recipe), vocab_size=32000)


def llama_steps(batches: list[int]) -> None:
    print("| micro-batch x seq | recipe | step ms (median of 12) | dense / recipe |\n|---|---|---|---|")
    for batch in batches:
        gc.collect()  # what a step that ran out of memory left
        torch.cuda.empty_cache()
        times: dict[str, float] = {}
        for recipe in ("dense", "s-ste", "t-sr-ste"):
            try:
                times[recipe] = step_ms(batch, recipe)
            except torch.OutOfMemoryError:
                print(f"| {batch} x 1024 | {recipe} | out of memory | |", flush=True)
                break
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            print(f"| {batch} x 1024 | {recipe} | {times[recipe]:.1f} | {times['dense'] / times[recipe]:.2f}x |",
                  flush=True)
        if len(times) == 3:
            SUMMARY.append(f"llama-1b step ({batch} x 1024): s-ste {times['dense'] / times['s-ste']:.2f}x, "
                           f"t-sr-ste {times['dense'] / times['t-sr-ste']:.2f}x dense (target >= 1.10x)")
            return
    SUMMARY.append("llama-1b step: no micro-batch of " + ",".join(map(str, batches)) + " fit every recipe")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the 7B FFN shape only, fewer repetitions")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile's reference activation")
    ap.add_argument("--batches", default="16,8,4", help="llama-1b micro-batches to try, largest first")
    ap.add_argument("--profile", action="store_true",
                    help="only where the 7B block's time goes: its kernels, dense against s-ste")
    args = ap.parse_args()
    if args.profile:
        block_profile()
        print("\n" + "\n".join(dispatch.choice_lines()))
        return
    rep = 100 if args.quick else 200
    print(f"{gpu_line()}; fast path available: {ops.fast_available()}")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s (bytes read + written)")
    run_part("1a. fused SwiGLU kernels against the plain-torch reference", kernels_vs_reference)
    run_part("1b. SwiGLU FFN block: fast path against the reference path (bf16, mvue off)", block_vs_reference)
    run_part("2. fused SwiGLU activation at the 7B shape", activation_times, bw, rep, not args.no_compile)
    run_part("3. SwiGLU FFN block (gate|up -> SwiGLU -> down), forward + backward, bf16 autocast", ffn_blocks, rep,
             args.quick)
    run_part("4. llama-1b training step (bf16 autocast, fused AdamW, vocabulary 32000, seq 1024)", llama_steps,
             [int(b) for b in args.batches.split(",")])
    print("\n## dispatch choices (twofour.kernels.dispatch.choices())\n")
    print("\n".join(dispatch.choice_lines()))
    print("\n## summary\n")
    print("\n".join(f"- {line}" for line in SUMMARY))


if __name__ == "__main__":
    main()
