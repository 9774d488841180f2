"""torchtitan runs side by side from their logged steps: loss at chosen steps, tokens/s per GPU,
memory, and (``--plot``) the loss curves.

    PYTHONPATH=src python scripts/torchtitan_curves.py STEPS [--every 50] [--tsv OUT.tsv] [--plot OUT.png]

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

STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
FIELDS = ("run", "step", "loss", "tps", "memory_gib")


def read_steps(path: Path) -> dict[str, dict[int, tuple[float, int, float]]]:
    """run -> step -> (loss, tokens/s per GPU, memory GiB), from any of the three forms."""
    runs: dict[str, dict[int, tuple[float, int, float]]] = {}
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
        for step, loss, mem, tps in STEP.findall(COLOUR.sub("", text)):
            steps.setdefault(int(step), (float(loss), int(tps.replace(",", "")), float(mem)))
    return {k: v for k, v in runs.items() if v}


def _sections(text: str) -> list[tuple[str, str]]:
    """(run, its lines) of a ``## RUN`` file."""
    parts = re.split(r"^## (\S+)\s*$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def table(runs: dict[str, dict[int, tuple[float, int, float]]], every: int) -> str:
    """Markdown: each run's median tokens/s per GPU (steps after the 5th), peak memory, and its loss
    every ``every`` steps."""
    last = max(max(s) for s in runs.values())
    marks = [s for s in range(every, last + 1, every)] or [last]
    lines = ["| run | tokens/s per GPU (median) | memory GiB | " + " | ".join(f"loss @{s}" for s in marks) + " |",
             "|---|---|---|" + "---|" * len(marks)]
    for name, steps in runs.items():
        tps = [t for s, (_, t, _) in steps.items() if s > 5] or [t for _, t, _ in steps.values()]
        losses = [f"{steps[s][0]:.4f}" if s in steps else "-" for s in marks]
        lines.append(f"| {name} | {statistics.median(tps):,.0f} | {max(m for *_, m in steps.values()):.1f} | "
                     + " | ".join(losses) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, tuple[float, int, float]]], out: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only with --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, steps in runs.items():
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
    ap.add_argument("--every", type=int, default=50, help="loss columns every this many steps (default 50)")
    ap.add_argument("--runs", default=None, help="comma-separated run names to keep (default: all)")
    ap.add_argument("--tsv", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--title", default="torchtitan Llama 3: training loss")
    a = ap.parse_args(argv)
    if a.every < 1:
        print(f"torchtitan_curves: --every must be at least 1, got {a.every}", file=sys.stderr)
        return 2
    if not a.steps.exists():
        print(f"torchtitan_curves: {a.steps}: no such file or folder", file=sys.stderr)
        return 2
    runs = read_steps(a.steps)
    if a.runs:
        runs = {k: v for k, v in runs.items() if k in a.runs.split(",")}
    if not runs:
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
