"""Which route each linear's weight gradient took in a short ``twofour train`` run (GPU): the
dispatch's ``dw`` choices after the run. ``dw-mvue`` (bf16) picks between the 2:4 GEMM on the
MVUE estimate (``sparse``) and the exact dense GEMM (``dense``, no estimate); so does
``fp8-dw-mvue`` in FP8. Only recipes with MVUE on make these choices (``--recipe s-ste``; the
default, STE, has none).

    PYTHONPATH=src python benchmarks/fp8/dw_routes.py [twofour train options]
    PYTHONPATH=src python benchmarks/fp8/dw_routes.py --recipe s-ste --model gpt2-124m --steps 3 \\
        --batch-size 32 --compile
"""

from __future__ import annotations

import sys

from twofour import dispatch
from twofour.cli import main

if __name__ == "__main__":
    rc = main(["train", "--no-progress", "--overwrite", *sys.argv[1:]])
    print("\n".join(line for line in dispatch.choice_lines() if "dw" in line.split(":")[0]))
    sys.exit(rc)
