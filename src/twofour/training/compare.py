"""``twofour compare``: several recipes (and seeds) on the same data, options and token budget,
then one markdown table (every run, then each recipe's mean ± std over seeds and its gap to
dense paired by seed) and one plot (per recipe, the mean curve and the seeds' spread). With
``--lrs``, a learning-rate sweep of the same runs: :mod:`twofour.training.sweep`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import DivergedError, TrainError
from ..sparse.recipes import RECIPES, recipe_options
from .checkpoint import checkpoint_path
from .config import LAUNCH_OPTIONS, TrainConfig, check_seed
from .data import TokenData, load_data
from .lock import RunLock
from .loop import train
from .options import once
from .parallel import launched_main
from .plots import curve_panels, save_figure
from .runs import METRICS, metrics_file, pyplot, read_config, read_summary

log = logging.getLogger("twofour")

__all__ = ["compare", "results_table", "recipe_stats", "plot_compare", "run_label", "summary_label",
           "run_order", "parse_recipes", "parse_seeds", "train_runs", "finished_runs", "one_per_run", "run_folder",
           "dense_label", "SharedData", "locked", "mean_std", "paired_gaps",
           "plus_minus", "speed_cells", "same_run", "Diverged", "options_for"]


def parse_recipes(text: str) -> list[str]:
    """``--recipes``: comma-separated names of :data:`RECIPES`, each once; one-line error otherwise."""
    recipes = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        raise ValueError(f"unknown recipe {', '.join(bad) or '(none given)'}; valid recipes: {', '.join(RECIPES)}")
    once(recipes, "--recipes", "give each recipe once (--seeds trains each several times)")
    return recipes


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds``: comma-separated whole numbers, each once (None when not given)."""
    try:
        seeds = [int(s) for s in text.split(",")] if text else None
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated whole numbers (e.g. 1,2,3), got {text!r}") from None
    once(seeds or [], "--seeds", "give each seed once")
    for seed in seeds or []:
        check_seed(seed, "--seeds")
    return seeds


def run_label(recipe: str, options: dict[str, Any] | None = None, precision: str = "bf16") -> str:
    """How a run's recipe is named in tables, plots and folder names: the recipe, its precision
    unless ``bf16``, then the options it was given (``s-ste precision=fp8 mvue=false``), so
    variants of one recipe stay apart; a name as it is (``dx=pruned-t``)."""
    words = (f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted((options or {}).items()))
    return " ".join([recipe, *([f"precision={precision}"] if precision != "bf16" else []), *words])


def run_folder(recipe: str, options: dict[str, Any] | None, seed: int, precision: str = "bf16",
               lr: float | None = None) -> str:
    """The folder of a run under a comparison's root: its label's words joined by '-', then the
    peak learning rate a sweep gave it, then the seed (``s-ste-precision=fp8-mvue=false-s1``,
    ``s-ste-lr=0.002-s1``)."""
    rate = "" if lr is None else f"-lr={json.dumps(lr)}"
    return run_label(recipe, options, precision).replace(" ", "-") + rate + f"-s{seed}"


def summary_label(summary: dict[str, Any]) -> str:
    """:func:`run_label` of a finished run's summary (read by ``read_summary``: an older version's
    in this one's form)."""
    return run_label(summary["recipe"], summary.get("recipe_options"), summary.get("precision", "bf16"))


def run_order(summary: dict[str, Any]) -> tuple:
    """The order runs appear in tables: recipes as :data:`RECIPES` lists them, variants by label,
    then seeds."""
    order = {name: i for i, name in enumerate(RECIPES)}
    return order.get(summary["recipe"], len(order)), summary_label(summary), summary["seed"]


def dense_label(summary: dict[str, Any]) -> str:
    """The dense run a run is compared with: dense with this run's precision and the options dense
    takes (``bf16_finetune``) as this run's."""
    return run_label("dense", options_for("dense", summary.get("recipe_options") or {}),
                     summary.get("precision", "bf16"))


def options_for(recipe: str, options: dict[str, Any]) -> dict[str, Any]:
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
    TrainError if another comparison holds it. Under torchrun rank 0 reports; the other ranks
    return an empty list."""
    root = Path(base.out_dir)
    with locked(root):
        runs = [(recipe, None, seed) for recipe in recipes for seed in seeds or [base.seed]]
        summaries = train_runs(base, runs, SharedData(base))
        if not launched_main():  # a rank's summary holds no more than its tokens/s
            return []
        root.mkdir(parents=True, exist_ok=True)
        return _report(root, summaries[0])


def locked(root: Path) -> contextlib.AbstractContextManager:
    """A comparison folder's lock (:class:`RunLock`), held by rank 0 under torchrun."""
    return RunLock(root) if launched_main() else contextlib.nullcontext()


class SharedData:
    """A comparison's data, read when a run first needs it and then shared by every run."""

    def __init__(self, base: TrainConfig) -> None:
        self.base, self._data = base, None

    def __call__(self) -> TokenData:
        if self._data is None:
            self._data = load_data(self.base.data, self.base.vocab_size)
        return self._data


class Diverged(Protocol):
    """How a comparison keeps a run that diverged (a sweep's rate too high): ``read(cfg)`` gives the
    record of ``cfg``'s run left by an earlier call (None: none), ``record(cfg, error)`` writes and
    gives it; either stands for the run's summary."""

    def read(self, cfg: TrainConfig) -> dict[str, Any] | None: ...

    def record(self, cfg: TrainConfig, error: DivergedError) -> dict[str, Any]: ...


def train_runs(base: TrainConfig, runs: list[tuple[str, float | None, int]], data: SharedData,
               diverged: Diverged | None = None) -> list[dict[str, Any]]:
    """Each (recipe, peak lr, seed) of ``runs`` as ``base`` with them (lr None: ``base``'s), in
    its :func:`run_folder` under ``base.out_dir``: reused if finished there, resumed if
    interrupted, else trained; the summaries, in order. A sweep's run at the preset's rate is
    the one in the folder without a rate, when that one is finished. With ``diverged``, a run
    that diverges is recorded by it and not trained again (else its error ends the comparison)."""
    root, summaries = Path(base.out_dir), []
    for recipe, lr, seed in runs:
        options = options_for(recipe, base.recipe_options)
        cfg = dataclasses.replace(base, recipe=recipe, seed=seed, recipe_options=options,
                                  lr=base.lr if lr is None else lr,
                                  out_dir=str(root / run_folder(recipe, options, seed, base.precision, lr)))
        cfg.validate()
        plain = None if lr is None else dataclasses.replace(  # a sweep's run: the plain run at its rate counts
            cfg, lr=None, out_dir=str(root / run_folder(recipe, options, seed, base.precision)))
        if _finished(cfg, base.overwrite):
            summaries.append(read_summary(cfg.out_dir))
        elif plain is not None and plain.peak_lr == lr and _finished(plain, base.overwrite):
            summaries.append(read_summary(plain.out_dir))
        elif diverged is not None and not base.overwrite and (record := diverged.read(cfg)) is not None:
            summaries.append(record)
        else:
            try:
                summaries.append(train(_continue(cfg, base.overwrite), data()))
            except DivergedError as e:
                if diverged is None:
                    raise
                summaries.append(diverged.record(cfg, e))
    return summaries


def _report(root: Path, like: dict[str, Any]) -> list[dict[str, Any]]:
    """compare.md and compare.png of every finished run in ``root`` like ``like``; its runs."""
    summaries = one_per_run(finished_runs(root, like), _plain_key)
    (root / "compare.md").write_text(results_table(summaries))
    plot_compare(root, summaries)
    return summaries


def _finished(cfg: TrainConfig, overwrite: bool) -> bool:
    """Whether ``cfg``'s folder holds this very run, finished (all its steps, not stopped early)."""
    done = read_summary(cfg.out_dir)
    return (not overwrite and done is not None and done["steps"] == cfg.steps
            and same_run(read_config(cfg.out_dir), cfg))


def _continue(cfg: TrainConfig, overwrite: bool) -> TrainConfig:
    """How to train a run that isn't finished: resumed from its checkpoint if it was interrupted,
    started over if it died before its first checkpoint; a folder holding another run is
    refused unless ``overwrite``."""
    out = Path(cfg.out_dir)
    if overwrite or (checkpoint_path(out) is None and metrics_file(out) is None):
        return cfg
    if not same_run(read_config(out), cfg):
        raise TrainError(f"{out} holds a run with other settings; choose another --out, or --overwrite to "
                         "retrain every run of the comparison")
    if checkpoint_path(out) is not None:
        return dataclasses.replace(cfg, resume=True)
    return dataclasses.replace(cfg, overwrite=True)  # died before its first checkpoint: nothing to keep


def same_run(config: dict[str, Any] | None, cfg: TrainConfig) -> bool:
    """Whether a run's config (its config.json) is ``cfg``, up to how it was launched and how
    often it logs, evaluates and checkpoints (device, compile and FSDP count: they change speed).
    A setting the saved config lacks (saved before it existed) counts as its default."""
    if config is None:
        return False
    launch = LAUNCH_OPTIONS | {"log_interval", "eval_interval", "ckpt_interval", "skip_nonfinite"}

    def compared(c: TrainConfig) -> dict[str, Any]:  # as JSON holds them (tuples and lists alike)
        return {k: v for k, v in json.loads(json.dumps(c.to_dict())).items() if k not in launch}

    return compared(cfg) == compared(TrainConfig.from_dict(config))


def finished_runs(root: Path, like: dict[str, Any]) -> list[dict[str, Any]]:
    """The summaries of every finished run under ``root`` with the same model, regime and token
    budget as ``like`` (so a later call with more seeds extends the table)."""
    def key(r: dict[str, Any]) -> tuple:
        return r["model"], r.get("regime", "ours"), r["tokens"]

    runs = [read_summary(p.parent) for p in sorted(root.glob("*/summary.json"))]
    for r in runs:
        missing = [k for k in ("recipe", "model", "seed", "steps", "tokens", "final_val_loss") if k not in r]
        if missing:
            raise TrainError(f"{r['out_dir']}/summary.json is not a twofour run's summary (no {', '.join(missing)}); "
                             f"move that folder out of {root}")
    return [r for r in runs if key(r) == key(like)]


def _plain_key(r: dict[str, Any]) -> tuple[tuple, str]:
    """A run of ``compare`` without a sweep: its label and seed, and the folder those name."""
    return (summary_label(r), r["seed"]), run_folder(r["recipe"], r.get("recipe_options"), r["seed"],
                                                     r.get("precision", "bf16"))


def one_per_run(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], tuple[tuple, str]]) -> list[dict[str, Any]]:
    """``runs`` in recipe order then seed, one per run: ``key`` gives a run's identity (two runs
    with one are the same run) and the folder it belongs in. Of two runs with one identity (a
    folder named by an older label), the one in its own folder counts, and the other is named in a
    warning. TrainError for a run without its metrics, which the plot reads."""
    kept: dict[tuple, dict[str, Any]] = {}
    for r in sorted(runs, key=lambda r: Path(r["out_dir"]).name != key(r)[1]):  # the run in its own folder first
        same = kept.setdefault(key(r)[0], r)
        if same is not r:
            log.warning("twofour: %s repeats the run %s (seed %s) of %s; it is left out of the table", r["out_dir"],
                        summary_label(r), r["seed"], same["out_dir"])
    for r in kept.values():
        if metrics_file(r["out_dir"]) is None:
            raise TrainError(f"{r['out_dir']} holds a finished run without its {METRICS}: a run is reported from "
                             f"its summary.json, config.json and {METRICS}; copy that file too, or move the folder "
                             f"out of {Path(r['out_dir']).parent}")
    return sorted(kept.values(), key=run_order)


def mean_std(values: list[float]) -> tuple[float, float | None]:
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
            baseline[summary_label(s)] = dense_label(s)
    stats = []
    for recipe, losses in by_recipe.items():
        dense = by_recipe.get(baseline[recipe], {})
        mean, std = mean_std(list(losses.values()))
        gaps, rel = paired_gaps(losses, dense)
        gap, gap_std = mean_std(gaps) if gaps else (None, None)
        rel_gap, rel_std = mean_std(rel) if rel else (None, None)
        stats.append({"recipe": recipe, "seeds": sorted(losses), "val_loss_mean": mean, "val_loss_std": std,
                      "pairs": len(gaps), "gap_mean": gap, "gap_std": gap_std,
                      "rel_gap_mean": rel_gap, "rel_gap_std": rel_std})
    return stats


def paired_gaps(losses: dict[int, float], ref: dict[int, float]) -> tuple[list[float], list[float]]:
    """``losses`` minus ``ref`` (each ``{seed: loss}``) over the seeds both ran, in seed order:
    the absolute gaps and the gaps relative to ``ref``'s loss of that seed."""
    paired = sorted(set(losses) & set(ref))
    return [losses[k] - ref[k] for k in paired], [(losses[k] - ref[k]) / ref[k] for k in paired]


def plus_minus(mean: float | None, std: float | None, fmt: str) -> str:
    """``mean ± std`` in ``fmt`` (the std unsigned); the mean alone without a std; ``n/a`` without a mean."""
    if mean is None:
        return "n/a"
    return format(mean, fmt) + (f" ± {std:{fmt.lstrip('+')}}" if std is not None else "")


def speed_cells(runs: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str:
    """``| tokens/s | / dense |`` cells: the median over ``runs`` of each run's steady tokens/s, and
    its ratio to the median of ``ref`` (dense's runs; ``-`` without them)."""
    mine = [r["tokens_per_s"] for r in runs if r.get("tokens_per_s")]
    theirs = [r["tokens_per_s"] for r in ref if r.get("tokens_per_s")]
    if not mine:
        return "n/a | n/a"
    ratio = f"{np.median(mine) / np.median(theirs):.3f}x" if theirs else "-"
    return f"{np.median(mine):,.0f} | {ratio}"


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
        ref = dense.get((dense_label(s), s["seed"]))
        gap = f"{s['final_val_loss'] - ref:+.4f}" if ref is not None and s["final_val_loss"] is not None else "n/a"
        val = f"{s['final_val_loss']:.4f}" if s["final_val_loss"] is not None else "n/a"
        lines.append(f"| {summary_label(s)} | {s['seed']} | {val} | {gap} | {s['mean_flip_rate']:.2e} "
                     f"| {s['final_flip_rate']:.2e} | {s['tokens_per_s']:,.0f} | {s['wall_s']:.0f} |")
    lines += ["", "Per recipe over seeds: mean ± sample standard deviation (n - 1). Paired gap: recipe - dense "
              "of the same seed, for each seed both ran, then mean ± std of those gaps; relative: the gaps "
              "over that seed's dense loss. Speed: the median over seeds of each run's steady tokens/s, and its "
              "ratio to dense's (meaningful where each run had its device alone).", "",
              "| recipe | seeds | final val loss | paired gap to dense | relative gap | tokens/s | / dense |",
              "|---|---|---|---|---|---|---|"]
    for st in recipe_stats(summaries):
        rel = plus_minus(*(None if v is None else 100 * v for v in (st["rel_gap_mean"], st["rel_gap_std"])), "+.2f")
        seeds = ", ".join(map(str, st["seeds"]))
        runs = [s for s in summaries if summary_label(s) == st["recipe"]]
        ref = [s for s in summaries if runs and summary_label(s) == dense_label(runs[0])]
        lines.append(f"| {st['recipe']} | {seeds} | {plus_minus(st['val_loss_mean'], st['val_loss_std'], '.4f')} "
                     f"| {plus_minus(st['gap_mean'], st['gap_std'], '+.4f')} | {rel}{'' if rel == 'n/a' else ' %'} "
                     f"| {speed_cells(runs, ref)} |")
    return "\n".join(lines) + "\n"


def plot_compare(root: Path, summaries: list[dict[str, Any]]) -> Path | None:
    """compare.png: per recipe, the mean over seeds of the validation loss, the (smoothed)
    train loss and the flip rate, with a band from the seeds' minimum to their maximum."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    curve_panels(axes, summaries, summary_label)
    return save_figure(fig, root / "compare.png")
