"""Check every FP8 quantization route byte for byte against plain torch on memory left full of
NaN patterns (an output element a kernel forgets to write shows up), then run a small FP8 layer's
forward and backward with each route forced and report non-finite gradients. ``--layer-test``
runs tests/test_fp8.py's fused-effective-weight test once and prints the dispatch's choices: run
it in several fresh processes, since the choices (and a failure that goes with one) vary by process.

    python benchmarks/fp8/fp8_route_check.py [--repeats 20]
    for i in 1 2 3 4 5 6; do python benchmarks/fp8/fp8_route_check.py --layer-test; done
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from twofour import dispatch
from twofour import fp8 as f8
from twofour.kernels import fp8cast
from twofour.sparse import SparseLinear

SHAPES = [(128, 64), (96, 64), (128, 96), (64, 96), (37, 100), (1024, 768)]


def poison(nbytes: int) -> None:
    """Leave a freed block of ``nbytes`` full of 0x7F (NaN in e4m3, NaN in bf16 pairs) for the next
    allocation of that size to reuse."""
    p = torch.full((nbytes,), 0x7F, dtype=torch.uint8, device="cuda")
    del p


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def force_route(route: str) -> None:
    """Make every FP8 quantization the dispatch has measured so far take ``route`` (``triton`` or
    ``compiled``) where it is one of its candidates."""
    for key in dispatch.choices():
        if key.startswith("fp8-quantize") and route in key.rsplit(":", 1)[-1].split("|"):
            dispatch.set_choice(key, route)


def check_quantization(repeats: int) -> list[str]:
    rows = []
    variants = ((False, False), (False, True), (True, False))  # (rowwise, transposed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for shape, fmt, (rowwise, transposed), dtype in itertools.product(SHAPES, (f8.E4M3, f8.E5M2), variants, dtypes):
        t = (torch.randn(shape, device="cuda") * 3).to(dtype)

        def run(t=t, fmt=fmt, rowwise=rowwise, transposed=transposed):
            return f8.quantize_t(t, fmt, f8.ROWWISE if rowwise else f8.TENSORWISE, transposed=transposed)

        with dispatch.override(fast=False):
            ref = run()  # plain torch
        run()  # the dispatch measures its routes for this variant and shape
        routes = ["compiled"] + (["triton"] if fp8cast.supported(t, rowwise, transposed) else [])
        for name in routes:
            force_route(name)
            bad = 0
            for _ in range(repeats):
                poison(t.numel())
                out = run()
                torch.cuda.synchronize()
                bad += not (same(out[0], ref[0]) and torch.equal(out[1], ref[1]) and same(out[2], ref[2]))
            rows.append(f"{str(shape):12} {str(dtype)[6:]:8} {str(fmt).split('_')[1]:5} rowwise={rowwise:d} "
                        f"T={transposed:d} {name:9} mismatches {bad}/{repeats}")
        dispatch.clear_choices()
    return rows


def fp8_layer_step(recipe: str, seed: int, x_grad: bool = False):
    """tests/test_fp8.py's fused-effective-weight case: a 64 -> 96 FP8 layer on 128 float32 tokens
    under bf16 autocast, forward and backward; ``(layer, x, y)``."""
    torch.manual_seed(seed)
    lin = SparseLinear(64, 96, recipe=recipe, precision="fp8").cuda()
    x = torch.randn(128, 64, device="cuda", requires_grad=x_grad)
    poison(1 << 20)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    y.float().pow(2).sum().backward()
    return lin, x, y


def layer_grads(route: str | None, repeats: int) -> list[str]:
    """The FP8 layer test's forward and backward with the quantization route forced after the
    first run (None: the dispatch's own choice), repeated; how many runs gave non-finite dX, dW or db."""
    rows = []
    for recipe in ("ste", "s-ste"):
        bad = {"dx": 0, "dw": 0, "db": 0}
        for i in range(repeats):
            lin, x, y = fp8_layer_step(recipe, i, x_grad=True)
            if route and i == 0:
                force_route(route)
            for name, g in (("dx", x.grad), ("dw", lin.weight.grad), ("db", lin.bias.grad)):
                bad[name] += not bool(torch.isfinite(g).all())
            assert rel_ok(y, F.linear(x, lin.effective_weight(), lin.bias))
        rows.append(f"layer {recipe:6} route={route or 'dispatch':9} non-finite runs of {repeats}: {bad}")
        dispatch.clear_choices()
    return rows


def layer_test_once() -> list[str]:
    """tests/test_fp8.py's fused-effective-weight test in a fresh process: which dispatch choices
    went with a non-finite weight gradient."""
    rows = []
    for recipe in ("s-ste", "ste", "t-sr-ste"):
        g = fp8_layer_step(recipe, 0)[0].weight.grad
        rows.append(f"{recipe}: non-finite dW entries {int((~torch.isfinite(g)).sum())} of {g.numel()}, "
                    f"rows {sorted(set((~torch.isfinite(g)).nonzero()[:, 0].tolist()))[:12]}")
    return rows


def rel_ok(a, b) -> bool:
    return ((a.float() - b.float()).norm() / b.float().norm()).item() < 0.1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layer-test", action="store_true", help="only the layer test, once, with the choices")
    a = ap.parse_args()
    if a.layer_test:
        print("\n".join(layer_test_once() + dispatch.choice_lines()))
        return
    print("\n".join(check_quantization(a.repeats)))
    for route in (None, "triton", "compiled"):
        print("\n".join(layer_grads(route, a.repeats)))
    print("\n".join(dispatch.choice_lines()))


if __name__ == "__main__":
    main()
