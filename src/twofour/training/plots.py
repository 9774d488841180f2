"""The curves of a comparison or a sweep, drawn: each recipe's validation loss, smoothed train loss
and flip rate over the steps, the mean over seeds with a band from their minimum to their maximum."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .runs import pyplot, read_metrics

__all__ = ["curve_panels", "save_figure"]


def _band(curves: list[list[tuple[int, float]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Steps every curve has, and the mean, min and max over the curves there."""
    common = sorted(set.intersection(*(set(st for st, _ in c) for c in curves)))
    if not common:
        return None
    vals = np.array([[dict(c)[st] for st in common] for c in curves])
    return np.array(common), vals.mean(0), vals.min(0), vals.max(0)


def curve_panels(axes, summaries: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> None:
    """The three panels of ``compare.png`` on ``axes``: the runs grouped by ``label``, one color each."""
    runs: dict[str, list[dict[str, list[tuple[int, float]]]]] = {}
    for s in summaries:
        m = read_metrics(s["out_dir"])
        steps, losses = zip(*m["train_loss"])
        k = max(1, len(losses) // 50)  # smooth the noisy per-step loss for the eye
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        m["train_smooth"] = list(zip(steps[k - 1:], smooth))
        runs.setdefault(label(s), []).append(m)
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


def save_figure(fig, path: Path) -> Path:
    """``fig`` laid out, written to ``path`` and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
