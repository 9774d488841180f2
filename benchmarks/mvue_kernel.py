"""Where the time of the MVUE + compression of dY^T goes (GPU): variants of the fused kernel that
leave one stage out, timed against the copy bandwidth of the same run, after a correctness check.

    PYTHONPATH=src python benchmarks/mvue_kernel.py

First a sweep of fixed tile widths and warp counts (MVUE of dY^T in place), then variants of
the autotuned kernel, all reading dY^T in place from the row-major dY and writing cuSPARSELt's
compressed layout, groups along tokens: ``hard`` (top-2, no random draws: the load/split/pack
skeleton), ``mvue r=0`` (MVUE with a Philox of no rounds: the draws' arithmetic without the
generator), ``mvue r=7`` / ``r=10`` (the generator). Kernel time is CUDA graph replay (no host
overhead); "eager" adds the host's launch cost. ``--profile`` runs one launch for ``ncu``.
"""

from __future__ import annotations

import torch
from triton.testing import do_bench, do_bench_cudagraph

from twofour.kernels import compress as ck
from twofour.kernels.layout import decompress_reference
from twofour.pruning import _mvue_24, mvue_inclusion_probability


def check() -> None:
    """Kernel == reference on the same uniforms (same kept set, values within bf16), and the
    Philox draws unbiased within 5 standard errors."""
    torch.manual_seed(0)
    dy = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    dy[::7] = 0.0
    x = dy.t()
    u = torch.rand(x.shape[0], x.shape[1] // 2, device="cuda")
    buf, _ = ck.compress(x, "mvue", u=u)
    ref = _mvue_24(x.contiguous(), u=u)
    dec = decompress_reference(buf, *x.shape).float()
    same = (dec != 0) == (ref != 0)
    print(f"check: kept sets equal on {same.float().mean().item():.6f} of entries; "
          f"max rel err {((dec - ref.float()).abs() / ref.float().abs().clamp_min(1e-3)).max().item():.2e}")
    assert same.all()
    xs = torch.randn(64, 256, device="cuda")
    n = 400
    acc = torch.zeros_like(xs, dtype=torch.float64)
    for i in range(n):
        b, _ = ck.compress(xs, "mvue", seed=torch.tensor([i], device="cuda"), out_dtype=torch.float16)
        acc += decompress_reference(b, *xs.shape, torch.float16).double()
    p = mvue_inclusion_probability(xs).double()
    z = ((acc / n - xs.double()) / (xs.double() ** 2 * (1 - p) / p / n).sqrt().clamp_min(1e-9)).abs()
    print(f"check: Philox draws, max |z| over {xs.numel()} entries after {n} draws: {z.max().item():.2f}")
    assert z.max() < 6


def _copy_bandwidth() -> float:
    """GB/s of a 512 MB device-to-device copy, bytes read + written."""
    x = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6


def main() -> None:
    check()
    bw = _copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s")
    t, n = 32768, 5120
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    nbytes = t * n * 2 + t * n + t * n // 8  # read bf16, write half the values + 4 bits per group
    seed = torch.tensor([5], device="cuda")
    print("\nMVUE of dY^T in place, 774M fc1 shape, per tile width x warps (kernel ms, % of copy):")
    for bc, w in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8), (256, 8)):
        fn = lambda bc=bc, w=w: ck.compress(dy.t(), "mvue", seed=seed, tile=(bc, w))  # noqa: E731
        fn()
        ms = do_bench_cudagraph(fn)
        print(f"  BC={bc} {w} warps: {ms:.3f} ms ({nbytes / ms / 1e6 / bw:.0%})", flush=True)
    print("\n| shape (tokens x out) | variant (dY^T read in place) | kernel ms | GB/s | of copy | eager ms |")
    print("|---|---|---|---|---|---|")
    for t, n in ((32768, 5120), (32768, 1280), (16384, 11008)):
        dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        nbytes = t * n * 2 + t * n + t * n // 8
        for name, kw in (("hard", dict(mode="hard")), ("mvue r=0", dict(mode="mvue", seed=seed, rounds=0)),
                         ("mvue r=7", dict(mode="mvue", seed=seed, rounds=7)),
                         ("mvue r=10", dict(mode="mvue", seed=seed, rounds=10))):
            fn = lambda dy=dy, kw=kw: ck.compress(dy.t(), **kw)  # noqa: E731
            fn()
            ms = do_bench_cudagraph(fn)
            eager = do_bench(fn, return_mode="median")
            print(f"| {t} x {n} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | {nbytes / ms / 1e6 / bw:.0%} | "
                  f"{eager:.3f} |", flush=True)
    print("\nautotuned (tile, warps) per (rows, columns, strides) and mode:",
          sorted({(k[:4], k[5][0], v) for k, v in ck._launch.items()}))


def profile_once() -> None:
    """One launch of the plain kernel at the 774M fc1 shape (MVUE of dY^T in place), for ``ncu``."""
    dy = torch.randn(32768, 5120, device="cuda", dtype=torch.bfloat16)
    ck.compress(dy.t(), "mvue", seed=torch.tensor([5], device="cuda"), tile=(32, 2))
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    profile_once() if "--profile" in sys.argv else main()
