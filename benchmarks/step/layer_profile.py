"""Where a SparseLinear's forward + backward spends its time against nn.Linear (GPU): the step's
GPU time, the host's time to issue it, and the kernels it runs (torch.profiler).

    PYTHONPATH=src python benchmarks/step/layer_profile.py [--fp8 | --fp8-cprofile]

A step whose host time exceeds its GPU time is launch-bound: the GPU waits for Python.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from twofour.bench import fwd_bwd_step
from twofour.sparse import SparseLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, host_ms  # noqa: E402


def host_costs() -> None:
    """Host microseconds per call of each piece of the fast path, on small operands (GPU time
    negligible), so that what a launch-bound layer pays for is visible."""
    import triton  # noqa: PLC0415

    from twofour.kernels import compress as ck  # noqa: PLC0415
    from twofour.kernels import ops  # noqa: PLC0415
    from twofour.sparse import fastpath  # noqa: PLC0415

    w = torch.randn(256, 1024, device="cuda")
    xb = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    wc = ops.compress(w, "hard", out_dtype=torch.bfloat16)[0]
    seed = torch.tensor([1], device="cuda")
    m, k = w.shape
    buf = torch.empty_like(wc)
    vals, meta = buf[: m * k].view(torch.int16), buf[m * k:].view(torch.int16)
    layer = SparseLinear(1024, 256, device="cuda", recipe="s-ste")
    step = int(layer.step)

    def cached():  # the layer's per-step cache, hit: what every micro-batch after the first pays
        return layer.compressed.get(layer.weight, layer.pruner, layer.beta, layer.mask, step, torch.bfloat16)

    cached()
    # The raw launch times Triton's own dispatch: the kernel launched with the constants compress()'s
    # launcher passes for a row-major source in hard mode (the rest at the kernel's defaults).
    kernel = ck.triton_kernel()
    consts = dict(MODE=0, HAS_U=False, WRITE_DENSE=False, OUT_BF16=True, BIG=False, QUAD_LOADS=False,
                  WRITE_SPARSE=True, PAIR_ROWS=False)
    consts = {name: v for name, v in consts.items() if name in kernel.arg_names}
    pieces = {
        "ops.compress (direct)": lambda: ops.compress(w, "hard", out_dtype=torch.bfloat16),
        # the registered ops by their public names (what ops' private _compress_op/_spmm_op call)
        "twofour::compress (custom op)": lambda: torch.ops.twofour.compress.default(w, "hard", None, None, None,
                                                                                    False, torch.bfloat16),
        "Triton launch": lambda: kernel[(4, triton.cdiv(k, 128))](
            w, w.stride(0), w.stride(1), m, k, buf, buf, seed, buf, vals, meta, vals, k // 32, vals, meta, 0,
            **consts, BC=128,
            num_warps=4),
        "ops.spmm (direct)": lambda: ops.spmm(wc, xb.t(), m, False),
        "twofour::spmm (custom op)": lambda: torch.ops.twofour.spmm.default(wc, xb.t(), m, False),
        "torch.randint on cuda": lambda: torch.randint(0, 2**31 - 1, (1,), device="cuda"),
        "layer.compressed.get (cached)": cached,
        "fastpath.applies": lambda: fastpath.applies(xb, layer.in_features, layer.out_features),
        "torch.mm (for scale)": lambda: xb @ xb.t(),
    }
    print("\n| piece | host us per call |\n|---|---|")
    for name, fn in pieces.items():
        for _ in range(5):
            fn()
        print(f"| {name} | {host_ms(fn, 200) * 1e3:.1f} |", flush=True)


def time_and_profile(layers: dict[str, nn.Module], x: torch.Tensor, g: torch.Tensor, profiled: tuple[str, ...]) -> None:
    """A row per layer (step time by bench_ms, host time to issue a step), then the profiler's
    kernel table of 5 steps of each of ``profiled``."""
    print("| layer | step ms (bench_ms) | host ms to issue a step |\n|---|---|---|")
    for name, layer in layers.items():
        fn = fwd_bwd_step(layer, x, g)
        for _ in range(3):
            fn()
        print(f"| {name} | {bench_ms(fn):.3f} | {host_ms(fn):.3f} |", flush=True)
    for name in profiled:
        fn = fwd_bwd_step(layers[name], x, g)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n{name}: 5 steps, by device time")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=60))


def fp8_main() -> None:
    """``--fp8``: dense and s-ste in FP8 (tensorwise, e5m2 and e4m3 dY) at GPT-2 774M's FFN shapes,
    16384 tokens: step time, host time, and each one's kernels."""
    for t, k, n in ((16384, 1280, 5120), (16384, 5120, 1280)):
        x = torch.randn(t, k, device="cuda", requires_grad=True)
        g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        print(f"\n{t} tokens x {k} -> {n}")
        layers = {f"{r} FP8, {'e4m3' if e4 else 'e5m2'} dY": SparseLinear(k, n, device="cuda", recipe=r,
                                                                           precision="fp8" if e4 else "fp8-e5m2")
                  for e4 in (False, True) for r in ("dense", "s-ste")}
        time_and_profile(layers, x, g, ("dense FP8, e4m3 dY", "s-ste FP8, e4m3 dY"))


def fp8_host() -> None:
    """``--fp8-cprofile``: where the host time of an FP8 layer step goes (Python's cProfile over 50
    steps, after 5 warm-up steps), dense and s-ste with e4m3 dY, 16384 tokens, 1280 -> 5120."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    t, k, n = 16384, 1280, 5120
    x = torch.randn(t, k, device="cuda", requires_grad=True)
    g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    for recipe in ("dense", "s-ste"):
        fn = fwd_bwd_step(SparseLinear(k, n, device="cuda", recipe=recipe, precision="fp8"), x, g)
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
        print(f"\n{recipe} FP8, e4m3 dY: 50 steps under cProfile, by own time\n{out.getvalue()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--fp8", action="store_true", help="dense and s-ste FP8 layers instead of bf16")
    what.add_argument("--fp8-cprofile", action="store_true", help="the host time of FP8 layer steps by function")
    args = ap.parse_args()
    if args.fp8:
        fp8_main()
        return
    if args.fp8_cprofile:
        fp8_host()
        return
    host_costs()
    for t, k, n in ((32768, 768, 3072), (32768, 1280, 5120)):
        x = torch.randn(t, k, device="cuda", requires_grad=True)
        g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        print(f"\n{t} tokens x {k} -> {n}")
        layers = {"nn.Linear": nn.Linear(k, n, device="cuda")}
        for r in ("ste", "s-ste"):
            layers[r] = SparseLinear(k, n, device="cuda", recipe=r)
        time_and_profile(layers, x, g, ("nn.Linear", "s-ste"))


if __name__ == "__main__":
    main()
