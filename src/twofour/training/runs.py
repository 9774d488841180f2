"""A run folder and what it holds: ``ckpt.pt`` (written atomically, read safely) or, for FSDP2
runs, the sharded ``ckpt/`` (:mod:`twofour.training.sharded`), ``metrics.csv``
(plus TensorBoard when it is installed), ``config.json``, ``summary.json`` and ``curves.png``.

Public: :func:`prepare_run_dir`, :func:`save_checkpoint`, :func:`read_checkpoint`,
:func:`load_checkpoint`, :func:`checkpoint_path`, :func:`rng_state`, :func:`set_rng_state`,
:func:`load_state_dicts`, :class:`MetricsLog`, :func:`read_metrics`, :func:`read_config`,
:func:`read_summary`, :func:`pyplot`, :func:`plot_run`, :func:`write_summary`,
:func:`source_digest`.

Checkpoints hold only tensors and plain Python data (RNG states included), so they load with
``torch.load(..., weights_only=True)``: a file that smuggles in any other object is refused.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import dispatch
from ..errors import TrainError
from ..inference.format import MODEL_CONFIG, WEIGHTS
from .config import TrainConfig, resumed_config, saved_options
from .sharded import META, SHARDED, load_plain, read_meta, sharded_folder

__all__ = ["CKPT", "METRICS", "FIELDS", "WEIGHTS", "MODEL_CONFIG", "prepare_run_dir", "save_checkpoint",
           "read_checkpoint", "load_checkpoint", "checkpoint_path", "rng_state", "set_rng_state",
           "load_state_dicts",
           "MetricsLog", "read_metrics", "read_config", "read_summary", "pyplot", "plot_run", "write_summary",
           "source_digest"]

CKPT = "ckpt.pt"
METRICS = "metrics.csv"
FIELDS = ["step", "tokens", "lr", "train_loss", "val_loss", "flip_rate", "tokens_per_s", "elapsed_s"]
#: What a run (and ``twofour export`` of it, in either weights format) leaves in its folder: a
#: folder holding any of them is refused without ``--overwrite``, which removes them (the
#: sharded checkpoint's folder ``ckpt/`` with all it holds).
_OUTPUTS = (CKPT, CKPT + ".tmp", SHARDED, METRICS, "curves.png", "summary.json", "config.json", WEIGHTS,
            str(Path(WEIGHTS).with_suffix(".pt")), MODEL_CONFIG)


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
            raise TrainError(f"--resume: no checkpoint {out / CKPT} (or sharded {out / SHARDED}) to resume from")
    elif {CKPT, SHARDED, METRICS} & set(present) and not cfg.overwrite:
        raise TrainError(f"{out} already holds a run; pass --resume to continue it, --overwrite to replace it, "
                         "or choose another --out")
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


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------


def rng_state(data_gen: torch.Generator) -> dict[str, Any]:
    """Every RNG a resumed run needs, as tensors and plain Python values (no numpy objects)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
             "data": data_gen.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], data_gen: torch.Generator) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    data_gen.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_state_dicts(model: torch.nn.Module, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict,
                     fsdp: bool) -> None:
    """Load whole model and optimizer state dicts (a ``ckpt.pt``'s), sharding them under FSDP2."""
    if not fsdp:
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # noqa: PLC0415

    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd,
                   options=StateDictOptions(full_state_dict=True))


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: a kill at any moment leaves the previous checkpoint intact.
    TrainError, saying so, when the file can't be written (a full disk, a read-only folder)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).splitlines() or [""])[0][:200]
        kept = f"; the previous checkpoint {path} is intact" if path.exists() else ""
        raise TrainError(f"cannot write the checkpoint {tmp}: {why}{kept}") from None


def checkpoint_path(out: str | Path) -> Path | None:
    """The newest checkpoint in run folder ``out``: ``ckpt.pt``, or the sharded checkpoint's step
    folder; None when it holds neither. Both are there only when a run was killed just after
    writing one form and before removing the other: the later step wins (``ckpt.pt`` on a tie)."""
    out = Path(out)
    single = out / CKPT if (out / CKPT).is_file() else None
    sharded = sharded_folder(out)
    if single is None or sharded is None:
        return single or sharded
    with contextlib.suppress(TrainError):
        if read_meta(sharded)["step"] > read_checkpoint(single)["step"]:
            return sharded
    return single


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A twofour checkpoint (a run folder, ``ckpt.pt`` or a sharded checkpoint's step folder),
    loaded with ``weights_only=True``: tensors and plain data only, so a crafted file can't run
    code. A sharded checkpoint's dict holds its ``meta.pt`` and, under ``"sharded"``, the step
    folder whose model and optimizer :mod:`twofour.training.sharded` loads. Raises TrainError."""
    path = Path(path)
    if path.is_dir():
        if (path / META).is_file():
            return {**read_meta(path), "sharded": str(path)}
        path = checkpoint_path(path) or path / CKPT
        if path.is_dir():
            return {**read_meta(path), "sharded": str(path)}
    if not path.exists():
        raise TrainError(f"no checkpoint at {path}")
    return load_plain(path, {"config", "model", "step"}, "training checkpoint")


def load_checkpoint(path: str | Path, cfg: TrainConfig) -> dict[str, Any]:
    """:func:`read_checkpoint`, checking that ``cfg`` trains what the checkpoint's run trained
    (:func:`twofour.training.config.resumed_config`; TrainError names the first option that differs)."""
    ckpt = read_checkpoint(path)
    resumed_config(ckpt["config"], cfg)
    return ckpt


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


def read_metrics(run: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Columns of a run's metrics.csv (the folder or the file) as (step, value) lists, skipping
    blanks; TrainError naming the line of a row that isn't one."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS
    cols: dict[str, list[tuple[int, float]]] = {k: [] for k in FIELDS[1:]}
    with path.open() as fh:
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
    """The first 16 hex digits of a SHA-256 over the ``.py`` files under ``root`` (default: this
    package), paths and contents in sorted order: which code a run ran, where no git checkout
    travels with it (compare with ``source_digest(Path("src/twofour"))`` in a checkout)."""
    root = Path(__file__).parent if root is None else Path(root)
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


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
