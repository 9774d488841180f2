"""Tokens/s of ``twofour train`` under torchrun: sparse against dense on several GPUs (DDP, or
FSDP2 with ``--fsdp``), as a user launches it, each run a fresh torchrun, median of repeats.

    PYTHONPATH=src python benchmarks/step/torchrun_throughput.py --gpus 2 [--model gpt2-124m]
        [--batches 8,16] [--recipes dense,s-ste] [--repeats 3] [--steps 40] [--busy 0,8]
        [--variants default,--no-step-graphs] [--out FILE] [-- ARGS FOR EVERY RUN]

``--batches`` are per GPU (``--batch-size``). ``--variants``: comma-separated extra arguments of
``twofour train`` to compare, ``default`` for none (e.g. ``default,--no-step-graphs,--fsdp``;
several arguments in one variant joined with ``+``). ``--busy N``: the runs again beside N
processes that each keep a CPU core busy (as a data loader's workers would). Tokens/s is each
run's ``summary.json`` ``tokens_per_s`` (the loop's median over its logged windows). Rows are
interleaved per repeat, so drift of the machine spreads over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import busy_cpus  # noqa: E402


def run_once(gpus: int, args: list[str], out: Path, timeout: float) -> float | None:
    """One torchrun of ``twofour train``; its tokens/s, or None (with its stderr's end) if it failed."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": "4"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "twofour", "train", *args, "--out", str(out), "--overwrite", "--no-progress"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out: {' '.join(args)}", flush=True)
        return None
    if res.returncode != 0:
        print(f"failed ({res.returncode}): {' '.join(args)}\n{res.stderr[-1500:]}", flush=True)
        return None
    return json.loads((out / "summary.json").read_text())["tokens_per_s"]


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--recipes", default="dense,s-ste")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--busy", default="0")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    batches = [int(b) for b in a.batches.split(",")]
    recipes = a.recipes.split(",")
    variants = [[] if v == "default" else v.split("+") for v in a.variants.split(",")]
    results: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (int(b) for b in a.busy.split(",")):
            with busy_cpus(busy):
                for rep in range(a.repeats):
                    for b in batches:
                        for v in variants:
                            for r in recipes:
                                args = ["--model", a.model, "--recipe", r, "--batch-size", str(b), "--seq-len",
                                        str(a.seq_len), "--steps", str(a.steps), "--eval-interval", str(a.steps),
                                        "--ckpt-interval", str(a.steps), "--log-interval", "5", *v, *extra]
                                tps = run_once(a.gpus, args, Path(tmp) / "run", a.timeout)
                                key = (busy, b, " ".join(v) or "default", r)
                                if tps is not None:
                                    results.setdefault(key, []).append(tps)
                                print(key, rep, tps, flush=True)
    ratios_head = " | ".join(f"{r} / {recipes[0]}" for r in recipes[1:])
    lines = [f"{a.gpus} GPUs, torchrun, `twofour train --model {a.model} --seq-len {a.seq_len} --steps {a.steps}` "
             f"(--batch-size per GPU), median (min-max) tokens/s of {a.repeats} runs", "",
             f"| busy procs | batch/GPU | variant | {' | '.join(recipes)} | {ratios_head} |",
             "|---|---|---|" + "---|" * (2 * len(recipes) - 1)]
    for key in sorted({k[:3] for k in results}):
        cells, meds = [], []
        for r in recipes:
            vals = results.get((*key, r), [])
            med = statistics.median(vals) if vals else None
            meds.append(med)
            cells.append(f"{med:,.0f} ({min(vals):,.0f}-{max(vals):,.0f})" if vals else "failed")
        ratios = [f"{m / meds[0]:.3f}x" if m and meds[0] else "n/a" for m in meds[1:]]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if a.out:
        Path(a.out).write_text(report)


if __name__ == "__main__":
    main()
