"""GPU probe: the machine's ceilings, and cuSPARSELt's compressed layout of bf16 2:4 matrices,
dumped for analysis.

    PYTHONPATH=src python benchmarks/gemm/probe_layout.py   # writes $OUT/layout.pt

Prints the copy bandwidth and the dense bf16 GEMM rate; writes, for several shapes, dense 2:4
matrices whose kept values carry unique bit patterns (so each value's place in the compressed
buffer can be found) and random masks (so each group's metadata bits can be located), with
cuSPARSELt's compression of each (``kernels/layout.py`` holds the result, ``tests/test_layout.py``
checks it against these dumps).
"""

import os
import sys
from pathlib import Path

import torch

from twofour.functional import mask_24
from twofour.kernels import cusparselt as C

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import copy_bandwidth, gemm_tflops, gpu_line  # noqa: E402

out_dir = os.environ.get("OUT", ".")
torch.manual_seed(0)
print(gpu_line())
print(f"copy bandwidth {copy_bandwidth():.0f} GB/s (read+write); dense bf16 8192^3: {gemm_tflops():.0f} TFLOP/s")


def ids_matrix(m, k, mask):
    """bf16 matrix with distinct normal-number bit patterns at the kept positions, 0 elsewhere."""
    n_kept = int(mask.sum())
    ids = torch.arange(n_kept, dtype=torch.int32)
    bits = torch.where(ids < 32000, ids + 0x0080, (ids - 32000) + 0x8080).to(torch.int16)
    a = torch.zeros(m * k, dtype=torch.int16)
    a[mask.flatten().cpu()] = bits
    return a.view(m, k).view(torch.bfloat16)


dumps = []
for m, k in [(32, 64), (64, 64), (64, 128), (128, 64), (128, 256), (256, 128), (96, 192), (64, 512)]:
    plan = C.get_plan(m, k, 64, C.ROW, C.ROW, torch.bfloat16)
    plan2 = C.get_plan(m, k, 128, C.COL, C.COL, torch.bfloat16)
    rec = {"m": m, "k": k, "size": plan.compressed_size, "masks": [], "dense": [], "comp": []}
    same_plan = True
    for _ in range(16):
        mask = mask_24(torch.randn(m, k))
        dense = ids_matrix(m, k, mask).cuda()
        comp = plan.compress(dense).cpu()
        comp2 = plan2.compress(dense).cpu()
        same_plan &= torch.equal(comp, comp2)
        rec["masks"].append(mask)
        rec["dense"].append(dense.cpu().view(torch.int16))
        rec["comp"].append(comp)
    # correctness of the plan: compare D with a dense matmul on random data
    w = (torch.randn(m, k, device="cuda") * mask_24(torch.randn(m, k, device="cuda"))).bfloat16()
    b = torch.randn(k, 64, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(m, 64, device="cuda", dtype=torch.bfloat16)
    plan.matmul(plan.compress(w), b, d)
    ref = w.float() @ b.float()
    err = ((d.float() - ref).norm() / ref.norm()).item()
    print(f"({m},{k}) compressed {plan.compressed_size} B = {plan.compressed_size / (m * k):.3f} B/elem, "
          f"same for another plan: {same_plan}, matmul rel err {err:.1e}")
    dumps.append(rec)
torch.save(dumps, os.path.join(out_dir, "layout.pt"))
print("saved", os.path.join(out_dir, "layout.pt"))
