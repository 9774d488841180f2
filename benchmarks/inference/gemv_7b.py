"""The 2:4 GEMV / skinny GEMM at decoding sizes (1-16 tokens) against dense bf16 and cuSPARSELt, at
Llama-7B's FFN shapes and gpt2-774m's, against the copy bandwidth; and the bound of a Llama-7B
decoding step (GPU, under 5 minutes on an H100).

    PYTHONPATH=src python benchmarks/inference/gemv_7b.py        # OUT=dir also writes gemv_7b.json

1. Correctness: every configuration of ``twofour.kernels.gemv24.configs_for`` at every shape, at
   1, 5 and 16 tokens, against the float32 product of the same weight (max error / max |y|).
2. Time per shape and token count (1, 2, 4, 8, 16), each a CUDA graph of calls that cycle through
   enough copies of the weight to exceed the L2 cache (a decoding step streams every layer's
   weight once: none is in L2), median of 10 replays: dense (``F.linear``, cuBLAS), cuSPARSELt
   (``SparseInferenceLinear``'s ``sparse`` route, tokens padded to 8), every GEMV configuration,
   and the one the dispatch measures and keeps (``gemv24`` with no config); and cuSPARSELt and that
   GEMV timed as ``SparseInferenceLinear``'s dispatch times its routes (``timing.median_ms``:
   eager calls on one weight copy, host time counted where it is longer than the kernel's). GB/s counts the
   weight bytes read (dense: 2 bytes an entry; 2:4: values + positions, 0.5625x); ``% copy``: of
   the copy bandwidth measured here (bytes read + written by a 256 MB copy).
3. The bound of a Llama-7B decoding step at batch 1 / 8 / 64: bytes a step reads (every linear's
   weight once, the KV cache of 208 positions), the ratio those bound, the ratio predicted from
   the measured linears (dense attention linears and head, the FFN dense or its fastest 2:4
   route), and the launch overhead (one tiny kernel in a graph, per launch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from twofour import dispatch, timing
from twofour.functional import mask_24
from twofour.inference import SparseInferenceLinear
from twofour.inference.packed import pack_24
from twofour.kernels.gemv24 import MAX_TOKENS, configs_for, gemv24, launch, reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import copies_past_l2, copy_bandwidth, cycled_us, gpu_line, graph_ms, md_head, md_row  # noqa: E402

#: (name, in, out): Llama-7B's FFN (gate|up fused with interleaved rows, as twofour's Llama holds it)
#: and gpt2-774m's
SHAPES = [("7b up", 4096, 11008), ("7b down", 11008, 4096), ("7b gate|up", 4096, 22016),
          ("774m fc", 1280, 5120), ("774m proj", 5120, 1280)]
TOKENS = (1, 2, 4, 8, 16)
REPS = 10
#: Llama-7B: blocks, width, FFN width, vocabulary; decoding reads a static cache of prompt 128 + 64 steps + 2
N_LAYER, D, H, VOCAB, CACHE = 32, 4096, 11008, 32000, 208


def weights(k: int, n: int, copies: int, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """``copies`` random 2:4 bf16 weights (n, k): (dense, values, positions, SparseInferenceLinear)."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda", generator=gen)
        w = (w * mask_24(w)).bfloat16()
        v, p = pack_24(w)
        lin = SparseInferenceLinear.from_weight(w, None)
        lin.prepare()
        out.append((w, v, p, lin))
    return out


def check(name: str, k: int, n: int, gen: torch.Generator) -> dict[str, float]:
    """Max relative error of every configuration at 1, 5 and 16 tokens (one weight)."""
    (w, v, p, _), = weights(k, n, 1, gen)
    errs = {}
    for t in (1, 5, MAX_TOKENS):
        x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
        want = reference(x.float(), v.float(), p)
        for cfg in configs_for(t):
            y = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
            try:
                launch(x, v, p, None, y, cfg)
                err = ((y.float() - want).abs().max() / want.abs().max()).item()
            except Exception as e:  # noqa: BLE001 - a configuration that fails to build is a result
                print(f"  {name} {t} tokens {cfg.name}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                err = float("inf")
            errs[f"{t}:{cfg.name}"] = max(errs.get(f"{t}:{cfg.name}", 0.0), err)
    return errs


def time_shape(k: int, n: int, gen: torch.Generator, bad: set[str]) -> dict:
    """Per token count: dense, cuSPARSELt, every GEMV configuration and the dispatch's choice (us)."""
    copies = copies_past_l2(n * k * 2 * 9 // 16)
    ws = weights(k, n, copies, gen)
    res = {"copies": copies, "dense_bytes": n * k * 2, "sparse_bytes": v_bytes(ws[0]), "tokens": {}}
    for t in TOKENS:
        x = torch.randn(t, k, device="cuda", generator=gen).bfloat16()
        ys = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
        row = {"dense": cycled_us([lambda w=w, x=x: F.linear(x, w) for w, *_ in ws]),
               "cusparselt": cycled_us([lin.routes(x)["sparse"] for *_, lin in ws])}
        cfgs = {}
        for cfg in configs_for(t):
            if cfg.name in bad:  # wrong or failed somewhere: not timed
                continue
            cfgs[cfg.name] = cycled_us([lambda v=v, p=p, y=y, c=cfg, x=x: launch(x, v, p, None, y, c)
                                        for (_, v, p, _), y in zip(ws, ys)])
        row["configs"] = cfgs
        row["dispatch"] = cycled_us([lambda v=v, p=p, x=x: gemv24(x, v, p) for _, v, p, _ in ws])
        # as the inference layer's dispatch times its routes: eager calls, host time counted where longer
        _, v, p, lin = ws[0]
        row["eager"] = {"cusparselt": 1e3 * timing.median_ms(lin.routes(x)["sparse"]),
                        "gemv": 1e3 * timing.median_ms(lambda v=v, p=p, x=x: gemv24(x, v, p))}
        res["tokens"][t] = row
    del ws
    torch.cuda.empty_cache()
    return res


def v_bytes(wt: tuple) -> int:
    return wt[1].numel() * 2 + wt[2].numel()


def launch_us() -> float:
    """Microseconds per launch of a tiny kernel, 200 in one CUDA graph: the floor of each kernel."""
    a = torch.zeros(256, device="cuda")
    return graph_ms(lambda: [a.add_(1.0) for _ in range(200)], reps=REPS) / 200 * 1e3


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    floor = launch_us()
    print(f"{gpu_line()}\n\ncopy bandwidth {bw:,.0f} GB/s (read + written); one kernel launch in a graph "
          f"{floor:.2f} us\n")
    out = {"copy_GBps": bw, "launch_us": floor, "shapes": {}}
    print("### Correctness: every configuration vs float32 (max error / max |y|, 1, 5 and 16 tokens)\n")
    bad = set()
    for name, k, n in SHAPES:
        errs = check(name, k, n, gen)
        bad |= {key.split(":", 1)[1] for key, e in errs.items() if not e < 2e-2}
        worst = max(errs, key=errs.get)
        print(f"- {name} {k}->{n}: {len(errs)} checks, worst {errs[worst]:.1e} ({worst}); "
              f"{sum(1 for e in errs.values() if not e < 2e-2)} over 2e-2", flush=True)
        out["shapes"][name] = {"errors": errs}
    print("\n### Time per call (us), weights cycled past L2; GB/s of weight bytes read, % of copy bandwidth\n")
    print(md_head("shape", "tokens", "dense us (GB/s, % copy)", "cuSPARSELt us", "best GEMV us (GB/s, % copy)",
                  "best config", "dispatch us", "eager cuSPARSELt / GEMV us", "dense / best 2:4"))
    for name, k, n in SHAPES:
        r = time_shape(k, n, gen, bad)
        out["shapes"][name].update(r)
        for t, row in r["tokens"].items():
            best = min(row["configs"], key=row["configs"].get)
            bu, du = row["configs"][best], row["dense"]
            gbd, gbs = r["dense_bytes"] / du / 1e3, r["sparse_bytes"] / bu / 1e3
            print(md_row(f"{name} {k}->{n}", t, f"{du:.1f} ({gbd:,.0f}, {gbd / bw:.0%})", f"{row['cusparselt']:.1f}",
                         f"{bu:.1f} ({gbs:,.0f}, {gbs / bw:.0%})", best, f"{row['dispatch']:.1f}",
                         f"{row['eager']['cusparselt']:.1f} / {row['eager']['gemv']:.1f}",
                         f"{du / min(bu, row['cusparselt'], row['dispatch']):.2f}x"), flush=True)
    print("\n### Every configuration (us), per shape and tokens\n")
    for name, s in out["shapes"].items():
        for t, row in s["tokens"].items():
            top = sorted(row["configs"].items(), key=lambda kv: kv[1])
            print(f"- {name}, {t}: " + ", ".join(f"{c} {u:.1f}" for c, u in top[:6]) + f" ... ({len(top)} timed)")
    bound_table(out, bw, floor)
    print("\nDispatch choices (`gemv24` keys: out x in x token bucket):\n\n```")
    print("\n".join(line[:240] for line in dispatch.choice_lines("gemv24")) + "\n```")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_7b.json").write_text(json.dumps(out, indent=1, default=str))


def bound_table(out: dict, bw: float, floor: float) -> None:
    """A Llama-7B decoding step: bytes it reads, the ratio they bound, the ratio the measured linears give."""
    print(f"\n### Llama-7B decoding step ({N_LAYER} blocks, KV cache of {CACHE}): what bounds it\n\n`linears`: the "
          "block's linears at the batch's tokens, timed above or here (attention qkv/proj and head dense in both "
          "models), x blocks + head; `2:4` takes the fastest 2:4 route per FFN linear. Kernels a block launches "
          f"besides its linears (norms, rotary, attention, SwiGLU) are not in it; each costs at least {floor:.1f} "
          "us.\n")
    print(md_head("batch", "bytes/step dense / 2:4", "at copy bw dense / 2:4 us", "bound ratio",
                  "linears dense / 2:4 us", "linears ratio", "2:4 FFN share of copy bw"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    att = [torch.randn(3 * D, D, device="cuda", generator=gen).bfloat16(), torch.randn(D, D, device="cuda").bfloat16()]
    head = torch.randn(VOCAB, D, device="cuda", generator=gen).bfloat16()
    attn_b, head_b = 4 * D * D * 2, VOCAB * D * 2
    up, down = out["shapes"]["7b gate|up"], out["shapes"]["7b down"]
    for b in (1, 8, 64):
        kv = 2 * N_LAYER * b * CACHE * D * 2
        bd = N_LAYER * (attn_b + up["dense_bytes"] + down["dense_bytes"]) + head_b + kv
        bs = N_LAYER * (attn_b + up["sparse_bytes"] + down["sparse_bytes"]) + head_b + kv
        x = torch.randn(b, D, device="cuda", generator=gen).bfloat16()
        t_att = graph_ms(lambda x=x: [F.linear(x, w) for w in att], inner=N_LAYER, reps=REPS) * 1e3  # per block
        t_head = graph_ms(lambda x=x: F.linear(x, head), reps=REPS) * 1e3
        cells = ["-"] * 3  # past the GEMV's tokens: cuSPARSELt's GEMM, timed by inference_bench.py
        if b <= MAX_TOKENS:
            tb = 1 << (b - 1).bit_length()
            ffn_d = up["tokens"][tb]["dense"] + down["tokens"][tb]["dense"]
            ffn_s = sum(min(s["tokens"][tb]["cusparselt"], s["tokens"][tb]["dispatch"], *s["tokens"][tb]["configs"]
                            .values()) for s in (up, down))
            td, ts = N_LAYER * (t_att + ffn_d) + t_head, N_LAYER * (t_att + ffn_s) + t_head
            share = (up["sparse_bytes"] + down["sparse_bytes"]) / ffn_s / 1e3 / bw
            cells = [f"{td:,.0f} / {ts:,.0f}", f"{td / ts:.2f}x", f"{share:.0%}"]
            out.setdefault("bound", {})[b] = {"linears_us_dense": td, "linears_us_2:4": ts}
        out.setdefault("bound", {}).setdefault(b, {}).update({"bytes_dense": bd, "bytes_2:4": bs})
        print(md_row(b, f"{bd / 1e6:,.0f} / {bs / 1e6:,.0f} MB", f"{bd / bw / 1e3:,.0f} / {bs / bw / 1e3:,.0f}",
                     f"{bd / bs:.2f}x", *cells), flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
