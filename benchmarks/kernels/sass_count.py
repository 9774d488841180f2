"""Compile the fused compression kernel for Hopper (sm_90a) on a machine without a GPU and count
what one thread executes: registers, spills, SASS instructions and the most frequent opcodes.

    PYTHONPATH=src python benchmarks/kernels/sass_count.py

Uses the ``ptxas``/``cuobjdump`` that ship inside Triton's wheel. The kernel has no loops, so
the static instruction count is what a thread runs for its share of one tile (64 x BC elements
over 32 x warps threads). docs/notes/fastpath-experiments.md (section "MVUE kernel", "Why the
instruction count") quotes this script's numbers.

It compiles the private ``_compress_kernel`` itself (there is no public handle on the Triton
kernel) with the constants its launcher in ``compress.py`` passes; ``ROUNDS`` is left to the
kernel's default (``PHILOX_ROUNDS``), as the launcher leaves it.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from twofour.kernels import compress as ck

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_SIG = {"src": "*bf16", "sr": "i32", "sc": "i32", "m_rows": "i32", "k_cols": "i32", "mask_ptr": "*u8",
        "u_ptr": "*fp32", "seed_ptr": "*i64", "scale_ptr": "*fp32", "vals": "*i16", "meta": "*i16",
        "dense_out": "*i16", "n_ct": "i32"}


def compile_for_hopper(fn, sig: dict[str, str], const: dict, aligned: tuple[str, ...] | list[str],
                       warps: int) -> tuple[int, int, str, str]:
    """(registers, spilled bytes, SASS text, TTGIR) of the Triton kernel ``fn`` compiled for
    sm_90a with the constants ``const`` (named in ``sig`` as constexpr) and the arguments
    ``aligned`` marked divisible by 16, through the ``ptxas``/``cuobjdump`` in Triton's wheel."""
    sig = {**sig, **{k: "constexpr" for k in const}}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptxas = next(p for p in (os.path.join(_BIN, "ptxas-blackwell"), os.path.join(_BIN, "ptxas")) if os.path.exists(p))
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as fh:
            fh.write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True,
                             check=True).stderr
        text = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return regs, spill, text, kernel.asm["ttgir"]


def sass(mode: int, bc: int, warps: int, in_place: bool) -> tuple[int, int, str]:
    """(registers, spilled bytes, SASS text) of one kernel variant; ``in_place`` compiles it for a
    source with contiguous rows (dY^T read from dY), else for a row-major source."""
    fn = ck._compress_kernel
    const = {"MODE": mode, "HAS_U": False, "WRITE_DENSE": False, "OUT_BF16": True, "BC": bc, "BIG": False,
             "QUAD_LOADS": in_place, "WRITE_SPARSE": True,
             "sr" if in_place else "sc": 1}
    # a compiled signature names every constexpr: the rest (ROUNDS) at the kernel's own defaults
    const.update({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in const})
    aligned = ("src", "vals", "meta", "m_rows", "k_cols", "n_ct", "sc" if in_place else "sr")
    return compile_for_hopper(fn, _SIG, const, aligned, warps)[:3]


def opcodes(text: str) -> collections.Counter:
    """Instruction count per opcode (without modifiers) of a cuobjdump listing."""
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", text, flags=re.M)
    return collections.Counter(ops)


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
