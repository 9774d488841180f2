"""The dX routes at their best rates: dense, and STE and S-STE with each dX route
(``dx=dense``, ``pruned-t``, ``mvue``), at each of ``--lrs`` for each seed, on one corpus, as
``twofour compare --lrs`` runs, several sharing the one GPU; then each at its best rate.

    PYTHONPATH=src python scripts/dx_sweep.py RUNS --kind code [--lrs 1x,2x,4x] [--seeds 1,2,3]
    PYTHONPATH=src python scripts/dx_sweep.py /tmp/dx --kind prose --model tiny --steps 6 --batch-size 2 \\
        --seq-len 64 --corpus-bytes 3e5 --device cpu --workers 2 --lrs 1x,2x --seeds 1   # the CPU check
    PYTHONPATH=src python scripts/dx_sweep.py /tmp/h20 --kind code --corpus /tmp/code --best-from docs/results/dx-code \
        --variants dense,ste,s-ste,s-ste+dx=pruned-t --tokens-per-weight 20 --workers 6   # the long runs

``--variants`` picks the recipes (with their ``--opt`` values joined by ``+``), ``--best-from`` runs
each at its best rate in a finished sweep folder (the lowest mean selection score, as ``twofour
compare --lrs`` picks it) instead of ``--lrs``, ``--tokens-per-weight`` sizes the runs in tokens per
block weight of the model instead of ``--steps``, ``--sparse-attention`` makes the attention
projections 2:4 too in every run (a sweep folder of its own: dense runs are the same either way).

Builds the corpus first if missing (``scripts/make_corpus.py --kind KIND`` on this machine's
files, ``--corpus-bytes`` of them, split by file: no validation text is seen in training). Each
run is one ``twofour compare`` process (its own folder under RUNS/parts, scored on both halves of
the validation split when it ends), ``--workers`` at a time; none starts after ``--deadline``
seconds, and runs finished under RUNS/parts, or under ``--reuse`` (a folder of run folders such as
docs/results/dx-code), are not trained again. ``TWOFOUR_GEMM=sparse`` (the default
here) forces every GEMM that has a 2:4 route onto it, so that the MVUE estimates are drawn at every
shape and the runs measure each route's math, not the speed choice. Then the run files
(config.json, metrics.csv gzipped, summary.json, val_halves.json) are gathered into RUNS/all, whose sweep
tables (``results_tables.py --folder``) go to RUNS/dx.md, and with ``$OUT`` set to
``$OUT/dx-KIND.md`` and ``$OUT/dx-KIND.tar.gz`` (RUNS's run files and logs: unpacked into RUNS, a
later call reuses the runs; RUNS/all is what docs/results/ keeps).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from results_tables import sweep_summaries, sweep_tables

from twofour.models import from_preset
from twofour.training.compare import run_folder, run_label
from twofour.training.config import TrainConfig
from twofour.training.options import parse_option
from twofour.training.sweep import best_rates, parse_rates

HERE = Path(__file__).resolve().parent
#: What each run folder keeps (checkpoints and plots are not kept).
KEPT = ("config.json", "metrics.csv", "summary.json", "val_halves.json")
#: (recipe, --opt values): the baseline, each recipe with dense dX, then each dX route.
VARIANTS = (("dense", ()), ("ste", ()), ("s-ste", ()),
            ("ste", ("dx=pruned-t",)), ("s-ste", ("dx=pruned-t",)),
            ("ste", ("dx=mvue",)), ("s-ste", ("dx=mvue",)))


def variant(text: str) -> tuple[str, tuple[str, ...]]:
    """``s-ste+dx=pruned-t`` -> ("s-ste", ("dx=pruned-t",)): a recipe and its --opt values."""
    recipe, *opts = text.split("+")
    return recipe, tuple(opts)


def block_weights(model: str) -> int:
    """The weights of the preset's blocks (its matrices inside the stack of blocks; embeddings and
    head left out): what "tokens per block weight" counts."""
    with torch.device("meta"):
        m = from_preset(model)
    stack = next(mod for mod in m.modules() if isinstance(mod, torch.nn.ModuleList))
    return sum(p.numel() for p in stack.parameters() if p.dim() == 2)


def best_rates_in(folder: Path) -> dict[str, float | None]:
    """Each variant's best rate in a finished sweep folder (its selection scores: ``val_halves.json``)."""
    runs = sweep_summaries(folder)
    if not runs:
        raise SystemExit(f"--best-from {folder}: no finished runs there")
    return best_rates(runs)


def rates_for(args: argparse.Namespace, recipe: str, opts: tuple[str, ...]) -> list[str]:
    """The rates a variant runs at: ``--lrs``, or with ``--best-from`` its best rate there."""
    if args.best is None:
        return args.lrs
    label = run_label(recipe, dict(parse_option(o) for o in opts), "bf16")
    if args.best.get(label) is None:
        raise SystemExit(f"--best-from {args.best_from}: no finished sweep of {label!r} there")
    return [json.dumps(args.best[label])]


def reused(args: argparse.Namespace, recipe: str, opts: tuple[str, ...], lr: str, seed: int) -> bool:
    """Whether ``--reuse`` (a folder of run folders, as docs/results/dx-code) holds this run scored,
    with the attention projections as ``--sparse-attention`` asks (a folder without its config.json:
    FFN only)."""
    if args.reuse is None:
        return False
    rate = parse_rates(lr, TrainConfig(model=args.model))[0]
    folder = args.reuse / run_folder(recipe, dict(parse_option(o) for o in opts), seed, "bf16", rate)
    config = folder / "config.json"
    attention = config.is_file() and json.loads(config.read_text()).get("sparse_attention", False)
    return (folder / "val_halves.json").is_file() and attention == args.sparse_attention


def jobs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(folder name, compare command) of each run, seed by seed, then rate, then variant (so that a
    call cut short leaves whole seeds); runs that ``--reuse`` holds are left out."""
    runs = sorted(((k, lr, recipe, opts) for recipe, opts in args.variants
                   for k, lr in enumerate(rates_for(args, recipe, opts))), key=lambda run: run[0])
    out = []
    for seed in args.seeds:
        for _, lr, recipe, opts in runs:
            if reused(args, recipe, opts, lr, seed):
                continue
            name = "-".join([recipe, *(o.replace("=", "_") for o in opts), *(["attn"] if args.sparse_attention else []),
                             f"lr{lr}", f"s{seed}"])
            cmd = [sys.executable, "-m", "twofour", "compare", "--recipes", recipe, "--lrs", lr,
                   "--seeds", str(seed), "--model", args.model, "--steps", str(args.steps),
                   "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                   "--eval-interval", str(max(1, args.steps // args.evals)), "--eval-iters", str(args.eval_iters),
                   "--ckpt-interval", str(args.steps), "--data", str(args.corpus), "--device", args.device,
                   "--no-progress", "--out", str(args.runs / "parts" / name)]
            for o in opts:
                cmd += ["--opt", o]
            if args.sparse_attention:
                cmd.append("--sparse-attention")
            out.append((name, cmd))
    return out


def done(folder: Path) -> bool:
    """Whether a run's compare folder holds its scored run."""
    return any(folder.glob("*/val_halves.json"))


def run_all(args: argparse.Namespace, t0: float) -> int:
    """Each unfinished run's compare process, ``--workers`` at a time, none started past the deadline;
    the number that failed."""
    todo = [(n, c) for n, c in jobs(args) if not done(args.runs / "parts" / n)]
    print(f"{len(jobs(args)) - len(todo)} runs finished already, {len(todo)} to train", flush=True)
    env = {**os.environ, "TWOFOUR_GEMM": args.gemm, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    logs = args.runs / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def one(job: tuple[str, list[str]]) -> int:
        name, cmd = job
        if time.time() - t0 > args.deadline:
            print(f"{name}: not started (past the deadline)", flush=True)
            return 0
        t = time.time()
        with open(logs / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        print(f"{name}: {'done' if rc == 0 else f'FAILED ({rc})'} in {time.time() - t:.0f} s", flush=True)
        if rc:
            print((logs / f"{name}.log").read_text()[-2000:], flush=True)
        return int(rc != 0)

    with ThreadPoolExecutor(args.workers) as pool:
        return sum(pool.map(one, todo))


def gather(runs: Path) -> Path:
    """Every scored run's files under ``runs``/all (one folder per run, as one sweep's)."""
    all_ = runs / "all"
    shutil.rmtree(all_, ignore_errors=True)
    for scores in sorted((runs / "parts").glob("*/*/val_halves.json")):
        dest = all_ / scores.parent.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            src = scores.parent / name
            if src.is_file() and name == "metrics.csv":  # gzipped, as docs/results keeps it
                with src.open("rb") as fh, gzip.GzipFile(dest / (name + ".gz"), "wb", mtime=0) as gz:
                    shutil.copyfileobj(fh, gz)
            elif src.is_file():
                shutil.copy2(src, dest / name)
    return all_


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="folder of the runs (finished runs there are reused)")
    ap.add_argument("--kind", default="code", choices=["code", "prose"], help="the corpus (make_corpus.py --kind)")
    ap.add_argument("--model", default="gpt-10m")
    ap.add_argument("--steps", type=int, default=500, help="optimizer steps per run (default %(default)s)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lrs", type=lambda s: s.split(","), default=["1x", "2x", "4x"],
                    help="peak rates, multiples of the preset's or numbers (default 1x,2x,4x)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    ap.add_argument("--evals", type=int, default=5, help="evaluations per run (default %(default)s)")
    ap.add_argument("--eval-iters", type=int, default=16)
    ap.add_argument("--corpus", type=Path, default=None, help="default /tmp/dx_corpus_KIND")
    ap.add_argument("--corpus-bytes", type=float, default=18e6, help="corpus size to build (default %(default)g)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gemm", default="sparse", choices=["sparse", "auto"], help="TWOFOUR_GEMM for the runs")
    ap.add_argument("--workers", type=int, default=9, help="runs sharing the device at a time")
    ap.add_argument("--deadline", type=float, default=480, help="seconds after which no run starts")
    ap.add_argument("--reuse", type=Path, default=None, help="a folder of finished run folders (docs/results/dx-code): "
                    "runs it holds are not trained again")
    ap.add_argument("--variants", type=lambda s: [variant(v) for v in s.split(",")], default=list(VARIANTS),
                    help="recipes with their --opt values joined by '+' (s-ste+dx=pruned-t); default the dX sweep's")
    ap.add_argument("--sparse-attention", action="store_true",
                    help="every run with the attention projections 2:4 too (twofour compare --sparse-attention)")
    ap.add_argument("--best-from", type=Path, default=None,
                    help="a finished sweep folder: each variant at its best rate there instead of --lrs")
    ap.add_argument("--tokens-per-weight", type=float, default=None,
                    help="the run's length in tokens per block weight of the model, instead of --steps")
    args = ap.parse_args()
    args.best = None if args.best_from is None else best_rates_in(args.best_from)
    if args.tokens_per_weight is not None:
        args.steps = math.ceil(args.tokens_per_weight * block_weights(args.model) / (args.batch_size * args.seq_len))
    args.corpus = args.corpus or Path(f"/tmp/dx_corpus_{args.kind}")
    t0 = time.time()
    if not args.corpus.is_dir():
        subprocess.run([sys.executable, str(HERE / "make_corpus.py"), str(args.corpus), "--kind", args.kind,
                        "--max-bytes", str(args.corpus_bytes), "--min-bytes", "0"], check=True)
        print(f"corpus built in {time.time() - t0:.1f} s", flush=True)
    failed = run_all(args, t0)
    all_ = gather(args.runs)
    text = sweep_tables(all_)
    print(text)
    (args.runs / "dx.md").write_text(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"dx-{args.kind}.md").write_text(text)
        with tarfile.open(Path(out, f"dx-{args.kind}.tar.gz"), "w:gz") as tar:  # RUNS's files, to reuse
            for f in sorted(args.runs.glob("parts/*/*/*")):
                if f.name in KEPT:
                    tar.add(f, arcname=str(f.relative_to(args.runs)))
            tar.add(args.runs / "logs", arcname="logs")
    print(f"{time.time() - t0:.0f} s in all; {failed} run(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
