"""``twofour bench``: what a user sees of twofour against dense bf16 on this GPU, from one run.

By default: a 2:4 layer's forward + backward against ``nn.Linear`` per recipe, the FFN blocks
(GPT's GELU, Llama's SwiGLU), and the tokens/s of ``twofour train`` itself, eager and compiled.
``--fp8``: FP8 layers against bf16 and dense FP8 (and torchao's float8 where it is installed).
``--inference``: an exported 2:4 model against its dense twin, prefill and decode tokens/s.
Ratios: dense time / twofour time (above 1: faster), dense measured in the same run. Kernel
probes and analyses: the scripts of ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

import torch
from torch import nn

from .. import dispatch
from ..errors import one_line
from ..fp8 import scaled_mm_available
from ..kernels import cusparselt, ops
from ..models.common import MLP, GPTConfig
from ..models.llama import GatedMLP
from ..models.presets import PRESETS
from ..sparse.convert import sparsify
from ..sparse.layer import SparseLinear
from ..version import __version__
from .speed import default_vocab, exported_pair, tokens_row
from .throughput import throughput_table, train_throughput

__all__ = ["run_bench", "layer_report", "fp8_report", "inference_report", "fwd_bwd_step"]

#: (name, d_model, FFN width, tokens = seq 1024 x micro-batch) of the layer rows; GPT's FFN block
#: (width 4 x d_model) runs at those it fits
SHAPES = [("gpt2-124m", 768, 3072, 32768), ("gpt2-350m", 1024, 4096, 32768), ("gpt2-774m", 1280, 5120, 32768),
          ("gpt2-1.5b", 1600, 6400, 32768), ("llama-7b", 4096, 11008, 16384)]
LAYER_RECIPES = ("ste", "sr-ste", "s-ste", "t-sr-ste")
SWIGLU_PRESETS = ("llama-1b", "llama-7b")  # SwiGLU FFN blocks at 16384 tokens
#: (label, tokens, in, out) of the ``--fp8`` rows, and the FP8 variants of SparseLinear they time
FP8_SHAPES = [("gpt2-774m fc", 16384, 1280, 5120), ("gpt2-774m proj", 16384, 5120, 1280),
              ("llama-7b up", 16384, 4096, 11008), ("llama-7b down", 16384, 11008, 4096)]
FP8_VARIANTS = {"FP8 tensorwise": {"precision": "fp8"}, "FP8 tensorwise, e5m2 dY": {"precision": "fp8-e5m2"},
                "FP8 rowwise": {"precision": "fp8-rowwise"}}
#: the real loop's (model, micro-batch) at seq 1024 and recipes, quick and full; its modes: eager,
#: --compile, and --compile with CUDA graphs (which take the custom ops' host time out of a step)
TRAIN_QUICK = ([("gpt2-124m", 32)], ("dense", "s-ste"))
TRAIN_FULL = ([("gpt2-124m", 32), ("gpt2-774m", 16)], ("dense", "ste", "s-ste"))
REAL_LOOP_MODES = (False, True, "reduce-overhead")


def fwd_bwd_step(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``module`` under bf16 autocast, as a training step runs it; every
    SparseLinear forgets its compressed weight first (a new weight each step), so its pruning and
    compression are counted."""

    def step() -> None:
        for p in module.parameters():
            p.grad = None
        for mod in module.modules():
            if isinstance(mod, SparseLinear):
                mod.compressed.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.backward(g)

    return step


def _step_ms(module: nn.Module, x: torch.Tensor, g: torch.Tensor, quick: bool) -> float:
    """Median ms of :func:`fwd_bwd_step` (CUDA events, ``triton.testing.do_bench``), after one step
    in which the dispatch measures its choices and the kernels tune."""
    from triton.testing import do_bench  # noqa: PLC0415

    step = fwd_bwd_step(module, x, g)
    step()
    return do_bench(step, warmup=10 if quick else 25, rep=50 if quick else 200, return_mode="median")


def _row(what: str, fn: Callable[..., str], *args: object) -> str:
    """``fn(*args)``, a table row, or one naming its error: a failed row must not hide the rest."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a row's failure is its result
        return f"| {what} | error: {one_line(e)[:200]} |"
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _vs_dense(label: str, dense: nn.Module, sparse: Callable[[str], nn.Module], recipes: Sequence[str],
              x: torch.Tensor, g: torch.Tensor, quick: bool) -> str:
    """A row: ``label``, the dense module's ms, then dense time / time of ``sparse(recipe)`` per recipe."""
    base = _step_ms(dense, x, g, quick)
    return f"| {label} | {base:.2f} | " + " | ".join(f"{base / _step_ms(sparse(r), x, g, quick):.2f}x"
                                                     for r in recipes) + " |"


def _layer_row(name: str, t: int, k: int, n: int, quick: bool) -> str:
    ffn_in = n > k  # the FFN's first linear may leave y^T; the second reads that (a column-major x)
    x = (torch.randn(t, k, device="cuda") if ffn_in else torch.randn(k, t, device="cuda").t()).requires_grad_()
    g = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    sparse = partial(SparseLinear, k, n, device="cuda", transposed_output=ffn_in)
    return _vs_dense(f"{name} | {t} x {k} -> {n}", nn.Linear(k, n, device="cuda"), lambda r: sparse(recipe=r),
                     LAYER_RECIPES, x, g, quick)


def _block_row(name: str, t: int, d: int, h: int, make: Callable[[], nn.Module], linears: tuple[str, str],
               quick: bool) -> str:
    x = torch.randn(t, d, device="cuda", requires_grad=True)
    g = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    return _vs_dense(f"{name} | {t} x {d} -> {h}", make().cuda(),  # the first linear's output may stay transposed
                     lambda r: sparsify(make().cuda(), r, include=linears, transposed_output=linears[:1]),
                     ("s-ste", "t-sr-ste"), x, g, quick)


def layer_report(quick: bool = False, shapes: Sequence[tuple[str, int, int, int]] | None = None,
                 swiglu: Sequence[str] | None = None) -> Iterator[str]:
    """The default rows, line by line: each recipe's layer and GPT's FFN block against dense at
    ``shapes`` (default :data:`SHAPES`), and the SwiGLU FFN blocks of the presets ``swiglu``."""
    shapes = shapes or (SHAPES[2:] if quick else SHAPES)
    swiglu = (SWIGLU_PRESETS[-1:] if quick else SWIGLU_PRESETS) if swiglu is None else swiglu
    yield from ["### SparseLinear forward + backward (pruning, compression and MVUE included), per recipe", "",
                "The first linear of an FFN may leave y^T (`transposed_output=True`), the second reads it (a "
                "column-major x); dense: nn.Linear on the same x.", "",
                "| shape | tokens x in -> out | dense ms | " + " | ".join(LAYER_RECIPES) + " |", "|---" * 7 + "|"]
    for name, d, h, t in shapes:
        yield from (_row(f"{name} | {k} -> {n}", _layer_row, name, t, k, n, quick) for k, n in ((d, h), (h, d)))
    yield from ["", "### FFN blocks, forward + backward: GPT's (fc -> GELU -> proj), Llama's (gate|up -> SwiGLU -> "
                "down); the recipe on both linears", "",
                "| block | tokens x d -> FFN width | dense ms | s-ste | t-sr-ste |", "|---|---|---|---|---|"]
    blocks = [(f"{name} GELU", t, d, h, partial(MLP, GPTConfig(n_embd=d)), ("fc", "proj"))
              for name, d, h, t in shapes if h == 4 * d]
    blocks += [(f"{p} SwiGLU", 16384, PRESETS[p].config.n_embd, PRESETS[p].config.hidden,
                partial(GatedMLP, PRESETS[p].config.n_embd, PRESETS[p].config.hidden), ("gate_up", "down"))
               for p in swiglu]
    yield from (_row(block[0], _block_row, *block, quick) for block in blocks)


def _fp8_row(label: str, name: str, make: Callable[[], nn.Module], x: torch.Tensor, g: torch.Tensor,
             times: dict[str, float], quick: bool) -> str:
    """``make()``'s ms (kept in ``times``), against nn.Linear bf16 and, for s-ste, the dense layer
    of the same precision."""
    ms = times[name] = _step_ms(make(), x, g, quick)
    dense = times.get(name.replace("s-ste", "dense", 1)) if name.startswith("s-ste FP8") else None
    vs_dense = f"{dense / ms:.2f}x" if dense else ""
    return f"| {label} | {name} | {ms:.3f} | {times['nn.Linear bf16'] / ms:.2f}x | {vs_dense} |"


def _torchao_float8(k: int, n: int) -> nn.Module:
    """nn.Linear converted by torchao's float8 training (tensorwise scaling) and compiled for its
    shape alone (``dynamic=False``), as a user of torchao runs it: the FP8 peer of twofour's FP8
    rows, which run eagerly (their quantization compiled inside)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    model = nn.Sequential(nn.Linear(k, n, device="cuda"))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return torch.compile(model, dynamic=False)


def fp8_report(quick: bool = False, shapes: Sequence[tuple[str, int, int, int]] | None = None) -> Iterator[str]:
    """The ``--fp8`` rows, line by line: per shape (default :data:`FP8_SHAPES`), the forward +
    backward of nn.Linear and s-ste in bf16, of dense and s-ste layers in each FP8 variant and,
    where torchao is installed, of its float8 linear compiled."""
    peer = importlib.util.find_spec("torchao") is not None
    yield from ["### FP8 layers, forward + backward (e4m3 operands and gradients unless the row says e5m2; "
                "current amax scaling)", "", "| shape | layer | ms | vs nn.Linear bf16 | vs dense of its precision |",
                "|---|---|---|---|---|"]
    if not peer:
        yield "| | torchao float8: not installed (`pip install torchao` adds its row) | | | |"
    for label, t, k, n in shapes or (FP8_SHAPES[:2] if quick else FP8_SHAPES):
        x = torch.randn(t, k, device="cuda", requires_grad=True)
        g, times = torch.randn(t, n, device="cuda", dtype=torch.bfloat16), {}
        layer = partial(SparseLinear, k, n, device="cuda")
        variants = {"nn.Linear bf16": partial(nn.Linear, k, n, device="cuda"),
                    "s-ste bf16": partial(layer, recipe="s-ste"),
                    **{f"{r} {p}": partial(layer, recipe=r, **kw) for p, kw in FP8_VARIANTS.items()
                       for r in ("dense", "s-ste")},
                    **({"torchao float8 tensorwise, compiled": partial(_torchao_float8, k, n)} if peer else {})}
        yield from (_row(f"{label} | {name}", _fp8_row, label, name, make, x, g, times, quick)
                    for name, make in variants.items())


@torch.no_grad()
def inference_report(quick: bool = False, preset: str = "gpt2-774m", *, vocab_size: int | None = None,
                     context: int = 1024, prefill_batches: Sequence[int] = (1, 8),
                     decode_batches: Sequence[int] = (1, 8, 64), prompt_len: int = 128, decode_steps: int = 64,
                     n_layer: int | None = None) -> Iterator[str]:
    """The ``--inference`` rows, line by line: :func:`exported_pair`'s two models of ``preset``
    (``n_layer`` blocks if given; vocabulary :func:`default_vocab` unless ``vocab_size``) through
    the static KV cache, each step one CUDA graph replay: prefill tokens/s at ``prefill_batches`` x
    ``context`` tokens, greedy decoding tokens/s after a ``prompt_len`` prompt over ``decode_steps``."""
    if quick:
        prefill_batches, decode_steps = prefill_batches[:1], decode_steps // 2
    vocab_size = vocab_size or default_vocab(preset)
    with tempfile.TemporaryDirectory(prefix="twofour-bench-") as folder:
        sparse, dense, cfg = exported_pair(preset, folder, vocab_size=vocab_size, context=context, n_layer=n_layer)
    models = {"dense": dense, "2:4": sparse}
    full = PRESETS[preset].config.n_layer
    layers = f"{n_layer} of its {full} blocks (--layers)" if n_layer and n_layer != full else f"{full} blocks"
    yield from [f"{preset}, {layers}, vocabulary {vocab_size}, random weights, s-ste on the FFN linears, exported in "
                f"bf16: 2:4 layers {cfg['sparse_layer_ratio']:.4f}x of their dense bytes, model file "
                f"{cfg['weights_bytes'] / 1e6:,.0f} MB; the dense twin holds the same weights in nn.Linear.", "",
                f"### Prefill ({context} tokens a sequence) and greedy decoding (prompt {prompt_len}, {decode_steps} "
                "steps), one CUDA graph replay a step", "",
                "| phase | batch | dense tokens/s | 2:4 tokens/s | ratio |", "|---|---|---|---|---|"]
    yield from (_row(f"prefill | {b}", tokens_row, "prefill", b, models, vocab_size, context, 3 if quick else 5)
                for b in prefill_batches)
    yield from (_row(f"decode | {b}", tokens_row, "decode", b, models, vocab_size, prompt_len, decode_steps)
                for b in decode_batches)


def _real_loop(quick: bool) -> Iterator[str]:
    models, recipes = TRAIN_QUICK if quick else TRAIN_FULL
    gc.collect()  # leave the GPU's memory to the training processes
    torch.cuda.empty_cache()
    yield from ["", "### twofour train: tokens/s of the real loop", "",
                "`twofour train --steps 40 [--compile [--compile-mode reduce-overhead]]` as a user runs it, a fresh "
                "process per run (default data, bf16 autocast, fused AdamW, the recipe on the FFN linears); tokens/s: "
                "the run's `summary.json` `tokens_per_s`; median (min-max) of 3 runs, the configurations interleaved. "
                "Ratios of medians: to dense in the same mode, and to the fastest compiled dense.", ""]
    yield throughput_table(train_throughput([m for m, _ in models], recipes, compile_modes=REAL_LOOP_MODES,
                                            batch_sizes=[b for _, b in models]))


def run_bench(args: argparse.Namespace) -> str:
    """``twofour bench [--quick] [--fp8 | --inference [--model PRESET] [--layers N]] [--write FILE]``:
    print the report as it is measured; ``--write`` also puts it between FILE's ``<!-- bench:begin -->``
    and ``end`` markers (``fp8``, ``inference`` for those reports), appended the first time."""
    marker = "fp8" if args.fp8 else "inference" if args.inference else "bench"
    command = "twofour bench" + ("" if marker == "bench" else f" --{marker}")
    if args.inference and (args.model not in PRESETS or (args.layers is not None and args.layers < 1)):
        raise ValueError(f"{command}: --model must be one of {', '.join(PRESETS)} and --layers positive; got "
                         f"{args.model!r}, {args.layers}")
    if not torch.cuda.is_available():
        raise ValueError(f"{command} needs a CUDA GPU; none is available here")
    if not ops.fast_available():
        raise ValueError(f"{command} needs Triton and nvmath-python's cuSPARSELt bindings (pip install 'twofour[gpu]')")
    if args.fp8 and not scaled_mm_available():
        raise ValueError(f"{command} needs torch._scaled_mm, which torch {torch.__version__} lacks")
    import triton  # noqa: PLC0415

    def report() -> Iterator[str]:
        yield from [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}, "
                    f"cuSPARSELt {cusparselt.version()}, twofour {__version__}, Python {platform.python_version()}. "
                    "Ratios: dense time / twofour time.", ""]
        if args.inference:
            yield from inference_report(args.quick, args.model, n_layer=args.layers)
        else:
            yield from (fp8_report if args.fp8 else layer_report)(args.quick)
        yield from ["", "Dispatch choices measured in this run (`twofour.kernels.dispatch.choices()`):", "", "```",
                    *dispatch.choice_lines("inf" if args.inference else ""), "```"]
        yield from _real_loop(args.quick) if marker == "bench" else ()

    lines = []
    for line in report():
        print(line, flush=True)
        lines.append(line)
    text = "\n".join(lines) + "\n"
    if args.write:
        path, begin, end = Path(args.write), f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
        old, block = (path.read_text() if path.exists() else ""), f"{begin}\n{text}{end}"
        new = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, old, flags=re.S)
        path.write_text(new if begin in old and end in old else old + ("\n" if old else "") + block + "\n")
    return text
