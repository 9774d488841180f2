"""S-STE against STE, one difference from the paper at a time: every variant of :data:`VARIANTS`
for 3 seeds on gpt-10m, about one epoch of a held-out corpus, gaps paired by seed.

    PYTHONPATH=src python scripts/s_ste_ablation.py RUNS [--workers 3] [--deadline 470]
    PYTHONPATH=src python scripts/s_ste_ablation.py /tmp/abl --model tiny --steps 6 --batch-size 2 \\
        --seq-len 64 --corpus-bytes 3e5 --device cpu --workers 2          # the CPU check

Builds the corpus first if missing (``scripts/make_corpus.py`` on this machine's Python sources,
``--corpus-bytes`` of them: split by file, so no validation text is seen in training), then
trains the runs ``--workers`` processes at a time on the one device, each process loading the
data once and training its share one run after another (in the order of the variants, seed by
seed, so a cut-short call leaves every variant's first seeds). Runs finished in RUNS are reused;
no run starts after ``--deadline`` seconds if the last one took longer than what is left.
Checkpoints are deleted as each run ends. Then prints the tables (also RUNS/ablation.md) and, with
``$OUT`` set, writes them and RUNS's run files (config.json, metrics.csv, summary.json) to
``$OUT/ablation.md`` and ``$OUT/ablation.tar.gz`` (copy the folder to docs/results/s-ste-ablation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from results_tables import ABLATION, _folder_tables, digest, load_runs

from twofour.training.config import LAUNCH_OPTIONS, TrainConfig
from twofour.training.runs import read_config, read_summary

HERE = Path(__file__).resolve().parent
#: What each run folder keeps (checkpoints and plots are not kept).
KEPT = ("config.json", "metrics.csv", "summary.json")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One run setting: a recipe with its options, and the training settings it changes
    (``lr_scale`` times the preset's peak learning rate, ``weight_decay``)."""

    recipe: str
    options: tuple[tuple[str, object], ...] = ()
    lr_scale: float = 1.0
    weight_decay: float | None = None


#: Baselines first, then one row of docs/RESULTS.md's list of differences each (in that order).
VARIANTS = (
    Variant("dense"), Variant("ste"), Variant("s-ste"),
    Variant("s-ste", (("mvue", False),)),                      # exact dW, as STE has
    Variant("s-ste", (("beta_interval", "tenth"),)),           # beta refitted 10 times a run
    Variant("ste", weight_decay=0.0), Variant("s-ste", weight_decay=0.0),
    Variant("ste", lr_scale=2.0), Variant("s-ste", lr_scale=2.0),
)


def configs(args: argparse.Namespace) -> list[TrainConfig]:
    """Every run's config, seed by seed and in :data:`VARIANTS`' order within a seed."""
    base = TrainConfig(model=args.model, data=str(args.corpus), steps=args.steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, eval_interval=max(1, args.steps // args.evals), eval_iters=args.eval_iters,
                       ckpt_interval=args.steps, log_interval=max(1, min(10, args.steps // 10)), device=args.device,
                       progress=False, overwrite=True)
    out = []
    for seed in args.seeds:
        for v in VARIANTS:
            opts = {k: (max(1, args.steps // 10) if val == "tenth" else val) for k, val in v.options}
            name = "-".join([v.recipe, *(f"{k}={json.dumps(val)}" for k, val in opts.items())])
            cfg = dataclasses.replace(base, recipe=v.recipe, recipe_options=opts, seed=seed)
            if v.lr_scale != 1.0:
                cfg = dataclasses.replace(cfg, lr=cfg.peak_lr * v.lr_scale)
                name += f"-lr={cfg.lr:g}"
            if v.weight_decay is not None:
                cfg = dataclasses.replace(cfg, weight_decay=v.weight_decay)
                name += f"-weight_decay={v.weight_decay:g}"
            out.append(dataclasses.replace(cfg, out_dir=str(Path(args.runs) / f"{name}-s{seed}")))
    return out


def _what(cfg: TrainConfig) -> dict:
    """What a run trains, as its config.json holds it (how it was launched left out)."""
    return {k: v for k, v in json.loads(json.dumps(cfg.to_dict())).items() if k not in LAUNCH_OPTIONS}


def finished(cfg: TrainConfig) -> bool:
    """Whether ``cfg``'s folder holds this run, finished."""
    done, saved = read_summary(cfg.out_dir), read_config(cfg.out_dir)
    return (done is not None and saved is not None and done["steps"] == cfg.steps
            and _what(TrainConfig.from_dict(saved)) == _what(cfg))


def _tidy(run: Path) -> None:
    """Leave only :data:`KEPT` in a run folder (its checkpoint alone is ~100 MB at gpt-10m)."""
    for f in run.iterdir():
        if f.name not in KEPT and f.is_file():
            f.unlink()


def worker(args: argparse.Namespace) -> None:
    """Train this worker's share of the unfinished runs, one after another, the data loaded once."""
    from twofour.training.data import load_data  # noqa: PLC0415
    from twofour.training.loop import train  # noqa: PLC0415

    todo = [c for c in configs(args) if not finished(c)][args.worker::args.workers]
    data, last, failed = None, 0.0, 0
    for cfg in todo:
        left = args.deadline_at - time.time()
        if left < last:
            print(f"worker {args.worker}: {left:.0f} s left, the last run took {last:.0f} s: stopping", flush=True)
            return
        data = data if data is not None else load_data(cfg.data, None)
        t = time.time()
        try:
            s = train(cfg, data)
        except Exception as e:  # one failed run must not stop the others: reported, exit status 1
            failed += 1
            print(f"worker {args.worker}: {Path(cfg.out_dir).name} failed: {type(e).__name__}: {e}", flush=True)
            continue
        finally:
            last = time.time() - t
            if Path(cfg.out_dir).is_dir():
                _tidy(Path(cfg.out_dir))
        print(f"worker {args.worker}: {Path(cfg.out_dir).name}: val {s['final_val_loss']:.4f}, "
              f"{s['tokens_per_s']:,.0f} tok/s, {last:.0f} s", flush=True)
    if failed:
        sys.exit(1)


def dw_routes(summary: dict) -> str:
    """Which weight-gradient route the run's process chose for S-STE's MVUE (``estimate`` or
    ``exact`` per shape), or ``-`` where no choice between them was made."""
    choices = summary.get("gemm_choices") or {}
    picked = [v.get("choice", "?") for k, v in sorted(choices.items()) if k.startswith("dw-mvue")]
    return ", ".join("estimate" if c.startswith("sparse") else "exact" for c in picked) or "-"


def report(runs: Path) -> str:
    """The ablation's tables (results_tables' three: against dense, and paired with S-STE and STE
    of the same seed) and each run's dW route and code digest."""
    lines = ["| run | seed | dW route of MVUE (per shape) | code digest |", "|---|---|---|---|"]
    for s in load_runs(runs):
        on = (s.get("recipe_options") or {}).get("mvue", s["recipe"] in ("s-ste", "t-sr-ste"))
        route = dw_routes(s) if on else "-" if s["recipe"] == "dense" else "exact (MVUE off)"
        lines.append(f"| {s['label']} | {s['seed']} | {route} | {digest(s)} |")
    return _folder_tables(runs, "dense", ("s-ste", "ste")) + "\n\n" + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="folder of the run folders (finished runs there are reused)")
    ap.add_argument("--model", default="gpt-10m")
    ap.add_argument("--steps", type=int, default=500, help="optimizer steps per run (default %(default)s)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    ap.add_argument("--evals", type=int, default=5, help="evaluations per run (default %(default)s)")
    ap.add_argument("--eval-iters", type=int, default=16)
    ap.add_argument("--corpus", type=Path, default=Path("/tmp/ablation_corpus"))
    ap.add_argument("--corpus-bytes", type=float, default=18e6, help="corpus size to build (default %(default)g)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workers", type=int, default=3, help="training processes sharing the device")
    ap.add_argument("--deadline", type=float, default=470, help="seconds after which no run starts")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args)
        return 0
    t0 = time.time()
    if not args.corpus.is_dir():
        subprocess.run([sys.executable, str(HERE / "make_corpus.py"), str(args.corpus),
                        "--max-bytes", str(args.corpus_bytes)], check=True)
        print(f"corpus built in {time.time() - t0:.1f} s", flush=True)
    args.runs.mkdir(parents=True, exist_ok=True)
    todo = [c for c in configs(args) if not finished(c)]
    print(f"{len(configs(args)) - len(todo)} runs finished already, {len(todo)} to train", flush=True)
    argv = sys.argv[1:]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(i),
                               "--deadline-at", str(t0 + args.deadline)])
             for i in range(min(args.workers, len(todo)))]
    failed = sum(p.wait() != 0 for p in procs)
    text = report(args.runs)
    print(text)
    (args.runs / "ablation.md").write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "ablation.md").write_text(text)
        with tarfile.open(Path(out, "ablation.tar.gz"), "w:gz") as tar:
            for run in sorted(p for p in args.runs.iterdir() if p.is_dir()):
                for name in KEPT:
                    if (run / name).is_file():
                        tar.add(run / name, arcname=f"{ABLATION}/{run.name}/{name}")
    print(f"{time.time() - t0:.0f} s in all; {failed} worker(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
