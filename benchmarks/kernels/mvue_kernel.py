"""Where the time of the MVUE + compression of dY^T goes (GPU): the kernel's layout variants,
timed against the copy bandwidth of the same run, after a correctness check.

    PYTHONPATH=src python benchmarks/kernels/mvue_kernel.py

All read dY^T in place from the row-major dY and write cuSPARSELt's compressed layout, groups
along tokens. Variants (``compress.VARIANT`` holds the chosen switch, ``compress_tiled``'s
``pair_rows`` overrides it): ``v10`` (one Philox call for two groups, joined across threads:
the kernel before ``PAIR_ROWS``) and ``PAIR_ROWS`` (one Philox call for rows 2i and 2i+1 of a
group: no layout conversion of the random bits); then the chosen kernel with the dense estimate
as well (``dense_out``) and alone (``sparse_out=False``), the hard top-2 through the same
layout, the kernel on a row-major dY^T (dY stored column-major, as fc1's gradient is in the
FFN's layout plan: the tile-load path), and a sweep of tile widths and warps
(``compress_tiled``'s ``tile``). (The "MVUE kernel" section of
docs/notes/fastpath-experiments.md records these numbers, and two variants measured there and
since removed: a group's values stored as one 32-bit word, and tile columns reordered so that a
metadata word packs within a warp.) Kernel time is CUDA graph replay (no host overhead).
``--profile`` runs one launch of the chosen kernel for ``ncu``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from twofour.functional import mvue_24, mvue_inclusion_probability
from twofour.kernels import compress as ck
from twofour.kernels.layout import decompress_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import copy_bandwidth, graph_ms  # noqa: E402


def check() -> None:
    """Kernel == reference on the same uniforms (same kept set, values within bf16), and the
    Philox draws unbiased within 5 standard errors."""
    torch.manual_seed(0)
    dy = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    dy[::7] = 0.0
    x = dy.t()
    u = torch.rand(x.shape[0], x.shape[1] // 2, device="cuda")
    buf, _ = ck.compress(x, "mvue", u=u)
    ref = mvue_24(x.contiguous(), u=u)
    dec = decompress_reference(buf, *x.shape).float()
    same = (dec != 0) == (ref != 0)
    print(f"check: kept sets equal on {same.float().mean().item():.6f} of entries; "
          f"max rel err {((dec - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max().item():.2e}")
    assert same.all()
    xs = torch.randn(256, 64, device="cuda").t()  # read in place, as dY^T is
    n = 400
    acc = torch.zeros_like(xs, dtype=torch.float64)
    for i in range(n):
        b, _ = ck.compress(xs, "mvue", seed=torch.tensor([i], device="cuda"), out_dtype=torch.float16)
        acc += decompress_reference(b, *xs.shape, torch.float16).double()
    p = mvue_inclusion_probability(xs).double()
    z = ((acc / n - xs.double()) / (xs.double() ** 2 * (1 - p) / p / n).sqrt().clamp_min(1e-9)).abs()
    print(f"check: Philox draws, max |z| over {xs.numel()} entries after {n} draws: {z.max().item():.2f}")
    assert z.max() < 6


VARIANTS = {"v10": False, "PAIR_ROWS": True}  # compress_tiled's pair_rows


def main() -> None:
    check()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    seed = torch.tensor([5], device="cuda")
    print("\n| shape (tokens x out) | variant | kernel ms | GB/s | of copy |\n|---|---|---|---|---|")
    for t, n in ((32768, 5120), (32768, 1280), (16384, 11008)):
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        sparse_bytes = t * n * 2 + t * n + t * n // 8  # read bf16, write half the values + 4 bits per group
        cases = {name: (dict(mode="mvue", seed=seed, pair_rows=v), sparse_bytes) for name, v in VARIANTS.items()}
        cases["chosen, + dense estimate"] = (dict(mode="mvue", seed=seed, dense_out=True), sparse_bytes + t * n * 2)
        cases["chosen, dense estimate only"] = (dict(mode="mvue", seed=seed, dense_out=True, sparse_out=False),
                                                t * n * 4)
        cases["chosen, hard top-2"] = (dict(mode="hard"), sparse_bytes)
        dyc = dy.t().contiguous().t()  # dY stored column-major: dY^T row-major, fc1's in the FFN's layout plan
        cases["dY^T row-major (tile path)"] = (dict(mode="mvue", seed=seed, src=dyc), sparse_bytes)
        cases["dY^T row-major, PAIR_ROWS"] = (dict(mode="mvue", seed=seed, src=dyc, pair_rows=True), sparse_bytes)
        for name, (kw, nbytes) in cases.items():
            kw = dict(kw)
            src = kw.pop("src", dy)
            fn = lambda src=src, kw=kw: ck.compress_tiled(src.t(), **kw)  # noqa: E731
            fn()
            ms = graph_ms(fn, inner=10)
            print(f"| {t} x {n} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | {nbytes / ms / 1e6 / bw:.0%} |",
                  flush=True)
    t, n = 32768, 5120
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    nbytes = t * n * 2 + t * n + t * n // 8
    print("\nchosen variant, 774M fc1 shape, per tile width x warps (kernel ms, % of copy):")
    for bc, w in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8), (256, 8)):
        fn = lambda bc=bc, w=w: ck.compress_tiled(dy.t(), "mvue", seed=seed, tile=(bc, w))  # noqa: E731
        fn()
        ms = graph_ms(fn, inner=10)
        print(f"  BC={bc} {w} warps: {ms:.3f} ms ({nbytes / ms / 1e6 / bw:.0%})", flush=True)


def profile_once() -> None:
    """One launch of the chosen kernel at the 774M fc1 shape (MVUE of dY^T in place), for ``ncu``
    (autotuned first; ``ncu -k regex:_compress_kernel`` with ``-c`` picks launches)."""
    dy = torch.randn(32768, 5120, device="cuda", dtype=torch.bfloat16)
    ck.compress(dy.t(), "mvue", seed=torch.tensor([5], device="cuda"))
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    profile_once() if "--profile" in sys.argv else main()
