"""The weight kernels of one optimizer step at a preset's FFN shapes, each against its bytes at the
device's copy bandwidth: the mask refresh, and for each recipe the compression of its operands, in
one pass (``compress_both``) or in two (the compression, then a second pass over W_eff^T or W^T, as
before the fused kernel).

    PYTHONPATH=src python benchmarks/step/weight_passes.py [--preset llama-8b] [--json out.json]

The weights are float32 masters of the preset's FFN shapes (the fused gate/up projection and the
down projection, one block); every kernel's output is checked against the two-pass result before it
is timed (bench_ms: L2 flushed, median). "bound" is the kernel's bytes (each read and write once) at
the copy bandwidth; "x bound" how far the kernel is from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line, md_head, md_row  # noqa: E402

from twofour.functional import mask_24, transposable_mask_24  # noqa: E402
from twofour.kernels import compress as ck  # noqa: E402
from twofour.kernels import ops  # noqa: E402
from twofour.models import PRESETS  # noqa: E402


def shapes(preset: str) -> list[tuple[int, int]]:
    """(out, in) of a block's FFN weights: the gate and up projections as one, then the down one."""
    c = PRESETS[preset].config
    n, h = c.n_embd, getattr(c, "ffn_hidden", None) or 4 * c.n_embd
    return [(2 * h, n), (n, h)]


def cases(w: torch.Tensor) -> dict[str, tuple[Callable[[], object], int]]:
    """{name: (kernel call, bytes it must move)} for one float32 weight ``w`` (N, K)."""
    n, k = w.shape
    mask, flips = mask_24(w), torch.zeros((), dtype=torch.long, device=w.device)
    tmask = transposable_mask_24(w)
    beta = torch.ones(1, device=w.device)
    comp = n * k + n * k // 8  # bf16 values (2 of 4) and the 4-bit positions
    dense = 2 * n * k
    return {
        "refresh (mask of |W|, flips)": (lambda: ops.refresh_mask_(w, mask, flips), 4 * n * k + 2 * n * k),
        "s-ste: W_eff (compressed, dense)": (lambda: ck.compress(w, "soft", scale=beta, dense_out=True),
                                             4 * n * k + comp + dense),
        "s-ste pruned-t: two passes": (lambda: ck.compress(ck.compress(w, "soft", scale=beta, dense_out=True)[1].t(),
                                                           "hard"), 4 * n * k + comp + dense + dense + comp),
        "s-ste pruned-t: compress_both": (lambda: ck.compress_both(w, "soft", scale=beta, dense_out=True),
                                          4 * n * k + 2 * comp + dense),
        "ste pruned-t: compress_both": (lambda: ck.compress_both(w, "hard", dense_out=True),
                                        4 * n * k + 2 * comp + dense),
        "t-sr-ste: two passes": (lambda: (ck.compress(w, "mask", mask=tmask, dense_out=True),
                                          ck.compress(w.t(), "mask", mask=tmask.t())),
                                 2 * (4 * n * k + n * k) + 2 * comp + dense),
        "t-sr-ste: compress_both": (lambda: ck.compress_both(w, "mask", mask=tmask, dense_out=True),
                                    4 * n * k + n * k + 2 * comp + dense),
    }


def check(w: torch.Tensor) -> None:
    """The one-pass kernels write what the two passes wrote (the table times nothing else)."""
    beta = torch.ones(1, device=w.device)
    wc, wd, wtc = ck.compress_both(w, "soft", scale=beta, dense_out=True)
    wc0, wd0 = ck.compress(w, "soft", scale=beta, dense_out=True)
    assert torch.equal(wc, wc0) and torch.equal(wd, wd0) and torch.equal(wtc, ck.compress(wd0.t(), "hard")[0])
    m = transposable_mask_24(w)
    assert torch.equal(ck.compress_both(w, "mask", mask=m)[2], ck.compress(w.t(), "mask", mask=m.t())[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(gpu_line(), f"\ncopy bandwidth {bw:,.0f} GB/s; preset {args.preset}, FFN weights {shapes(args.preset)}\n")
    weights = [torch.randn(s, device="cuda") for s in shapes(args.preset)]
    for w in weights:
        check(w)
    rows = {}
    names = list(cases(weights[0]))
    for name in names:
        ms = sum(bench_ms(cases(w)[name][0]) for w in weights)
        nbytes = sum(cases(w)[name][1] for w in weights)
        rows[name] = {"ms": ms, "bytes": nbytes, "bound_ms": nbytes / bw / 1e6}
    print(md_head("kernel (one block's FFN weights)", "ms", "bound ms", "x bound"))
    for name, r in rows.items():
        print(md_row(name, f"{r['ms']:.3f}", f"{r['bound_ms']:.3f}", f"{r['ms'] / r['bound_ms']:.2f}"))
    if args.json:
        args.json.write_text(json.dumps({"gpu": gpu_line(), "copy_gbps": bw, "preset": args.preset, "rows": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
