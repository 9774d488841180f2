"""Tokens/s of the real training loop (``twofour.training.train``) under torchrun, dense against
sparse side by side, many settings in one launch: each run is a fresh model and optimizer through
the same ``train()`` that ``twofour train`` calls, in one process group (no torchrun start per run).

    torchrun --standalone --nproc-per-node 2 benchmarks/step/dist_loop.py \\
        --case "ddp-16 model=gpt2-124m batch_size=16" \\
        --case "fsdp-16 model=gpt2-124m batch_size=16 fsdp=bf16" \\
        [--recipes dense,s-ste] [--repeats 3] [--steps 30] [--seq-len 1024] [--deadline 480]
        [--profile fsdp-16] [--out FILE]

A case is a label, then ``field=value`` pairs of :class:`twofour.training.TrainConfig` (ints,
floats, true/false/none and names as written), plus ``busy=N``: N processes beside the run that
each keep a CPU core busy (as a data loader's workers would), and ``vocab=N``: the model's
vocabulary (embedding and output layer) N wide instead of the byte data's 256, as a real
tokenizer's (Llama 3: 128256). No run writes a checkpoint (``ckpt_interval=0``): at 8B a save
would write 16 bytes a parameter. The table also gives each case's peak GPU memory per recipe
(the most any rank allocated in any of its runs), and is rewritten after every run, so a launch
cut short by a time limit leaves the runs that finished. Runs are interleaved (repeat,
case, recipe), so drift of the machine spreads over all rows. Tokens/s is each run's
``summary.json`` value (the loop's median over its logged windows of 5 steps, so the first
windows' warm-up and compilation drop out). ``--deadline`` stops starting runs after that many
seconds and reports what finished. ``--profile LABEL`` runs that case once more per recipe under
torch.profiler and prints the ops that take the host's and the GPU's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from twofour.training import TrainConfig, train
from twofour.training.data import load_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import busy_cpus  # noqa: E402


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_case(spec: str) -> tuple[str, dict, int]:
    """(label, TrainConfig fields, busy processes) of one ``--case`` (``vocab`` stays among the
    fields; :func:`run_once` takes it out)."""
    label, *pairs = spec.split()
    fields = dict(p.split("=", 1) for p in pairs)
    busy = int(fields.pop("busy", 0))
    return label, {k: _value(v) for k, v in fields.items()}, busy


def _peak_gib() -> float:
    """The most GPU memory any rank allocated since the last reset, in GiB (0 on the CPU)."""
    if not torch.cuda.is_available():
        return 0.0
    t = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_once(fields: dict, recipe: str, a, data, out: Path) -> float | None:
    """One training run; its tokens/s on rank 0 (None elsewhere, or if it failed)."""
    fields = dict(fields)
    vocab = fields.pop("vocab", None)
    if vocab is not None:  # the bytes stay below 256; the model's embedding and head are vocab wide
        data = dataclasses.replace(data, vocab_size=int(vocab))
    cfg = TrainConfig(**{"seq_len": a.seq_len, "steps": a.steps, "eval_interval": a.steps, "eval_iters": 1,
                         "ckpt_interval": 0, "log_interval": 5, "progress": False, **fields},
                      recipe=recipe, out_dir=str(out), overwrite=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        summary = train(cfg, data)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return summary.get("tokens_per_s")


def _agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank."""
    t = torch.tensor([int(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.broadcast(t, 0)
    return bool(t.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--recipes", default="dense,s-ste")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--deadline", type=float, default=1e9)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:  # a CPU check of the script itself, over gloo
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [parse_case(c) for c in a.case]
    recipes = a.recipes.split(",")
    data = load_data(None)
    t0 = time.perf_counter()
    results: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], float] = {}  # (case, recipe) -> peak GiB over its runs and ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        if world > 1:
            obj = [str(out)]
            dist.broadcast_object_list(obj, 0)  # rank 0's folder: only it writes
            out = Path(obj[0])
        for rep in range(a.repeats):
            for label, fields, busy in cases:
                for recipe in recipes:
                    if _agree(time.perf_counter() - t0 > a.deadline):
                        continue
                    try:
                        with busy_cpus(busy):
                            tps = run_once(fields, recipe, a, data, out)
                    except Exception as e:  # noqa: BLE001 - reported, the other runs go on
                        tps = None
                        if rank == 0:
                            print(f"{label} {recipe}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    peak = _peak_gib()  # every rank takes part, failed runs too
                    peaks[label, recipe] = max(peaks.get((label, recipe), 0.0), peak)
                    if rank == 0 and tps:
                        results.setdefault((label, recipe), []).append(tps)
                        print(f"rep {rep} {label} {recipe}: {tps:,.0f} tokens/s, peak {peak:.1f} GiB "
                              f"({time.perf_counter() - t0:.0f} s)", flush=True)
                        if a.out:  # the table so far: what finished survives a time limit
                            Path(a.out).write_text(_table(a, cases, recipes, results, world, peaks))
        if a.profile:
            _profile(a, cases, recipes, data, out, rank)
    if rank == 0:
        report = _table(a, cases, recipes, results, world, peaks)
        print("\n" + report, flush=True)
        if a.out:
            Path(a.out).write_text(report)
    dist.destroy_process_group()


def _table(a, cases, recipes, results, world, peaks) -> str:
    where = "GPUs" if torch.cuda.is_available() else "CPU processes"
    lines = [f"{world} {where}, torchrun, twofour.training.train, seq {a.seq_len}, {a.steps} steps a run, median "
             f"(min-max) tokens/s of up to {a.repeats} runs; batch per GPU", "",
             "| " + " | ".join(["case", "settings", *recipes, *(f"{r} / {recipes[0]}" for r in recipes[1:]),
                                "peak GiB, " + " / ".join(recipes)]) + " |",
             "|---|---|" + "---|" * (2 * len(recipes))]
    for label, fields, busy in cases:
        meds, cells = [], []
        for r in recipes:
            vals = results.get((label, r), [])
            meds.append(statistics.median(vals) if vals else None)
            cells.append(f"{meds[-1]:,.0f} ({min(vals):,.0f}-{max(vals):,.0f}, n={len(vals)})" if vals else "-")
        ratios = [f"{m / meds[0]:.3f}x" if m and meds[0] else "-" for m in meds[1:]]
        settings = " ".join(f"{k}={v}" for k, v in fields.items()) + (f" busy={busy}" if busy else "")
        peak = " / ".join(f"{peaks[label, r]:.1f}" if peaks.get((label, r)) else "-" for r in recipes)
        lines.append("| " + " | ".join([label, settings, *cells, *ratios, peak]) + " |")
    return "\n".join(lines) + "\n"


def _profile(a, cases, recipes, data, out, rank) -> None:
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    for label, fields, _ in cases:
        if label != a.profile:
            continue
        for recipe in recipes:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run_once({**fields, "steps": 12}, recipe, a, data, out)
            if rank == 0:
                ev = prof.key_averages()
                print(f"\n== profile {label} {recipe}: by self CPU time ==\n"
                      + ev.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
                print(f"== profile {label} {recipe}: by GPU time ==\n"
                      + ev.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
