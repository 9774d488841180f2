"""A run folder and what it holds: its checkpoint (:mod:`twofour.training.checkpoint`),
``metrics.csv`` (plus TensorBoard when it is installed), ``config.json``, ``summary.json`` and
``curves.png``; whether a run may start in it or go on from it.

Public: :func:`prepare_run_dir`, :func:`resume_from`, :func:`resume_config`, :func:`check_resumable`,
:class:`MetricsLog`, :func:`read_metrics`, :func:`read_config`, :func:`read_summary`, :func:`pyplot`,
:func:`plot_run`, :func:`write_summary`, :func:`source_digest`.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import dispatch
from ..errors import TrainError
from ..inference.format import MODEL_CONFIG, WEIGHTS
from .checkpoint import CKPT, FILE, SHARDED, check_intact, checkpoint_path, read_checkpoint, sharded_problem
from .config import TrainConfig, saved_options
from .lock import RunLock
from .resuming import first_difference, resumed_config

__all__ = ["METRICS", "metrics_file", "FIELDS", "WEIGHTS", "MODEL_CONFIG", "prepare_run_dir", "resume_from",
           "resume_config", "check_resumable", "MetricsLog", "read_metrics", "read_config", "read_summary", "pyplot",
           "plot_run", "write_summary", "source_digest"]

METRICS = "metrics.csv"
FIELDS = ["step", "tokens", "lr", "train_loss", "val_loss", "flip_rate", "tokens_per_s", "elapsed_s"]
#: What a run (and ``twofour export`` of it, in either weights format) leaves in its folder: a
#: folder holding any of them is refused without ``--overwrite``, which removes them (the
#: sharded checkpoint's folder ``ckpt/`` with all it holds).
_OUTPUTS = (CKPT, CKPT + ".tmp", SHARDED, METRICS, METRICS + ".gz", "curves.png", "summary.json", "config.json",
            WEIGHTS, str(Path(WEIGHTS).with_suffix(".pt")), MODEL_CONFIG)


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """``cfg.out_dir``, created and writable; refuses to touch an existing run unless
    ``cfg.resume`` (it needs its checkpoint) or ``cfg.overwrite`` (its outputs are removed), and
    refuses a folder holding files a run writes (a ``config.json`` of one's own, say) unless
    ``cfg.overwrite``. Call it holding the folder's :class:`~twofour.training.lock.RunLock`."""
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise TrainError(f"output folder {out} exists and is not a folder")
    present = [n for n in (*_OUTPUTS, "tb") if (out / n).exists()]
    if cfg.resume:
        if checkpoint_path(out) is None:
            raise TrainError(_no_checkpoint(out))
    elif {CKPT, SHARDED, METRICS, METRICS + ".gz"} & set(present) and not cfg.overwrite:
        if checkpoint_path(out) is not None:
            raise TrainError(f"{out} already holds a run; pass --resume to continue it, --overwrite to replace it, "
                             "or choose another --out")
        broken = sharded_problem(out)
        why = f"its checkpoint can't be read: {broken}" if broken else f"it wrote no checkpoint ({_NONE_WRITTEN})"
        raise TrainError(f"{out} already holds a run that --resume can't continue: {why}; pass --overwrite to start "
                         "it again, or choose another --out")
    elif present and not cfg.overwrite:
        raise TrainError(f"{out} holds {', '.join(present)}, which a run writes; pass --overwrite to replace "
                         "them, or choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TrainError(f"cannot write to output folder {out}: {e.strerror or e}") from None
    if cfg.overwrite and not cfg.resume:
        for name in _OUTPUTS:
            if (out / name).is_dir() and not (out / name).is_symlink():
                shutil.rmtree(out / name)
            else:
                (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "tb", ignore_errors=True)  # TensorBoard's event files
    return out


#: Why a run folder holding a run's outputs may hold no checkpoint.
_NONE_WRITTEN = "it stopped before its first, or ran with --ckpt-interval 0"


def _no_checkpoint(out: Path) -> str:
    """Why ``--resume`` finds no checkpoint in run folder ``out``, and what to do (one line): a
    live run holding the folder's lock is named first (it may not have written one yet)."""
    held = RunLock(out).holder()
    if held:
        return held
    broken = sharded_problem(out)
    if broken:
        return (f"--resume: no checkpoint to resume from in {out}: {broken}; --overwrite instead of --resume "
                "starts the run again")
    if any((out / name).exists() for name in _OUTPUTS):
        return (f"--resume: the run in {out} wrote no checkpoint ({_NONE_WRITTEN}), so there is nothing to resume; "
                "pass --overwrite instead of --resume to start it again, or choose another --out")
    return f"--resume: {out} holds no run to resume (no {CKPT} or {SHARDED}/); leave out --resume to start one there"


def resume_from(out: str | Path) -> dict[str, Any]:
    """The checkpoint ``--resume`` continues the run in ``out`` from (the dict of
    :func:`~twofour.training.checkpoint.read_checkpoint`); TrainError, one line saying why there is
    none or why it can't be read, and what to do."""
    out = Path(out)
    found = checkpoint_path(out)
    if found is None:
        raise TrainError(_no_checkpoint(out))
    again = "--overwrite instead of --resume starts the run again, or choose another --out"
    try:
        ckpt = read_checkpoint(found)
    except TrainError as e:
        raise TrainError(f"--resume: {e}; {again}") from None
    if "sharded" not in ckpt:  # before its settings are used (under torchrun each rank checks its share at load)
        check_intact(ckpt, again)
    return ckpt


def resume_config(out: str | Path, cfg: TrainConfig, given: set[str] | None = None) -> TrainConfig:
    """The settings ``--resume`` continues the run in ``out`` with: its checkpoint's, with ``cfg``'s
    where they may differ (:func:`~twofour.training.resuming.resumed_config`; ``given``: the fields set
    on the command line), checked against its step (:func:`check_resumable`); TrainError, one line,
    before anything runs."""
    ckpt = resume_from(out)
    cfg = resumed_config(ckpt["config"], cfg, given)
    check_resumable(ckpt, cfg, Path(out))
    return cfg


def check_resumable(ckpt: dict[str, Any], cfg: TrainConfig, out: Path) -> None:
    """Raise TrainError if the run in ``out``, at its checkpoint ``ckpt``, can't go on as ``cfg`` asks,
    or if the checkpoint is not this run's: its model, shapes, recipe, data or seed differ from
    what ``out``'s ``config.json`` says (a checkpoint copied in from another run)."""
    _check_belongs(ckpt, out)
    step = ckpt["step"]
    if cfg.stop_at is not None and step >= cfg.stop_at:
        raise TrainError(f"--stop-at {cfg.stop_at} is not after the checkpoint's step {step}")
    if step > cfg.steps or (step == cfg.steps and read_summary(out) is not None):
        if cfg.reschedule:
            raise TrainError(f"--steps {cfg.steps} --reschedule: the run in {out} has done {step} steps already; to "
                             f"train it further, give --steps larger than {step}")
        raise TrainError(f"the run in {out} has done {step} of {cfg.steps} steps; to train it further, "
                         f"resume with --steps larger than {step} and --reschedule")


def _check_belongs(ckpt: dict[str, Any], out: Path) -> None:
    """TrainError naming both values when ``ckpt`` trains another run than ``out/config.json``
    describes; nothing when the folder has no readable ``config.json`` (the checkpoint, checked
    whole, then holds the run's only settings, and the resume writes them back)."""
    try:
        written = read_config(out)
    except TrainError:
        return
    differs = first_difference(written, ckpt["config"]) if written is not None else None
    if differs:
        option, theirs, saved = differs
        where = ckpt.get("sharded") or ckpt.get(FILE)
        raise TrainError(f"--resume: the checkpoint {where} is not this run's: it trains {option} {saved}, "
                         f"{out / 'config.json'} says {theirs} (a checkpoint copied from another run?); put back "
                         "the run's own checkpoint, or start anew with --overwrite")


# --------------------------------------------------------------------------------------------
# metrics, summary, plots
# --------------------------------------------------------------------------------------------


class MetricsLog:
    """metrics.csv (appended across resumes) and TensorBoard when it is installed."""

    def __init__(self, out: Path, resume_step: int | None):
        self.path = out / METRICS
        rows = []
        if resume_step is not None and self.path.exists():  # drop rows logged after the checkpoint
            with self.path.open() as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) <= resume_step]
        with self.path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, FIELDS)
            w.writeheader()
            w.writerows(rows)
        self.tb = None
        with contextlib.suppress(Exception):
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

            self.tb = SummaryWriter(str(out / "tb"))

    def log(self, row: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as fh:
            csv.DictWriter(fh, FIELDS).writerow({k: ("" if row.get(k) is None else row[k]) for k in FIELDS})
        if self.tb is not None:
            for k in ("lr", "train_loss", "val_loss", "flip_rate", "tokens_per_s"):
                if row.get(k) is not None:
                    self.tb.add_scalar(k, row[k], row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def metrics_file(run: str | Path) -> Path | None:
    """A run folder's metrics: ``metrics.csv``, else the gzipped copy a results folder keeps
    (``metrics.csv.gz``, docs/results), else None."""
    for name in (METRICS, METRICS + ".gz"):
        if (Path(run) / name).is_file():
            return Path(run) / name
    return None


def read_metrics(run: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Columns of a run's metrics (the folder, or the file: metrics.csv or its .gz) as (step,
    value) lists, skipping blanks; TrainError naming the line of a row that isn't one."""
    path = Path(run)
    if path.is_dir():
        path = metrics_file(path) or path / METRICS
    cols: dict[str, list[tuple[int, float]]] = {k: [] for k in FIELDS[1:]}
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as fh:
        for line, r in enumerate(csv.DictReader(fh), 2):
            try:
                for k in cols:
                    if r.get(k):
                        cols[k].append((int(r["step"]), float(r[k])))
            except (KeyError, TypeError, ValueError) as e:
                raise TrainError(f"{path}, line {line}, is corrupt ({type(e).__name__}: {e})") from None
    return cols


def read_config(run: str | Path) -> dict[str, Any] | None:
    """A run folder's ``config.json`` as a dict (recipe options as :func:`saved_options` reads
    them), or None if it has none."""
    path = Path(run) / "config.json"
    return saved_options(_read_json(path)) if path.exists() else None


def _read_json(path: Path) -> dict[str, Any]:
    """A run's JSON file as a dict; TrainError naming the file when it is not JSON or not a dict."""
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise TrainError(f"{path} is corrupt (not JSON: {e}); restore it, or delete the run's folder") from None
    if not isinstance(d, dict):
        raise TrainError(f"{path} is not a twofour run's (it holds a {type(d).__name__}, not a dict)")
    return d


def read_summary(run: str | Path) -> dict[str, Any] | None:
    """A finished run's ``summary.json`` as a dict, or None if it hasn't finished. Its paths
    (``out_dir``, ``plot``) name where the folder is now: it may have been moved or copied.
    TrainError naming the file when it is corrupt or not a run's summary."""
    path = Path(run) / "summary.json"
    if not path.exists():
        return None
    summary = saved_options(_read_json(path))
    summary["out_dir"] = str(Path(run))
    if summary.get("plot"):
        summary["plot"] = str(Path(run) / Path(summary["plot"]).name)
    return summary


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt


def plot_run(out: Path, title: str) -> Path | None:
    """curves.png: train/val loss and flip rate against step (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    m = read_metrics(out)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        if m[key]:
            ax1.plot(*zip(*m[key]), style, label=key.replace("_", " "), markersize=3)
    ax1.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    ax1.legend()
    if m["flip_rate"]:
        ax2.plot(*zip(*m["flip_rate"]))
        if any(v > 0 for _, v in m["flip_rate"]):
            ax2.set_yscale("log")
    ax2.set(xlabel="step", ylabel="flip rate", title="mask flip rate per step")
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _steady_throughput(rows: list[tuple[int, float]]) -> float:
    """Median tokens/s over the logged windows after warm-up: the first window (compilation,
    allocator and autotuning warm-up) and any ending at one of the first 5 steps are left out,
    unless nothing else is left."""
    steady = [v for i, (step, v) in enumerate(rows) if i > 0 and step > 5]
    return float(np.median(steady or [v for _, v in rows]))


def _version() -> str:
    from ..version import __version__  # noqa: PLC0415

    return __version__


def source_digest(root: Path | None = None) -> str:
    """The first 16 hex digits of a SHA-256 over the ``.py`` files under ``root``, paths and
    contents in sorted order: which code a run ran, where no git checkout travels with it (compare
    with ``source_digest(Path("src/twofour"))`` in a checkout). Without ``root``: the whole twofour
    package as this process imported it (hashed at import, so that files edited during a long run
    do not change what its summary records)."""
    if root is None:
        return _IMPORTED_DIGEST
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


_IMPORTED_DIGEST = source_digest(Path(__file__).resolve().parents[1])


def write_summary(out: Path, cfg: TrainConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json (final losses, throughput, flip rates, the GEMM dispatch's choices in this
    process: which route each GEMM took, dW on MVUE's estimate or exact for one, and what each
    measured, and the code that ran: twofour's and torch's versions and :func:`source_digest`)
    and curves.png from the metrics; ``extra``: more entries (how the steps ran)."""
    m = read_metrics(out)
    flips = [v for _, v in m["flip_rate"]]
    summary = {
        "recipe": cfg.recipe, "recipe_options": cfg.recipe_options, "precision": cfg.precision, "model": cfg.model,
        "regime": cfg.regime, "seed": cfg.seed, "steps": m["tokens"][-1][0],
        "tokens": int(m["tokens"][-1][1]),
        "final_train_loss": m["train_loss"][-1][1] if m["train_loss"] else None,  # None: every step skipped
        "final_val_loss": m["val_loss"][-1][1] if m["val_loss"] else None,
        "tokens_per_s": _steady_throughput(m["tokens_per_s"]),
        "mean_flip_rate": float(np.mean(flips)),
        "final_flip_rate": flips[-1],
        "wall_s": m["elapsed_s"][-1][1],
        "gemm_choices": dispatch.choices(),
        "code": {"twofour": _version(), "torch": torch.__version__, "source": source_digest()},
        "out_dir": str(out),
        **(extra or {}),
    }
    plot = plot_run(out, f"{cfg.model}, {cfg.recipe}")
    summary["plot"] = str(plot) if plot else None
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
