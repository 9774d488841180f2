"""twofour's recipes beside torchao's float8 training at a preset's shape (GPU, compiled): tokens/s
as ratios to bf16 dense and to torchao float8, and, per row, where the step's GPU time goes.

    PYTHONPATH=src python benchmarks/fp8/peer.py [--preset llama-8b --layers 4 --batch 8 --vocab 32000]
        [--rows dense,ao-float8,ste-fp8,s-ste-fp8,dense-fp8,ste,s-ste,ste+dx=pruned-t,t-sr-ste] [--json out.json]

Each row builds the preset (``--layers`` blocks, sequence 1024) on the GPU, converts its FFN
linears (twofour's recipe with its precision, or torchao's ``convert_to_float8_training`` with the
tensorwise recipe), compiles it (``torch.compile(model)``, without ``twofour train``'s per-layer plan) and times
forward, backward and fused AdamW in this harness's loop (``benchmarks/common.preset_train_step``,
not ``twofour train``'s): the median over ``--runs`` repeats of the median step of ``--steps``
one-step windows, after 3 warm-up steps. Then torch.profiler records 3 steps, and the row's GPU time is split by kernel
kind: dense GEMMs, 2:4 GEMMs (cuSPARSELt), attention, Inductor's fused kernels, twofour's own
Triton kernels, the optimizer, the rest. The weight kernels are put against one pass over the FFN
weights at copy bandwidth, and the ceilings give the most any 2:4 recipe could gain at this shape.
torchao is optional: without it its row says so and the ratios use the rows that ran.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import twofour
from twofour.errors import one_line
from twofour.models import FFN_PATTERNS, PRESETS
from twofour.sparse import make_recipe
from twofour.sparse.convert import matches
from twofour.training.options import parse_option
from twofour.training.runs import source_digest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import (  # noqa: E402
    copy_bandwidth,
    gpu_line,
    kernel_times,
    md_head,
    md_row,
    preset_train_step,
    steps_ms,
)

#: row name -> (twofour recipe, precision); "ao-float8" is bf16 dense converted by torchao
ROWS = {
    "dense": ("dense", "bf16"),
    "ao-float8": ("dense", "bf16"),
    "dense-fp8": ("dense", "fp8"),
    "ste": ("ste", "bf16"),
    "s-ste": ("s-ste", "bf16"),
    "ste-fp8": ("ste", "fp8"),
    "s-ste-fp8": ("s-ste", "fp8"),
}


def row_recipe(row: str) -> tuple[str, str, dict]:
    """(recipe, precision, options) of a row: a name of :data:`ROWS`, or any recipe with ``-fp8``
    for FP8 and ``+KEY=VALUE`` recipe options (``ste+dx=pruned-t``, ``s-ste-fp8+dx=mvue``,
    ``t-sr-ste``; a ``+attn`` as well, :func:`row_attention`, is no recipe option);
    ``ValueError`` naming what is wrong."""
    base, *opts = row.split("+")
    opts = [o for o in opts if o != "attn"]
    if base in ROWS:
        name, precision = ROWS[base]
    else:
        name, precision = (base[:-4], "fp8") if base.endswith("-fp8") else (base, "bf16")
    options = dict(parse_option(o) for o in opts)
    make_recipe(name, precision=precision, **options)  # refuses unknown recipes and options
    return name, precision, options


def row_attention(row: str) -> bool:
    """Whether a row's recipe takes the attention projections too (``+attn``: ``twofour train
    --sparse-attention``), not only the FFN linears."""
    return "attn" in row.split("+")[1:]


#: Profiler ranges that a CPU+CUDA profile also lists among the GPU's entries (compiled graphs,
#: the optimizer step): spans over kernels counted on their own, so left out of the kinds.
RANGES = re.compile(r"^(## .* ##|Optimizer\.\w+#)")

#: The operators whose device time (their kernels included) the GEMM table lists, by input shapes.
GEMM_OPS = re.compile(r"^(aten::(mm|addmm|_scaled_mm|bmm|matmul|linear)|twofour::)")

#: twofour's kernels that pass over the weights each step: the mask refresh, the pruning into the
#: bf16 effective weight, the e4m3 compression of the FP8 2:4 forward operand.
WEIGHT_KERNELS = ("_refresh_kernel", "_compress_kernel", "_compress_e4m3_kernel")

KINDS = ("GEMM dense", "GEMM 2:4", "attention", "Inductor", "twofour Triton", "optimizer", "other")


def _torchao():
    """torchao, or None where it is not installed (its row then says why)."""
    try:
        import torchao  # noqa: PLC0415
    except ImportError:
        return None
    return torchao


def ao_float8(model: nn.Module) -> None:
    """torchao's float8 training (tensorwise scaling) on the FFN linears, as torchtitan's converter does."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda _m, fqn: matches(fqn, FFN_PATTERNS))


def twofour_kernels() -> set[str]:
    """Names of the Triton kernels twofour defines (read from its sources: some are built lazily)."""
    src = Path(twofour.__file__).parent
    names = set()
    for path in src.rglob("*.py"):
        names |= set(re.findall(r"@triton\.(?:jit|autotune)[^\n]*\n(?:\s*@[^\n]*\n)*\s*def (\w+)", path.read_text()))
    return names


def kind(name: str, ours: set[str]) -> str:
    """The kind of a CUDA kernel, by its name."""
    low = name.lower()
    if name in ours:
        return "twofour Triton"
    if name.startswith("triton_"):
        return "Inductor"
    if "sparse_gemm" in low or "cusparselt" in low:
        return "GEMM 2:4"
    if any(k in low for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")):
        return "GEMM dense"
    if "multi_tensor" in low or "adam" in low:
        return "optimizer"
    return "other"


def run_row(row: str, args: argparse.Namespace) -> dict:
    """Build, compile, time and profile one row: its step ms, tokens/s, the GEMM operators by input
    shapes and every kernel's ms and launches per step."""
    name, precision, options = row_recipe(row)
    convert: Callable[[nn.Module], object] | None = ao_float8 if row == "ao-float8" else None
    model, step = preset_train_step(args.preset, args.batch, make_recipe(name, precision=precision, **options),
                                    vocab_size=args.vocab, compile=True, n_layer=args.layers, convert=convert,
                                    sparse_attention=row_attention(row))
    for _ in range(3):
        step()
    windows = [steps_ms(step, args.steps) for _ in range(args.runs)]
    ms = sorted(windows)[len(windows) // 2]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    kernels = kernel_times(prof, 3)  # with the profiler's ranges, which report() leaves out
    gemms = sorted(((evt.device_time_total / 3e3, evt.count / 3, evt.key, str(evt.input_shapes))
                    for evt in prof.key_averages(group_by_input_shape=True)
                    if GEMM_OPS.search(evt.key) and evt.device_time_total > 0), reverse=True)[:args.top * 3]
    ffn = sum(m.weight.numel() for n, m in model.named_modules() if matches(n, FFN_PATTERNS) and hasattr(m, "weight"))
    del model, step
    gc.collect()
    torch.cuda.empty_cache()
    return {"row": row, "ms": ms, "windows_ms": windows, "tokens_per_s": args.batch * 1024 / ms * 1e3,
            "gemms": gemms, "ffn_weights": ffn, "kernels": {k: [us / 1e3, n] for k, (us, n) in kernels.items()}}


def ffn_shapes(preset: str, vocab: int) -> set[tuple[int, int]]:
    """(in, out) of the preset's FFN linears (built on the meta device: no memory, no GPU)."""
    with torch.device("meta"):
        model = PRESETS[preset].build(block_size=1024, vocab_size=vocab, n_layer=1)
    return {(m.in_features, m.out_features) for n, m in model.named_modules() if matches(n, FFN_PATTERNS)}


def ffn_gemm_ms(gemms: list, shapes: set[tuple[int, int]], tokens: int) -> dict[str, tuple[float, float]] | None:
    """{part: (ms, calls) per step} of a row's plain GEMM operators (``aten::mm``, ``aten::addmm``,
    ``aten::_scaled_mm``) that are the FFN's forward, dX and dW, told apart by their operands'
    shapes; None where shapes cannot tell them apart (one linear's forward shaped as another's
    dX, as in GPT's FFN, whose second linear is the first transposed)."""
    parts: dict[tuple[int, ...], str] = {}
    for k, n in shapes:
        for key, part in (((tokens, k, k, n), "fwd"), ((tokens, n, n, k), "dX"), ((n, tokens, tokens, k), "dW")):
            if parts.setdefault(key, part) != part:
                return None
    out = dict.fromkeys(("fwd", "dX", "dW"), (0.0, 0.0))
    for ms, calls, op, text in gemms:
        if op not in ("aten::mm", "aten::addmm", "aten::_scaled_mm"):
            continue
        try:
            operands = [s for s in ast.literal_eval(text) if len(s) == 2]  # addmm's bias (1-D) left out
        except (ValueError, SyntaxError):  # a shape list cut short when it was saved
            continue
        part = parts.get((*operands[0], *operands[1])) if len(operands) >= 2 else None
        if part:
            out[part] = (out[part][0] + ms, out[part][1] + calls)
    return out


def report(saved: list[tuple[str, dict]], ratios: list[float]) -> str:
    """The markdown tables of saved runs, each with its label (a row whose name repeats gets it):
    ratios, time by kernel kind, the weight passes against copy bandwidth, the ceilings, the GEMM
    operators and the largest other kernels of every row."""
    first = saved[0][1]
    a, rates = first["args"], first["rates"]
    res: dict[str, dict] = {}
    for label, run in saved:
        for row, r in run["rows"].items():
            res[row if row not in res else f"{row} ({label})"] = r
    base = res.get("dense", {}).get("tokens_per_s")
    peer = res.get("ao-float8", {}).get("tokens_per_s")
    out = [first["gpu"], f"{a['preset']}, {a['layers']} blocks, vocabulary {a['vocab']}, {a['batch']} x 1024 "
           f"tokens a step, FFN linears converted, torch.compile, fused AdamW; step ms: median of {a['runs']} "
           f"windows of {a['steps']} steps", "",
           md_head("row", "step ms", "tokens/s", "/ bf16 dense", "/ torchao float8")]
    for row, r in res.items():
        if "error" in r:
            out.append(md_row(row, r["error"], "", "", ""))
            continue
        tps = r["tokens_per_s"]
        out.append(md_row(row, f"{r['ms']:.2f}", f"{tps:,.0f}", f"{tps / base:.3f}x" if base else "-",
                          f"{tps / peer:.3f}x" if peer else "-"))
    # the rows that ran, their kernels without the profiler's ranges (spans over kernels counted on their own)
    ok = {row: {**r, "kernels": {k: v for k, v in r["kernels"].items() if not RANGES.search(k)}}
          for row, r in res.items() if "error" not in r}
    if not ok:
        return "\n".join(out)
    ours, kinds = twofour_kernels(), by_kind(ok)
    out += ["", "GPU ms per step by kernel kind (torch.profiler, 3 steps):", "", md_head("kind", *ok)]
    out += [md_row(k, *(f"{kinds[row][k]:.2f}" for row in ok)) for k in KINDS]
    out.append(md_row("sum", *(f"{sum(kinds[row].values()):.2f}" for row in ok)))

    ffn, tokens = next(iter(ok.values()))["ffn_weights"], a["batch"] * 1024
    one_pass, weight_ms = weight_passes(ok, rates)
    out += ["", f"Weight passes: the FFN weights are {ffn / 1e6:,.0f}M elements; one pass over them (read "
            f"fp32, write one byte each) takes {one_pass:.2f} ms at the copy bandwidth measured in the same run "
            f"({rates['copy_gbs']:,.0f} GB/s). Weight kernels: {', '.join(WEIGHT_KERNELS)} (in bf16 with MVUE, "
            "the compression kernel also draws the estimate of dY^T).", "",
            md_head("row", "weight kernels ms", "= passes over the FFN weights", "other twofour kernels ms")]
    out += [md_row(row, f"{weight_ms[row]:.2f}", f"{weight_ms[row] / one_pass:.1f}",
                   f"{kinds[row]['twofour Triton'] - weight_ms[row]:.2f}") for row in ok]

    shapes = ffn_shapes(a["preset"], a["vocab"])
    peers = {"bf16": ok.get("dense"), "fp8": ok.get("ao-float8")}
    head = ["row", "against", "measured", "peer's FFN fwd / dX / dW ms", "2:4 GEMMs could take"]
    out += ["", "Ceilings: the peer's step with the FFN GEMMs a recipe can run 2:4 (forward; dW too with "
            "MVUE; dX too with a dX route other than dense) sped up r times and nothing else "
            "added; r measured is the peer's forward GEMMs against ste's 2:4 GEMM kernels in the same run "
            "(ste runs only its forward 2:4).", "",
            md_head(*head, *(f"ceiling at r={r}" for r in ["measured", *ratios]))]
    for row, r in ok.items():
        name = row.split(" ")[0]
        try:
            recipe_name, precision, options = row_recipe(name)
        except (ValueError, argparse.ArgumentTypeError):
            continue
        recipe = make_recipe(recipe_name, precision=precision, **options)
        if not recipe.sparse:
            continue
        prec = "fp8" if recipe.precision.fp8 else "bf16"
        p = peers[prec]
        ste = ok.get("ste-fp8" if prec == "fp8" else "ste")
        if p is None:
            continue
        g = ffn_gemm_ms(p["gemms"], shapes, tokens)
        if g is None:
            out.append(md_row(row, "n/a: the FFN's forward and dX GEMMs have the same operand shapes here", "",
                              "", "", *[""] * (1 + len(ratios))))
            continue
        sped = g["fwd"][0] + (g["dW"][0] if recipe.mvue else 0.0) + (g["dX"][0] if recipe.dx != "dense" else 0.0)
        # ste's 2:4 kernels against the peer's forward GEMMs, where ste ran every FFN forward 2:4 and nothing else
        sparse = [v for k, v in (ste or {}).get("kernels", {}).items() if kind(k, ours) == "GEMM 2:4"]
        every = sparse and sum(n for _ms, n in sparse) == g["fwd"][1]
        r_meas = g["fwd"][0] / sum(ms for ms, _n in sparse) if every else None
        cells = []
        for ratio in [r_meas, *ratios]:
            cells.append("-" if not ratio else f"{p['ms'] / (p['ms'] - sped * (1 - 1 / ratio)):.3f}x (r={ratio:.2f})")
        out.append(md_row(row, "torchao float8" if prec == "fp8" else "bf16 dense", f"{p['ms'] / r['ms']:.3f}x",
                          " / ".join(f"{g[part][0]:.2f}" for part in ("fwd", "dX", "dW")), f"{sped:.2f} ms", *cells))

    for row, r in ok.items():
        out += ["", f"{row}: GEMM operators (and twofour's ops) by input shapes, device time with their kernels",
                "", md_head("op", "input shapes", "ms per step", "calls per step")]
        out += [md_row(f"`{op}`", f"`{text}`", f"{ms:.3f}", f"{n:.0f}") for ms, n, op, text in r["gemms"]]
        other = sorted(((ms, n, k) for k, (ms, n) in r["kernels"].items()
                        if kind(k, ours) in ("twofour Triton", "other", "Inductor", "GEMM 2:4")), reverse=True)
        out += ["", f"{row}: largest kernels other than dense GEMMs, attention and the optimizer", "",
                md_head("kernel", "ms per step", "launches per step")]
        out += [md_row(f"`{k[:100]}`", f"{ms:.3f}", f"{n:.0f}") for ms, n, k in other[:a["top"]]]
    return "\n".join(out)


def by_kind(ok: dict[str, dict]) -> dict[str, dict[str, float]]:
    """{row: {kind of kernel: GPU ms per step}} of the rows' profiles (ranges left out)."""
    ours = twofour_kernels()
    kinds = {row: dict.fromkeys(KINDS, 0.0) for row in ok}
    for row, r in ok.items():
        for k, (ms, _n) in r["kernels"].items():
            if not RANGES.search(k):
                kinds[row][kind(k, ours)] += ms
    return kinds


def weight_passes(rows: dict[str, dict], rates: dict) -> tuple[float, dict[str, float]]:
    """(ms of one pass over the FFN weights at the run's copy bandwidth: read the fp32 master, write
    a byte each; {row: its weight kernels' ms per step})."""
    one_pass = next(iter(rows.values()))["ffn_weights"] * (4 + 1) / (rates["copy_gbs"] * 1e9) * 1e3
    return one_pass, {row: sum(r["kernels"].get(k, (0.0, 0))[0] for k in WEIGHT_KERNELS) for row, r in rows.items()}


def summary_table(run: dict, rows: list[str]) -> str:
    """One saved run's rows side by side in a few lines (docs/PERFORMANCE.md): the GEMMs, the rest
    of the step, twofour's kernels and of them the weight kernels in passes over the FFN weights,
    and the step with its tokens/s ratio to the first row."""
    res = {row: run["rows"][row] for row in rows}
    kinds = by_kind(res)
    one_pass, weight = weight_passes(res, run["rates"])
    rest = ("attention", "Inductor", "optimizer", "other")
    base = res[rows[0]]["tokens_per_s"]
    return "\n".join([
        md_head("kind", *rows),
        *(md_row(k, *(f"{kinds[row][k]:.2f}" for row in rows)) for k in ("GEMM dense", "GEMM 2:4")),
        md_row(", ".join(rest), *(f"{sum(kinds[row][k] for k in rest):.2f}" for row in rows)),
        md_row("twofour Triton", *(f"{kinds[row]['twofour Triton']:.2f}" for row in rows)),
        md_row("of which weight kernels (passes)",
               *(f"{weight[row]:.2f} ({weight[row] / one_pass:.1f})" for row in rows)),
        md_row(f"step ms (ratio to {rows[0]})",
               *(f"{r['ms']:.2f} ({r['tokens_per_s'] / base:.3f}x)" for r in res.values()))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--ratios", default="2", help="2:4 GEMM speedups over the peer's to give ceilings at")
    ap.add_argument("--json", type=Path, help="write every row's numbers here (rewritten after each row)")
    ap.add_argument("--from-json", nargs="+", type=Path, metavar="JSON",
                    help="print the tables of saved runs (no GPU); rows of later files keep their file's name")
    ap.add_argument("--summary", default=None, metavar="ROWS",
                    help="with --from-json (one file): only the few-line table of these rows (docs/PERFORMANCE.md)")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",") if r]
    if args.from_json and args.summary:
        print(summary_table(json.loads(args.from_json[0].read_text()), args.summary.split(",")))
        return
    if args.from_json:
        print(report([(p.stem, json.loads(p.read_text())) for p in args.from_json], ratios))
        return
    rows = args.rows.split(",")
    for r in rows:
        try:
            row_recipe(r)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise SystemExit(f"peer.py: row {r!r}: {one_line(exc)} "
                             f"(rows: {', '.join(ROWS)}, or RECIPE[-fp8][+KEY=VALUE])") from None
    rates = {"copy_gbs": copy_bandwidth()}
    saved = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rates": rates,
             "code": {"source": source_digest(), "torchao": getattr(_torchao(), "__version__", None)},
             "gpu": gpu_line(), "rows": {}}
    for row in rows:
        try:
            saved["rows"][row] = r = run_row(row, args)
            print(f"{row}: {r['ms']:.2f} ms, {r['tokens_per_s']:,.0f} tokens/s", flush=True)
        except Exception as exc:  # noqa: BLE001 - a row that cannot run says why in its place
            saved["rows"][row] = {"row": row, "error": one_line(exc)[:160]}
            print(f"{row}: {saved['rows'][row]['error']}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps(saved, indent=1))
    print(report([("", saved)], ratios))


if __name__ == "__main__":
    main()
