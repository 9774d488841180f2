"""Build the CUTLASS sm90 2:4 GEMM library into the cache, where `sm90.gemm` finds it (minutes of
nvcc, CUTLASS's headers):

    python -m sm90.cutlass [--jobs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

from . import CONFIGS, build


def main(argv: list[str] | None = None) -> None:
    """Compile and link every configuration, print the library's path."""
    ap = argparse.ArgumentParser(prog="python -m sm90.cutlass", description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None, help="nvcc processes at once (default: one per CPU core)")
    ap.add_argument("--out", default=None, help="folder for the library instead of the cache "
                                                "(then load it with TWOFOUR_SM90_LIB)")
    args = ap.parse_args(argv)
    t0 = time.time()
    lib = build(CONFIGS, out_dir=args.out, jobs=args.jobs)
    print(f"{lib} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
