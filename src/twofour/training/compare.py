"""``twofour compare``: several recipes (and seeds) on the same data, options and token budget,
then one markdown table (every run, then each recipe's mean ± std over seeds and its gap to
dense paired by seed) and one plot (per recipe, the mean curve and the seeds' spread)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TrainError
from ..sparse.recipes import RECIPES, recipe_options
from .checkpoint import checkpoint_path
from .config import LAUNCH_OPTIONS, TrainConfig
from .data import load_data
from .lock import RunLock
from .loop import train
from .runs import METRICS, pyplot, read_config, read_metrics, read_summary

log = logging.getLogger("twofour")

__all__ = ["compare", "results_table", "recipe_stats", "plot_compare", "run_label", "summary_label",
           "run_order"]


def run_label(recipe: str, options: dict[str, Any] | None = None, precision: str = "bf16") -> str:
    """How a run's recipe is named in tables, plots and folder names: the recipe, its precision
    unless ``bf16``, then the options it was given (``s-ste precision=fp8 mvue=false``), so
    variants of one recipe stay apart."""
    return " ".join([recipe, *([f"precision={precision}"] if precision != "bf16" else []),
                     *(f"{k}={json.dumps(v)}" for k, v in sorted((options or {}).items()))])


def _folder(recipe: str, options: dict[str, Any] | None, seed: int, precision: str = "bf16") -> str:
    """The folder of a run under a comparison's root: its label's words joined by '-', then the seed
    (``s-ste-precision=fp8-mvue=false-s1``)."""
    return run_label(recipe, options, precision).replace(" ", "-") + f"-s{seed}"


def summary_label(summary: dict[str, Any]) -> str:
    """:func:`run_label` of a finished run's summary (read by ``read_summary``: an older version's
    in this one's form)."""
    return run_label(summary["recipe"], summary.get("recipe_options"), summary.get("precision", "bf16"))


def run_order(summary: dict[str, Any]) -> tuple:
    """The order runs appear in tables: recipes as :data:`RECIPES` lists them, variants by label,
    then seeds."""
    order = {name: i for i, name in enumerate(RECIPES)}
    return order.get(summary["recipe"], len(order)), summary_label(summary), summary["seed"]


def _dense_label(summary: dict[str, Any]) -> str:
    """The dense run a run is compared with: dense with this run's precision and the options dense
    takes (``bf16_finetune``) as this run's."""
    return run_label("dense", _options_for("dense", summary.get("recipe_options") or {}),
                     summary.get("precision", "bf16"))


def _options_for(recipe: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of ``options`` that ``recipe`` takes (dense runs without the sparse recipes'
    ``mvue`` or ``decay``, but with ``bf16_finetune``); one no recipe takes stays, to be refused by name."""
    takes = recipe_options(recipe)
    return {k: v for k, v in options.items() if k in takes or not any(k in recipe_options(r) for r in RECIPES)}


def compare(recipes: list[str], base: TrainConfig, seeds: list[int] | None = None) -> list[dict[str, Any]]:
    """Train ``base`` once per (recipe, seed) under ``base.out_dir``/RECIPE-sSEED (the precision
    and the recipe's options in the name when it is given any: ``s-ste-mvue=false-s1``); runs already
    finished there (a ``summary.json`` with the same config) are reused, not retrained, and an
    interrupted one (a checkpoint, no summary) is resumed, unless ``base.overwrite``. The table
    and plot cover every finished run in the folder with the same model and token budget. The
    folder is locked meanwhile (rank 0 under torchrun), as each run's folder is while it trains:
    TrainError if another comparison holds it."""
    root = Path(base.out_dir)
    with RunLock(root) if int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext():
        return _compare(recipes, base, seeds or [base.seed], root)


def _compare(recipes: list[str], base: TrainConfig, seeds: list[int], root: Path) -> list[dict[str, Any]]:
    """:func:`compare`'s work, in the locked folder ``root``."""
    data = None  # read once, when the first run needs training, and shared by every run
    summaries = []
    for recipe in recipes:
        for seed in seeds:
            options = _options_for(recipe, base.recipe_options)
            out = root / _folder(recipe, options, seed, base.precision)
            cfg = dataclasses.replace(base, recipe=recipe, seed=seed, out_dir=str(out), recipe_options=options)
            cfg.validate()
            if _finished(cfg, base.overwrite):
                summaries.append(read_summary(cfg.out_dir))
            else:
                data = data if data is not None else load_data(base.data, base.vocab_size)
                summaries.append(train(_continue(cfg, base.overwrite), data))
    root.mkdir(parents=True, exist_ok=True)
    summaries = _all_runs(root, summaries[0])
    (root / "compare.md").write_text(results_table(summaries))
    plot_compare(root, summaries)
    return summaries


def _finished(cfg: TrainConfig, overwrite: bool) -> bool:
    """Whether ``cfg``'s folder holds this very run, finished (all its steps, not stopped early)."""
    done = read_summary(cfg.out_dir)
    return (not overwrite and done is not None and done["steps"] == cfg.steps
            and _same_run(read_config(cfg.out_dir), cfg))


def _continue(cfg: TrainConfig, overwrite: bool) -> TrainConfig:
    """How to train a run that isn't finished: resumed from its checkpoint if it was interrupted,
    started over if it died before its first checkpoint; a folder holding another run is
    refused unless ``overwrite``."""
    out = Path(cfg.out_dir)
    if overwrite or (checkpoint_path(out) is None and not (out / METRICS).exists()):
        return cfg
    if not _same_run(read_config(out), cfg):
        raise TrainError(f"{out} holds a run with other settings; choose another --out, or --overwrite to "
                         "retrain every run of the comparison")
    if checkpoint_path(out) is not None:
        return dataclasses.replace(cfg, resume=True)
    return dataclasses.replace(cfg, overwrite=True)  # died before its first checkpoint: nothing to keep


def _same_run(config: dict[str, Any] | None, cfg: TrainConfig) -> bool:
    """Whether a run's config (its config.json) is ``cfg``, up to how it was launched and how
    often it logs, evaluates and checkpoints (device, compile and FSDP count: they change speed).
    A setting the saved config lacks (saved before it existed) counts as its default."""
    if config is None:
        return False
    launch = LAUNCH_OPTIONS | {"log_interval", "eval_interval", "ckpt_interval", "skip_nonfinite"}

    def compared(c: TrainConfig) -> dict[str, Any]:  # as JSON holds them (tuples and lists alike)
        return {k: v for k, v in json.loads(json.dumps(c.to_dict())).items() if k not in launch}

    return compared(cfg) == compared(TrainConfig.from_dict(config))


def _all_runs(root: Path, like: dict[str, Any]) -> list[dict[str, Any]]:
    """Every finished run under ``root`` with the same model, regime and token budget as ``like``,
    in recipe order then seed (so a later call with more seeds extends the table). Of two runs
    with one label and seed (a folder named by an older label), the one in its label's folder
    counts, and the other is named in a warning."""
    def key(r: dict[str, Any]) -> tuple:
        return r["model"], r.get("regime", "ours"), r["tokens"]

    runs = [read_summary(p.parent) for p in sorted(root.glob("*/summary.json"))]
    for r in runs:
        missing = [k for k in ("recipe", "model", "seed", "steps", "tokens", "final_val_loss") if k not in r]
        if missing:
            raise TrainError(f"{r['out_dir']}/summary.json is not a twofour run's summary (no {', '.join(missing)}); "
                             f"move that folder out of {root}")
    kept: dict[tuple, dict[str, Any]] = {}
    # the run in the folder its label names first
    for r in sorted(runs, key=lambda r: Path(r["out_dir"]).name != _folder(r["recipe"], r.get("recipe_options"),
                                                                          r["seed"], r.get("precision", "bf16"))):
        if key(r) != key(like):
            continue
        same = kept.setdefault((summary_label(r), r["seed"]), r)
        if same is not r:
            log.warning("%s repeats the run %s (seed %s) of %s; it is left out of the table", r["out_dir"],
                        summary_label(r), r["seed"], same["out_dir"])
    for r in kept.values():  # the plot reads their curves
        if not (Path(r["out_dir"]) / METRICS).is_file():
            raise TrainError(f"{r['out_dir']} holds a finished run without its {METRICS}: a run is reported from "
                             f"its summary.json, config.json and {METRICS}; copy that file too, or move the folder "
                             f"out of {root}")
    return sorted(kept.values(), key=run_order)


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for a single value)."""
    return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def recipe_stats(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per recipe (with its options, :func:`run_label`), over its seeds: the final val loss (mean,
    std) and the paired gap to dense (with the same precision): recipe - dense of the same seed for every seed both ran,
    then the gaps' mean and std (absolute, and relative to that seed's dense loss)."""
    by_recipe: dict[str, dict[int, float]] = {}
    baseline: dict[str, str] = {}
    for s in summaries:
        if s["final_val_loss"] is not None:
            by_recipe.setdefault(summary_label(s), {})[s["seed"]] = s["final_val_loss"]
            baseline[summary_label(s)] = _dense_label(s)
    stats = []
    for recipe, losses in by_recipe.items():
        dense = by_recipe.get(baseline[recipe], {})
        mean, std = _mean_std(list(losses.values()))
        paired = sorted(set(losses) & set(dense))
        gaps = [losses[k] - dense[k] for k in paired]
        rel = [(losses[k] - dense[k]) / dense[k] for k in paired]
        gap, gap_std = _mean_std(gaps) if gaps else (None, None)
        rel_gap, rel_std = _mean_std(rel) if rel else (None, None)
        stats.append({"recipe": recipe, "seeds": sorted(losses), "val_loss_mean": mean, "val_loss_std": std,
                      "pairs": len(paired), "gap_mean": gap, "gap_std": gap_std,
                      "rel_gap_mean": rel_gap, "rel_gap_std": rel_std})
    return stats


def _pm(mean: float | None, std: float | None, fmt: str) -> str:
    if mean is None:
        return "n/a"
    return format(mean, fmt) + (f" ± {std:{fmt.lstrip('+')}}" if std is not None else "")


def results_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: one row per run (final val loss, gap to the same seed's dense, flip rates,
    tokens/s, wall time), then one row per recipe: mean ± std over seeds and the paired gap."""
    dense = {(summary_label(s), s["seed"]): s["final_val_loss"] for s in summaries if s["recipe"] == "dense"}
    s0 = summaries[0]
    lines = [f"model `{s0['model']}`, regime `{s0.get('regime', 'ours')}`, {s0['steps']} steps, "
             f"{s0['tokens']:,} tokens per run", "",
             "| recipe | seed | final val loss | gap to dense (same seed) | mean flip rate | final flip rate "
             "| tokens/s | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        ref = dense.get((_dense_label(s), s["seed"]))
        gap = f"{s['final_val_loss'] - ref:+.4f}" if ref is not None and s["final_val_loss"] is not None else "n/a"
        val = f"{s['final_val_loss']:.4f}" if s["final_val_loss"] is not None else "n/a"
        lines.append(f"| {summary_label(s)} | {s['seed']} | {val} | {gap} | {s['mean_flip_rate']:.2e} "
                     f"| {s['final_flip_rate']:.2e} | {s['tokens_per_s']:,.0f} | {s['wall_s']:.0f} |")
    lines += ["", "Per recipe over seeds: mean ± sample standard deviation (n - 1). Paired gap: recipe - dense "
              "of the same seed, for each seed both ran, then mean ± std of those gaps; relative: the gaps "
              "over that seed's dense loss.", "",
              "| recipe | seeds | final val loss | paired gap to dense | relative gap |", "|---|---|---|---|---|"]
    for st in recipe_stats(summaries):
        rel = _pm(*(None if v is None else 100 * v for v in (st["rel_gap_mean"], st["rel_gap_std"])), "+.2f")
        seeds = ", ".join(map(str, st["seeds"]))
        lines.append(f"| {st['recipe']} | {seeds} | {_pm(st['val_loss_mean'], st['val_loss_std'], '.4f')} "
                     f"| {_pm(st['gap_mean'], st['gap_std'], '+.4f')} | {rel}{'' if rel == 'n/a' else ' %'} |")
    return "\n".join(lines) + "\n"


def _band(curves: list[list[tuple[int, float]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Steps every curve has, and the mean, min and max over the curves there."""
    common = sorted(set.intersection(*(set(st for st, _ in c) for c in curves)))
    if not common:
        return None
    vals = np.array([[dict(c)[st] for st in common] for c in curves])
    return np.array(common), vals.mean(0), vals.min(0), vals.max(0)


def plot_compare(root: Path, summaries: list[dict[str, Any]]) -> Path | None:
    """compare.png: per recipe, the mean over seeds of the validation loss, the (smoothed)
    train loss and the flip rate, with a band from the seeds' minimum to their maximum."""
    plt = pyplot()
    if plt is None:
        return None
    runs: dict[str, list[dict[str, list[tuple[int, float]]]]] = {}
    for s in summaries:
        m = read_metrics(s["out_dir"])
        steps, losses = zip(*m["train_loss"])
        k = max(1, len(losses) // 50)  # smooth the noisy per-step loss for the eye
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        m["train_smooth"] = list(zip(steps[k - 1:], smooth))
        runs.setdefault(summary_label(s), []).append(m)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = (("val_loss", "validation loss", "o-"), ("train_smooth", "train loss (smoothed)", "-"),
              ("flip_rate", "mask flip rate", "-"))
    for i, (recipe, ms) in enumerate(runs.items()):
        color = f"C{i % 10}"  # one color per recipe in every panel
        label = f"{recipe} ({len(ms)} seed{'s' if len(ms) > 1 else ''})"
        for ax, (key, _, style) in zip(axes, panels):
            band = _band([m[key] for m in ms]) if all(m[key] for m in ms) else None
            if band is None or (key == "flip_rate" and not (band[1] > 0).any()):
                continue
            steps, mean, lo, hi = band
            if key == "flip_rate":  # log scale: leave out the steps without flips
                keep = mean > 0
                steps, mean, lo, hi = steps[keep], mean[keep], np.maximum(lo[keep], mean[keep] * 1e-3), hi[keep]
            ax.plot(steps, mean, style, markersize=3, label=label, color=color)
            if len(ms) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
    for ax, (_, title, _) in zip(axes, panels):
        ax.set(xlabel="step", ylabel=title, title=title + " (mean over seeds, band: min to max)")
        if ax.has_data():
            ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    fig.tight_layout()
    path = root / "compare.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
