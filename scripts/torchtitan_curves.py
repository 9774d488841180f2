"""torchtitan runs side by side from their logged steps: tokens/s per GPU and its ratio to the
dense run, memory, the last loss and the loss at chosen steps, and (``--plot``) the loss curves.

    python scripts/torchtitan_curves.py STEPS [--every 50] [--runs A,B] [--tsv OUT.tsv] [--plot OUT.png]

STEPS is what ``benchmarks/step/scale_out.sh``'s titan part writes (``torchtitan_steps.txt``: a
``## RUN`` line, then that run's log lines), a folder of torchtitan logs (``RUN.log``, as
``benchmarks/step/torchtitan_run.sh`` leaves them), or a ``.tsv`` this script wrote. Every rank
logs each step; the first line of a step is kept (the loss is the same on every rank). ``--tsv``
writes one row per run and step (run, step, loss, tokens/s per GPU, memory GiB): the compact form
kept beside the tables in docs/results/.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+)")
MEMORY = re.compile(r"memory:\s*([\d.]+)GiB")
TPS = re.compile(r"tps:\s*([\d,]+)")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
FIELDS = ("run", "step", "loss", "tps", "memory_gib")
Steps = dict[int, tuple[float, int, float]]  # step -> (loss, tokens/s per GPU, memory GiB)


def read_steps(path: Path) -> dict[str, Steps]:
    """run -> its logged steps, from any of the three forms (a run whose log holds no step line
    maps to an empty dict: it failed before its first step)."""
    runs: dict[str, Steps] = {}
    if path.suffix == ".tsv":
        with path.open() as fh:
            for r in csv.DictReader(fh, delimiter="\t"):
                runs.setdefault(r["run"], {})[int(r["step"])] = (float(r["loss"]), int(r["tps"]),
                                                                 float(r["memory_gib"]))
        return runs
    texts = ([(p.stem, p.read_text(errors="replace")) for p in sorted(path.glob("*.log"))] if path.is_dir()
             else _sections(path.read_text(errors="replace")))
    for name, text in texts:
        steps = runs.setdefault(name, {})
        for line in COLOUR.sub("", text).splitlines():
            m, tps = STEP.search(line), TPS.search(line)
            if m and tps and int(m.group(1)) not in steps:
                mem = MEMORY.search(line)
                steps[int(m.group(1))] = (float(m.group(2)), int(tps.group(1).replace(",", "")),
                                          float(mem.group(1)) if mem else 0.0)
    return runs


def _sections(text: str) -> list[tuple[str, str]]:
    """(run, its lines) of a ``## RUN`` file."""
    parts = re.split(r"^## (\S+)\s*$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _median_tps(steps: Steps) -> float:
    """Tokens/s per GPU over the steps after the 5th (warm-up and compilation left out), else all."""
    return statistics.median([t for s, (_, t, _) in steps.items() if s > 5] or [t for _, t, _ in steps.values()])


def table(runs: dict[str, Steps], every: int | None = None) -> str:
    """Markdown: each run's steps, median tokens/s per GPU, its ratio to the dense run of the same
    name (``sste-X`` against ``dense-X``), peak memory, last loss and, with ``every``, its loss
    every that many steps."""
    last = max((max(s) for s in runs.values() if s), default=0)
    marks = list(range(every, last + 1, every)) if every else []
    lines = ["| run | steps | tokens/s per GPU (median) | s-ste / dense | memory GiB | last loss | "
             + "".join(f"loss @{s} | " for s in marks),
             "|---|---|---|---|---|---|" + "---|" * len(marks)]
    for name, steps in runs.items():
        if not steps:
            lines.append(f"| {name} | no steps logged | - | | - | - | " + "- | " * len(marks))
            continue
        dense = runs.get(name.replace("sste-", "dense-", 1)) if name.startswith("sste-") else None
        ratio = f"{_median_tps(steps) / _median_tps(dense):.2f}x" if dense else ""
        losses = "".join(f"{steps[s][0]:.4f} | " if s in steps else "- | " for s in marks)
        lines.append(f"| {name} | {min(steps)}-{max(steps)} | {_median_tps(steps):,.0f} | {ratio} | "
                     f"{max(m for *_, m in steps.values()):.1f} | {steps[max(steps)][0]:.4f} | " + losses)
    return "\n".join(line.rstrip() for line in lines)


def plot(runs: dict[str, Steps], out: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only with --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, steps in runs.items():
        if not steps:
            continue
        xs = sorted(steps)
        ax.plot(xs, [steps[s][0] for s in xs], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("steps", type=Path)
    ap.add_argument("--every", type=int, default=None, help="a loss column every this many steps (default: none)")
    ap.add_argument("--runs", default=None, help="comma-separated run names to keep (default: all)")
    ap.add_argument("--tsv", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--title", default="torchtitan Llama 3: training loss")
    a = ap.parse_args(argv)
    if a.every is not None and a.every < 1:
        print(f"torchtitan_curves: --every must be at least 1, got {a.every}", file=sys.stderr)
        return 2
    if not a.steps.exists():
        print(f"torchtitan_curves: {a.steps}: no such file or folder", file=sys.stderr)
        return 2
    runs = read_steps(a.steps)
    if a.runs:
        runs = {k: v for k, v in runs.items() if k in a.runs.split(",")}
    if not any(runs.values()):
        print(f"torchtitan_curves: {a.steps}: no torchtitan step lines found", file=sys.stderr)
        return 2
    print(table(runs, a.every))
    if a.tsv:
        with a.tsv.open("w", newline="") as fh:
            w = csv.writer(fh, delimiter="\t", lineterminator="\n")
            w.writerow(FIELDS)
            for name, steps in runs.items():
                w.writerows((name, s, f"{loss:.5f}", tps, f"{mem:.2f}")
                            for s, (loss, tps, mem) in sorted(steps.items()))
    if a.plot:
        plot(runs, a.plot, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
