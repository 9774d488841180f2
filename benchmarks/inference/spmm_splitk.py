"""cuSPARSELt at decoding sizes: every algorithm configuration at every split of the inner
dimension (split-K), at Llama-7B's FFN shapes with 8 and 16 columns (the tokens, padded to 8),
against dense bf16 and the copy bandwidth (GPU, about a minute on an H100).

    PYTHONPATH=src python benchmarks/inference/spmm_splitk.py

Each (configuration, split) is checked against the dense product of the same weight, then timed
as a CUDA graph that cycles through enough weight copies to exceed the L2 cache (a decoding step
streams each layer's weight once), median of 10 replays. The table gives, per shape and width:
dense (``F.linear``), cuSPARSELt's default, the fastest configuration without a split, the
fastest with one, and the share of the copy bandwidth the fastest reads (values and metadata:
the compressed buffer's bytes). The question: does a split fill the GPU where a layer has few
output rows (the down projection: 4096 rows, 32 tiles of 128) and make cuSPARSELt's sparse
tensor cores the multi-token decoding route?
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from twofour.kernels import compress as ck
from twofour.kernels import cusparselt as cs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import copies_past_l2, copy_bandwidth, cycled_us, gpu_line, md_head, md_row  # noqa: E402

DT = torch.bfloat16
SHAPES = [("7b up", 4096, 11008), ("7b down", 11008, 4096), ("7b gate|up", 4096, 22016)]
WIDTHS = (8, 16)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def case(k: int, m: int, n: int) -> dict:
    buf, dense = ck.compress(torch.randn(m, k, device="cuda"), "hard", dense_out=True)
    copies = copies_past_l2(buf.numel())
    bufs = [buf] + [ck.compress(torch.randn(m, k, device="cuda"), "hard")[0] for _ in range(copies - 1)]
    x = torch.randn(n, k, device="cuda").to(DT)
    b, out = x.t(), torch.empty(n, m, dtype=DT, device="cuda")  # y = x W^T as the inference layer asks it
    ref = F.linear(x, dense).float()
    base = cs.get_plan(m, k, n, cs.COL, cs.COL, DT)
    times, bad = {}, 0
    for config in range(base.num_configs):
        for split in SPLITS:
            try:
                p = cs.get_plan(m, k, n, cs.COL, cs.COL, DT, config=config, split_k=split)
                if p.config_id != config or p.split_k != split or p.compressed_size != base.compressed_size:
                    continue  # the library runs another configuration or split than asked: not this one
                p.matmul(buf, b, out)
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - this configuration or split cannot run this shape
                continue
            if ((out.float() - ref).norm() / ref.norm()).item() > 1e-2:
                bad += 1
                continue
            times[(config, split)] = cycled_us([lambda p=p, a=a: p.matmul(a, b, out) for a in bufs])
    dcopies = copies_past_l2(m * k * 2)
    dws = [dense.to(DT)] + [torch.randn(m, k, device="cuda").to(DT) for _ in range(dcopies - 1)]
    dense_us = cycled_us([lambda w=w: F.linear(x, w) for w in dws])
    del bufs, dws
    torch.cuda.empty_cache()
    return {"times": times, "bad": bad, "dense": dense_us, "default": base.config_id, "bytes": buf.numel()}


def main() -> None:
    bw = copy_bandwidth()
    print(f"{gpu_line()}\n\ncopy bandwidth {bw:,.0f} GB/s\n")
    print(md_head("shape", "columns", "dense us", "default us", "fastest, no split us (config)",
                  "fastest us (config, split)", "% copy bw", "dense / fastest", "wrong"))
    for name, k, m in SHAPES:
        for n in WIDTHS:
            r = case(k, m, n)
            t = r["times"]
            if not any(c[1] == 1 for c in t):
                print(md_row(f"{name} {k}->{m}", n, f"{r['dense']:.1f}", "no configuration ran", *["-"] * 5))
                continue
            nosplit = {c: v for c, v in t.items() if c[1] == 1}
            b1 = min(nosplit, key=nosplit.get)
            best = min(t, key=t.get)
            print(md_row(f"{name} {k}->{m}", n, f"{r['dense']:.1f}", f"{t.get((r['default'], 1), float('nan')):.1f}",
                         f"{t[b1]:.1f} (#{b1[0]})", f"{t[best]:.1f} (#{best[0]}, k/{best[1]})",
                         f"{r['bytes'] / t[best] / 1e3 / bw:.0%}", f"{r['dense'] / t[best]:.2f}x", r["bad"]),
                  flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
