"""``twofour compare --lrs``: a learning-rate sweep. Every recipe at every peak learning rate and
seed, then each recipe at its best rate against dense at dense's best, paired by seed.

The rate is chosen on one half of the validation split and reported on the other, so that the
choice does not flatter the numbers reported: each finished run's final model (read from its
checkpoint) is scored on both halves (:func:`halves`; on each, the windows an evaluation during
training takes, :func:`twofour.training.loop.val_windows`), and the scores stay in the run's
folder (:data:`SCORES`), so a run copied in without its checkpoint is reported from its files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DivergedError, TrainError
from .checkpoint import checkpoint_path
from .compare import (
    SharedData,
    dense_label,
    finished_runs,
    locked,
    mean_std,
    one_per_run,
    options_for,
    paired_gaps,
    plus_minus,
    run_folder,
    run_order,
    same_run,
    speed_cells,
    summary_label,
    train_runs,
)
from .config import TrainConfig, resolve_device
from .data import TokenData
from .export import run_model
from .loop import evaluate
from .options import once
from .parallel import launched_main
from .plan import autocast_for
from .plots import curve_panels, save_figure
from .runs import pyplot, read_config

__all__ = ["SCORES", "DIVERGED", "DivergedRuns", "parse_rates", "sweep", "sweep_runs", "halves", "scores",
           "best_rates", "sweep_table", "plot_sweep"]

#: A sweep run's final val loss on each half of the validation split, in its folder.
SCORES = "val_halves.json"
#: A sweep run that diverged: at which step, and the error's line, in its folder.
DIVERGED = "diverged.json"


class DivergedRuns:
    """A sweep's runs that diverged (:class:`~twofour.training.compare.Diverged`): each a
    :data:`DIVERGED` file in its folder, read back as a summary whose scores are infinite, so that
    its rate is never chosen and the run is not trained again (``--overwrite`` trains it again)."""

    def read(self, cfg: TrainConfig) -> dict[str, Any] | None:
        out = Path(cfg.out_dir)
        with contextlib.suppress(OSError, ValueError):
            record = json.loads((out / DIVERGED).read_text())
            if record.get("steps") == cfg.steps and same_run(read_config(out), cfg):
                return _diverged_summary(record, out)
        return None

    def record(self, cfg: TrainConfig, error: DivergedError) -> dict[str, Any]:
        record = {"recipe": cfg.recipe, "recipe_options": cfg.recipe_options, "precision": cfg.precision,
                  "model": cfg.model, "regime": cfg.regime, "seed": cfg.seed, "steps": cfg.steps,
                  "lr": cfg.peak_lr, "diverged_at": error.step, "error": str(error)}
        if launched_main():
            (Path(cfg.out_dir) / DIVERGED).write_text(json.dumps(record, indent=2))
        return _diverged_summary(record, Path(cfg.out_dir))


def _diverged_summary(record: dict[str, Any], out: Path) -> dict[str, Any]:
    """A diverged run as the tables read a run: no losses, infinite scores."""
    return {**record, "out_dir": str(out), "final_val_loss": None, "selection": math.inf, "report": math.inf}


def _diverged_runs(root: Path, like: dict[str, Any]) -> list[dict[str, Any]]:
    """The diverged runs under ``root`` with ``like``'s model, regime and steps (a folder whose run
    has since finished, with ``--overwrite``, counts as that run)."""
    found = []
    for path in sorted(root.glob(f"*/{DIVERGED}")):
        if (path.parent / "summary.json").exists():
            continue
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if (record.get("model"), record.get("regime", "ours"), record.get("steps")) == (
                    like["model"], like.get("regime", "ours"), like["steps"]):
                found.append(_diverged_summary(record, path.parent))
    return found


def parse_rates(text: str, base: TrainConfig) -> list[float]:
    """``--lrs``: comma-separated peak learning rates, each a number (``2e-3``) or a multiple of
    the preset's (``2x``: twice the rate ``base`` trains at without ``--lr``), in increasing
    order. One-line error for a malformed, out-of-range or repeated rate, and with ``--lr``."""
    if base.lr is not None:
        raise ValueError("--lr and --lrs contradict each other: --lrs gives every peak learning rate of the sweep "
                         "(the preset's as 1x)")
    # the preset's rate needs a known model and regime (the options as the first recipe takes them:
    # dense runs without the sparse recipes' options)
    dataclasses.replace(base, recipe_options=options_for(base.recipe, base.recipe_options)).validate()
    rates: list[float] = []
    for item in (t.strip() for t in text.split(",")):
        multiple = item.lower().endswith("x")
        try:
            rate = float(item[:-1]) * base.peak_lr if multiple else float(item)
        except ValueError:
            got = repr(item) if item else "an empty one"
            raise ValueError(f"--lrs takes comma-separated learning rates (e.g. 5e-4,1e-3,2e-3) or multiples of the "
                             f"preset's (e.g. 0.5x,1x,2x), got {got} in {text!r}") from None
        if multiple:  # 3x of 1e-3 is 0.003, not 0.0030000000000000005, in the folder's name too
            rate = float(f"{rate:.6g}")
        if not (math.isfinite(rate) and 0 < rate <= 1):
            raise ValueError(f"--lrs: a peak learning rate is > 0 and at most 1, got {item}")
        rates.append(rate)
    once(rates, "--lrs", "give each rate once")
    return sorted(rates)


def sweep(recipes: list[str], base: TrainConfig, seeds: list[int] | None, lrs: list[float]) -> list[dict[str, Any]]:
    """Train ``base`` once per (recipe, rate of ``lrs``, seed) under ``base.out_dir``, in folders
    RECIPE-lr=LR-sSEED, finished runs reused and interrupted ones resumed as by
    :func:`~twofour.training.compare.compare` (a finished run at the preset's rate in RECIPE-sSEED
    counts too); score each (:func:`scores`); write compare.md (:func:`sweep_table`) and
    compare.png (:func:`plot_sweep`) over every finished run in the folder with the same model,
    regime and tokens; return those runs (:func:`sweep_runs`). TrainError, before any training,
    with ``ckpt_interval`` 0: nothing to score from."""
    if base.ckpt_interval == 0:
        raise TrainError("--lrs scores each run's final checkpoint on the two halves of the validation split, and "
                         "--ckpt-interval 0 writes none: leave --ckpt-interval out, or set it above 0")
    root = Path(base.out_dir)
    with locked(root):
        data = SharedData(base)
        done = train_runs(base, [(r, lr, s) for r in recipes for lr in lrs for s in seeds or [base.seed]], data,
                          DivergedRuns())
        if not launched_main():  # under torchrun rank 0 scores and reports
            return []
        root.mkdir(parents=True, exist_ok=True)
        summaries = sweep_runs(root, next((d for d in done if "diverged_at" not in d), done[0]), data)
        (root / "compare.md").write_text(sweep_table(summaries))
        plot_sweep(root, summaries)
        return summaries


def sweep_runs(root: Path, like: dict[str, Any], data: SharedData | None = None) -> list[dict[str, Any]]:
    """Every finished run under ``root`` with the model, regime and tokens of ``like``, one per
    (label, peak lr, seed), each summary with ``lr`` (from its ``config.json``) and its
    ``selection`` and ``report`` scores (:func:`scores`; without ``data``, only those saved), and
    every run that diverged (:class:`DivergedRuns`), in recipe order, then rate, then seed."""
    diverged = _diverged_runs(root, like)
    runs = finished_runs(root, like) if "diverged_at" not in like else []
    for r in runs:
        config = read_config(r["out_dir"])
        if config is None:
            raise TrainError(f"{r['out_dir']} holds a finished run without its config.json, which gives its learning "
                             f"rate; copy that file too, or move the folder out of {root}")
        r["lr"] = TrainConfig.from_dict(config).peak_lr
    kept = one_per_run(runs, lambda r: ((summary_label(r), r["lr"], r["seed"]), run_folder(
        r["recipe"], r.get("recipe_options"), r["seed"], r.get("precision", "bf16"), r["lr"])))
    for r in kept:
        r.update(scores(r, data))
    return sorted(kept + diverged, key=lambda r: (*run_order(r)[:2], r["lr"], r["seed"]))


def halves(data: TokenData) -> tuple[TokenData, TokenData]:
    """``data`` with its validation split cut at the middle: the first half picks a sweep's
    rates, the second reports them; no token is in both."""
    mid = len(data.val) // 2
    return (dataclasses.replace(data, val=data.val[:mid], name=f"{data.name} (validation, first half)"),
            dataclasses.replace(data, val=data.val[mid:], name=f"{data.name} (validation, second half)"))


def scores(run: dict[str, Any], data: SharedData | None) -> dict[str, float]:
    """The mean val loss of ``run``'s final model on each half of the validation split
    (:func:`halves`): ``selection`` on the first, ``report`` on the second. Read from the run's
    :data:`SCORES` when written for this very run (its steps and final val loss), else computed
    from its checkpoint on ``data`` (on ``data``'s device) and written there."""
    out = Path(run["out_dir"])
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none, or not this run's: scored again
        saved = json.loads((out / SCORES).read_text())
        if saved["steps"] == run["steps"] and saved["final_val_loss"] == run["final_val_loss"]:
            return {"selection": float(saved["selection"]), "report": float(saved["report"])}
    if data is None or checkpoint_path(out) is None:
        raise TrainError(f"{out} holds a finished run without its {SCORES} (its scores on the halves of the "
                         f"validation split){'' if data is None else ' nor a checkpoint to score it from'}; copy "
                         f"that file too, or move the folder out of {out.parent}")
    model, cfg, ckpt = run_model(out)
    if ckpt["step"] != run["steps"]:
        raise TrainError(f"{out}: its checkpoint is of step {ckpt['step']}, not the run's last ({run['steps']}), so "
                         f"its final model can't be scored; move the folder out of {out.parent}")
    device = resolve_device(data.base.device)
    cfg = dataclasses.replace(cfg, compile=False, compile_mode="default")  # scored eagerly
    autocast = autocast_for(cfg, device)
    model.to(device)
    got = {}
    for name, half in zip(("selection", "report"), halves(data())):
        half.check(cfg.seq_len)
        got[name] = evaluate(model, half, cfg, device, autocast)
    (out / SCORES).write_text(json.dumps({**got, "steps": run["steps"], "final_val_loss": run["final_val_loss"]},
                                         indent=2))
    return got


def _by_rate(summaries: list[dict[str, Any]]) -> dict[str, dict[float, dict[int, dict[str, Any]]]]:
    """The runs by label, then rate (increasing), then seed."""
    out: dict[str, dict[float, dict[int, dict[str, Any]]]] = {}
    for s in sorted(summaries, key=lambda s: s["lr"]):
        out.setdefault(summary_label(s), {}).setdefault(s["lr"], {})[s["seed"]] = s
    return {label: out[label] for label in dict.fromkeys(summary_label(s) for s in summaries)}


def best_rates(summaries: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each label's best rate: the lowest mean ``selection`` score over seeds, among the rates run
    with the most seeds (means over other seeds would not compare); None where none is finite."""
    best: dict[str, float | None] = {}
    for label, rates in _by_rate(summaries).items():
        most = max(len(runs) for runs in rates.values())
        means = {lr: float(np.mean([r["selection"] for r in runs.values()])) for lr, runs in rates.items()
                 if len(runs) == most}
        finite = {lr: m for lr, m in means.items() if math.isfinite(m)}
        best[label] = min(finite, key=finite.get) if finite else None
    return best


def _gap(runs: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]]) -> str:
    """``| paired gap | relative gap |`` cells: report scores of ``runs`` minus ``ref``'s of the same
    seed, mean ± std over the seeds both ran; relative to ``ref``'s loss, in %."""
    gaps, rel = paired_gaps({k: r["report"] for k, r in runs.items()}, {k: r["report"] for k, r in ref.items()})
    if not gaps:
        return "n/a | n/a"
    if not all(map(math.isfinite, gaps)):
        return "n/a (diverged) | n/a"
    return f"{plus_minus(*mean_std(gaps), '+.4f')} | {plus_minus(*mean_std([100 * r for r in rel]), '+.2f')} %"


def _scores(runs: dict[int, dict[str, Any]], key: str) -> str:
    bad = [seed for seed, r in runs.items() if not math.isfinite(r[key])]
    if bad:
        return f"diverged (seed {', '.join(map(str, bad))})"
    return plus_minus(*mean_std([r[key] for r in runs.values()]), ".4f")


NOTE = ("Every run's final model is scored on the two halves of the validation split (cut at its middle; on "
        "each, as many evenly spaced windows as an evaluation during training takes): the first half picks each "
        "recipe's learning rate (the lowest mean over seeds, among its rates run with the most seeds), the second "
        "gives every loss and gap below, so that the choice does not flatter them. Mean ± sample standard deviation "
        "(n - 1) over seeds; a gap is the recipe's loss - dense's (with the same precision) of the same seed, then "
        "mean ± std over the seeds both ran; relative: over that seed's dense loss. Speed: the median over seeds of "
        "each run's steady tokens/s, and its ratio to dense's at dense's best rate (meaningful where each run had "
        "its device alone).")


def sweep_table(summaries: list[dict[str, Any]]) -> str:
    """Markdown: each recipe at its best rate with its gap to dense at dense's best rate, paired
    by seed; then every recipe at every rate (gap to dense at the same rate); then every run."""
    if not summaries:
        return ""
    rates, best = _by_rate(summaries), best_rates(summaries)
    s0 = next((s for s in summaries if "tokens" in s), summaries[0])  # a diverged run's record has no tokens
    dense_of = {summary_label(s): dense_label(s) for s in summaries}
    tried = ", ".join(f"{lr:g}" for lr in sorted({s["lr"] for s in summaries}))
    tokens = f"{s0['tokens']:,} tokens per run" if "tokens" in s0 else "every run diverged"
    lines = [f"model `{s0['model']}`, regime `{s0.get('regime', 'ours')}`, {s0['steps']} steps, "
             f"{tokens}; peak learning rates {tried}", "", NOTE, "",
             "Each recipe at its best learning rate, against dense at dense's best:", "",
             "| recipe | best lr | seeds | val loss (report half) | dense's best lr | paired gap to dense "
             "| relative gap | tokens/s | / dense |", "|---|---|---|---|---|---|---|---|---|"]
    for label, by_lr in rates.items():
        lr, ref_lr = best[label], best.get(dense_of[label])
        if lr is None:
            lines.append(f"| {label} | none (no finite loss) | | | | | | | |")
            continue
        ref = rates[dense_of[label]][ref_lr] if ref_lr is not None else {}
        edge = (" (lowest tried)" if lr == min(by_lr) else " (highest tried)" if lr == max(by_lr) else "") \
            if len(by_lr) > 1 else ""
        lines.append(f"| {label} | {lr:g}{edge} | {', '.join(map(str, by_lr[lr]))} | {_scores(by_lr[lr], 'report')} "
                     f"| {'not run' if ref_lr is None else format(ref_lr, 'g')} | {_gap(by_lr[lr], ref)} "
                     f"| {speed_cells(list(by_lr[lr].values()), list(ref.values()))} |")
    lines += ["", "Every recipe at every learning rate:", "",
              "| recipe | lr | seeds | val loss (selection half) | val loss (report half) | paired gap to dense at "
              "this lr | relative gap |", "|---|---|---|---|---|---|---|"]
    for label, by_lr in rates.items():
        for lr, runs in by_lr.items():
            ref = rates.get(dense_of[label], {}).get(lr, {})
            lines.append(f"| {label} | {lr:g}{' (best)' if lr == best[label] else ''} | "
                         f"{', '.join(map(str, runs))} | {_scores(runs, 'selection')} | {_scores(runs, 'report')} "
                         f"| {_gap(runs, ref)} |")
    lines += ["", "Every run (the final val loss as logged, over the whole validation split):", "",
              "| recipe | lr | seed | final val loss | selection half | report half | mean flip rate | final flip rate "
              "| tokens/s | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if "diverged_at" in s:
            lines.append(f"| {summary_label(s)} | {s['lr']:g} | {s['seed']} | diverged at step {s['diverged_at']} "
                         "| | | | | | |")
            continue
        val = "n/a" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"
        lines.append(f"| {summary_label(s)} | {s['lr']:g} | {s['seed']} | {val} | {s['selection']:.4f} "
                     f"| {s['report']:.4f} | {s['mean_flip_rate']:.2e} | {s['final_flip_rate']:.2e} "
                     f"| {s['tokens_per_s']:,.0f} | {s['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot_sweep(root: Path, summaries: list[dict[str, Any]]) -> Path | None:
    """compare.png of a sweep: compare's three panels for each recipe at its best rate and, with
    more than one rate, the final val loss on the report half against the peak learning rate (log
    scale; mean over seeds, band from their minimum to their maximum; a star at the chosen rate;
    a rate where a seed diverged left out)."""
    plt = pyplot()
    if plt is None or not summaries:
        return None
    best = best_rates(summaries)
    many = len({s["lr"] for s in summaries}) > 1
    fig, axes = plt.subplots(1, 4 if many else 3, figsize=(21 if many else 16, 4.5))
    curve_panels(axes[:3], [s for s in summaries if s["lr"] == best[summary_label(s)]],
                 lambda s: f"{summary_label(s)} lr={s['lr']:g}")
    if many:  # the same colors as the curves: the labels with a best rate, in order
        ax = axes[3]
        for i, (label, by_lr) in enumerate((k, v) for k, v in _by_rate(summaries).items() if best[k] is not None):
            x = [lr for lr, runs in by_lr.items() if all(math.isfinite(r["report"]) for r in runs.values())]
            losses = [[r["report"] for r in by_lr[lr].values()] for lr in x]
            mean = [float(np.mean(v)) for v in losses]
            ax.plot(x, mean, "o-", markersize=3, color=f"C{i % 10}", label=label)
            ax.fill_between(x, [min(v) for v in losses], [max(v) for v in losses], color=f"C{i % 10}", alpha=0.2,
                            linewidth=0)
            ax.plot([best[label]], [mean[x.index(best[label])]], "*", markersize=12, color=f"C{i % 10}")
        ax.set_xscale("log")
        ax.set(xlabel="peak learning rate (star: the one chosen on the selection half)",
               ylabel="final val loss (report half)", title="final val loss against the peak lr")
        ax.legend(fontsize=7)
    return save_figure(fig, root / "compare.png")
