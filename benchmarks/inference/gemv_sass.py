"""Compile the 2:4 GEMV kernels (``twofour.kernels.gemv24``) for Hopper (sm_90a) on a machine
without a GPU and count what they execute: registers, SASS instructions, block-wide barriers,
shared-memory traffic, and the layout conversions Triton put inside the loop over the inputs.

    PYTHONPATH=src python benchmarks/inference/gemv_sass.py

Compiles through ``common.compile_for_hopper`` (Triton's own ``ptxas``/``cuobjdump``). Each
layout conversion in the loop is a round trip through shared memory between barriers; at one
token (decoding at batch 1) the pair-load kernel should have none. The GPU's tuner, not this
count, picks the variant per shape; this says why a variant can be slow.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

from twofour.kernels import gemv24 as g

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import compile_for_hopper, opcodes  # noqa: E402

SIG = {"x_ptr": "*bf16", "sxt": "i32", "sxk": "i32", "pos_ptr": "*u8", "pos_stride": "i32",
           "bias_ptr": "*bf16", "y_ptr": "*bf16", "T": "i32", "N": "i32", "K": "i32", "k_per": "i32"}


def compile_kernel(pairs: bool, tokens: int, bo: int, bk: int, warps: int) -> tuple[int, collections.Counter, str]:
    """(registers, SASS opcode counts, TTGIR) of one variant for bf16 inputs read row-major."""
    fn = g.triton_kernels()["pairs" if pairs else "tiles"]
    sig = dict(SIG, **({"pairs_ptr": "*i32"} if pairs else {"vals_ptr": "*bf16", "pos_width": "i32"}))
    const = {"HAS_BIAS": True, "BT": tokens, "BO": bo, "BK": bk, "SPLIT": 1, "sxk": 1}
    if pairs:
        const.update(VALUE_BITS=16, IS_BF16=True)
    aligned = [k for k in ("x_ptr", "pairs_ptr", "vals_ptr", "pos_ptr", "y_ptr", "K", "N", "sxt", "pos_stride",
                           "pos_width", "k_per") if k in fn.arg_names]
    regs, _, text, ttgir = compile_for_hopper(fn, sig, const, aligned, warps)
    return regs, opcodes(text), ttgir


def main() -> None:
    print("| kernel | tokens | rows x inputs x warps | registers | SASS | barriers | STS / LDS "
          "| conversions in the loop |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (1, 8):
        for bo, bk, warps in ((4, 256, 2), (8, 256, 4), (16, 256, 4), (8, 512, 4)):
            for pairs in (False, True):
                regs, ops, ttgir = compile_kernel(pairs, tokens, bo, bk, warps)
                loops = re.findall(r"scf\.for.*?scf\.yield", ttgir, flags=re.S)
                conv = sum(body.count("convert_layout") for body in loops)
                print(f"| {'pairs' if pairs else 'tiles'} | {tokens} | {bo} x {bk} x {warps} | {regs} "
                      f"| {sum(ops.values())} | {ops['BAR']} | {ops['STS']} / {ops['LDS']} | {conv} |", flush=True)


if __name__ == "__main__":
    main()
