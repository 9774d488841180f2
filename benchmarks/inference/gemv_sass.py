"""Compile the 2:4 GEMV kernels (``twofour.kernels.gemv24``) for Hopper (sm_90a) on a machine
without a GPU and count what they execute: registers, spills, SASS instructions, block-wide
barriers, shared-memory traffic, tensor-core instructions, 16-byte global loads (``LDG``, and
``cp.async``'s ``LDGSTS``), and the layout conversions Triton put inside the loop over the inputs.

    PYTHONPATH=src python benchmarks/inference/gemv_sass.py

The loop's instructions are those of one step over the inputs (a tile of rows x inputs): what a
warp issues per weight byte, where a kernel is bound by issue rather than memory. Compiles
through ``common.compile_for_hopper`` (Triton's own ``ptxas``/``cuobjdump``). Each
layout conversion in the loop is a round trip through shared memory between barriers; the
``quad`` kernel (CUDA cores) should have none. The GPU's measurement, not this count, picks the
variant per shape; this says why a variant can be slow.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

from twofour.kernels import gemv24 as g

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import compile_for_hopper, opcodes  # noqa: E402

SIG = {"x_ptr": "*bf16", "sxt": "i32", "sxk": "i32", "pos_ptr": "*u8", "p_ptr": "*u8", "pos_stride": "i32",
       "bias_ptr": "*bf16", "y_ptr": "*bf16", "T": "i32", "N": "i32", "K": "i32", "Q": "i32", "k_per": "i32",
       "q_per": "i32", "pairs_ptr": "*i32", "q_ptr": "*i64"}
#: (kernel, tokens, rows, inputs per step, warps) compiled
VARIANTS = [("quad", 1, 16, 256, 4), ("quad", 1, 32, 512, 8), ("quad", 1, 8, 256, 2),
            ("quad_multi", 2, 64, 32, 2), ("quad_multi", 8, 128, 32, 4),
            ("quad_mma", 16, 64, 256, 4), ("quad_mma", 16, 64, 512, 4), ("quad_mma", 16, 128, 512, 8),
            ("pairs", 1, 16, 256, 4), ("pairs", 8, 8, 256, 4)]


def compile_kernel(kernel: str, tokens: int, bo: int, bk: int, warps: int) -> tuple[int, int, collections.Counter,
                                                                                     str, str]:
    """(registers, spilled bytes, SASS opcode counts, SASS text, TTGIR) of one variant for bf16
    inputs read row-major (the quad kernels' x as int64 words), every row and input in range."""
    fn = g.triton_kernels()[kernel]
    sig = {k: v for k, v in SIG.items() if k in fn.arg_names}
    if kernel not in ("pairs", "quad_mma"):  # x as int64 words of four inputs
        sig["x_ptr"] = "*i64"
    const = {"HAS_BIAS": False, "BT": tokens, "BO": bo, "PARTIAL": False, "sxk": 1, "IS_BF16": True}
    if kernel == "pairs":
        const.update(BK=bk, VALUE_BITS=16)
    else:
        const.update(BQ=bk // 8, EVEN=True)
    aligned = [k for k in ("x_ptr", "pairs_ptr", "q_ptr", "pos_ptr", "p_ptr", "y_ptr", "K", "N", "Q", "sxt",
                           "pos_stride", "k_per", "q_per") if k in fn.arg_names]
    regs, spill, text, ttgir = compile_for_hopper(fn, sig, const, aligned, warps)
    return regs, spill, opcodes(text), text, ttgir


def loop_instructions(text: str) -> int:
    """SASS instructions in the longest backward branch's body: the loop over the inputs, one step."""
    rows = [(int(a, 16), op, rest) for a, op, rest in
            re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", text, flags=re.M)]
    spans = [(a - int(m.group(1), 16)) // 16 + 1 for a, op, rest in rows if op.startswith("BRA")
             for m in [re.search(r"0x([0-9a-f]+)", rest)] if m and int(m.group(1), 16) < a]
    return max(spans, default=0)


def main() -> None:
    print("| kernel | tokens | rows x inputs x warps | registers (spill B) | SASS (in the loop) | barriers | STS / LDS "
          "| HGMMA / HMMA | 16-byte / all global loads | conversions in the loop |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kernel, tokens, bo, bk, warps in VARIANTS:
        regs, spill, ops, text, ttgir = compile_kernel(kernel, tokens, bo, bk, warps)
        loops = re.findall(r"scf\.for.*?scf\.yield", ttgir, flags=re.S)
        conv = sum(body.count("convert_layout") for body in loops)
        ldg = sum(v for k, v in ops.items() if k in ("LDG", "LDGSTS"))
        ldg128 = len(re.findall(r"LDG(?:STS)?\.E\.(?:\w+\.)*128", text))
        print(f"| {kernel} | {tokens} | {bo} x {bk} x {warps} | {regs} ({spill}) "
              f"| {sum(ops.values())} ({loop_instructions(text)}) | {ops['BAR']} "
              f"| {ops['STS']} / {ops['LDS']} | {ops['HGMMA']} / {ops['HMMA']} | {ldg128} / {ldg} | {conv} |",
              flush=True)


if __name__ == "__main__":
    main()
