"""Compile the fused compression kernel for Hopper (sm_90a) on a machine without a GPU and count
what one thread executes: registers, spills, SASS instructions and the most frequent opcodes.

    PYTHONPATH=src python benchmarks/kernels/sass_count.py

Uses the ``ptxas``/``cuobjdump`` that ship inside Triton's wheel. The kernel has no loops, so
the static instruction count is what a thread runs for its share of one tile (64 x BC elements
over 32 x warps threads). docs/notes/fastpath-experiments.md (section "MVUE kernel", "Why the
instruction count") quotes this script's numbers.

It compiles the kernel itself (``compress.triton_kernel()``) with the constants its launcher in
``compress.py`` passes for the product's variant (pair-row Philox draws for dY^T read in place);
the constants it does not name (``ROUNDS``) stay at the kernel's defaults, as the launcher leaves them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from twofour.kernels import compress as ck

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import compile_for_hopper, opcodes  # noqa: E402

SIG = {"src": "*bf16", "sr": "i32", "sc": "i32", "m_rows": "i32", "k_cols": "i32", "mask_ptr": "*u8",
       "u_ptr": "*fp32", "seed_ptr": "*i64", "scale_ptr": "*fp32", "vals": "*i16", "meta": "*i16",
       "dense_out": "*i16", "n_ct": "i32"}


def sass(mode: int, bc: int, warps: int, in_place: bool) -> tuple[int, int, str]:
    """(registers, spilled bytes, SASS text) of one kernel variant; ``in_place`` compiles it for a
    source with contiguous rows (dY^T read from dY), else for a row-major source."""
    fn = ck.triton_kernel()
    const = {"MODE": mode, "HAS_U": False, "WRITE_DENSE": False, "OUT_BF16": True, "BC": bc, "BIG": False,
             "QUAD_LOADS": in_place, "WRITE_SPARSE": True, "PAIR_ROWS": in_place, "sr" if in_place else "sc": 1}
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    # a compiled signature names every constexpr: the rest (ROUNDS) at the kernel's own defaults
    const.update({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in const})
    aligned = ("src", "vals", "meta", "m_rows", "k_cols", "n_ct", "sc" if in_place else "sr")
    return compile_for_hopper(fn, SIG, const, aligned, warps)[:3]


def main() -> None:
    print("| mode | tile x warps | source | registers | spill bytes | SASS per thread | per element | top opcodes |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in (0, 3):
        for bc, warps in ((32, 2), (64, 4), (128, 8)):
            for in_place in (True, False):
                regs, spill, text = sass(mode, bc, warps, in_place)
                ops = opcodes(text)
                n = sum(ops.values())
                top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
                where = "dY^T in place" if in_place else "row-major"
                print(f"| {'hard' if mode == 0 else 'mvue'} | {bc} x {warps} | {where} "
                      f"| {regs} | {spill} | {n} | {n / (64 * bc / (32 * warps)):.0f} | {top} |", flush=True)


if __name__ == "__main__":
    main()
