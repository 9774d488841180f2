"""Where a full GPT training step spends its time, dense against 2:4 (GPU).

    PYTHONPATH=src python benchmarks/step/step_profile.py [--preset gpt2-774m] [--batch 16]

For each variant: the step's time (median of CUDA-event timings), the host's time to issue it,
the time of ``advance()`` alone, and a torch.profiler table of the kernels by device time, so
that what the sparse step adds over the dense one (transposes, strided elementwise kernels,
pruning, host time) can be read off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from twofour import dispatch
from twofour.sparse import advance, make_recipe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, host_ms, preset_train_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-774m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--variants", default="dense,s-ste,s-ste-row-out,s-ste-gemm-dense",
                    help="dense, s-ste (fc1 may leave h^T), s-ste-row-out (every output row-major), "
                         "s-ste-no-advance (no mask refresh), s-ste-gemm-dense (fast path, dense GEMMs)")
    args = ap.parse_args()
    print(f"{args.preset}, micro-batch {args.batch} x 1024\n")
    print("| variant | step ms | host ms to issue a step | advance() ms |\n|---|---|---|---|")
    tables = {}
    for variant in args.variants.split(","):
        recipe = make_recipe("dense" if variant == "dense" else "s-ste")  # s-ste's defaults (MVUE dW on)
        with dispatch.override(gemm="dense" if variant.endswith("gemm-dense") else "auto"):
            model, step = preset_train_step(args.preset, args.batch, recipe, advance=variant != "s-ste-no-advance",
                                         transposed_output=variant != "s-ste-row-out")
            for _ in range(3):
                step()
            ms = bench_ms(step, warmup=1, rep=1500)
            adv = bench_ms(lambda m=model: advance(m)) if recipe.sparse else 0.0
            hm = host_ms(step, 5)
            print(f"| {variant} | {ms:.1f} | {hm:.1f} | {adv:.2f} |", flush=True)
            if variant in ("dense", "s-ste"):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        step()
                    torch.cuda.synchronize()
                tables[variant] = prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows,
                                                            max_name_column_width=70)
        del model, step
        torch.cuda.empty_cache()
    for variant, table in tables.items():
        print(f"\n{variant}: 2 steps, kernels by device time\n{table}")
    print("\ndispatch choices:")
    print("\n".join(dispatch.choice_lines()))


if __name__ == "__main__":
    main()
