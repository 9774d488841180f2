"""docs/RESULTS.md's tables, recomputed from the run files under docs/results/.

    PYTHONPATH=src python scripts/results_tables.py                           # print every table
    PYTHONPATH=src python scripts/results_tables.py --write docs/RESULTS.md   # rewrite the tables in it
    PYTHONPATH=src python scripts/results_tables.py --check docs/RESULTS.md   # exit 1 if one differs
    PYTHONPATH=src python scripts/results_tables.py --folder runs/ablation    # one folder's tables

Each table of RESULTS.md sits between ``<!-- table NAME -->`` and ``<!-- /table -->``; :data:`TABLES`
says how each is computed. A table that quotes their figures in prose (which run tested what)
sits between ``<!-- quotes NAME ... -->`` and ``<!-- /quotes -->`` instead, and ``--check`` finds
each signed percentage it holds in the tables it names; a table in neither fails ``--check``.
Reads only each run's ``summary.json``, ``config.json`` and ``metrics.csv`` (and a learning-rate
sweep's ``val_halves.json``: ``--folder`` on a ``twofour compare --lrs`` folder prints its
compare.md, :func:`sweep_tables`; and the record ``scripts/effective_step.py --out`` writes): a
run is named by its recipe, precision and options and by the settings it changed from ``twofour
train``'s defaults (``lr``, ``weight_decay`` ...); gaps are paired by seed with the baseline run
(``dense`` unless named) of the same folder; the code digest is the summary's ``code.source``
(``not recorded`` for summaries written before it existed).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import effective_step
import numpy as np
from gap_by_eval import gap_series, gap_table, label_of

from twofour.training.compare import mean_std as compare_mean_std
from twofour.training.compare import paired_gaps, run_order, summary_label
from twofour.training.config import TrainConfig
from twofour.training.runs import read_config, read_summary
from twofour.training.sweep import SCORES, best_rates, sweep_runs, sweep_table

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
#: Where the S-STE ablation's run folders go in the repository (scripts/s_ste_ablation.py).
ABLATION = "s-ste-ablation"
#: The rate-shift test's sweep (twofour compare --lrs, CPU) and effective_step.py's record.
RATE_SHIFT = "rate-shift"


def load_runs(folder: Path, by_folder: bool = False) -> list[dict]:
    """Every finished run directly under ``folder`` (its summary, with ``label``: :func:`label_of`,
    or with ``by_folder`` the folder's name without its ``-sSEED``), in compare's order."""
    runs = [s for s in (read_summary(p.parent) for p in sorted(Path(folder).glob("*/summary.json"))) if s]
    for s in runs:
        s["label"] = re.sub(r"-s\d+$", "", Path(s["out_dir"]).name) if by_folder else label_of(s)
    return sorted(runs, key=lambda s: (run_order(s)[0], s["label"], s["seed"]))


def digest(summary: dict) -> str:
    """The code digest a summary records, or ``not recorded``."""
    return (summary.get("code") or {}).get("source") or "not recorded"


def _gaps(runs: list[dict], base: str) -> dict[str, dict[int, float]]:
    """``{label: {seed: relative gap % of its final val loss to the base's of that seed}}``."""
    ref = {s["seed"]: s["final_val_loss"] for s in runs if s["label"] == base}
    out: dict[str, dict[int, float]] = {}
    for s in runs:
        if s["label"] != base and s["seed"] in ref and s["final_val_loss"] is not None:
            out.setdefault(s["label"], {})[s["seed"]] = (s["final_val_loss"] / ref[s["seed"]] - 1) * 100
    return out


def mean_std(values: list[float], unit: str = " %", digits: int = 2) -> str:
    """``m ± s`` (sample std, n - 1) over several values; one value as itself, saying ``one seed``."""
    if len(values) == 1:
        return f"{values[0]:+.{digits}f}{unit} (one seed)"
    return f"{np.mean(values):+.{digits}f} ± {np.std(values, ddof=1):.{digits}f}{unit}"


def runs_table(runs: list[dict], base: str = "dense") -> str:
    """One row per run: final val loss, relative gap to the base of its seed, flip rates, digest."""
    gaps = _gaps(runs, base)
    lines = [f"| run | seed | tokens | final val loss | against {base}, same seed | mean flip rate | code digest |",
             "|---|---|---|---|---|---|---|"]
    for s in runs:
        g = gaps.get(s["label"], {}).get(s["seed"])
        gap = "-" if s["label"] == base else ("no baseline" if g is None else f"{g:+.2f} %")
        lines.append(f"| {s['label']} | {s['seed']} | {s['tokens'] / 1e6:.1f}M | {s['final_val_loss']:.4f} | {gap} "
                     f"| {s['mean_flip_rate']:.2e} | {digest(s)} |")
    return "\n".join(lines)


def summary_table(runs: list[dict], base: str = "dense", versus: tuple[str, ...] = ()) -> str:
    """One row per run label: seeds, final val loss (mean ± std), the relative gap to the base
    paired by seed, and the paired gap to each label of ``versus`` (its run of the same seed)."""
    gaps = _gaps(runs, base)
    vs = {v: _gaps(runs, v) for v in versus}
    lines = [f"| run | seeds | final val loss | against {base}, paired by seed |"
             + "".join(f" against {v}, paired |" for v in versus), "|---|---|---|---|" + "---|" * len(versus)]
    for label in dict.fromkeys(s["label"] for s in runs):
        if label == base:
            continue
        seeds = sorted(s["seed"] for s in runs if s["label"] == label)
        loss = [s["final_val_loss"] for s in runs if s["label"] == label]
        g = list(gaps.get(label, {}).values())
        row = (f"| {label} | {', '.join(map(str, seeds))} | {mean_std(loss, '', 4).lstrip('+')} "
               f"| {mean_std(g) if g else 'no baseline'} |")
        for v in versus:
            d = list(vs[v].get(label, {}).values())
            row += f" {'-' if label == v else (mean_std(d) if d else 'no run')} |"
        lines.append(row)
    return "\n".join(lines)


def claim_table(folders: dict[str, Path]) -> str:
    """The paper's order (S-STE > SR-STE > STE) against the one each folder's runs give: each
    recipe's relative gap to dense paired by seed, and their order (smallest gap first)."""
    lines = ["| experiment | STE | SR-STE | S-STE | order found (smallest gap first) |", "|---|---|---|---|---|",
             "| paper (S-STE, NeurIPS 2024): GPT-2 124M-774M, 300k steps of 0.5M tokens | - | - | - | "
             "S-STE > SR-STE > STE |"]
    for name, folder in folders.items():
        runs = load_runs(folder)
        gaps = _gaps(runs, "dense")
        cells, means = [], {}
        for recipe in ("ste", "sr-ste", "s-ste"):
            g = list(gaps.get(recipe, {}).values())
            cells.append(mean_std(g) if g else "not run")
            if g:
                means[recipe.upper()] = np.mean(g)
        order = " > ".join(sorted(means, key=means.get))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {order or '-'} |")
    return "\n".join(lines)


def _folder_tables(folder: Path, base: str = "dense", versus: tuple[str, ...] = (), by_folder: bool = False,
                   keep: Callable[[str], bool] = lambda label: True) -> str:
    """A folder's three tables: every run, each label over its seeds, and (unless ``by_folder``)
    the gap at each evaluation; only the labels ``keep`` accepts, besides the baselines."""
    runs = [s for s in load_runs(folder, by_folder) if s["label"] in (base, *versus) or keep(s["label"])]
    parts = [runs_table(runs, base), "", summary_table(runs, base, versus)]
    if not by_folder:
        steps, series = gap_series(folder, base)
        series = {k: v for k, v in series.items() if k in versus or keep(k)}
        parts += ["", f"The relative gap to {base} at each evaluation, mean over seeds:", "",
                  gap_table(steps, series)]
    return "\n".join(parts)


def sweep_summaries(folder: Path) -> list[dict]:
    """A learning-rate sweep's finished runs with their rates and scores (``val_halves.json``), as
    ``twofour compare --lrs`` reads them; empty where the folder has none."""
    runs = [s for s in (read_summary(p.parent) for p in sorted(Path(folder).glob("*/summary.json"))) if s]
    return sweep_runs(Path(folder), runs[0]) if runs else []


def sweep_tables(folder: Path) -> str:
    """A learning-rate sweep's tables (``twofour compare --lrs``: each recipe at its best rate, every
    recipe at every rate, every run), from its runs' files, ``val_halves.json`` included."""
    runs = sweep_summaries(folder)
    return sweep_table(runs) if runs else f"No finished runs in {folder}."


def shift_table(folder: Path, recipe: str = "s-ste", versus: str = "ste", factor: float = 1.5) -> str:
    """A sweep's test of a rate shift: ``recipe`` at each rate r against ``versus`` at r and at
    ``factor`` * r (final val loss, relative gap paired by seed). If ``recipe`` trains like
    ``versus`` at ``factor`` times the rate, the second gap is the smaller one at every r."""
    losses: dict[tuple[str, float], dict[int, float]] = {}  # (label, peak lr) -> {seed: final val loss}
    for s in load_runs(folder):
        cfg = read_config(s["out_dir"])
        if cfg is not None and s["final_val_loss"] is not None:
            lr = TrainConfig.from_dict(cfg).peak_lr
            losses.setdefault((summary_label(s), lr), {})[s["seed"]] = s["final_val_loss"]

    def gap(r: float, r_vs: float) -> str:
        ref = next((v for (name, lr), v in losses.items() if name == versus and math.isclose(lr, r_vs, rel_tol=1e-3)),
                   {})
        _, rel = paired_gaps(losses[(recipe, r)], ref)
        return mean_std([100 * g for g in rel]) if rel else "not run"

    rates = sorted(lr for name, lr in losses if name == recipe)
    lines = [f"| {recipe} at lr | against {versus} at the same lr | against {versus} at {factor:g}x that lr |",
             "|---|---|---|"]
    lines += [f"| {r:.4g} | {gap(r, r)} | {gap(r, r * factor)} |" for r in rates]
    return "\n".join(lines)


def scored_runs(folder: Path) -> list[dict]:
    """A sweep folder's finished runs that have report-half scores (:func:`sweep_summaries`)."""
    return [r for r in sweep_summaries(folder) if "report" in r]


def report_losses(found: list[dict]) -> dict[tuple[str, float], dict[int, float]]:
    """``{(label, rate): {seed: report-half loss}}`` of scored runs."""
    loss: dict[tuple[str, float], dict[int, float]] = {}
    for r in found:
        loss.setdefault((summary_label(r), r["lr"]), {})[r["seed"]] = r["report"]
    return loss


def paired_cell(mine: dict[int, float], theirs: dict[int, float], empty: str) -> tuple[str, bool | None]:
    """The relative gap of ``mine`` to ``theirs`` paired by seed, in %, and whether it is within
    the seed spread (mean at most one standard deviation above 0; None under two seeds)."""
    _, rel = paired_gaps(mine, theirs)
    if len(rel) < 2:
        return (empty if not rel else f"{100 * rel[0]:+.2f} % (one seed)"), None
    m, sd = (100 * v for v in compare_mean_std(rel))
    return f"{m:+.2f} ± {sd:.2f} % (n={len(rel)})", m <= sd


def twin_table(folder: Path, full_seeds: int = 3) -> str:
    """A dX-route sweep's test (scripts/dx_sweep.py): each route (a label with ``dx=``) against its
    twin with the exact dX (the same label without it), report-half losses paired by seed, relative
    gap in %: each at its own best rate, then at each rate both ran with ``full_seeds`` seeds. A
    route is kept where it is no worse than its twin beyond the seed spread: the mean of its paired
    gap at the best rates at most one standard deviation above 0."""
    found = scored_runs(folder)
    if not found:
        return f"No finished runs in {folder}."
    loss = report_losses(found)
    best = best_rates(found)

    def cell(route: tuple[str, float], twin: tuple[str, float]) -> tuple[str, bool | None]:
        return paired_cell(loss.get(route, {}), loss.get(twin, {}), "n/a")

    labels = [label for label in dict.fromkeys(summary_label(r) for r in found) if " dx=" in label]
    rates = sorted({lr for (_, lr), seeds in loss.items() if len(seeds) >= full_seeds})
    head = ["route", "its twin", "best rates (route / twin)", "gap to twin at the best rates", "kept"]
    lines = ["| " + " | ".join(head + [f"at {lr:g}" for lr in rates]) + " |", "|---" * (len(head) + len(rates)) + "|"]
    for label in labels:
        twin = re.sub(r" dx=\S+", "", label)
        b, bt = best.get(label), best.get(twin)
        at_best, ok = cell((label, b), (twin, bt)) if b and bt else ("n/a", None)
        same = [cell((label, lr), (twin, lr))[0] if len(loss.get((label, lr), {})) >= full_seeds else "-"
                for lr in rates]
        kept = "-" if ok is None else "yes" if ok else "no"
        lines.append(f"| {label} | {twin} | {b:g} / {bt:g} | {at_best} | {kept} | " + " | ".join(same) + " |")
    return "\n".join(lines)


def _effective_step() -> str:
    path = RESULTS / RATE_SHIFT / "effective_step.json"
    if not path.exists():
        return f"No docs/results/{RATE_SHIFT}/effective_step.json yet: `scripts/effective_step.py` has not been run."
    return effective_step.table(json.loads(path.read_text()))


def _ablation() -> str:
    folder = RESULTS / ABLATION
    if not folder.is_dir():
        return f"No run files in docs/results/{ABLATION}/ yet: `scripts/s_ste_ablation.py` has not been run."
    # the doubled-lr runs paired with each other too: the one comparison of the recipes at that lr
    return _folder_tables(folder, "dense", ("s-ste", "ste", "ste lr=0.002"))


def _claims() -> str:
    folders = {"gpt2-124m, 200M tokens (docs/results/q124m-ours)": RESULTS / "q124m-ours"}
    if (RESULTS / ABLATION).is_dir():
        folders["gpt-10m, ~1 epoch of a held-out corpus (docs/results/s-ste-ablation)"] = RESULTS / ABLATION
    return claim_table(folders)


#: RESULTS.md's tables by name: what fills each ``<!-- table NAME -->`` block.
TABLES: dict[str, Callable[[], str]] = {
    "claim": _claims,
    "ablation": _ablation,
    "q124m-bf16": lambda: _folder_tables(RESULTS / "q124m-ours", "dense", keep=lambda label: "fp8" not in label),
    "q124m-fp8": lambda: _folder_tables(RESULTS / "q124m-ours", "s-ste", keep=lambda label: "fp8" in label),
    "q124m-repeat": lambda: runs_table(load_runs(RESULTS / "q124m-repeat")),
    "q10m-mvue": lambda: _folder_tables(RESULTS / "q10m-mvue", "s-ste", by_folder=True),
    "rate-sweep": lambda: sweep_tables(RESULTS / RATE_SHIFT),
    "rate-shift": lambda: shift_table(RESULTS / RATE_SHIFT),
    "effective-step": _effective_step,
}

# a block's body never holds another block's start: a missing end marker is left alone, not swallowed
_BLOCK = re.compile(r"(<!-- table (?P<name>[\w-]+) -->\n)(?P<body>(?:(?!<!-- table ).)*?)(<!-- /table -->)", re.S)


def rewrite(text: str) -> str:
    """``text`` with every marked table recomputed; SystemExit naming a table TABLES lacks."""
    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        return m.group(1) + TABLES[name]() + "\n" + m.group(4)
    return _BLOCK.sub(fill, text)


_QUOTES = re.compile(r"<!-- quotes (?P<names>[\w -]+?) -->\n(?P<body>.*?)<!-- /quotes -->", re.S)
#: A figure a quoting table must find in the tables it names: a signed percentage, with its spread.
_FIGURE = re.compile(r"[+-]\d+\.\d+(?: ± \d+\.\d+)? %")


def problems(text: str) -> list[str]:
    """What ``--check`` finds besides a marked table that differs: a markdown table outside both
    kinds of block (its first line), and a figure of a ``quotes`` block in none of its tables."""
    found, tables = [], {}
    bare = _BLOCK.sub("", text)
    for m in _QUOTES.finditer(bare):
        names = m["names"].split()
        if unknown := [n for n in names if n not in TABLES]:
            raise SystemExit(f"unknown table {unknown[0]!r} in a quotes block; known: {', '.join(TABLES)}")
        for n in names:
            if n not in tables:
                tables[n] = TABLES[n]()
        given = set(_FIGURE.findall("\n".join(tables[n] for n in names)))
        found += [f"{fig} (quoted from {', '.join(names)}) is in none of those tables"
                  for fig in _FIGURE.findall(m["body"]) if fig not in given]
    lines = _QUOTES.sub("", bare).splitlines()
    found += [f"a table outside the marked blocks: {line[:80]}" for i, line in enumerate(lines)
              if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))]
    return found


def against_table(folder: Path, other: Path) -> str:
    """Each label and rate of one sweep (``--sparse-attention`` runs, say) against the same label at
    the same rate in ``other``: report-half losses paired by seed, relative gap in %, and whether it
    is within the seed spread; refused where the two hold runs of another model or length."""
    mine, theirs = scored_runs(folder), scored_runs(other)
    if not mine:
        return f"No finished runs in {folder}."
    like, like_other = ({(r["model"], r["tokens"]) for r in runs} for runs in (mine, theirs))
    if theirs and like != like_other:
        raise SystemExit(f"results_tables.py: {folder} holds runs of {sorted(like)} (model, tokens), {other} of "
                         f"{sorted(like_other)}; only runs of one model and length pair")
    theirs_loss = report_losses(theirs)
    lines = [f"| run | rate | seeds | gap to the same run in {other.name}, paired | within the spread |",
             "|---|---|---|---|---|"]
    for (label, lr), seeds in report_losses(mine).items():
        gap, ok = paired_cell(seeds, theirs_loss.get((label, lr), {}), "no twin")
        lines.append(f"| {label} | {lr:g} | {', '.join(map(str, sorted(seeds)))} | {gap} "
                     f"| {'-' if ok is None else 'yes' if ok else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="rewrite the marked tables of this markdown file")
    ap.add_argument("--check", type=Path, help="exit 1 if a marked table of this file differs from its run files")
    ap.add_argument("--folder", type=Path, help="print the tables of one folder of runs instead")
    ap.add_argument("--base", default="dense", help="with --folder: the baseline's label (default %(default)s)")
    ap.add_argument("--versus", nargs="*", default=[], help="with --folder: more labels to pair gaps with (s-ste ste)")
    ap.add_argument("--twins", action="store_true", help="with --folder (a dX-route sweep): each route against its "
                    "twin with the exact dX")
    ap.add_argument("--against", type=Path, help="with --folder (a sweep): each run against the same run (label, "
                    "rate, seed) in this sweep folder")
    args = ap.parse_args()
    if args.against and not args.folder:
        ap.error("--against pairs the runs of --folder with another sweep's: give --folder too")
    if args.folder and args.against:
        print(against_table(args.folder, args.against))
    elif args.folder:
        sweep = any(args.folder.glob(f"*/{SCORES}"))  # a twofour compare --lrs folder
        if args.twins:
            print(twin_table(args.folder))
        else:
            print(sweep_tables(args.folder) if sweep else _folder_tables(args.folder, args.base, tuple(args.versus)))
    elif args.write or args.check:
        path = args.write or args.check
        old = path.read_text()
        new = rewrite(old)
        for problem in (found := problems(new)):
            print(f"{path}: {problem}", file=sys.stderr)
        if args.check:
            if new != old:
                print(f"{path}: its tables differ from the run files; run scripts/results_tables.py --write {path}",
                      file=sys.stderr)
                return 1
            if found:
                return 1
            print(f"{path}: every table matches the run files")
        else:
            path.write_text(new)
            print(f"{path}: tables rewritten")
            return 1 if found else 0
    else:
        for name, make in TABLES.items():
            print(f"## {name}\n\n{make()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
