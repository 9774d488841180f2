"""Bias added in place to a GEMM output stored as y^T (one row per output feature), the order a
sparse forward writes when it reads ``x`` as a column-major operand.

torch's broadcast add on that layout runs its generic strided kernel (about 1.6 TB/s in the
H200's profile, docs/PERFORMANCE.md step 16); this Triton kernel reads each row's bias once and
streams the row in wide vectors. Tested against ``d + b[:, None]`` on the CPU under Triton's
interpreter.
"""

from __future__ import annotations

import torch

from .compress import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rows_kernel(d, b, n_rows, n_cols, BR: tl.constexpr, BCOL: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
        c = tl.program_id(1) * BCOL + tl.arange(0, BCOL)[None, :]
        ok = (r < n_rows) & (c < n_cols)
        off = r.to(tl.int64) * n_cols + c
        v = tl.load(d + off, mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(b + r, mask=r < n_rows, other=0.0).to(tl.float32)
        tl.store(d + off, (v + bias).to(d.dtype.element_ty), mask=ok)

__all__ = ["add_bias_rows_"]


def add_bias_rows_(d: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``d += b[:, None]`` in place for a contiguous (rows, cols) ``d``; returns ``d``."""
    if not HAS_TRITON:
        raise RuntimeError("add_bias_rows_ needs Triton (pip install triton)")
    if not (d.is_contiguous() and d.dim() == 2 and b.shape == (d.shape[0],)):
        raise ValueError(f"add_bias_rows_: needs a contiguous 2-D d and a bias of its row count, "
                         f"got {tuple(d.shape)} and {tuple(b.shape)}")
    rows, cols = d.shape
    br, bcol = 4, 1024
    _add_rows_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bcol))](d, b, rows, cols, BR=br, BCOL=bcol,
                                                                       num_warps=4)
    return d
