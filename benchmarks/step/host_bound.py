"""Is the training step bound by the host? Dense against 2:4 at small batches (GPU).

    PYTHONPATH=src python benchmarks/step/host_bound.py [--preset gpt2-124m] [--batches 8,16]
        [--recipes dense,s-ste] [--steps 20] [--busy 8] [--profile s-ste]

For each preset, batch and recipe, one eager training step as ``twofour train`` runs it (bf16
autocast, fused AdamW, masks advanced by ``twofour.attach``) is timed three ways over ``--steps``
steps: the wall time per step (synchronized), the GPU's busy time per step (the sum of its kernels'
durations, from torch.profiler) and the host's time to issue one step (from the step's start
until ``optimizer.step()`` returns, with no synchronization inside). A step whose GPU is busy for
much less than its wall time, and whose issue time is close to the wall time, is host-bound.
``--busy N`` runs every case again beside N processes that keep a CPU core busy each (as a data
loader's workers would). ``--profile RECIPE`` prints the Python functions that take the host's
time in that recipe's step (cProfile, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import twofour
from twofour.models import build_model
from twofour.training.graphs import StepGraphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import busy_cpus, kernel_times  # noqa: E402


def _step_fn(preset: str, recipe: str, batch: int, seq: int, graphed: bool = False):
    torch.manual_seed(0)
    model = build_model(preset, recipe, vocab_size=50304, block_size=seq).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    twofour.attach(model, opt)
    x = torch.randint(0, 50304, (batch, seq), device="cuda")
    y = torch.randint(0, 50304, (batch, seq), device="cuda")

    def micro(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)[1]
        loss.backward()
        return loss

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)

    graphs = StepGraphs(model, micro, clip) if graphed else None

    def step() -> float:
        t0 = time.perf_counter()
        if graphs is not None:
            graphs([(x, y)])
        else:
            micro(x, y)
            clip()
        opt.step()
        if graphs is None:
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step.graphs = graphs
    return step


def measure(step, steps: int) -> dict[str, float]:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    issue = []
    t0 = time.perf_counter()
    for _ in range(steps):
        issue.append(step())
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    busy_us = sum(us for us, _ in kernel_times(prof, 5).values())
    return {"wall_ms": wall * 1e3, "issue_ms": statistics.median(issue) * 1e3, "busy_ms": busy_us / 1e3}


def check(preset: str, recipe: str, batch: int, seq: int, steps: int = 12) -> str:
    """Train ``steps`` steps eagerly and with graphs from the same weights on the same batches: the
    per-step losses and the final weights' largest relative difference."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [(torch.randint(0, 50304, (batch, seq), device="cuda", generator=gen),
             torch.randint(0, 50304, (batch, seq), device="cuda", generator=gen)) for _ in range(steps)]
    out = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = build_model(preset, recipe, vocab_size=50304, block_size=seq).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        twofour.attach(model, opt)

        def micro(x, y, model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)[1]
            loss.backward()
            return loss.detach()

        def clip(model=model):
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)

        graphs = StepGraphs(model, micro, clip) if graphed else None
        losses = []
        for x, y in data:
            if graphs is not None:
                loss, _ = graphs([(x, y)])
            else:
                loss = micro(x, y)
                clip()
            losses.append(loss.item())
            opt.step()
            if graphs is None:
                opt.zero_grad(set_to_none=True)
        assert graphs is None or (graphs.replayed and not graphs.disabled), "no step was replayed"
        out[graphed] = (losses, torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    (le, we), (lg, wg) = out[False], out[True]
    dl = max(abs(a - b) for a, b in zip(le, lg))
    dw = ((we - wg).norm() / we.norm()).item()
    return f"{recipe}: losses eager {le[-1]:.4f} graphed {lg[-1]:.4f}, max |diff| {dl:.2e}; weights rel diff {dw:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--recipes", default="dense,s-ste")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--busy", type=int, default=0, help="also run beside N busy processes")
    ap.add_argument("--graphs", action="store_true", help="also time each recipe with the step's forward and "
                    "backward captured as a CUDA graph (twofour.training.graphs)")
    ap.add_argument("--check", action="store_true", help="first check that a graphed step trains as the eager one")
    ap.add_argument("--profile", default=None, help="cProfile this recipe's step (at the first batch)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    recipes = args.recipes.split(",")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.preset}, seq {args.seq}, eager, bf16")
    if args.check:
        for r in ("dense", "ste", "s-ste"):
            print(check(args.preset, r, batches[0], args.seq), flush=True)
    rows = []
    for busy in ([0, args.busy] if args.busy else [0]):
        with busy_cpus(busy):
            for b in batches:
                res = {}
                for graphed in (False, True) if args.graphs else (False,):
                    for r in recipes:
                        step = _step_fn(args.preset, r, b, args.seq, graphed)
                        name = r + (" +graphs" if graphed else "")
                        res[name] = measure(step, args.steps)
                        if graphed:
                            assert step.graphs.graphs and not step.graphs.disabled, "no graph was captured"
                        del step
                        torch.cuda.empty_cache()
                        m = res[name]
                        rows.append((busy, b, name, m["wall_ms"], m["issue_ms"], m["busy_ms"],
                                     b * args.seq / m["wall_ms"] * 1e3, res[recipes[0]]["wall_ms"] / m["wall_ms"]))
                        print(rows[-1], flush=True)
    print("\n| busy procs | batch | recipe | wall ms/step | issue ms/step | GPU busy ms/step | GPU busy % | tokens/s "
          f"| vs {recipes[0]} |\n|---|---|---|---|---|---|---|---|---|")
    for busy, b, r, wall, issue, gpu, tps, ratio in rows:
        print(f"| {busy} | {b} | {r} | {wall:.2f} | {issue:.2f} | {gpu:.2f} | {100 * gpu / wall:.0f} | {tps:,.0f} "
              f"| {ratio:.2f}x |")
    if args.profile:
        step = _step_fn(args.preset, args.profile, batches[0], args.seq)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(f"\ncProfile of {args.steps} {args.profile} steps at batch {batches[0]} (own time):")
        print("\n".join(s.getvalue().splitlines()[:60]))


if __name__ == "__main__":
    main()
