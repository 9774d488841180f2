"""The FFN activation's backward fused with the MVUE compression of dz^T (``kernels/actgrad.py``), on
the GPU: correctness, each kernel against copy bandwidth, and FFN blocks and a whole step with the
fused route against the unfused one (the activation's gradient, then the standalone MVUE kernel)
and against dense.

    PYTHONPATH=src python benchmarks/kernels/act_mvue.py [--reps 5] [--no-step] [--kernels-only]

1. Kernels at the FFN shapes (16384 tokens; z column-major, as a 2:4 gate|up or fc with
   ``transposed_output`` leaves it, the order the fused kernel takes): the activation's gradient
   alone, the standalone MVUE compression of its dz^T, and the fused kernel with each of its
   Philox counter schemes (``actgrad.VARIANT``); the fused kernel's extra time over the gradient
   alone against one write of the compressed operand at copy bandwidth (its traffic bound), and
   its GB/s. Checked too: the fused dz against the unfused kernel's, and its bytes against the
   standalone MVUE kernel on that dz with the same seed and counters.
2. FFN blocks, forward + backward (``twofour.bench.fwd_bwd_step``: weight compression counted): the GELU
   block at GPT-2 774M and the SwiGLU block at Llama-7B, dense, s-ste unfused and s-ste fused,
   ``--reps`` rounds interleaved, each a ``common.bench_ms`` median; the median of the rounds.
3. Whole training steps (``common.train_step_ms``) of gpt2-774m and llama-1b, the same three.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from twofour import activations, dispatch
from twofour.activations import GELU_TANH, SWIGLU, Activation
from twofour.bench import fwd_bwd_step
from twofour.kernels import actgrad, ops
from twofour.kernels import compress as ck
from twofour.kernels.layout import compressed_size
from twofour.models import GatedMLP, GPTConfig
from twofour.models.common import MLP
from twofour.sparse import Recipe, make_recipe, sparsify

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import bench_ms, copy_bandwidth, gpu_line, train_step_ms  # noqa: E402

KERNEL_CASES = [("gpt2-774m fc, GELU", 16384, 5120, GELU_TANH), ("llama-7b gate|up, SwiGLU", 16384, 22016, SWIGLU)]
BLOCKS = [("gpt2-774m GELU FFN", 16384, 1280, 5120, GELU_TANH), ("llama-7b SwiGLU FFN", 16384, 4096, 11008, SWIGLU)]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def stored(rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) bf16 matrix stored column-major."""
    return torch.randn(cols, rows, device="cuda").bfloat16().t()


def ffn_block(d: int, h: int, act: Activation, recipe: Recipe | None = None, fused: bool = True) -> nn.Module:
    """The FFN block as the models run it (GPT's MLP for GELU, h = 4 d; Llama's GatedMLP for SwiGLU),
    dense or with ``recipe`` on both linears, the first leaving its output transposed; with
    ``fused=False`` the activation runs after the first linear instead of inside it, so that its
    backward and the MVUE compression of dz^T are two kernels."""
    gelu = act is GELU_TANH
    block = MLP(GPTConfig(n_embd=d)) if gelu else GatedMLP(d, h)
    names = ("fc", "proj") if gelu else ("gate_up", "down")
    if recipe is not None:
        sparsify(block, recipe, include=names, transposed_output=names[:1])
    if not fused:
        first, second = (getattr(block, name) for name in names)
        block.forward = lambda x: second(act(first(x)))
    return block.cuda()


def kernels(bw: float) -> None:
    print("| case (z column-major) | Philox counters | grad alone ms | standalone MVUE ms | fused ms | "
          "fused - grad ms | compressed write at copy bw ms | fused GB/s (% of copy) | unfused total ms | "
          "dz rel err | bytes = standalone |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    seed = torch.tensor([11], device="cuda")
    for name, t, n, act in KERNEL_CASES:
        z = stored(t, n)
        dh = stored(t, n // 2 if act is SWIGLU else n)
        dz_plain = act.grad(z, dh)
        t_grad = bench_ms(lambda a=act, z=z, dh=dh: a.grad(z, dh))
        t_mvue = bench_ms(lambda d=dz_plain: ops.compress(d.t(), "mvue", seed=seed))
        for pair_rows in (False, True):
            dz, buf = actgrad.act_backward_mvue(z, dh, act.code, seed, pair_rows=pair_rows)
            same = torch.equal(buf, ck.compress_tiled(dz.t().contiguous(), "mvue", seed=seed, pair_rows=pair_rows)[0])
            t_fused = bench_ms(lambda a=act, z=z, dh=dh, p=pair_rows: actgrad.act_backward_mvue(z, dh, a.code, seed,
                                                                                              pair_rows=p))
            cbytes = compressed_size(n, t, 2)
            nbytes = z.numel() * 2 + dh.numel() * 2 + dz.numel() * 2 + cbytes
            gbs = nbytes / t_fused / 1e6
            print(f"| {name} | {'row pairs' if pair_rows else 'group pairs'} | {t_grad:.3f} | {t_mvue:.3f} | "
                  f"{t_fused:.3f} | {t_fused - t_grad:.3f} | {cbytes / bw / 1e6:.3f} | {gbs:.0f} ({gbs / bw:.0%}) | "
                  f"{t_grad + t_mvue:.3f} | {rel(dz, dz_plain):.1e} | {same} |", flush=True)
        z = dh = dz_plain = dz = buf = None
        torch.cuda.empty_cache()


def blocks(reps: int) -> None:
    s_ste = make_recipe("s-ste")
    print("\n| block (tokens x d -> h) | dense ms | s-ste unfused | s-ste fused | fused / unfused | rounds (fused) |")
    print("|---|---|---|---|---|---|")
    for name, t, d, h, act in BLOCKS:
        x = torch.randn(t, d, device="cuda", requires_grad=True)
        g = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        mods = {"dense": ffn_block(d, h, act), "unfused": ffn_block(d, h, act, s_ste, fused=False),
                "fused": ffn_block(d, h, act, s_ste)}
        steps = {k: fwd_bwd_step(m, x, g) for k, m in mods.items()}
        for fn in steps.values():
            fn()  # the dispatch's measurements and the kernels' tuning
        times = {k: [] for k in steps}
        for _ in range(reps):
            for k, fn in steps.items():
                times[k].append(bench_ms(fn, warmup=25, rep=300))
        med = {k: statistics.median(v) for k, v in times.items()}
        rounds = ", ".join(f"{a / b:.3f}" for a, b in zip(times["dense"], times["fused"]))
        print(f"| {name} ({t} x {d} -> {h}) | {med['dense']:.2f} | {med['dense'] / med['unfused']:.3f}x "
              f"({med['unfused']:.2f} ms) | {med['dense'] / med['fused']:.3f}x ({med['fused']:.2f} ms) | "
              f"{med['unfused'] / med['fused']:.3f}x | {rounds} |", flush=True)
        del mods, steps
        torch.cuda.empty_cache()


def steps(reps: int) -> None:
    print("\n| step (micro-batch x 1024) | dense ms | s-ste unfused | s-ste fused | fused / unfused |")
    print("|---|---|---|---|---|")
    s_ste, dense = make_recipe("s-ste"), make_recipe("dense")
    fuses = activations.Activation.fuses_mvue
    for preset, batch, vocab in (("gpt2-774m", 16, 50304), ("llama-1b", 8, 32000)):
        times = {"dense": [], "unfused": [], "fused": []}
        for _ in range(reps):
            times["dense"].append(train_step_ms(preset, batch, dense, vocab))
            activations.Activation.fuses_mvue = lambda self, z: False
            try:
                times["unfused"].append(train_step_ms(preset, batch, s_ste, vocab))
            finally:
                activations.Activation.fuses_mvue = fuses
            times["fused"].append(train_step_ms(preset, batch, s_ste, vocab))
            gc.collect()
            torch.cuda.empty_cache()
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {preset} ({batch}) | {med['dense']:.1f} | {med['dense'] / med['unfused']:.3f}x | "
              f"{med['dense'] / med['fused']:.3f}x | {med['unfused'] / med['fused']:.3f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds of the block and step timings")
    ap.add_argument("--no-step", action="store_true", help="skip the whole-step timings")
    ap.add_argument("--kernels-only", action="store_true", help="only the kernel table")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{gpu_line()}; copy bandwidth {bw:.0f} GB/s\n")
    kernels(bw)
    if args.kernels_only:
        return
    blocks(args.reps)
    if not args.no_step:
        steps(max(1, args.reps // 2))
    print("\ndispatch (the first linears' forward routes, sparse_dr leaving z column-major, and the dW routes):")
    for line in dispatch.choice_lines("fwd") + dispatch.choice_lines("dw-mvue"):
        print(" ", line)


if __name__ == "__main__":
    main()
