"""``twofour bench``: twofour against dense bf16 on this GPU, from one run.

Ratios are dense time / twofour time (above 1 is faster), medians of CUDA-event timings
(``triton.testing.do_bench``), dense measured in the same run on the same random data.
The last section, :func:`train_throughput`, runs ``twofour train`` itself as subprocesses and
reports the tokens/s a user sees, sparse recipes against dense, eager and compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from . import dispatch
from .activations import GELU_TANH, SWIGLU, Activation, linear_act
from .functional import transposable_mask_24
from .kernels import cusparselt, ops
from .sparse.layer import SparseLinear
from .sparse.recipes import Recipe, make_recipe
from .training.config import CUDA_GRAPH_MODES
from .training.runs import CKPT, read_summary
from .version import __version__

__all__ = ["run_bench", "fwd_bwd_step", "preset_train_step", "train_step_ms", "train_throughput", "throughput_table",
           "copy_bandwidth"]

# (name, d_model, d_ffn, tokens) of a transformer's FFN pair; tokens = seq 1024 x micro-batch
SHAPES = [("gpt2-124m", 768, 3072, 32768), ("gpt2-350m", 1024, 4096, 32768), ("gpt2-774m", 1280, 5120, 32768),
          ("gpt2-1.5b", 1600, 6400, 32768), ("llama-7b-ffn", 4096, 11008, 16384)]
#: (name, preset) of the SwiGLU FFN blocks benched at 16384 tokens (seq 1024 x 16): d -> 2 x H -> d
SWIGLU_SHAPES = [("llama-1b", "llama-1b", 16384), ("llama-7b-ffn", "llama-7b", 16384)]
LAYER_RECIPES = [make_recipe(name) for name in ("ste", "sr-ste", "s-ste", "t-sr-ste")]
DENSE, S_STE, T_SR_STE = make_recipe("dense"), make_recipe("s-ste"), make_recipe("t-sr-ste")
# twofour train section: (model, micro-batch) at seq 1024 and the recipes, quick and full
TRAIN_QUICK = ([("gpt2-124m", 32)], ("dense", "s-ste"))
TRAIN_FULL = ([("gpt2-124m", 32), ("gpt2-774m", 16)], ("dense", "ste", "s-ste"))
#: the modes of twofour bench's real-loop runs: eager, --compile, and --compile with CUDA graphs
#: (the sparse step's custom ops cost the host more than dense GEMMs: docs/PERFORMANCE.md)
REAL_LOOP_MODES = (False, True, "reduce-overhead")
#: micro-batch per preset when train_throughput isn't given one (seq 1024 in bf16 on an 80 GB GPU)
TRAIN_BATCH = {"tiny": 16, "gpt2-124m": 32, "gpt2-350m": 16, "gpt2-774m": 16, "gpt2-1.5b": 8, "llama-tiny": 16,
               "llama-125m": 32, "llama-350m": 16, "llama-1b": 8}


def _bench(fn, quick: bool) -> float:
    from triton.testing import do_bench  # noqa: PLC0415

    return do_bench(fn, warmup=10 if quick else 25, rep=50 if quick else 200, return_mode="median")


def copy_bandwidth(quick: bool = False) -> float:
    """Device copy bandwidth in GB/s (bytes read + written by a 256 MB bf16 copy): the limit of
    the memory-bound kernels benched against it."""
    x = torch.randn(128 * 2**20, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / _bench(lambda: y.copy_(x), quick) / 1e6  # GB/s, bytes read + written


def _gemms(t: int, k: int, n: int, quick: bool) -> dict[str, float]:
    """Each GEMM of a linear alone: dense time / best 2:4 time (operands pre-compressed)."""
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda")
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    wc, wd = ops.compress(w, "hard", dense_out=True)
    m = transposable_mask_24(w)
    wtc = ops.compress(w.t(), "mask", mask=m.t())[0]
    wtd = (w * m).bfloat16()
    dyc = ops.compress(dy.t(), "mvue", seed=torch.tensor([1], device="cuda"))[0]
    out = {}
    fd = _bench(lambda: x @ wd.t(), quick)
    out["fwd"] = fd / min(_bench(lambda d=d: ops.spmm(wc, x.t(), n, d), quick) for d in (False, True))
    xd = _bench(lambda: dy @ wtd, quick)
    out["dX (W^T 2:4)"] = xd / min(_bench(lambda d=d: ops.spmm(wtc, dy.t(), k, d), quick) for d in (False, True))
    wdt = _bench(lambda: dy.t() @ x, quick)
    out["dW"] = wdt / _bench(lambda: ops.spmm(dyc, x, n, False), quick)
    return out


def _kernels(t: int, k: int, n: int, bw: float, quick: bool) -> dict[str, tuple[float, float, float]]:
    """Each fused kernel: GB/s (bytes it must read and write, kernel time by CUDA graph replay),
    fraction of copy bandwidth, and the eager call's time in ms (host launch cost included)."""
    from triton.testing import do_bench_cudagraph  # noqa: PLC0415

    w = torch.randn(n, k, device="cuda")
    beta = torch.ones(1, device="cuda")
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    seed = torch.tensor([3], device="cuda")
    cbytes = n * k // 2 * 2 + n * k // 8
    cases = {"soft threshold + scale + compress W": (lambda: ops.compress(w, "soft", scale=beta), n * k * 4 + cbytes),
             "hard mask + compress W (+ dense W_eff)": (lambda: ops.compress(w, "hard", dense_out=True),
                                                        n * k * 6 + cbytes),
             "MVUE + compress dY^T, read in place from dY": (
                 lambda: ops.compress(dy.t(), "mvue", seed=seed), t * n * 2 + t * n // 2 * 2 + t * n // 8)}
    res = {}
    for name, (fn, nbytes) in cases.items():
        fn()  # autotune outside the graph
        gbs = nbytes / do_bench_cudagraph(fn, rep=50 if quick else 200) / 1e6
        res[name] = (gbs, gbs / bw, _bench(fn, quick))
    return res


def fwd_bwd_step(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """One forward + backward of ``module`` under bf16 autocast, as a training step would run it;
    every SparseLinear forgets its compressed weight first (a new weight each step), so its
    pruning and compression are counted."""

    def step():
        for p in module.parameters():
            p.grad = None
        for mod in module.modules():
            if isinstance(mod, SparseLinear):
                mod.compressed.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.backward(g)

    return step


def _fwd_bwd(module: nn.Module, x: torch.Tensor, g: torch.Tensor, quick: bool) -> float:
    return _bench(fwd_bwd_step(module, x, g), quick)


def _layers(t: int, k: int, n: int, quick: bool, ffn_in: bool) -> dict[str, float]:
    """One layer in the FFN's layout plan: the first linear (``ffn_in``) may leave its output as
    y^T; the second reads that y^T (a column-major x) and writes a row-major y."""
    x = (torch.randn(t, k, device="cuda") if ffn_in else torch.randn(k, t, device="cuda").t()).requires_grad_()
    g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    dense = nn.Linear(k, n, device="cuda")
    td = _fwd_bwd(dense, x, g, quick)
    out = {}
    for r in LAYER_RECIPES:
        layer = SparseLinear(k, n, device="cuda", recipe=r, transposed_output=ffn_in)
        _fwd_bwd(layer, x, g, True)  # measure the dispatch choices first
        out[r.name] = td / _fwd_bwd(layer, x, g, quick)
    return out


class FFNBlock(nn.Module):
    """An FFN block as the models run it: ``fc`` (``transposed_output`` when sparse) -> ``act``
    -> ``proj``, the activation passed to ``fc`` (:func:`twofour.activations.linear_act`; with
    ``fused=False`` computed after it instead). GELU: d -> h -> d with biases; SwiGLU: d -> 2h
    (gate|up interleaved) -> h -> d without. Dense ``nn.Linear`` without ``recipe``."""

    def __init__(self, d: int, h: int, act: Activation = GELU_TANH, recipe: Recipe | None = None,
                 fused: bool = True):
        super().__init__()
        n, bias = (2 * h, False) if act is SWIGLU else (h, True)
        if recipe is None:
            self.fc, self.proj = nn.Linear(d, n, bias=bias), nn.Linear(h, d, bias=bias)
        else:
            self.fc = SparseLinear(d, n, bias=bias, recipe=recipe, transposed_output=True)
            self.proj = SparseLinear(h, d, bias=bias, recipe=recipe)
        self.act, self.fused = act, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear_act(self.fc, x, self.act) if self.fused else self.act(self.fc(x))
        return self.proj(h)


def _ffn(t: int, d: int, h: int, quick: bool, recipe: Recipe) -> float:
    x = torch.randn(t, d, device="cuda", requires_grad=True)
    g = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    dense = FFNBlock(d, h).cuda()
    sparse = FFNBlock(d, h, recipe=recipe).cuda()
    _fwd_bwd(sparse, x, g, True)
    return _fwd_bwd(dense, x, g, quick) / _fwd_bwd(sparse, x, g, quick)


def _swiglu_ffn(t: int, d: int, h: int, quick: bool, recipe: Recipe) -> tuple[float, float]:
    """Llama's FFN block (:class:`twofour.models.GatedMLP`: gate|up -> fused SwiGLU -> down),
    dense and with ``recipe`` on both linears in the layout plan (gate|up may leave z^T, which
    the activation and down read in place): (dense ms, dense time / sparse time)."""
    from .models.llama import GatedMLP  # noqa: PLC0415
    from .sparse.convert import sparsify  # noqa: PLC0415

    x = torch.randn(t, d, device="cuda", requires_grad=True)
    g = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    dense = GatedMLP(d, h).cuda()
    sparse = sparsify(GatedMLP(d, h).cuda(), recipe, include=("gate_up", "down"), transposed_output=("gate_up",))
    _fwd_bwd(sparse, x, g, True)  # measure the dispatch choices first
    td = _fwd_bwd(dense, x, g, quick)
    return td, td / _fwd_bwd(sparse, x, g, quick)


def _swiglu_kernels(t: int, h: int, bw: float, quick: bool) -> dict[str, tuple[float, float, float]]:
    """The fused SwiGLU kernels on a (t, 2h) bf16 gate|up output stored row-major and as z^T:
    GB/s (the bytes each must read and write once; kernel time by CUDA graph replay), fraction of
    copy bandwidth, and the time of torch's unfused eager ops for the same work over the fused
    call's (both eager)."""
    def stored(rows: int, cols: int, column_major: bool) -> torch.Tensor:
        shape = (cols, rows) if column_major else (rows, cols)
        z = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        return z.t() if column_major else z

    res = {}
    for order, column_major in (("z row-major", False), ("z^T stored (z column-major)", True)):
        z, dh = stored(t, 2 * h, column_major), stored(t, h, column_major)
        for name, row in _swiglu_kernel_rows(z, dh, bw, quick).items():
            res[f"{name}, {order}"] = row
    return res


def _swiglu_kernel_rows(z: torch.Tensor, dh: torch.Tensor, bw: float, quick: bool) -> dict[str, tuple]:
    from triton.testing import do_bench_cudagraph  # noqa: PLC0415

    from .kernels.swiglu import swiglu_backward, swiglu_forward  # noqa: PLC0415

    silu = torch.nn.functional.silu
    t, h = dh.shape
    zr = z.detach().requires_grad_()
    yr = silu(zr[:, 0::2]) * zr[:, 1::2]
    cases = {"forward": (lambda: swiglu_forward(z), 6 * t * h, lambda: silu(z[:, 0::2]) * z[:, 1::2]),
             "backward": (lambda: swiglu_backward(z, dh), 10 * t * h,
                          lambda: torch.autograd.grad(yr, zr, dh, retain_graph=True))}
    res = {}
    for name, (fn, nbytes, unfused) in cases.items():
        fn()  # autotune outside the graph
        gbs = nbytes / do_bench_cudagraph(fn, rep=50 if quick else 200) / 1e6
        res[name] = (gbs, gbs / bw, _bench(unfused, quick) / _bench(fn, quick))
    return res


def preset_train_step(preset: str, batch: int, recipe: Recipe, *, transposed_output: bool = True,
                      advance: bool = True, vocab_size: int = 50304,
                      compile: bool | str = False) -> tuple[nn.Module, Callable[[], None]]:
    """A model ``preset`` (GPT or Llama; vocabulary ``vocab_size``, sequence 1024) on the GPU with
    ``recipe`` on its FFN linears (dense bf16 left as nn.Linear; the first, fc or gate|up, with
    ``transposed_output``), fused AdamW and, with ``advance``, ``attach()``; returns the model and
    a function that runs one training step on a fixed random batch, through ``torch.compile(model)``
    with ``compile`` (as ``twofour train --compile`` runs it; a string is torch.compile's ``mode``)."""
    from .models.common import FFN_IN_PATTERNS, FFN_PATTERNS
    from .models.presets import PRESETS  # noqa: PLC0415
    from .sparse.convert import attach, sparsify  # noqa: PLC0415

    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: a 1B model's init on the CPU takes a while
        model = PRESETS[preset].build(block_size=1024, vocab_size=vocab_size)
    if recipe.sparse or recipe.precision.fp8:
        sparsify(model, recipe, include=FFN_PATTERNS, transposed_output=FFN_IN_PATTERNS if transposed_output else ())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if advance:
        attach(model, opt)
    idx = torch.randint(0, vocab_size, (batch, 1024), device="cuda")
    mode = compile if isinstance(compile, str) else None
    fwd = torch.compile(model, mode=mode) if compile else model

    def step():
        if mode in CUDA_GRAPH_MODES:  # a new step: the last one's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(idx, idx)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def train_step_ms(preset: str, batch: int, recipe: Recipe, vocab_size: int = 50304) -> float:
    """Median ms of 12 training steps of :func:`preset_train_step` after 3 warm-up steps."""
    step = preset_train_step(preset, batch, recipe, vocab_size=vocab_size)[1]
    for _ in range(3):
        step()
    return _median_ms(step, 12)


def _median_ms(fn, n: int) -> float:
    """Median of ``n`` back-to-back runs, each timed by CUDA events, one sync at the end (for
    steps long enough that do_bench's time budget would allow only one or two runs)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _train_step(preset: str, batches: tuple[int, ...], vocab_size: int) -> tuple[float, float, int]:
    """A whole training step (forward, backward, AdamW): dense vs s-ste on the FFN linears, at
    the largest of ``batches`` whose dense step fits in the GPU's memory: (ratio, dense ms, batch)."""
    for batch in batches:
        try:
            dense = train_step_ms(preset, batch, DENSE, vocab_size)
        except torch.OutOfMemoryError:
            dense = None
        gc.collect()  # the failed attempt's model, once its traceback is gone
        torch.cuda.empty_cache()
        if dense is None:
            continue
        sparse = train_step_ms(preset, batch, S_STE, vocab_size)
        torch.cuda.empty_cache()
        return dense / sparse, dense, batch
    raise RuntimeError(f"twofour bench: no micro-batch of {batches} fits {preset} on this GPU")


def _gemm_rate(quick: bool) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / _bench(lambda: a @ a, quick) / 1e9


def _mode(compiled: bool | str) -> str:
    """A run's mode as the table shows it: eager, compiled, or compiled with a torch.compile mode."""
    return f"compiled ({compiled})" if isinstance(compiled, str) else "compiled" if compiled else "eager"


def _compile_args(compiled: bool | str) -> list[str]:
    return ["--compile", *(["--compile-mode", compiled] if isinstance(compiled, str) else [])] if compiled else []


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
    tok_s = summary["tokens_per_s"]
    (out / CKPT).unlink(missing_ok=True)  # a bench needs no checkpoint, and a 774M one is ~9 GB
    return float(tok_s)


def train_throughput(models: Sequence[str], recipes: Sequence[str], *,
                     compile_modes: Sequence[bool | str] = (False, True),
                     repeats: int = 3, steps: int = 40, batch_sizes: Sequence[int] | None = None,
                     seq_len: int = 1024, workdir: str | Path | None = None, extra_args: Sequence[str] = (),
                     progress: bool = True) -> list[dict]:
    """Tokens/s of ``twofour train`` as a user runs it (one fresh process per run), per model,
    recipe and mode (``compile_modes``: False eager, True ``--compile``, a string ``--compile
    --compile-mode`` that mode): the runs' summary.json ``tokens_per_s`` (the loop's own median
    after its warm-up/compile steps), median, min and max over ``repeats``.

    Each repeat runs every configuration once, in the same order (repeats outermost), so drift
    (clocks, heat, other load) hits every configuration alike. ``batch_sizes``: one micro-batch
    per model (default :data:`TRAIN_BATCH`'s, else 16); ``extra_args`` go to every run (e.g.
    ``["--device", "cpu"]``). Runs go to a temporary folder removed afterwards, or to
    ``workdir`` (kept, less each run's checkpoint, which is deleted as soon as the run ends).
    A failed run raises RuntimeError with its last stderr lines. ``progress``: one line per
    finished run on stderr.

    Returns one dict per (model, recipe, mode), in that order: model, batch_size, seq_len, recipe,
    compile, mode, tokens_per_s (every repeat's), median, min, max, and the ratios of medians
    vs_dense (to dense of the same model and mode) and vs_dense_compiled (to the fastest compiled
    dense of the model over the modes measured, the fastest dense a user can run); a ratio is None
    where its dense wasn't measured.
    """
    if batch_sizes is None:
        batch_sizes = [TRAIN_BATCH.get(m, 16) for m in models]
    if len(batch_sizes) != len(models):
        raise ValueError(f"train_throughput: {len(batch_sizes)} batch sizes for {len(models)} models, "
                         "give one per model")
    if repeats < 1 or steps < 1:
        raise ValueError(f"train_throughput: repeats and steps must be >= 1, got {repeats} and {steps}")
    configs = [(m, b, r, c) for m, b in zip(models, batch_sizes) for r in recipes for c in compile_modes]
    measured: dict[tuple, list[float]] = {key: [] for key in configs}
    where = tempfile.TemporaryDirectory(prefix="twofour-bench-") if workdir is None else contextlib.nullcontext(workdir)
    with where as folder:
        root = Path(folder)
        for rep in range(repeats):
            for i, (model, batch, recipe, compiled) in enumerate(configs):
                out = root / f"{model}-b{batch}-{recipe}-{_mode(compiled)}-r{rep}"
                cmd = [sys.executable, "-m", "twofour", "train", "--model", model, "--recipe", recipe,
                       "--steps", str(steps), "--batch-size", str(batch), "--seq-len", str(seq_len),
                       *_compile_args(compiled), "--eval-interval", str(steps),
                       "--ckpt-interval", str(steps), "--out", str(out), "--overwrite", "--no-progress",
                       *extra_args]
                tok_s = _train_once(cmd, out)
                measured[(model, batch, recipe, compiled)].append(tok_s)
                if progress:
                    print(f"twofour bench: [{rep * len(configs) + i + 1}/{repeats * len(configs)}] {model} "
                          f"b{batch}x{seq_len} {recipe} {_mode(compiled)}: {tok_s:,.0f} tokens/s",
                          file=sys.stderr, flush=True)
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

    def ratio(r: float | None) -> str:
        return "n/a" if r is None else f"{r:.2f}x"

    lines = ["| model | micro-batch x seq | recipe | mode | tokens/s median (min-max) | vs dense same mode "
             "| vs dense compiled |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch_size']} x {r['seq_len']} | {r['recipe']} | {r['mode']} "
                     f"| {r['median']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) | {ratio(r['vs_dense'])} "
                     f"| {ratio(r['vs_dense_compiled'])} |")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> str:
    """Run every measurement, print the markdown report, and write it where ``--write`` says."""
    if not torch.cuda.is_available():
        raise ValueError("twofour bench needs a CUDA GPU; none is available here")
    if not ops.fast_available():
        raise ValueError("twofour bench needs Triton and nvmath-python's cuSPARSELt bindings "
                         "(pip install 'twofour[gpu]')")
    quick = args.quick
    shapes = SHAPES[2:] if quick else SHAPES
    import triton  # noqa: PLC0415

    bw = copy_bandwidth(quick)
    tflops = _gemm_rate(quick)
    lines = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
             f"cuSPARSELt {cusparselt.version()}, "
             f"twofour {__version__}, Python {platform.python_version()}; copy bandwidth {bw:.0f} GB/s, "
             f"dense bf16 {tflops:.0f} TFLOP/s (8192^3). Ratios: dense bf16 time / twofour time.", ""]
    lines += ["### GEMMs of one linear (operands already compressed)", "",
              "| shape | tokens x in -> out | fwd | dX (W^T 2:4) | dW (MVUE dY^T) |", "|---|---|---|---|---|"]
    for name, d, h, t in shapes:
        for k, n in ((d, h), (h, d)):
            r = _gemms(t, k, n, quick)
            lines.append(f"| {name} | {t} x {k} -> {n} | {r['fwd']:.2f}x | {r['dX (W^T 2:4)']:.2f}x | {r['dW']:.2f}x |")
            print(lines[-1], flush=True)
    lines += ["", "### Fused pruning + compression kernels (kernel time by CUDA graph replay)", "",
              "| kernel | shape | GB/s | of copy bandwidth | eager call ms |", "|---|---|---|---|---|"]
    for name, d, h, t in shapes[-3:]:
        for kname, (gbs, frac, eager) in _kernels(t, d, h, bw, quick).items():
            lines.append(f"| {kname} | {name} ({t} tokens, {d}->{h}) | {gbs:.0f} | {frac:.0%} | {eager:.3f} |")
            print(lines[-1], flush=True)
    lines += ["", "### SparseLinear forward + backward (pruning, compression and MVUE included), per recipe", "",
              "In the FFN's layout plan: the first linear may leave y^T (`transposed_output=True`), the second "
              "reads it (a column-major x) and writes a row-major y; dense nn.Linear on the same x.", "",
              "| shape | tokens x in -> out | " + " | ".join(r.name for r in LAYER_RECIPES) + " |",
              "|---|---|" + "---|" * len(LAYER_RECIPES)]
    for name, d, h, t in shapes:
        for k, n in ((d, h), (h, d)):
            r = _layers(t, k, n, quick, ffn_in=(k, n) == (d, h))
            ratios = " | ".join(f"{r[x.name]:.2f}x" for x in LAYER_RECIPES)
            lines.append(f"| {name} | {t} x {k} -> {n} | {ratios} |")
            print(lines[-1], flush=True)
    lines += ["", "### FFN block (fc -> GELU -> proj), forward + backward", "", "| shape | tokens | s-ste | t-sr-ste |",
              "|---|---|---|---|"]
    for name, d, h, t in shapes:
        s_ste, t_sr = _ffn(t, d, h, quick, S_STE), _ffn(t, d, h, quick, T_SR_STE)
        lines.append(f"| {name} | {t} | {s_ste:.2f}x | {t_sr:.2f}x |")
        print(lines[-1], flush=True)
    from .models.presets import PRESETS  # noqa: PLC0415

    lines += ["", "### SwiGLU FFN block (gate|up -> fused SwiGLU -> down, no biases), forward + backward", "",
              "Llama's FFN: gate and up as one linear with interleaved rows (its output may stay z^T), the fused "
              "activation reading it in place, down reading h in that order; dense: nn.Linear with the same fused "
              "activation.", "", "| shape | tokens x d -> 2 x H -> d | dense ms | s-ste | t-sr-ste |",
              "|---|---|---|---|---|"]
    for name, preset, t in SWIGLU_SHAPES[-1:] if quick else SWIGLU_SHAPES:
        d, h = PRESETS[preset].config.n_embd, PRESETS[preset].config.hidden
        td, s_ste = _swiglu_ffn(t, d, h, quick, S_STE)
        t_sr = _swiglu_ffn(t, d, h, quick, T_SR_STE)[1]
        lines.append(f"| {name} | {t} x {d} -> 2 x {h} -> {d} | {td:.2f} | {s_ste:.2f}x | {t_sr:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "### Fused SwiGLU activation (kernel time by CUDA graph replay)", "",
              "| kernel | shape | GB/s | of copy bandwidth | torch's unfused eager ops / fused (time) |",
              "|---|---|---|---|---|"]
    name, preset, t = SWIGLU_SHAPES[-1]
    h = PRESETS[preset].config.hidden
    for kname, (gbs, frac, vs_torch) in _swiglu_kernels(t, h, bw, quick).items():
        lines.append(f"| {kname} | {name} ({t} tokens, 2 x {h}) | {gbs:.0f} | {frac:.0%} | {vs_torch:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "### Full training step (bf16 autocast, fused AdamW; s-ste on the FFN linears)", "",
              "fc1 or gate|up with `transposed_output`, `attach()`'s mask refresh included; the largest "
              "micro-batch of 64/32/16 (gpt2-124m), 32/16/8 (gpt2-774m) or 16/8/4 (llama-1b) whose dense step "
              "fits in the GPU's memory; vocabulary 50304 (GPT-2) or 32000 (Llama); median of 12 steps.", "",
              "| model | micro-batch x seq | dense step ms | s-ste ratio |", "|---|---|---|---|"]
    steps = [("gpt2-124m", (64, 32, 16), 50304), ("gpt2-774m", (32, 16, 8), 50304),
             ("llama-1b", (16, 8, 4), 32000)]
    for preset, batches, vocab in steps[1:] if quick else steps:
        ratio, td, batch = _train_step(preset, batches, vocab)
        lines.append(f"| {preset} | {batch} x 1024 | {td:.1f} | {ratio:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "Dispatch choices measured in this run (`twofour.dispatch.choices()`):", "", "```"]
    lines += dispatch.choice_lines() + ["```"]
    gc.collect()  # leave the GPU's memory to the training processes
    torch.cuda.empty_cache()
    models, recipes = TRAIN_QUICK if quick else TRAIN_FULL
    repeats, steps = 3, 40
    lines += ["", "### twofour train: tokens/s of the real loop", "",
              f"`twofour train --steps {steps} [--compile [--compile-mode reduce-overhead]]` as a user runs it, each "
              "run a fresh process (default "
              "data, bf16 autocast, fused AdamW, the recipe on the FFN linears, its own dispatch choices); tokens/s "
              "is the run's `summary.json` `tokens_per_s` (the loop's median after its warm-up/compile steps); "
              f"median (min-max) of {repeats} runs, the configurations interleaved in each repeat. Ratios of "
              "medians: to dense in the same mode, and to the fastest compiled dense (the fastest dense a user can "
              "run).", ""]
    rows = train_throughput([m for m, _ in models], recipes, compile_modes=REAL_LOOP_MODES, repeats=repeats,
                            steps=steps, batch_sizes=[b for _, b in models], seq_len=1024)
    lines.append(throughput_table(rows))
    report = "\n".join(lines) + "\n"
    print("\n" + report)
    if args.write:
        _write_section(Path(args.write), report)
    return report


def _write_section(path: Path, report: str, marker: str = "bench") -> None:
    """Replace the text between the ``marker`` markers of ``path`` (``<!-- bench:begin -->`` and
    ``<!-- bench:end -->`` by default; or append them) with ``report``."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{report}{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text += ("\n" if text else "") + block + "\n"
    path.write_text(text)

