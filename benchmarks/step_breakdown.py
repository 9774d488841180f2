"""What a sparse GPT training step adds to, and saves from, the dense step, by kind of kernel (GPU).

    PYTHONPATH=src python benchmarks/step_breakdown.py [--presets gpt2-124m:32,gpt2-774m:16]
        [--vocab-size 256] [--variants dense,s-ste,s-ste-gemm-dense] [--compile]

For each preset (micro-batch after the colon) and variant: the step's time (median of 10 steps,
each timed on its own as the dispatch times its candidates, ``ops.median_ms``), the device time
of its kernels (summed from torch.profiler over 2 steps; below the step time when the GPU waits
for the host), and the host's time to issue a step. Then
each kind of kernel's device time per step, against dense: where the 2:4 GEMMs save and what
the pruning, compression, MVUE and mask refresh cost. ``s-ste-gemm-dense`` runs the fast path
with every GEMM dense (``settings.override(gemm="dense")``): the sparse step's overhead alone.
The vocabulary defaults to 256, as ``twofour train`` on text (byte-level) uses. ``--compile``
runs each step through ``torch.compile(model)`` (as ``twofour train --compile``) and prints the
graph breaks Dynamo counted.
"""

from __future__ import annotations

import argparse
import re

import torch
from layer_profile import host_ms  # benchmarks/ is the script's folder
from torch._dynamo.utils import counters
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from twofour import make_recipe, settings
from twofour.bench import preset_train_step
from twofour.kernels import ops

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


def kernel_ms(step, steps: int = 2) -> tuple[dict[str, float], dict[str, float]]:
    """Device ms per step by kind and by kernel name."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    for e in prof.events():
        # kernels only: a user annotation (e.g. "Optimizer.step#AdamW.step") has a GPU-side range
        # too, which spans kernels counted on their own (the optimizer hooks' ones included)
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) or "#" in e.name:
            continue
        ms = e.time_range.elapsed_us() / 1e3 / steps
        kinds[kind_of(e.name)] = kinds.get(kind_of(e.name), 0.0) + ms
        names[e.name] = names.get(e.name, 0.0) + ms
    return kinds, names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="gpt2-124m:32,gpt2-774m:16")
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--variants", default="dense,s-ste,s-ste-gemm-dense")
    ap.add_argument("--top", type=int, default=8, help="kernels listed by their change against dense")
    ap.add_argument("--compile", action="store_true", help="torch.compile(model), as twofour train --compile")
    args = ap.parse_args()
    for spec in args.presets.split(","):
        preset, batch = spec.split(":")
        results = {}
        for variant in args.variants.split(","):
            recipe = make_recipe(variant.removesuffix("-gemm-dense"))
            with settings.override(gemm="dense" if variant.endswith("gemm-dense") else "auto"):
                torch._dynamo.reset()
                counters["graph_break"].clear()
                model, step = preset_train_step(preset, int(batch), recipe, vocab_size=args.vocab_size,
                                                compile=args.compile)
                for _ in range(3):
                    step()
                if args.compile:
                    breaks = sum(counters["graph_break"].values())
                    print(f"{preset} {variant}: {breaks} graph breaks; "
                          + "; ".join(f"{n}x {r[:90]}" for r, n in counters["graph_break"].most_common(4)))
                results[variant] = (ops.median_ms(step, 10), host_ms(step, 5), *kernel_ms(step))
            del model, step
            torch.cuda.empty_cache()
        mode = ", torch.compile" if args.compile else ""
        print(f"\n### {preset}, micro-batch {batch} x 1024, vocabulary {args.vocab_size}{mode}\n")
        print("| variant | step ms | kernel ms | host ms to issue | ratio to dense |\n|---|---|---|---|---|")
        base = results["dense"][0] if "dense" in results else None
        for v, (ms, host, kinds, _) in results.items():
            ratio = f"{base / ms:.3f}x" if base else "n/a"
            print(f"| {v} | {ms:.1f} | {sum(kinds.values()):.1f} | {host:.1f} | {ratio} |")
        variants = list(results)
        print("\n| kernel kind | " + " | ".join(f"{v} ms" for v in variants) + " |")
        print("|---" * (len(variants) + 1) + "|")
        for kind in [k for k, _ in KINDS] + ["other elementwise and reductions"]:
            cells = [f"{results[v][2].get(kind, 0.0):.2f}" for v in variants]
            print(f"| {kind} | " + " | ".join(cells) + " |")
        if "dense" in results and len(variants) > 1:
            other = variants[1]
            dn, sn = results["dense"][3], results[other][3]
            delta = {n: sn.get(n, 0.0) - dn.get(n, 0.0) for n in set(dn) | set(sn)}
            print(f"\nkernels whose time changes most, {other} - dense (ms per step; GEMMs, then the rest):")
            gemm = ("dense GEMM", "2:4 GEMM (cuSPARSELt)")
            for part in (True, False):
                picked = {n: d for n, d in delta.items() if (kind_of(n) in gemm) == part}
                for n, d in sorted(picked.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
                    print(f"  {d:+7.2f}  [{kind_of(n)}] {n[:110]}")


if __name__ == "__main__":
    main()
