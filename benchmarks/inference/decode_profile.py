"""Where a decoding step's time goes: an exported 2:4 Llama against its dense twin, kernel by kernel
(GPU, a few minutes at Llama-7B's shape with 16 blocks on an H100).

    PYTHONPATH=src python benchmarks/inference/decode_profile.py [--model llama-7b] [--layers 16] \\
        [--batches 1 8] [--out DIR]

Per batch and model: the step's time as a CUDA graph replay (what ``twofour bench --inference``
times), the sum of its kernels' durations (``torch.profiler`` over eager steps, and over graph
replays where the profiler sees the graph's kernels), the step's time less the eager kernels'
(gaps between kernels in the replay: launch latency and dependencies), and the kernels grouped
by job (2:4 GEMV, cuSPARSELt, dense GEMMs, attention, the rest) with their time and launches
per step; then what bounds the ratio: the dense step less its FFN's kernels (kernels launched
inside each block's ``mlp``, a profiler range) plus the 2:4 FFN's bytes at copy bandwidth, and
the share of copy bandwidth the 2:4 FFN must reach for a ratio of 1.2x and 1.3x; then the
kernels that take the most time. ``--out DIR`` writes the rows as ``decode_profile.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from twofour.bench.speed import default_vocab, exported_pair
from twofour.inference import SparseInferenceLinear
from twofour.timing import captured

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import copy_bandwidth, gpu_line, graph_ms, kernel_times, md_head, md_row, weight_bytes  # noqa: E402

PROMPT, STEPS, PROFILED = 128, 30, 5
#: kernel groups, first match wins (regular expressions on the kernel's name)
GROUPS = [("2:4 GEMV", r"_quad|_gemv24|_sum_splits|_permute_x"), ("cuSPARSELt", r"sparse|cusparse|_sp_"),
          ("dense GEMM", r"gemm|nvjet|cutlass|xmma|sm90_"), ("attention", r"flash|fmha|attention|softmax"),
          ("other", r".")]


def ffn_bytes(model: torch.nn.Module) -> int:
    """Bytes of the FFNs' weights (2:4: values and positions)."""
    return sum(weight_bytes(mod) for name, mod in model.named_modules()
               if ".mlp." in f".{name}." and isinstance(mod, (torch.nn.Linear, SparseInferenceLinear)))


def group(name: str) -> str:
    return next(g for g, pat in GROUPS if re.search(pat, name, flags=re.I))


@contextlib.contextmanager
def ffn_ranges(model: torch.nn.Module):
    """Each block's FFN (``*.mlp``) run inside a profiler range named ``ffn``, so that its kernels
    are counted apart (forward hooks, removed on exit)."""
    handles, open_ = [], []
    for name, mod in model.named_modules():
        if name.split(".")[-1] == "mlp":
            handles.append(mod.register_forward_pre_hook(
                lambda *_: open_.append(torch.profiler.record_function("ffn").__enter__())))
            handles.append(mod.register_forward_hook(lambda *_: open_.pop().__exit__(None, None, None)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def kernels_per_step(step, n: int, model: torch.nn.Module | None = None) -> tuple[dict[str, tuple[float, float]],
                                                                                 float]:
    """{kernel name: (us per step, launches per step)} over ``n`` calls of ``step``, and the us per
    step of the kernels launched inside the FFNs of ``model`` by torch's operators (cuBLAS, not
    Triton's launches, which the profiler does not tie to a range; 0 without ``model``)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            (ffn_ranges(model) if model is not None else contextlib.nullcontext()):
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    out = kernel_times(prof, n, skip=("ffn",))  # the ranges' spans on the GPU are not kernels
    ffn = sum(getattr(e, "device_time_total", 0.0) for e in prof.events()
              if e.name == "ffn" and e.device_type == DeviceType.CPU)
    return out, ffn / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    vocab = default_vocab(a.model)
    print(f"{gpu_line()}\n\n{a.model}, {a.layers} blocks, vocabulary {vocab}, random weights, s-ste FFN exported in "
          f"bf16; prompt {PROMPT}, graph replays of one greedy step; kernels from {PROFILED} eager steps\n")
    with tempfile.TemporaryDirectory() as folder:
        sparse, dense, _ = exported_pair(a.model, folder, vocab_size=vocab, context=PROMPT + 2 * STEPS + 64,
                                         n_layer=a.layers)
    rows, tops = [], {}
    for b in a.batches:
        for name, model in (("dense", dense), ("2:4", sparse)):
            cache = model.make_cache(b, PROMPT + 2 * STEPS + 32)
            idx = torch.randint(0, vocab, (b, PROMPT), device="cuda")
            tok = model(idx, cache=cache)[0][:, -1:].argmax(-1)
            step = lambda m=model, c=cache, t=tok: t.copy_(m(t, cache=c)[0][:, -1:].argmax(-1))  # noqa: E731
            ms = graph_ms(step, reps=STEPS)
            ks, ffn = kernels_per_step(step, PROFILED, model)
            total = sum(us for us, _ in ks.values())
            in_graph = sum(us for us, _ in kernels_per_step(captured(step).replay, PROFILED)[0].values())
            groups = {}
            for k, (us, n) in ks.items():
                g = groups.setdefault(group(k), [0.0, 0.0])
                g[0] += us
                g[1] += n
            rows.append({"batch": b, "model": name, "step_us": ms * 1e3, "kernels_us": total, "in_graph_us": in_graph,
                         "ffn_us": ffn, "ffn_bytes": ffn_bytes(model),
                         "launches": sum(n for _, n in ks.values()), "groups": groups})
            tops[f"{b}:{name}"] = sorted(ks.items(), key=lambda kv: -kv[1][0])[:12]
            del cache
    names = [g for g, _ in GROUPS]
    print(md_head("batch", "model", "step us (graph)", "kernels us (eager / in the graph)", "gaps us", "launches",
                  *[f"{g} us (launches)" for g in names]))
    for r in rows:
        print(md_row(r["batch"], r["model"], f"{r['step_us']:,.0f}",
                     f"{r['kernels_us']:,.0f} / " + (f"{r['in_graph_us']:,.0f}" if r["in_graph_us"] else "-"),
                     f"{r['step_us'] - r['kernels_us']:,.0f}", f"{r['launches']:.0f}",
                     *[f"{r['groups'].get(g, [0, 0])[0]:,.0f} ({r['groups'].get(g, [0, 0])[1]:.0f})" for g in names]))
    bw = copy_bandwidth()
    print(f"\n### What bounds the ratio: the rest of the step against an FFN at copy bandwidth ({bw:,.0f} GB/s)\n\n"
          "`rest`: the dense step less its FFN kernels (the same for the 2:4 model but for the FFN); `best 2:4`: the "
          "rest plus the 2:4 FFN's bytes at copy bandwidth; `needed`: the share of copy bandwidth the 2:4 FFN must "
          "read at for the ratio named.\n")
    print(md_head("batch", "dense step / FFN us", "rest us", "2:4 step less the rest us (share of copy bw)",
                  "2:4 FFN at copy bw us", "best 2:4 step us", "bound ratio", "needed for 1.2x / 1.3x"))
    for d, sp in zip(rows[::2], rows[1::2]):
        if not d["ffn_us"]:
            print(md_row(d["batch"], "the profiler tied no kernels to the FFN ranges", *["-"] * 6))
            continue
        rest, at_bw = d["step_us"] - d["ffn_us"], sp["ffn_bytes"] / bw / 1e3
        eff = sp["step_us"] - rest  # the 2:4 FFN as the step sees it: kernels and any gaps they add
        need = [sp["ffn_bytes"] / (d["step_us"] / r - rest) / 1e3 / bw if d["step_us"] / r > rest else float("inf")
                for r in (1.2, 1.3)]
        print(md_row(d["batch"], f"{d['step_us']:,.0f} / {d['ffn_us']:,.0f}", f"{rest:,.0f}",
                     f"{eff:,.0f} ({sp['ffn_bytes'] / eff / 1e3 / bw:.0%})", f"{at_bw:,.0f}",
                     f"{rest + at_bw:,.0f}", f"{d['step_us'] / (rest + at_bw):.2f}x",
                     " / ".join("out of reach" if n == float("inf") or n > 1 else f"{n:.0%}" for n in need)))
    for key, top in tops.items():
        b, name = key.split(":", 1)
        print(f"\nbatch {b}, {name}: " + "; ".join(f"{k[:70]} {us:.0f} us x{n:.0f}" for k, (us, n) in top))
    if a.out:
        Path(a.out, "decode_profile.json").write_text(json.dumps({"copy_GBps": bw, "rows": rows, "top": tops},
                                                                 indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main()
