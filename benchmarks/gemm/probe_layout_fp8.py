"""GPU probe: cuSPARSELt's compressed layout of an e4m3 2:4 matrix, dumped for analysis.

    PYTHONPATH=src python benchmarks/gemm/probe_layout_fp8.py   # writes $OUT/layout_fp8.pt

For several shapes, e4m3 2:4 matrices with random masks and random non-zero kept bytes, and
cuSPARSELt's compression of each (``cusparselt.compress``), so that each kept value's and each
group's metadata place in the buffer can be found offline (``kernels/layout.py`` holds the result
and is checked against these dumps by ``tests/test_layout.py``).
"""

import os

import torch

from twofour.functional import mask_24
from twofour.kernels import cusparselt as cs

torch.manual_seed(0)
dumps = []
for m, k in [(64, 64), (128, 128), (64, 256), (192, 128), (32, 512), (96, 192)]:
    rec = {"m": m, "k": k, "masks": [], "dense": [], "comp": []}
    for _ in range(24 if (m, k) in ((128, 128), (64, 256)) else 4):
        mask = mask_24(torch.randn(m, k))
        vals = torch.randint(1, 0x7E, (m, k), dtype=torch.uint8) | (torch.randint(0, 2, (m, k), dtype=torch.uint8) << 7)
        dense = torch.where(mask, vals, torch.zeros_like(vals))
        comp = cs.compress(dense.cuda().view(torch.float8_e4m3fn)).cpu()
        rec["masks"].append(mask)
        rec["dense"].append(dense)
        rec["comp"].append(comp)
    print(f"({m},{k}) compressed {comp.numel()} B = {comp.numel() / (m * k):.4f} B/elem")
    dumps.append(rec)
path = os.path.join(os.environ.get("OUT", "."), "layout_fp8.pt")
torch.save(dumps, path)
print("saved", path)
