"""The GPU fast path of a SparseLinear: cuSPARSELt 2:4 GEMMs where they measure faster than dense
(forward, dX for transposable masks, dW on the fused MVUE-compressed dY^T), with operands read
in whatever order they are stored, and the per-step cache of the compressed weight.

It computes the same function as the layer's reference math (``layer.py``); the tests compare
the two on random inputs (``tests/test_fastpath.py``).
"""

from __future__ import annotations

import torch

from .kernels import ops
from .pruners import Compressed, Pruner

__all__ = ["FastSparseLinearFn", "CompressedWeight", "compute_dtype", "applies"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's, else the input's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def applies(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether the fast path can run this call: a CUDA input in bf16/fp16 compute, shapes that
    cuSPARSELt and the kernels take (multiples of 32), outside torch.compile's tracing, and the
    bindings present (:func:`twofour.kernels.ops.fast_available`)."""
    return (x.is_cuda and not torch.compiler.is_compiling()
            and compute_dtype(x) in (torch.bfloat16, torch.float16)
            and in_features % 32 == 0 and out_features % 32 == 0
            and (x.numel() // in_features) % 32 == 0 and ops.fast_available())


class CompressedWeight:
    """A layer's compressed effective weight, built by one fused kernel once per optimizer step
    and reused by every micro-batch until the weight changes (its version counter, storage, the
    compute dtype and the layer's step counter form the key). Inside a captured CUDA graph the
    compression is recorded in the graph instead, so that each replay compresses the current
    weight, and the graph's buffers stay out of the cache."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Compressed | None = None

    def get(self, weight: torch.Tensor, pruner: Pruner, beta: torch.Tensor | None, mask: torch.Tensor | None,
            step: int, dtype: torch.dtype) -> Compressed:
        """(compressed W_eff, dense W_eff, compressed W_eff^T or empty) for the current weight."""
        w = weight.detach()
        key = (weight._version, w.data_ptr(), dtype, step)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing and self._key == key:
            return self._value
        value = pruner.compress(w, beta, mask, dtype)
        if not capturing:
            self._key, self._value = key, value
        return value

    def clear(self) -> None:
        """Forget the cached weight (the next call compresses again; benchmarks use it to count
        the per-step compression without an optimizer step)."""
        self._key = self._value = None


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """(tokens, features) view of ``t`` in row- or column-major order (a copy only if neither)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if ops.order(t2) is not None else t2.contiguous()


class FastSparseLinearFn(torch.autograd.Function):
    """y = x W_eff^T + b with W_eff given compressed (``wc``), dense (``wdense``) and, for
    transposable masks, compressed transposed (``wtc``); dW = dY^T X (or its MVUE 2:4 estimate
    with ``mvue``) passed straight through to the master ``weight``.

    Each GEMM runs dense or 2:4, whichever :func:`twofour.kernels.ops.choose` measured faster.
    The output is row-major, as nn.Linear's, unless ``transposed_output`` allows y^T stored
    row-major (a column-major y) where that is faster; dX comes back in x's own order, so that
    elementwise backward ops see operands of one order."""

    @staticmethod
    def forward(ctx, x, weight, bias, wc, wdense, wtc, mvue: bool, transposed_output: bool):
        x2 = _as_2d(x)
        t, k = x2.shape
        n = wdense.shape[0]
        bo = "col" if ops.order(x2) == "row" else "row"  # the order of x^T as cuSPARSELt's B
        b = None if bias is None else bias.to(x2.dtype)
        # y^T = W x^T (+ b in cuSPARSELt's epilogue), stored column-major (y row-major) or row-major
        cands = {"sparse_dc": lambda: ops.spmm(wc, x2.t(), n, True, b).t(),
                 "dense": lambda: x2 @ wdense.t() if b is None else torch.addmm(b, x2, wdense.t())}  # fused bias
        if transposed_output:
            cands["sparse_dr"] = lambda: ops.spmm(wc, x2.t(), n, False, b).t()
        y = cands[ops.choose("fwd" if b is None else "fwd+bias", n, k, t, bo, x2.dtype, cands)]()
        ctx.save_for_backward(x2, wdense, wtc)
        ctx.mvue, ctx.x_shape, ctx.x_dtype, ctx.has_bias = mvue, x.shape, x.dtype, bias is not None
        ctx.w_dtype = weight.dtype
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x2, wdense, wtc = ctx.saved_tensors
        dy2 = _as_2d(dy.to(wdense.dtype))
        t, n = dy2.shape
        k = x2.shape[1]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dX in x's order: dX^T = W^T dY^T stored column- or row-major
            x_col = ops.order(x2) == "col"
            cands = {"dense": (lambda: (wdense.t() @ dy2.t()).t()) if x_col else (lambda: dy2 @ wdense)}
            if wtc.numel():  # transposable mask: W^T is 2:4 too
                cands["sparse"] = lambda: ops.spmm(wtc, dy2.t(), k, not x_col).t()
            bo = "col" if ops.order(dy2) == "row" else "row"
            dx = cands[ops.choose("dx-xcol" if x_col else "dx", k, n, t, bo, dy2.dtype, cands)]()
            dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (_mvue_dw(dy2, x2) if ctx.mvue else dy2.t() @ x2).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None


def _mvue_dw(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """dW on the MVUE 2:4 estimate of dY^T where that pays, else the exact dense dW.

    The two routes are timed whole, once per shape: the sparse one is the fused kernel reading
    dY^T in place (a transposing copy first measured slower) and writing the compressed
    estimate, then the 2:4 GEMM; the dense one is the plain dY^T X GEMM, with no estimate at
    all. So MVUE runs only where its compression plus the sparse GEMM beat the dense GEMM, and
    elsewhere dW is exact (unbiased either way)."""
    t, n = dy2.shape

    def sparse() -> torch.Tensor:
        seed = torch.randint(0, 2**31 - 1, (1,), device=dy2.device)
        buf = ops.compress(dy2.t(), "mvue", seed=seed, out_dtype=dy2.dtype)[0]
        return ops.spmm(buf, x2, n, False)

    cands = {"sparse": sparse, "dense": lambda: dy2.t() @ x2}
    return cands[ops.choose("dw-mvue", n, t, x2.shape[1], ops.order(x2), dy2.dtype, cands)]()
