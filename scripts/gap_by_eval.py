"""The relative gap to a baseline at every evaluation of a ``twofour compare`` folder.

    PYTHONPATH=src python scripts/gap_by_eval.py runs/q10m-ours
    PYTHONPATH=src python scripts/gap_by_eval.py docs/results/q124m-ours --base s-ste --per-seed \\
        --only precision=fp8 --plot docs/results_gpt2-124m_200m_fp8_gap.png

For each run label (:func:`label_of`: the recipe with its precision and options, as compare's table names
it, then the settings a run changed from ``twofour train``'s defaults, ``lr=0.002``) and each evaluation step that
every run has: (val loss - baseline val loss of the same seed) / baseline val loss, for each seed
both ran (``--per-seed``) or averaged over them. The baseline is ``dense`` unless ``--base``
names another run label (``s-ste``, ``"s-ste precision=fp8 mvue=false"``). Prints a markdown table (the ones in
docs/RESULTS.md); ``--plot`` also draws the gaps over the steps, the mean over seeds with a band
from their least to their greatest. Reads only the runs' ``summary.json`` and ``metrics.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from twofour.training.compare import run_order, summary_label
from twofour.training.config import TrainConfig
from twofour.training.runs import pyplot, read_config, read_metrics, read_summary

#: Settings an ablation varies besides the recipe: named in a run's label where its config.json
#: holds another value than ``twofour train``'s default.
VARIED = ("lr", "warmup", "min_lr_ratio", "weight_decay")


def label_of(summary: dict) -> str:
    """A finished run's name in tables: compare's label (:func:`summary_label`), then each setting
    of :data:`VARIED` its config.json changed from the default (``s-ste weight_decay=0``)."""
    cfg, default = read_config(summary["out_dir"]) or {}, TrainConfig()
    extra = [f"{k}={cfg[k]:g}" for k in VARIED if cfg.get(k) is not None and cfg[k] != getattr(default, k)]
    return " ".join([summary_label(summary), *extra])


def gap_series(root: Path, base: str = "dense", only: str = "") -> tuple[list[int], dict[str, dict[int, list[float]]]]:
    """The evaluation steps every run has, and ``{label: {seed: [gap % at each of them]}}`` against
    the run labelled ``base`` of the same seed; labels without ``only`` in them are left out."""
    runs: dict[str, dict[int, dict[int, float]]] = {}
    for s in sorted((read_summary(p.parent) for p in root.glob("*/summary.json")), key=run_order):
        runs.setdefault(label_of(s), {})[s["seed"]] = dict(read_metrics(s["out_dir"])["val_loss"])
    ref = runs.pop(base, None)
    if not ref:
        raise SystemExit(f"{root}: no finished run labelled {base!r} to compare with; labels: {', '.join(runs)}")
    runs = {name: by_seed for name, by_seed in runs.items() if only in name}
    steps = sorted(set.intersection(*(set(v) for by_seed in [ref, *runs.values()] for v in by_seed.values())))
    return steps, {name: {s: [(by_seed[s][st] / ref[s][st] - 1) * 100 for st in steps]
                          for s in sorted(set(by_seed) & set(ref))}
                   for name, by_seed in runs.items() if set(by_seed) & set(ref)}


def gap_table(steps: list[int], series: dict[str, dict[int, list[float]]], per_seed: bool = False) -> str:
    """The markdown table of :func:`gap_series`' gaps (%) at each common evaluation step: one row
    per recipe (the mean over seeds), or per recipe and seed."""
    head = "| recipe | seed | " if per_seed else "| recipe | "
    lines = [head + " | ".join(f"step {st}" for st in steps) + " |",
             "|---" * (len(steps) + 1 + per_seed) + "|"]
    for name, by_seed in series.items():
        rows = ([(f"{name} | {s}", gaps) for s, gaps in by_seed.items()] if per_seed else
                [(name, np.mean(list(by_seed.values()), axis=0))])
        lines += [f"| {label} | " + " | ".join(f"{g:+.2f} %" for g in gaps) + " |" for label, gaps in rows]
    return "\n".join(lines)


def plot_gaps(steps: list[int], series: dict[str, dict[int, list[float]]], base: str, path: Path) -> None:
    """The gaps over the steps: per recipe the mean over seeds, a band from the least to the
    greatest seed where there are several."""
    plt = pyplot()
    if plt is None:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, by_seed) in enumerate(series.items()):
        gaps = np.array(list(by_seed.values()))  # seeds x steps
        mean, lo, hi = gaps.mean(0), gaps.min(0), gaps.max(0)
        color = f"C{i % 10}"
        ax.plot(steps, mean, "o-", markersize=3, color=color,
                label=f"{name} ({len(by_seed)} seed{'s' if len(by_seed) > 1 else ''})")
        if len(by_seed) > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set(xlabel="step", ylabel=f"validation loss over {base}'s, same seed - 1 (%)",
           title=f"relative gap to {base} (mean over seeds, band: min to max)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a twofour compare --out folder")
    ap.add_argument("--base", default="dense", help="the baseline's run label (default %(default)s)")
    ap.add_argument("--per-seed", action="store_true", help="one row per recipe and seed instead of the mean")
    ap.add_argument("--only", default="", help="only the recipes whose label contains this text")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the gaps into this image")
    args = ap.parse_args()
    steps, series = gap_series(args.root, args.base, args.only)
    print(gap_table(steps, series, args.per_seed))
    if args.plot:
        plot_gaps(steps, series, args.base, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
