"""Tokens/s of the real training loop: ``twofour train`` run as a user runs it, one fresh process
per run, repeated and interleaved, sparse recipes against dense, eager and compiled (the last
section of ``twofour bench``; ``benchmarks/step/train_throughput.py`` runs it alone)."""

from __future__ import annotations

import contextlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..training.checkpoint import CKPT, SHARDED
from ..training.runs import read_summary

__all__ = ["train_throughput", "throughput_table", "TRAIN_BATCH"]

#: micro-batch per preset when train_throughput isn't given one (seq 1024 in bf16 on an 80 GB GPU)
TRAIN_BATCH = {"tiny": 16, "gpt2-124m": 32, "gpt2-350m": 16, "gpt2-774m": 16, "gpt2-1.5b": 8, "llama-tiny": 16,
               "llama-125m": 32, "llama-350m": 16, "llama-1b": 8}


def _mode(compiled: bool | str) -> str:
    """A run's mode as the table shows it: eager, compiled, or compiled with a torch.compile mode."""
    return f"compiled ({compiled})" if isinstance(compiled, str) else "compiled" if compiled else "eager"


def _train_once(cmd: list[str], out: Path) -> float:
    """Run one ``twofour train`` command; its summary.json's tokens/s, or RuntimeError with the
    end of its stderr if it failed (a benchmark that skips a failed run reports a wrong table)."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = "\n".join(res.stderr.rstrip().splitlines()[-20:])
        raise RuntimeError(f"twofour train failed (exit status {res.returncode}): {shlex.join(cmd)}\n{tail}")
    summary = read_summary(out)
    if summary is None:
        raise RuntimeError(f"twofour train wrote no summary in {out}: {shlex.join(cmd)}")
    (out / CKPT).unlink(missing_ok=True)  # a bench needs no checkpoint, and a 774M one is ~9 GB
    shutil.rmtree(out / SHARDED, ignore_errors=True)  # an FSDP2 run's
    return float(summary["tokens_per_s"])


def train_throughput(models: Sequence[str], recipes: Sequence[str], *,
                     compile_modes: Sequence[bool | str] = (False, True), repeats: int = 3, steps: int = 40,
                     batch_sizes: Sequence[int] | None = None, seq_len: int = 1024, workdir: str | Path | None = None,
                     extra_args: Sequence[str] = (), progress: bool = True) -> list[dict]:
    """Tokens/s of ``twofour train`` as a user runs it (a fresh process per run), per model, recipe
    and mode (``compile_modes``: False eager, True ``--compile``, a string ``--compile
    --compile-mode`` that mode): each run's summary.json ``tokens_per_s`` (the loop's median after
    its warm-up/compile steps); median, min and max over ``repeats``, each repeat running every
    configuration once in the same order (drift hits all alike). ``batch_sizes``: one per model
    (default :data:`TRAIN_BATCH`'s, else 16); ``extra_args`` go to every run. Runs go to a temporary
    folder, or to ``workdir`` (kept, less each run's checkpoint). A failed run raises RuntimeError
    with its last stderr lines; ``progress``: a line per finished run on stderr. Returns a dict per
    (model, recipe, mode): model, batch_size, seq_len, recipe, compile, mode, tokens_per_s (each
    repeat's), median, min, max, and the ratios of medians vs_dense (to dense in the same mode) and
    vs_dense_compiled (to the fastest compiled dense of the model); None where it wasn't run."""
    batch_sizes = [TRAIN_BATCH.get(m, 16) for m in models] if batch_sizes is None else batch_sizes
    if len(batch_sizes) != len(models):
        raise ValueError(f"train_throughput: {len(batch_sizes)} batch sizes for {len(models)} models, "
                         "give one per model")
    if repeats < 1 or steps < 1:
        raise ValueError(f"train_throughput: repeats and steps must be >= 1, got {repeats} and {steps}")
    configs = [(m, b, r, c) for m, b in zip(models, batch_sizes) for r in recipes for c in compile_modes]
    measured: dict[tuple, list[float]] = {key: [] for key in configs}
    where = tempfile.TemporaryDirectory(prefix="twofour-bench-") if workdir is None else contextlib.nullcontext(workdir)
    with where as folder:
        for rep in range(repeats):
            for i, (model, batch, recipe, compiled) in enumerate(configs):
                out = Path(folder) / f"{model}-b{batch}-{recipe}-{_mode(compiled)}-r{rep}"
                mode = ["--compile", *(["--compile-mode", compiled] if isinstance(compiled, str) else [])]
                cmd = [sys.executable, "-m", "twofour", "train", "--model", model, "--recipe", recipe, "--steps",
                       str(steps), "--batch-size", str(batch), "--seq-len", str(seq_len), *(mode if compiled else []),
                       "--eval-interval", str(steps), "--ckpt-interval", str(steps), "--out", str(out), "--overwrite",
                       "--no-progress", *extra_args]
                measured[(model, batch, recipe, compiled)].append(tok_s := _train_once(cmd, out))
                if progress:
                    print(f"twofour bench: [{rep * len(configs) + i + 1}/{repeats * len(configs)}] {model} "
                          f"b{batch}x{seq_len} {recipe} {_mode(compiled)}: {tok_s:,.0f} tokens/s", file=sys.stderr,
                          flush=True)
    med = {key: statistics.median(v) for key, v in measured.items()}
    rows = []
    for (model, batch, recipe, compiled), values in measured.items():
        dense = med.get((model, batch, "dense", compiled))
        dense_c = max((v for (m, b, r, c), v in med.items() if (m, b, r) == (model, batch, "dense") and c),
                      default=None)
        m = med[(model, batch, recipe, compiled)]
        rows.append({"model": model, "batch_size": batch, "seq_len": seq_len, "recipe": recipe, "compile": compiled,
                     "mode": _mode(compiled), "tokens_per_s": values, "median": m, "min": min(values),
                     "max": max(values), "vs_dense": m / dense if dense else None,
                     "vs_dense_compiled": m / dense_c if dense_c else None})
    return rows


def throughput_table(rows: Sequence[dict]) -> str:
    """:func:`train_throughput`'s rows as a markdown table (ratios above 1: faster than dense)."""
    lines = ["| model | micro-batch x seq | recipe | mode | tokens/s median (min-max) | vs dense same mode "
             "| vs dense compiled |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = ["n/a" if v is None else f"{v:.2f}x" for v in (r["vs_dense"], r["vs_dense_compiled"])]
        lines.append(f"| {r['model']} | {r['batch_size']} x {r['seq_len']} | {r['recipe']} | {r['mode']} "
                     f"| {r['median']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)
