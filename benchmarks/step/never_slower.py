"""The never-slower matrix: tokens/s of ``twofour train`` as a user runs it (one GPU, under
``torchrun`` with DDP or FSDP2, eager and ``--compile``, beside CPU-busy processes), sparse
recipes against dense in the same call, median of repeats, each cell's command printed.

    PYTHONPATH=src python benchmarks/step/never_slower.py [--cells one-eager,one-compile,ddp-eager,
        ddp-compile,ddp-busy,fsdp] [--gpus 2] [--model gpt2-124m] [--batches 8,16,32]
        [--recipes dense,ste,s-ste] [--repeats 3] [--steps 40] [--budget-s 540] [--out DIR]
        [-- ARGS FOR EVERY RUN]

Each run is a fresh process (a fresh ``torchrun`` for several GPUs) writing ``summary.json``;
its ``tokens_per_s`` is the loop's median over its logged windows after the first, and its
``step_graphs`` entry says how many steps were replayed from CUDA graphs; a compiled run also
counts rank 0's recompilations and graph breaks (``TORCH_LOGS=recompiles,graph_breaks``). Runs are interleaved
per repeat (every cell, batch and recipe once, then again), so the machine's drift spreads over
all of them. A compiled cell's ratio is to compiled dense, the fastest dense that path offers.
``--budget-s``: no run starts past that many seconds; the table then says which runs are missing.
The table (markdown) and every run's numbers (JSON) are rewritten after each run under ``--out``;
``--from-runs A.json B.json`` prints the table of saved runs merged (the same options, no runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import busy_cpus  # noqa: E402

#: NVLink multicast stays off (it can take a shared host's GPUs out of service).
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "OMP_NUM_THREADS": "4"}


@dataclass(frozen=True)
class Cell:
    """One path a user takes: processes (1: no torchrun), extra ``twofour train`` arguments, and
    CPU-busy neighbour processes."""

    name: str
    nproc: int
    args: tuple[str, ...] = ()
    busy: int = 0
    compiled: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", "--compile" in self.args)

    def command(self, train_args: list[str]) -> list[str]:
        """The user's command line for this cell."""
        launch = ([sys.executable, "-m", "twofour"] if self.nproc == 1 else
                  [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                   "-m", "twofour"])
        return [*launch, "train", *train_args, *self.args]


def cells(gpus: int) -> dict[str, Cell]:
    """The matrix's paths, by name."""
    return {c.name: c for c in (
        Cell("one-eager", 1), Cell("one-compile", 1, ("--compile",)),
        Cell("ddp-eager", gpus), Cell("ddp-compile", gpus, ("--compile",)),
        Cell("ddp-busy", gpus, busy=8), Cell("fsdp", gpus, ("--fsdp", "bf16")),
        Cell("fsdp-compile", gpus, ("--fsdp", "bf16", "--compile")),
    )}


#: Dynamo's logs a compiled run writes (on stderr), whose events :func:`compile_events` counts.
COMPILE_LOGS = {"TORCH_LOGS": "recompiles,graph_breaks"}


def compile_events(stderr: str) -> dict[str, int]:
    """Rank 0's recompilations and graph breaks in a run's stderr under :data:`COMPILE_LOGS`:
    what makes a compiled step slower than its eager twin when one recipe's count differs."""
    lines = [line for line in stderr.splitlines() if not line.startswith("[rank") or line.startswith("[rank0]")]
    return {"recompiles": sum("[__recompiles] Recompiling function" in line for line in lines),
            "graph_breaks": sum("[__graph_breaks] Graph break in user code" in line for line in lines)}


def run_once(cmd: list[str], out: Path, timeout: float, compiled: bool = False) -> dict | None:
    """One run; its summary's tokens/s and step-graph report (compiled: Dynamo's recompilations and
    graph breaks too, :func:`compile_events`), or None (its stderr's end printed)."""
    try:
        res = subprocess.run([*cmd, "--out", str(out), "--overwrite", "--no-progress"], capture_output=True,
                             text=True, env={**os.environ, **ENV, **(COMPILE_LOGS if compiled else {})},
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out: {shlex.join(cmd)}", flush=True)
        return None
    if res.returncode != 0:
        print(f"failed ({res.returncode}): {shlex.join(cmd)}\n{res.stderr[-2000:]}", flush=True)
        return None
    s = json.loads((out / "summary.json").read_text())
    warned = sum("could not be captured" in line or "AccumulateGrad" in line for line in res.stderr.splitlines())
    plans = {k: v for k, v in s.get("gemm_choices", {}).items() if k.startswith("compiled-layer")}
    return {"tokens_per_s": s["tokens_per_s"], "step_graphs": s.get("step_graphs"), "warnings": warned,
            "compiled_plans": plans, **(compile_events(res.stderr) if compiled else {})}


def table(results: dict[str, list[dict]], recipes: list[str], planned: dict[str, list[str]]) -> str:
    """Markdown: per cell and batch, dense tokens/s and each sparse recipe's ratio of medians."""
    lines = ["| path | micro-batch x seq per GPU | dense tokens/s, median (min-max) | "
             + " | ".join(f"{r} / dense" for r in recipes if r != "dense") + " | runs | steps replayed | command |",
             "|---|---|---|" + "---|" * (len(recipes) - 1) + "---|---|---|"]
    for key, cmd in planned.items():
        cell, batch = key.split("|")
        got = {r: [x["tokens_per_s"] for x in results.get(f"{key}|{r}", [])] for r in recipes}
        med = {r: statistics.median(v) if v else None for r, v in got.items()}
        dense = got.get("dense") or []
        dense_txt = f"{med['dense']:,.0f} ({min(dense):,.0f}-{max(dense):,.0f})" if dense else "n/a"
        ratios = [f"{med[r] / med['dense']:.2f}x" if med[r] and med.get("dense") else "n/a"
                  for r in recipes if r != "dense"]
        replays = [x["step_graphs"] for r in recipes for x in results.get(f"{key}|{r}", [])]
        counts = [f"{g['replayed_steps']}/{g['replayed_steps'] + g['eager_steps']}" for g in replays
                  if g and "eager_steps" in g]
        replay_txt = ("-" if not counts else f"{counts[0]} in each run" if len(set(counts)) == 1 and
                      len(counts) == len(replays) else ", ".join(counts))
        runs = "/".join(str(len(got[r])) for r in recipes)
        lines.append(f"| {cell} | {batch} | {dense_txt} | " + " | ".join(ratios)
                     + f" | {runs} | {replay_txt} | `{cmd}` |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="one-eager,one-compile,ddp-eager,ddp-compile,ddp-busy,fsdp")
    ap.add_argument("--gpus", type=int, default=2, help="processes of the torchrun cells")
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batches", default="8,16,32", help="micro-batch per GPU")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--recipes", default="dense,ste,s-ste")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=240, help="seconds a run may take")
    ap.add_argument("--budget-s", type=float, default=None, help="start no run past this many seconds")
    ap.add_argument("--out", default=None, help="folder for table.md and runs.json")
    ap.add_argument("--from-runs", nargs="+", default=None, metavar="RUNS_JSON",
                    help="run nothing: the table of these runs.json files merged (with the options they ran with)")
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    known = cells(a.gpus)
    chosen = [known[c] for c in a.cells.split(",")]
    batches, recipes = [int(b) for b in a.batches.split(",")], a.recipes.split(",")
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    t0, results, planned = time.monotonic(), {}, {}

    def train_args(batch: int) -> list[str]:
        return ["--model", a.model, "--batch-size", str(batch), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
                "--eval-interval", str(a.steps), "--ckpt-interval", "0", "--log-interval", "5", *extra]
    for cell in chosen:
        for b in batches:
            launch = "twofour" if cell.nproc == 1 else f"torchrun --nproc-per-node {cell.nproc} -m twofour"
            planned[f"{cell.name}|{b} x {a.seq_len}"] = " ".join(
                [launch, shlex.join(["train", *train_args(b), *cell.args, "--recipe", "RECIPE"])]) + (
                f"` beside {cell.busy} CPU-busy processes`" if cell.busy else "")
    if a.from_runs:
        for f in a.from_runs:
            for key, runs in json.loads(Path(f).read_text()).items():
                results.setdefault(key, []).extend(runs)
        ran = {k: c for k, c in planned.items() if any(r.startswith(k + "|") for r in results)}
        print(table(results, recipes, ran))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for cell in chosen:
                with busy_cpus(cell.busy):
                    for b in batches:
                        for r in recipes:
                            if a.budget_s is not None and time.monotonic() - t0 > a.budget_s:
                                break
                            key = f"{cell.name}|{b} x {a.seq_len}"
                            cmd = cell.command([*train_args(b), "--recipe", r])
                            got = run_once(cmd, Path(tmp) / "run", a.timeout, cell.compiled)
                            print(f"[{time.monotonic() - t0:5.0f} s] rep {rep + 1} {cell.name} b{b} {r}: "
                                  f"{got}", flush=True)
                            if got is not None:
                                results.setdefault(f"{key}|{r}", []).append(got)
                            if out:
                                (out / "runs.json").write_text(json.dumps(results, indent=1))
                                (out / "table.md").write_text(table(results, recipes, planned) + "\n")
    print(table(results, recipes, planned))


if __name__ == "__main__":
    main()
