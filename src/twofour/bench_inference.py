"""``twofour bench --inference``: an exported 2:4 GPT against its dense twin, on this GPU.

One process builds the preset (default gpt2-774m, vocabulary 50304, context 1024) with random
weights, makes its FFN linears 2:4 with S-STE, exports it in bf16 (twofour's format, to a
temporary folder) and loads it twice: as exported (:class:`~twofour.SparseInferenceLinear`
layers, cuSPARSELt and the GEMV kernel) and as its dense twin (the same weights in
``nn.Linear``). Both run the same code: prefill and decoding go through the model's static KV
cache, each forward or decoding step captured once in a CUDA graph and replayed. Ratios are
dense time / 2:4 time (above 1: the 2:4 model is faster). Every row is measured on its own; a
row that fails prints its error and the rest go on.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import platform
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from . import dispatch
from .inference.format import load_for_inference, save_inference
from .inference.layer import SparseInferenceLinear
from .kernels import cusparselt, ops
from .models.common import FFN_PATTERNS
from .models.gpt import GPT
from .sparse.convert import sparsify
from .version import __version__

__all__ = ["inference_bench", "run_inference_bench", "graph_ms", "decode_bytes"]

PRESET, VOCAB, CONTEXT = "gpt2-774m", 50304, 1024


def _capture(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph after ``warmup`` calls on a side stream (which measure
    the dispatch, build cuSPARSELt plans and tune kernels: nothing is measured while capturing)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn: Callable[[], object], *, inner: int = 1, reps: int = 10) -> float:
    """Milliseconds of one call of ``fn``: ``inner`` calls captured back to back in one CUDA
    graph, replayed ``reps`` times, each replay timed by CUDA events; median / ``inner``."""

    def body() -> None:
        for _ in range(inner):
            fn()

    graph = _capture(body)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    del graph
    return statistics.median(times)


def _copy_gbs() -> float:
    """Copy bandwidth (bytes read + written per second, GB/s), by CUDA graph replay."""
    x = torch.empty(256 * 2**20, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * x.numel() / graph_ms(lambda: y.copy_(x), inner=5, reps=10) / 1e6


def _weight_bytes(mod: nn.Module) -> int:
    """Bytes the layer's kernels read for its weight."""
    if isinstance(mod, SparseInferenceLinear):
        return mod.values.numel() * mod.values.element_size() + mod.positions.numel()
    return mod.weight.numel() * mod.weight.element_size()


def decode_bytes(model: GPT, batch: int, max_len: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decoding step reads at least: every linear's weight
    once (the output head included, which is the embedding), and the whole cache of keys and
    values, which the masked attention of a static cache reads up to ``max_len``."""
    weights = sum(_weight_bytes(m) for m in model.modules() if isinstance(m, (nn.Linear, SparseInferenceLinear)))
    c = model.cfg
    kv = 2 * c.n_layer * batch * max_len * c.n_embd * model.wte.weight.element_size()
    return weights, kv


class _Report:
    """Lines printed as they come and kept for the report; ``row`` catches a row's error."""

    def __init__(self, log: Callable[[str], None]):
        self.lines: list[str] = []
        self.log = log

    def add(self, *lines: str) -> None:
        for line in lines:
            self.lines.append(line)
            self.log(line)

    @contextlib.contextmanager
    def row(self, what: str):
        try:
            yield
        except Exception as e:  # a benchmark has one shot: report the row and go on
            self.add(f"| {what} | error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''} |")
        finally:
            gc.collect()
            torch.cuda.empty_cache()


def _pair(preset: str, vocab: int, context: int, recipe: str, folder: Path) -> tuple[GPT, GPT, dict]:
    """The exported 2:4 model and its dense twin, from one random model made 2:4 on its FFNs."""
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU, not in the CPU's slower init
        model = GPT.from_preset(preset, block_size=context, vocab_size=vocab)
    sparsify(model, recipe, include=FFN_PATTERNS)
    cfg = save_inference(model, folder, dtype=torch.bfloat16, meta={"preset": preset, "recipe": recipe})
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return load_for_inference(folder, "cuda"), load_for_inference(folder, "cuda", dense=True), cfg


def _ratio(dense_ms: float, sparse_ms: float) -> str:
    return f"{dense_ms / sparse_ms:.2f}x"


def inference_bench(preset: str = PRESET, *, vocab_size: int = VOCAB, context: int = CONTEXT, recipe: str = "s-ste",
                    prefill_batches: Sequence[int] = (1, 8), decode_batches: Sequence[int] = (1, 8, 64),
                    prompt_len: int = 128, decode_steps: int = 64, ffn_tokens: Sequence[int] | None = None,
                    reps: int = 10, log: Callable[[str], None] = print) -> str:
    """Run every measurement and return the markdown report (also passed line by line to ``log``)."""
    if not torch.cuda.is_available():
        raise ValueError("twofour bench --inference needs a CUDA GPU; none is available here")
    if not ops.fast_available():
        raise ValueError("twofour bench --inference needs Triton and nvmath-python's cuSPARSELt bindings "
                         "(pip install 'twofour[gpu]')")
    if prompt_len + max(decode_steps, _CHECK + 2) > context or prompt_len < 1 or decode_steps < 1:
        raise ValueError(f"prompt_len ({prompt_len}) + decode_steps ({decode_steps}, at least {_CHECK + 2} positions) "
                         f"must fit the context ({context}), both at least 1")
    rep = _Report(log)
    bw = _copy_gbs()
    rep.add(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, cuSPARSELt {cusparselt.version()}, "
            f"twofour {__version__}, Python {platform.python_version()}; copy bandwidth {bw:.0f} GB/s. "
            f"{preset} (vocabulary {vocab_size}, context {context}), random weights, {recipe} on the FFN linears, "
            "exported in bf16 and loaded back; the dense twin holds the same weights in nn.Linear. Ratios: dense "
            "time / 2:4 time.", "")
    with tempfile.TemporaryDirectory(prefix="twofour-inference-") as folder:
        try:
            sparse, dense, cfg = _pair(preset, vocab_size, context, recipe, Path(folder))
        except Exception as e:
            rep.add(f"could not build the models: {type(e).__name__}: {e}")
            return "\n".join(rep.lines) + "\n"
        file_bytes = cfg["weights_bytes"]
    fc, proj = sparse.h[0].mlp.fc, sparse.h[0].mlp.proj
    dfc, dproj = dense.h[0].mlp.fc, dense.h[0].mlp.proj
    gen = torch.Generator(device="cuda").manual_seed(0)

    # -- bytes ---------------------------------------------------------------------------------
    rep.add("### Weight bytes", "", "| what | 2:4 model | dense twin | ratio |", "|---|---|---|---|")
    with rep.row("weight bytes"):
        sl = [m for m in sparse.modules() if isinstance(m, SparseInferenceLinear)]
        stored = cfg["sparse_layer_bytes"]
        dense_eq = cfg["sparse_layer_dense_bytes"]
        held = sum(m.nbytes() for m in sl)
        twin_all = sum(p.numel() * p.element_size() for p in dense.parameters())
        rep.add(f"| 2:4 layers as stored (values + positions, {len(sl)} layers) | {stored / 1e6:,.1f} MB "
                f"| {dense_eq / 1e6:,.1f} MB | {stored / dense_eq:.4f}x |",
                f"| 2:4 layers on the GPU (cuSPARSELt operand + positions) | {held / 1e6:,.1f} MB "
                f"| {dense_eq / 1e6:,.1f} MB | {held / dense_eq:.4f}x |",
                f"| whole model file (model.safetensors) | {file_bytes / 1e6:,.1f} MB | {twin_all / 1e6:,.1f} MB "
                f"(parameters) | {file_bytes / twin_all:.4f}x |")

    # -- correctness ---------------------------------------------------------------------------
    rep.add("", "### Correctness", "", "| check | result |", "|---|---|")
    with rep.row("logits"), torch.no_grad():
        idx = torch.randint(0, vocab_size, (2, min(128, context)), device="cuda", generator=gen)
        ls, ld = sparse(idx)[0].float(), dense(idx)[0].float()
        agree = (ls.argmax(-1) == ld.argmax(-1)).float().mean().item()
        rep.add(f"| logits, 2:4 vs dense twin (2 x {idx.shape[1]} tokens) | max abs diff "
                f"{(ls - ld).abs().max().item():.4f} (max abs logit {ld.abs().max().item():.2f}); argmax agrees "
                f"at {agree:.1%} of positions |")
    for t in (1, 5, 8, 64, 1024):
        with rep.row(f"fc, {t} tokens"), torch.no_grad():
            x = torch.randn(t, fc.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.float(), fc.dense_weight().float(), fc.bias.float())
            errs = {name: ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                    for name, fn in fc.routes(x).items()}
            rep.add(f"| h.0.mlp.fc, {t} tokens, each 2:4 kernel vs float32 reference | "
                    + ", ".join(f"{n}: max rel err {e:.1e}" for n, e in errs.items()) + " |")

    # -- FFN and its GEMMs ---------------------------------------------------------------------
    tokens = ffn_tokens or sorted({1, 8, 64, *(b * context for b in prefill_batches)})
    rep.add("", "### FFN block alone (fc -> GELU -> proj, block 0), CUDA graph replay", "",
            "| tokens | dense ms | 2:4 ms | ratio |", "|---|---|---|---|")
    for t in tokens:
        with rep.row(f"{t}"), torch.no_grad():
            x = torch.randn(t, fc.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
            inner = 20 if t <= 64 else 3
            td = graph_ms(lambda x=x: dense.h[0].mlp(x), inner=inner, reps=reps)
            ts = graph_ms(lambda x=x: sparse.h[0].mlp(x), inner=inner, reps=reps)
            rep.add(f"| {t} | {td:.4f} | {ts:.4f} | {_ratio(td, ts)} |")
    rep.add("", "### One FFN linear at decoding sizes: each kernel, and the memory bound", "",
            "`bound` = weight bytes / copy bandwidth (no kernel reads its weight faster); cuSPARSELt pads the "
            "tokens to 8.", "",
            "| layer | tokens | dense us (bound) | cuSPARSELt us | 2:4 GEMV us | 2:4 bound us | best ratio |",
            "|---|---|---|---|---|---|---|")
    for name, lin, twin in (("fc", fc, dfc), ("proj", proj, dproj)):
        for t in (1, 8, 64):
            with rep.row(f"{name} {t}"), torch.no_grad():
                x = torch.randn(t, lin.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
                td = graph_ms(lambda x=x, twin=twin: twin(x), inner=20, reps=reps) * 1e3
                routes = {n: graph_ms(fn, inner=20, reps=reps) * 1e3 for n, fn in lin.routes(x).items()}
                bd, bs = _weight_bytes(twin) / bw / 1e3, _weight_bytes(lin) / bw / 1e3
                gemv = f"{routes['sparse_gemv']:.1f}" if "sparse_gemv" in routes else "-"
                cslt = min(v for n, v in routes.items() if n != "sparse_gemv")  # either output order
                rep.add(f"| {name} {lin.in_features}->{lin.out_features} | {t} | {td:.1f} ({bd:.1f}) "
                        f"| {cslt:.1f} | {gemv} | {bs:.1f} | {td / min(routes.values()):.2f}x |")

    # -- whole model ---------------------------------------------------------------------------
    rep.add("", f"### Whole model, prefill ({context} tokens a sequence, through the KV cache)", "",
            "| batch x tokens | dense tokens/s | 2:4 tokens/s | ratio |", "|---|---|---|---|")
    for b in prefill_batches:
        with rep.row(f"prefill {b}"), torch.no_grad():
            idx = torch.randint(0, vocab_size, (b, context), device="cuda", generator=gen)
            ms = {}
            for name, model in (("dense", dense), ("sparse", sparse)):
                cache = model.make_cache(b, context)

                def prefill(model=model, cache=cache, idx=idx) -> None:
                    cache.reset()  # every replay writes positions 0.. again
                    model(idx, cache=cache)

                ms[name] = graph_ms(prefill, reps=max(3, reps // 2))
                del cache
            tps = {k: b * context / v * 1e3 for k, v in ms.items()}
            rep.add(f"| {b} x {context} | {tps['dense']:,.0f} | {tps['sparse']:,.0f} "
                    f"| {_ratio(ms['dense'], ms['sparse'])} |")
    max_len = -(-(prompt_len + max(decode_steps, _CHECK + 2)) // 16) * 16  # + the check's steps and warm-ups
    rep.add("", f"### Whole model, decoding (prompt {prompt_len}, then {decode_steps} greedy steps; static KV cache of "
            f"{max_len}; one step = one CUDA graph replay)", "",
            "`bytes/step`: weights + KV cache read per step (lower bound on traffic); `bound`: the ratio if both "
            "ran at the same bandwidth. `graph = eager`: the replayed tokens equal an eager run's.", "",
            "| batch | dense tokens/s | 2:4 tokens/s | ratio | bytes/step dense / 2:4 | bound | graph = eager |",
            "|---|---|---|---|---|---|---|")
    for b in decode_batches:
        with rep.row(f"decode {b}"), torch.no_grad():
            prompt = torch.randint(0, vocab_size, (b, prompt_len), device="cuda", generator=gen)
            res = {name: _decode(model, prompt, decode_steps, max_len) for name, model in (("dense", dense),
                                                                                           ("sparse", sparse))}
            (wd, kvd), (ws, kvs) = decode_bytes(dense, b, max_len), decode_bytes(sparse, b, max_len)
            tok = {k: b * decode_steps / v[0] * 1e3 for k, v in res.items()}
            same = "yes" if res["dense"][1] and res["sparse"][1] else \
                f"dense {res['dense'][1]}, 2:4 {res['sparse'][1]}"
            rep.add(f"| {b} | {tok['dense']:,.0f} | {tok['sparse']:,.0f} | {tok['sparse'] / tok['dense']:.2f}x "
                    f"| {(wd + kvd) / 1e6:,.0f} / {(ws + kvs) / 1e6:,.0f} MB | {(wd + kvd) / (ws + kvs):.2f}x "
                    f"| {same} |")
    rep.add("", "2:4 kernel chosen per shape (`twofour.dispatch.choices()`, `inf` keys: MxKxN = out x in x "
            "tokens):", "", "```")
    rep.add(*dispatch.choice_lines("inf"))
    rep.add("```")
    return "\n".join(rep.lines) + "\n"


_CHECK = 8  # decoding steps compared between eager calls and graph replays


def _decode(model: GPT, prompt: torch.Tensor, steps: int, max_len: int, check: int = _CHECK) -> tuple[float, bool]:
    """(ms for ``steps`` greedy decoding steps after the prompt, whether graph replay gives the
    tokens an eager run gives over the first ``check`` steps). ``max_len`` must hold the prompt
    and ``max(steps, check + 2)`` more positions (the check, then the capture's 2 warm-ups)."""
    b = prompt.shape[0]
    if prompt.shape[1] + max(steps, check + 2) > max_len:
        raise ValueError(f"a KV cache of {max_len} can't hold {prompt.shape[1]} + {max(steps, check + 2)} positions")
    cache = model.make_cache(b, max_len)
    tok = torch.zeros(b, 1, dtype=torch.long, device="cuda")

    def prefill() -> None:
        cache.reset()
        tok.copy_(model(prompt, cache=cache)[0][:, -1].argmax(-1, keepdim=True))

    def step() -> None:
        tok.copy_(model(tok, cache=cache)[0][:, -1].argmax(-1, keepdim=True))

    prefill()
    eager = [tok.clone()]
    for _ in range(check):
        step()
        eager.append(tok.clone())
    graph = _capture(step)
    prefill()
    replayed = [tok.clone()]
    for _ in range(check):
        graph.replay()
        replayed.append(tok.clone())
    same = all(torch.equal(a, c) for a, c in zip(eager, replayed))
    prefill()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), same


def run_inference_bench(args: argparse.Namespace) -> str:
    """``twofour bench --inference [--quick] [--write FILE]``: print the report; ``--write``
    puts it between the ``<!-- inference:begin -->`` / ``end`` markers of FILE."""
    from .bench import _write_section  # noqa: PLC0415

    quick = getattr(args, "quick", False)
    report = inference_bench(prefill_batches=(1,) if quick else (1, 8), decode_steps=32 if quick else 64,
                             reps=5 if quick else 10)
    if getattr(args, "write", None):
        _write_section(Path(args.write), report, "inference")
    return report
