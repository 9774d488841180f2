"""The relative gap to dense at every evaluation of a ``twofour compare`` folder, mean over seeds.

    PYTHONPATH=src python benchmarks/gap_by_eval.py runs/q10m-ours

For each recipe (with its options, as compare's table names it) and each evaluation step that
every run has: (val loss - dense val loss of the same seed) / dense val loss, averaged over the
seeds both ran. Prints a markdown table (the one in docs/RESULTS.md); reads only the runs'
``summary.json`` and ``metrics.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from twofour.compare import run_label, run_order, summary_label
from twofour.runs import read_metrics, read_summary


def gap_table(root: Path) -> str:
    """The markdown table of relative gaps to dense (%) at each common evaluation step."""
    runs: dict[str, dict[int, dict[int, float]]] = {}
    for s in sorted((read_summary(p.parent) for p in root.glob("*/summary.json")), key=run_order):
        runs.setdefault(summary_label(s), {})[s["seed"]] = dict(read_metrics(s["out_dir"])["val_loss"])
    dense = runs.pop(run_label("dense"), None)
    if not dense:
        raise SystemExit(f"{root}: no finished dense run to compare with")
    steps = sorted(set.intersection(*(set(v) for by_seed in [dense, *runs.values()] for v in by_seed.values())))
    lines = ["| recipe | " + " | ".join(f"step {st}" for st in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for name, by_seed in runs.items():
        seeds = sorted(set(by_seed) & set(dense))
        gaps = [np.mean([(by_seed[s][st] - dense[s][st]) / dense[s][st] for s in seeds]) * 100 for st in steps]
        lines.append(f"| {name} | " + " | ".join(f"{g:+.2f} %" for g in gaps) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a twofour compare --out folder")
    print(gap_table(ap.parse_args().root))


if __name__ == "__main__":
    main()
