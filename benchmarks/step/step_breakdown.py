"""What a sparse GPT training step adds to, and saves from, the dense step, by kind of kernel (GPU).

    PYTHONPATH=src python benchmarks/step/step_breakdown.py [--presets gpt2-124m:32,gpt2-774m:16,llama-8b:4:8]
        [--vocab-size 256] [--variants dense,s-ste,s-ste-gemm-dense] [--compile [--compile-mode M]]
        [--gaps] [--host]

A variant is a recipe, optionally with options after a ``+`` each (as ``twofour train --opt``):
``dense+precision=fp8`` is dense FP8 (e4m3 operands and gradients, one scale per tensor).

For each preset (micro-batch after the colon, optionally its number of blocks after a second)
and variant: the dispatch's choices, the step's time
(median of 10 steps, each timed on its own behind a short device-side wait,
``common.steps_ms(lead=True)``; and per step over windows of 4 steps in a row, as the loop runs them,
the host free to run ahead), the device time
of its kernels (summed from torch.profiler over 2 steps; below the step time when the GPU waits
for the host), and the host's time to issue a step. Then
each kind of kernel's device time per step, against dense: where the 2:4 GEMMs save and what
the pruning, compression, MVUE and mask refresh cost. ``s-ste-gemm-dense`` runs the fast path
with every GEMM dense (``dispatch.override(gemm="dense")``): the sparse step's overhead alone.
The vocabulary defaults to 256, as ``twofour train`` on text (byte-level) uses. ``--compile``
runs each step through ``torch.compile(model)`` (as ``twofour train --compile``; ``--compile-mode``
picks torch.compile's mode) and prints the graph breaks Dynamo counted.

Where the GPU waits: ``--gaps`` adds, from the same profile, the gaps of over 50 us between
consecutive kernels (with the kernels on either side) and the host calls that wait for the
device (synchronizations, copies to the host), then runs one step under
``torch.cuda.set_sync_debug_mode("error")``, which stops at the first torch operation that
synchronizes and prints where it was called; ``--host`` adds the Python functions that take the
host's time over five steps (cProfile, by own time).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import re
import sys
import traceback
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from twofour import dispatch
from twofour.sparse import make_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import host_ms, preset_train_step, steps_ms  # noqa: E402

#: (kind, pattern on the kernel's name), first match wins
KINDS = [
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("2:4 GEMM (cuSPARSELt)", r"sparse|_sp_|spmma|cusparselt"),
    ("twofour Triton (prune/compress/MVUE/refresh, SwiGLU)", r"_compress_kernel|_refresh_kernel|_swiglu_"),
    ("dense GEMM", r"gemm|nvjet|cutlass|xmma|matmul"),
    ("optimizer", r"adam|multi_tensor"),
    ("copies and transposes", r"copy|transpose|cat_|contiguous"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name, re.I):
            return kind
    return "other elementwise and reductions"


#: host calls that wait for the device or the allocator
BLOCKING = ("Synchronize", "Memcpy", "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMalloc", "cudaFree")


def profile_step(step, steps: int = 2) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """One torch.profiler pass over ``steps`` steps: device ms per step by kind and by kernel
    name, and the lines of ``--gaps`` (idle gaps between kernels, blocking host calls)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    kernels, blocking = [], {}
    for e in prof.events():
        # kernels only: a user annotation (e.g. "Optimizer.step#AdamW.step") has a GPU-side range
        # too, which spans kernels counted on their own (the optimizer hooks' ones included)
        if e.device_type == DeviceType.CPU and any(b in e.name for b in BLOCKING):
            n, us = blocking.get(e.name, (0, 0.0))
            blocking[e.name] = (n + 1, us + e.time_range.elapsed_us())
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) or "#" in e.name:
            continue
        ms = e.time_range.elapsed_us() / 1e3 / steps
        kinds[kind_of(e.name)] = kinds.get(kind_of(e.name), 0.0) + ms
        names[e.name] = names.get(e.name, 0.0) + ms
        kernels.append((e.time_range.start, e.time_range.end, e.name))
    return kinds, names, _gap_lines(sorted(kernels), blocking, steps)


def _gap_lines(kernels: list[tuple[int, int, str]], blocking: dict[str, tuple[int, float]], steps: int,
               top: int = 12) -> list[str]:
    """The idle gaps over 50 us between kernels (sorted by start, us) and the blocking host calls."""
    found, end, last = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start - end > 50:  # us with no kernel running (the latest end so far: kernels may overlap)
            found.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 / steps
    lines = [f"kernels span {span:.1f} ms a step, {len(found) / steps:.0f} gaps over 50 us totalling "
             f"{sum(g for g, _, _ in found) / 1e3 / steps:.1f} ms a step"]
    lines += [f"  {g / 1e3:6.2f} ms  after {n0[:60]}  before {n1[:60]}"
              for g, n0, n1 in sorted(found, reverse=True)[:top]]
    lines += [f"  host: {name}: {n / steps:.0f} a step, {us / 1e3 / steps:.2f} ms a step"
              for name, (n, us) in sorted(blocking.items(), key=lambda kv: -kv[1][1])]
    return lines


def host_profile(step) -> str:
    """The host's Python over five steps, by own time (cProfile's top 22)."""
    torch.cuda.synchronize()
    with cProfile.Profile() as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    return "\n".join(out.getvalue().splitlines()[6:])


def sync_check(step) -> str:
    """Run one step under set_sync_debug_mode("error"): where a torch operation synchronizes, if any."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "no synchronizing torch operation in a step"
    except RuntimeError:
        return "a torch operation synchronizes:\n" + "".join(traceback.format_exc().splitlines(True)[-14:])
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def option(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE`` as ``twofour train --opt`` reads it: the value a bool (true/false, yes/no,
    on/off) or a number; ``precision=NAME`` keeps its name."""
    key, sep, val = text.partition("=")
    low = val.lower()
    if not sep or not key:
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    if low in ("true", "yes", "on", "false", "no", "off"):
        return key.replace("-", "_"), low in ("true", "yes", "on")
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return key.replace("-", "_"), kind(val)
    if key == "precision":
        return key, val
    raise ValueError(f"option value {val!r} is not a bool or a number")


def variant_recipe(variant: str):
    """The recipe of a ``--variants`` entry: ``NAME[-gemm-dense][+KEY=VALUE...]``."""
    name, *opts = variant.split("+")
    try:
        options = dict(option(opt) for opt in opts)
    except ValueError as e:
        raise SystemExit(f"step_breakdown.py: variant {variant!r}: {e}") from None
    return make_recipe(name.removesuffix("-gemm-dense"), **options), name.endswith("-gemm-dense")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="gpt2-124m:32,gpt2-774m:16")
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--variants", default="dense,s-ste,s-ste-gemm-dense")
    ap.add_argument("--top", type=int, default=8, help="kernels listed by their change against dense")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model), as twofour train --compile")
    ap.add_argument("--compile-mode", default=None, help="torch.compile's mode (implies --compile)")
    ap.add_argument("--gaps", action="store_true", help="where the GPU waits: idle gaps, blocking calls, syncs")
    ap.add_argument("--host", action="store_true", help="cProfile of the host's Python over five steps")
    args = ap.parse_args()
    compiled = args.compile_mode or args.compile
    for spec in args.presets.split(","):
        preset, batch, *layers = spec.split(":")  # preset:batch[:blocks]
        results = {}
        for variant in args.variants.split(","):
            recipe, gemm_dense = variant_recipe(variant)
            with dispatch.override(gemm="dense" if gemm_dense else "auto"):
                torch._dynamo.reset()
                counters["graph_break"].clear()
                model, step = preset_train_step(preset, int(batch), recipe, vocab_size=args.vocab_size,
                                                compile=compiled, n_layer=int(layers[0]) if layers else None)
                for _ in range(3):
                    step()
                if compiled:
                    breaks = sum(counters["graph_break"].values())
                    print(f"{preset} {variant}: {breaks} graph breaks; "
                          + "; ".join(f"{n}x {r[:90]}" for r, n in counters["graph_break"].most_common(4)))
                ms, host = steps_ms(step, 10, lead=True), host_ms(step, 5)
                in_a_row = steps_ms(step, 3, calls=4, lead=True)
                kinds, names, gaps = profile_step(step)
                results[variant] = (ms, in_a_row, host, kinds, names)
                print(f"{preset} {variant}: dispatch choices\n  "
                      + "\n  ".join(line for line in dispatch.choice_lines() if ":configs" not in line.split(": ")[0]))
                if args.gaps:
                    print(f"\n{preset} {variant}, where the GPU waits:\n" + "\n".join(gaps) + f"\n  {sync_check(step)}")
                if args.host:
                    print(f"\n{preset} {variant}, host Python over 5 steps, by own time:\n{host_profile(step)}")
            del model, step
            torch.cuda.empty_cache()
        mode = f", torch.compile ({args.compile_mode or 'default'})" if compiled else ""
        print(f"\n### {preset}, micro-batch {batch} x 1024, vocabulary {args.vocab_size}{mode}\n")
        print("| variant | step ms, alone | step ms, 4 in a row | kernel ms | host ms to issue | ratio to dense, "
              "alone / in a row |\n|---|---|---|---|---|---|")
        base = results.get("dense")
        for v, (ms, in_a_row, host, kinds, _) in results.items():
            ratio = f"{base[0] / ms:.3f}x / {base[1] / in_a_row:.3f}x" if base else "n/a"
            print(f"| {v} | {ms:.1f} | {in_a_row:.1f} | {sum(kinds.values()):.1f} | {host:.1f} | {ratio} |")
        variants = list(results)
        print("\n| kernel kind | " + " | ".join(f"{v} ms" for v in variants) + " |")
        print("|---" * (len(variants) + 1) + "|")
        for kind in [k for k, _ in KINDS] + ["other elementwise and reductions"]:
            cells = [f"{results[v][3].get(kind, 0.0):.2f}" for v in variants]
            print(f"| {kind} | " + " | ".join(cells) + " |")
        if "dense" in results and len(variants) > 1:
            other = variants[1]
            dn, sn = results["dense"][4], results[other][4]
            delta = {n: sn.get(n, 0.0) - dn.get(n, 0.0) for n in set(dn) | set(sn)}
            print(f"\nkernels whose time changes most, {other} - dense (ms per step; GEMMs, then the rest):")
            gemm = ("dense GEMM", "2:4 GEMM (cuSPARSELt)")
            for part in (True, False):
                picked = {n: d for n, d in delta.items() if (kind_of(n) in gemm) == part}
                for n, d in sorted(picked.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
                    print(f"  {d:+7.2f}  [{kind_of(n)}] {n[:110]}")


if __name__ == "__main__":
    main()
