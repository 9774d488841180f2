"""What the benchmark scripts share: the timers, the copy-bandwidth and GEMM-rate probes, markdown
table lines, a header naming the GPU and the software, and a preset's training step to time.

Scripts run as ``PYTHONPATH=src python benchmarks/FOLDER/SCRIPT.py`` from the repository's root and
import this module after putting its folder on ``sys.path``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
    from common import bench_ms  # noqa: E402

Only twofour's public names are used here and in the scripts (``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import twofour
from twofour import timing
from twofour.inference import SparseInferenceLinear
from twofour.models import ATTN_PATTERNS, FFN_IN_PATTERNS, FFN_PATTERNS, PRESETS
from twofour.sparse import Recipe, attach, sparsify
from twofour.training.config import CUDA_GRAPH_MODES

LEAD_CYCLES = timing.LEAD_CYCLES  # the dispatch's device-side wait before a timed window


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


@contextlib.contextmanager
def busy_cpus(n: int):
    """``n`` processes that each keep a CPU core busy while the block runs (as a data loader's
    workers would): a step that slows beside them is bound by the host."""
    stop = mp.Event()
    procs = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join()


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (CUDA events, the L2 cache flushed before
    each call, calls for about ``rep`` ms after ``warmup`` ms of them): a kernel or a step from an
    idle device, its launch included."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn: Callable[[], object], *, inner: int = 1, reps: int = 20) -> float:
    """Milliseconds of one call of ``fn`` without the host's launch cost: ``inner`` calls captured
    back to back in one CUDA graph (after 2 calls on a side stream, where the dispatch measures
    and the kernels tune), replayed ``reps`` times, each replay timed by CUDA events; median / ``inner``
    (:func:`twofour.timing.graph_ms`)."""
    return timing.graph_ms(fn, reps, inner=inner)


def steps_ms(fn: Callable[[], object], n: int = 12, *, calls: int = 1, lead: bool = False) -> float:
    """Median ms per call over ``n`` windows of ``calls`` back-to-back calls, each window timed by
    CUDA events: for steps too long for :func:`bench_ms`'s time budget. Without ``lead`` the host
    runs ahead freely and synchronizes once at the end; with it, each window starts from an idle
    device behind a short device-side wait, so the host launches while the device waits (a call's
    host time counts only where it exceeds its device time, as in a loop whose GPU runs behind)."""
    windows = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            torch.cuda.synchronize()
            torch.cuda._sleep(LEAD_CYCLES)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        windows.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / calls for start, end in windows)


def host_ms(fn: Callable[[], object], n: int = 50) -> float:
    """Host ms to issue one call of ``fn``, measured while the GPU lags behind (no sync inside)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


#: The weight copies a decoding-size timing cycles through: well past an H100's or H200's 50 MB L2,
#: as a decoding step streams each layer's weight once
L2_BYTES = 256 * 2**20


def copies_past_l2(nbytes: int) -> int:
    """How many copies of an ``nbytes`` operand exceed :data:`L2_BYTES` (at least 2)."""
    return max(2, -(-L2_BYTES // nbytes))


def cycled_us(fns: list[Callable[[], object]], reps: int = 10) -> float:
    """Microseconds per call of a CUDA graph that runs each of ``fns`` (one per weight copy) in turn."""
    return graph_ms(lambda: [f() for f in fns], reps=reps) / len(fns) * 1e3


def weight_bytes(mod: nn.Module) -> int:
    """Bytes a linear's kernels read for its weight (2:4: values and positions)."""
    if isinstance(mod, SparseInferenceLinear):
        return mod.values.numel() * mod.values.element_size() + mod.positions.numel()
    return mod.weight.numel() * mod.weight.element_size()


def kernel_times(prof, n: int, skip: tuple[str, ...] = ()) -> dict[str, tuple[float, float]]:
    """{kernel name: (us per call, launches per call)} of a finished ``torch.profiler`` run over
    ``n`` calls: the GPU's own entries only (an operator's CPU entry also counts the kernels it
    launched), less the GPU spans of the ranges named in ``skip``."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    out = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type == DeviceType.CUDA and evt.key not in skip and us > 0:
            out[evt.key] = (us / n, evt.count / n)
    return out


def copy_bandwidth() -> float:
    """The device's copy bandwidth in GB/s (bytes read + written by a 256 MB bf16 copy, CUDA graph
    replay): the limit of the memory-bound kernels timed against it."""
    x = torch.randn(128 * 2**20, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.nbytes / graph_ms(lambda: y.copy_(x), inner=5, reps=10) / 1e6


def gemm_tflops() -> float:
    """Dense bf16 TFLOP/s of an 8192^3 GEMM on random data (cuBLAS)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench_ms(lambda: a @ a) / 1e9


def md_head(*cols: str) -> str:
    """A markdown table's header and rule."""
    return "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|"


def md_row(*cells: object) -> str:
    """A markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def gpu_line() -> str:
    """The GPU, torch, Triton, cuSPARSELt and twofour versions, for a report's first line."""
    import triton

    from twofour.kernels import cusparselt

    cslt = cusparselt.version() if cusparselt.available() else "not available"
    return (f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
            f"cuSPARSELt {cslt}, twofour {twofour.__version__}, Python {platform.python_version()}")


def preset_train_step(preset: str, batch: int, recipe: Recipe, *, transposed_output: bool = True,
                      advance: bool = True, vocab_size: int = 50304,
                      compile: bool | str = False, n_layer: int | None = None,
                      convert: Callable[[nn.Module], object] | None = None,
                      sparse_attention: bool = False) -> tuple[nn.Module, Callable[[], None]]:
    """A model ``preset`` (GPT or Llama; vocabulary ``vocab_size``, sequence 1024) on the GPU with
    ``recipe`` on its FFN linears (dense bf16 left as nn.Linear; the first, fc or gate|up, with
    ``transposed_output``), fused AdamW and, with ``advance``, ``attach()``; returns the model and
    a function that runs one training step on a fixed random batch, through ``torch.compile(model)``
    with ``compile`` (as ``twofour train --compile`` runs it; a string is torch.compile's ``mode``);
    ``n_layer`` blocks instead of the preset's where given; ``convert(model)`` runs before the
    optimizer is made (a peer's conversion, e.g. torchao's float8, on a dense-bf16 ``recipe``);
    ``sparse_attention``: the recipe on the attention projections too."""
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: a 1B model's init on the CPU takes a while
        model = PRESETS[preset].build(block_size=1024, vocab_size=vocab_size,
                                      **({"n_layer": n_layer} if n_layer else {}))
    if recipe.sparse or recipe.precision.fp8:
        sparsify(model, recipe, include=FFN_PATTERNS + (ATTN_PATTERNS if sparse_attention else ()),
                 transposed_output=FFN_IN_PATTERNS if transposed_output else ())
    if convert is not None:
        convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if advance:
        attach(model, opt)
    idx = torch.randint(0, vocab_size, (batch, 1024), device="cuda")
    mode = compile if isinstance(compile, str) else None
    fwd = torch.compile(model, mode=mode) if compile else model

    def step() -> None:
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
    return steps_ms(step, 12)
