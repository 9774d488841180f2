"""Where the GPU waits during a training step (GPU): the idle gaps between kernels and the host
calls that block.

    PYTHONPATH=src python benchmarks/step_gaps.py [--preset gpt2-124m] [--batch 32]
        [--variants dense,s-ste,s-ste@reduce-overhead] [--compile] [--host]

For each variant: the step's time, the sum of its kernels' device time, the gaps of over 50 us
between consecutive kernels (with the kernels on either side), and the host calls that wait for
the device (synchronizations, copies to the host) by count and time, from torch.profiler over
two steps. Then one step under ``torch.cuda.set_sync_debug_mode("error")``, which stops at the
first torch operation that synchronizes and prints where it was called. ``--host`` adds the
Python functions that take the host's time over five steps (cProfile, by own time), for a step
where the GPU waits for the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import traceback

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from twofour import make_recipe
from twofour.bench import preset_train_step
from twofour.kernels import ops

BLOCKING = ("Synchronize", "Memcpy", "cudaStreamWaitEvent", "cudaHostAlloc", "cudaMalloc", "cudaFree")


def gaps(step, steps: int = 2, top: int = 12) -> None:
    """Print the step's kernel-to-kernel gaps and blocking host calls."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels, blocking = [], {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False) and "#" not in e.name:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif e.device_type == DeviceType.CPU and any(b in e.name for b in BLOCKING):
            n, us = blocking.get(e.name, (0, 0.0))
            blocking[e.name] = (n + 1, us + e.time_range.elapsed_us())
    kernels.sort()
    busy = sum(end - start for start, end, _ in kernels) / 1e3 / steps
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 / steps
    found, end, last = [], kernels[0][1], kernels[0][2]
    for start, stop, name in kernels[1:]:
        if start - end > 50:  # us with no kernel running (the latest end so far: kernels may overlap)
            found.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    idle = sum(g for g, _, _ in found) / 1e3 / steps
    print(f"kernels span {span:.1f} ms a step, busy {busy:.1f} ms, {len(found) / steps:.0f} gaps over 50 us "
          f"totalling {idle:.1f} ms a step")
    for g, n0, n1 in sorted(found, reverse=True)[:top]:
        print(f"  {g / 1e3:6.2f} ms  after {n0[:60]}  before {n1[:60]}")
    for name, (n, us) in sorted(blocking.items(), key=lambda kv: -kv[1][1]):
        print(f"  host: {name}: {n / steps:.0f} a step, {us / 1e3 / steps:.2f} ms a step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--variants", default="dense,s-ste",
                    help="recipes, each optionally @mode: compiled with that torch.compile mode")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--host", action="store_true", help="cProfile of the host's Python over five steps")
    args = ap.parse_args()
    for variant in args.variants.split(","):
        recipe, _, mode = variant.partition("@")  # recipe@mode: torch.compile's mode
        torch._dynamo.reset()
        model, step = preset_train_step(args.preset, args.batch, make_recipe(recipe), vocab_size=args.vocab_size,
                                        compile=mode or args.compile)
        for _ in range(3):
            step()
        how = f", compiled ({mode or 'default'})" if mode or args.compile else ""
        print(f"\n### {args.preset} x {args.batch}, {recipe}{how}: step {ops.median_ms(step, 10):.1f} ms")
        gaps(step)
        if args.host:
            torch.cuda.synchronize()
            with cProfile.Profile() as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
            print("  host Python over 5 steps, by own time:\n" + "\n".join(out.getvalue().splitlines()[6:]))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            print("  no synchronizing torch operation in a step")
        except RuntimeError:
            print("  a torch operation synchronizes:\n" + "".join(traceback.format_exc().splitlines(True)[-14:]))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
