"""``twofour compare``: several recipes (and seeds) on the same data, seed and token budget,
then one markdown table and one plot overlaying their curves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from .config import TrainConfig
from .data import load_data
from .recipes import RECIPES, recipe_options
from .runs import pyplot, read_config, read_metrics, read_summary
from .train import train

__all__ = ["compare", "results_table"]


def compare(recipes: list[str], base: TrainConfig, seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Train ``base`` once per (recipe, seed) under ``base.out_dir``/RECIPE-sSEED; runs already
    finished there (a ``summary.json`` with the same config) are reused, not retrained. The table
    and plot cover every finished run in the folder with the same model and token budget."""
    seeds = seeds or [base.seed]
    root = Path(base.out_dir)
    data = load_data(base.data, base.vocab_size)  # read once, shared by every run
    summaries = []
    for recipe in recipes:
        for seed in seeds:
            # a recipe that takes no options (dense) runs without the others' --opt
            options = base.recipe_options if recipe_options(recipe) else {}
            cfg = dataclasses.replace(base, recipe=recipe, seed=seed, out_dir=str(root / f"{recipe}-s{seed}"),
                                      recipe_options=options)
            cfg.validate()
            done = read_summary(cfg.out_dir)
            if done is not None and not base.overwrite and _same_run(read_config(cfg.out_dir), cfg):
                summaries.append(done)
                continue
            summaries.append(train(cfg, data))
    root.mkdir(parents=True, exist_ok=True)
    summaries = _all_runs(root, summaries[0])
    (root / "compare.md").write_text(results_table(summaries))
    plot_compare(root, summaries)
    return summaries


def _same_run(config: dict[str, Any] | None, cfg: TrainConfig) -> bool:
    """Whether a finished run's config (its config.json) is ``cfg``, up to how it was launched."""
    if config is None:
        return False
    launch = ("overwrite", "resume", "progress")
    want = {k: v for k, v in json.loads(json.dumps(cfg.to_dict())).items() if k not in launch}
    have = {k: v for k, v in config.items() if k not in launch}
    return want == have


def _all_runs(root: Path, like: dict[str, Any]) -> list[dict[str, Any]]:
    """Every finished run under ``root`` with the same model and token budget as ``like``,
    in recipe order then seed (so a later call with more seeds extends the table)."""
    runs = [read_summary(p.parent) for p in root.glob("*/summary.json")]
    runs = [r for r in runs if (r["model"], r["tokens"]) == (like["model"], like["tokens"])]
    order = {name: i for i, name in enumerate(RECIPES)}
    return sorted(runs, key=lambda r: (order.get(r["recipe"], len(order)), r["seed"]))


def results_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: final val loss, gap to dense, mean and final flip rate, tokens/s, wall time."""
    dense = [s["final_val_loss"] for s in summaries if s["recipe"] == "dense"]
    ref = float(np.mean(dense)) if dense else None
    s0 = summaries[0]
    lines = [f"model `{s0['model']}`, {s0['steps']} steps, {s0['tokens']:,} tokens per run", "",
             "| recipe | seed | final val loss | gap to dense | mean flip rate | final flip rate | tokens/s | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        gap = f"{s['final_val_loss'] - ref:+.4f}" if ref is not None else "n/a"
        lines.append(f"| {s['recipe']} | {s['seed']} | {s['final_val_loss']:.4f} | {gap} | {s['mean_flip_rate']:.2e} "
                     f"| {s['final_flip_rate']:.2e} | {s['tokens_per_s']:,.0f} | {s['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot_compare(root: Path, summaries: list[dict[str, Any]]) -> Path | None:
    """compare.png: validation loss and flip rate of every run, overlaid."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, s in enumerate(summaries):
        color = f"C{i % 10}"  # one color per run in every panel
        m = read_metrics(s["out_dir"])
        label = f"{s['recipe']} (seed {s['seed']})"
        if m["val_loss"]:
            ax1.plot(*zip(*m["val_loss"]), "o-", markersize=3, label=label, color=color)
        steps, losses = zip(*m["train_loss"])
        k = max(1, len(losses) // 50)  # smooth the noisy per-step loss for the eye
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax2.plot(steps[k - 1:], smooth, label=label, color=color)
        fr = [(st, v) for st, v in m["flip_rate"] if v > 0]
        if fr:
            ax3.plot(*zip(*fr), label=label, color=color)
    ax1.set(xlabel="step", ylabel="validation loss", title="validation loss")
    ax2.set(xlabel="step", ylabel="train loss (smoothed)", title="train loss")
    ax3.set(xlabel="step", ylabel="flip rate (steps with flips)", title="mask flip rate", yscale="log")
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = root / "compare.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
