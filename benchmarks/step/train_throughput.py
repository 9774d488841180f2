"""Tokens/s of ``twofour train`` as a user sees it: sparse recipes against dense, eager and
``--compile``, each run a fresh process, median (min-max) of repeated runs interleaved per repeat.

    PYTHONPATH=src python benchmarks/step/train_throughput.py [--models gpt2-124m,gpt2-774m]
        [--batch-size 32,16] [--recipes dense,ste,s-ste] [--repeats 3] [--steps 40] [--out FILE]
        [--compile-modes default,reduce-overhead]
        [-- ARGS FOR EVERY twofour train RUN, e.g. --data DIR]

The logic (and the meaning of each column) is ``twofour.bench.throughput.train_throughput``'s, the
last section of ``twofour bench``; tokens/s is each run's ``summary.json`` ``tokens_per_s``.
Without ``dense`` among the recipes, or without compiled runs, the ratios read n/a.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from twofour.bench.throughput import throughput_table, train_throughput
from twofour.version import __version__


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-124m", help="comma-separated presets (default %(default)s)")
    ap.add_argument("--recipes", default="dense,s-ste", help="comma-separated (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", default=None, help="micro-batch per model, comma-separated "
                    "(default: twofour.bench.throughput.TRAIN_BATCH's, e.g. gpt2-124m 32, gpt2-774m 16)")
    ap.add_argument("--seq-len", type=int, default=1024)
    modes = ap.add_mutually_exclusive_group()
    modes.add_argument("--no-compile", action="store_true", help="eager runs only")
    modes.add_argument("--compile-only", action="store_true", help="--compile runs only")
    ap.add_argument("--compile-modes", default="default",
                    help="torch.compile modes of the compiled runs, comma-separated (default %(default)s)")
    ap.add_argument("--workdir", default=None, help="keep the runs' folders here (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    batches = [int(b) for b in args.batch_size.split(",")] if args.batch_size else None
    names = [m.strip() for m in args.compile_modes.split(",") if m.strip()]
    compiled = [True if m == "default" else m for m in names]
    compile_modes = [False] if args.no_compile else compiled if args.compile_only else [False, *compiled]
    rows = train_throughput(models, recipes, compile_modes=compile_modes, repeats=args.repeats, steps=args.steps,
                            batch_sizes=batches, seq_len=args.seq_len, workdir=args.workdir, extra_args=extra)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU"
    report = (f"{device}; torch {torch.__version__}, twofour {__version__}; `twofour train --steps {args.steps}`, "
              f"median (min-max) of {args.repeats} runs\n\n{throughput_table(rows)}\n")
    print("\n" + report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
