"""The GPU fast path of a SparseLinear: cuSPARSELt 2:4 GEMMs where they measure faster than dense
(forward, dX for transposable masks, dW on the fused MVUE-compressed dY^T), and the per-step
cache of the compressed weight.

Two entries share the same GEMM routes: :class:`FastSparseLinearFn` for eager calls (operands
read in whatever order they are stored, the weight compressed once per optimizer step), and
:func:`compiled_linear` under ``torch.compile``: the layer as one custom op with its backward
(``twofour::sparse_linear``), which the compiler sees as an opaque node while the elementwise
work around it (and the weight's compression, ``twofour::compress``) is compiled with the rest
of the model. It computes the same function as the layer's reference math (``layer.py``); the
tests compare the two on random inputs (``tests/test_fastpath.py``).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..kernels import ops
from .pruners import Compressed, Pruner

__all__ = ["FastSparseLinearFn", "FastLinearActFn", "CompressedWeight", "compiled_linear", "compute_dtype", "applies",
           "operands"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's, else the input's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


@torch.compiler.assume_constant_result
def _fast_available() -> bool:
    """ops.fast_available(), evaluated eagerly and taken as a constant when torch.compile traces."""
    return ops.fast_available()


def applies(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether the fast path can run this call: a CUDA input in bf16/fp16 compute, shapes that
    cuSPARSELt and the kernels take (multiples of 32), and the bindings present
    (:func:`twofour.kernels.ops.fast_available`)."""
    return (x.is_cuda and compute_dtype(x) in (torch.bfloat16, torch.float16)
            and in_features % 32 == 0 and out_features % 32 == 0
            and (x.numel() // in_features) % 32 == 0 and _fast_available())


_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # torch's own query


def _saving_memory() -> bool:
    """Whether saved-tensor hooks are active: non-reentrant activation checkpointing (its forward
    and its recomputation) or offloading, where the caller trades compute for memory."""
    return _top_hooks is not None and _top_hooks(False) is not None


def operands(pruner: Pruner, w: torch.Tensor, beta: torch.Tensor | None, mask: torch.Tensor | None,
             dtype: torch.dtype, sparse: bool = True, dx: str = "dense") -> Compressed:
    """The fast path's operands (:meth:`Pruner.compress`); for the ``pruned-t`` dX route the third
    is W_pt^T compressed: W_eff^T pruned 2:4 along the output features, written by the same pass
    where the pruning kind fuses it (:meth:`Pruner.compress_pruned_t`)."""
    if dx == "pruned-t" and sparse:
        return pruner.compress_pruned_t(w, beta, mask, dtype)
    return pruner.compress(w, beta, mask, dtype, sparse)


class CompressedWeight:
    """A layer's compressed effective weight, built by one fused kernel once per optimizer step
    and reused by every micro-batch until the weight changes (its version counter, storage, the
    compute dtype and the layer's step counter form the key). Inside a captured CUDA graph the
    compression is recorded in the graph instead, so that each replay compresses the current
    weight, and the graph's buffers stay out of the cache. Under saved-tensor hooks (non-reentrant
    activation checkpointing, offloading), or always where ``keep`` is False (a layer in a block
    :func:`twofour.training.parallel.checkpoint_blocks` checkpoints, evaluations included),
    nothing is kept past the call and nothing kept earlier stays: the forward and its
    recomputation compress each, as compiled code does, and so does each micro-batch. Kept,
    every layer's compressed weight would stay for the whole step on every rank (its size:
    docs/notes/scale-out.md, "Memory")."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Compressed | None = None
        self.keep = True  # False: never kept past a call (memory first)

    def get(self, weight: torch.Tensor, pruner: Pruner, beta: torch.Tensor | None, mask: torch.Tensor | None,
            step: int, dtype: torch.dtype, sparse: bool = True, dx: str = "dense") -> Compressed:
        """(compressed W_eff, dense W_eff, compressed W_eff^T or empty) for the current weight;
        without ``sparse`` the dense W_eff alone (:func:`operands`)."""
        w = weight.detach()
        capturing = w.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or not self.keep or _saving_memory():  # built for this call alone
            if not capturing:
                self.clear()  # what an earlier call kept (an evaluation: no hooks under no_grad) goes too
            return operands(pruner, w, beta, mask, dtype, sparse, dx)
        key = (weight._version, w.data_ptr(), dtype, step, sparse, dx)
        if self._key != key:
            self._key, self._value = key, operands(pruner, w, beta, mask, dtype, sparse, dx)
        return self._value

    def clear(self) -> None:
        """Forget the cached weight (the next call compresses again; benchmarks use it to count
        the per-step compression without an optimizer step)."""
        self._key = self._value = None


def _forward_gemm(x2: torch.Tensor, wc: torch.Tensor, wdense: torch.Tensor, b: torch.Tensor | None,
                  transposed_output: bool) -> torch.Tensor:
    """y = x W_eff^T (+ b), dense or 2:4. y is row-major unless ``transposed_output`` allows
    y^T stored row-major (a column-major y) where that GEMM is faster."""
    t, k = x2.shape
    n = wdense.shape[0]
    bo = "col" if ops.order(x2) == "row" else "row"  # the order of x^T as cuSPARSELt's B
    # y^T = W x^T (+ b in cuSPARSELt's epilogue), stored column-major (y row-major) or row-major
    cands = {"dense": lambda: x2 @ wdense.t() if b is None else torch.addmm(b, x2, wdense.t())}  # fused bias
    if wc.numel():
        cands["sparse_dc"] = lambda: ops.spmm(wc, x2.t(), n, True, b).t()
        if transposed_output:
            cands["sparse_dr"] = lambda: ops.spmm(wc, x2.t(), n, False, b).t()
    cands = dict(sorted(cands.items(), key=lambda kv: kv[0] == "dense"))  # sparse first (see dispatch.choose)
    return cands[dispatch.choose("fwd" if b is None else "fwd+bias", n, k, t, bo, x2.dtype, cands)]()


def _dx_gemm(dy2: torch.Tensor, x2: torch.Tensor, wdense: torch.Tensor, wtc: torch.Tensor,
             dx: str = "dense") -> torch.Tensor:
    """dX by the dX route ``dx`` in x's order (dX^T = W^T dY^T stored column- or row-major): 2:4
    on ``wtc`` (W_eff^T compressed: a transposable mask's, or ``pruned-t``'s W_pt^T), whose dense
    twin for ``pruned-t`` makes W_pt by one pass of the compression kernel
    (:func:`~twofour.kernels.ops.prune_transpose`); ``mvue`` by :func:`_mvue_dx`."""
    t, n = dy2.shape
    k = x2.shape[1]
    x_col = ops.order(x2) == "col"
    if dx == "mvue":
        return _mvue_dx(dy2, wdense, x_col)

    cands = {"dense": lambda: _dense_dx(dy2, ops.prune_transpose(wdense) if dx == "pruned-t" else wdense, x_col)}
    if wtc.numel():
        cands = {"sparse": lambda: ops.spmm(wtc, dy2.t(), k, not x_col).t(), **cands}
    bo = "col" if ops.order(dy2) == "row" else "row"
    kind = ("dx-xcol" if x_col else "dx") + ("-pt" if dx == "pruned-t" else "")
    return cands[dispatch.choose(kind, k, n, t, bo, dy2.dtype, cands)]()


def _dense_dx(dy2: torch.Tensor, w: torch.Tensor, x_col: bool) -> torch.Tensor:
    """dY W as a dense GEMM, in x's order (computed as (W^T dY^T)^T for a column-major x)."""
    return (w.t() @ dy2.t()).t() if x_col else dy2 @ w


def _mvue_dx(dy2: torch.Tensor, wdense: torch.Tensor, x_col: bool) -> torch.Tensor:
    """dX on the MVUE 2:4 estimate of dY along the output features where that pays (the MVUE
    compression kernel reading dY, then the 2:4 GEMM with dY's estimate as the sparse operand),
    else the exact dense dY W_eff: timed whole once per shape, as :func:`_mvue_dw`'s routes."""
    t, n = dy2.shape

    def sparse() -> torch.Tensor:
        buf = ops.compress(dy2, "mvue", seed=_seed(dy2.device), out_dtype=dy2.dtype)[0]
        return ops.spmm(buf, wdense, t, x_col)

    cands = {"sparse": sparse, "dense": lambda: _dense_dx(dy2, wdense, x_col)}
    kind = "dx-mvue" + ("-xcol" if x_col else "")
    return cands[dispatch.choose(kind, wdense.shape[1], n, t, ops.order(dy2), dy2.dtype, cands)]()


def _dw_gemm(dy2: torch.Tensor, x2: torch.Tensor, mvue: bool) -> torch.Tensor:
    """dW = dY^T X, or on the MVUE 2:4 estimate of dY^T where that pays (:func:`_mvue_dw`)."""
    return _mvue_dw(dy2, x2) if mvue and dy2.is_cuda else dy2.t() @ x2


class FastSparseLinearFn(torch.autograd.Function):
    """y = x W_eff^T + b with W_eff given compressed (``wc``), dense (``wdense``) and, for
    transposable masks, compressed transposed (``wtc``); dW = dY^T X (or its MVUE 2:4 estimate
    with ``mvue``) passed straight through to the master ``weight``. Eager calls.

    Each GEMM runs dense or 2:4, whichever :func:`twofour.dispatch.choose` measured faster.
    The output is row-major, as nn.Linear's, unless ``transposed_output`` allows y^T stored
    row-major (a column-major y) where that is faster; dX comes back in x's own order, so that
    elementwise backward ops see operands of one order."""

    @staticmethod
    def forward(ctx, x, weight, bias, wc, wdense, wtc, mvue: bool, transposed_output: bool, dx: str = "dense"):
        x2 = ops.as_2d(x)
        y = _forward_gemm(x2, wc, wdense, None if bias is None else bias.to(x2.dtype), transposed_output)
        ctx.save_for_backward(x2, wdense, wtc)
        ctx.mvue, ctx.dx, ctx.x_shape, ctx.x_dtype, ctx.has_bias = mvue, dx, x.shape, x.dtype, bias is not None
        ctx.w_dtype = weight.dtype
        return y.reshape(*x.shape[:-1], wdense.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wdense, wtc = ctx.saved_tensors
        dy2 = ops.as_2d(dy.to(wdense.dtype))
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _dx_gemm(dy2, x2, wdense, wtc, ctx.dx).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = _dw_gemm(dy2, x2, ctx.mvue).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None, None


class FastLinearActFn(torch.autograd.Function):
    """h = act(x W_eff^T + b) as one op (eager), for an FFN's first linear with MVUE: the forward
    GEMM as :class:`FastSparseLinearFn`'s, then the activation on its output ``z`` (saved for the
    backward in place of ``y``); the backward's activation gradient and the MVUE estimate of dz^T
    come from one kernel where that route measures faster (:func:`_act_grad_dw`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, wc, wdense, wtc, transposed_output: bool, act, dx: str = "dense"):
        x2 = ops.as_2d(x)
        z = _forward_gemm(x2, wc, wdense, None if bias is None else bias.to(x2.dtype), transposed_output)
        h = act.values(z)
        ctx.save_for_backward(x2, wdense, wtc, z)
        ctx.dx = dx
        ctx.act, ctx.x_shape, ctx.x_dtype, ctx.has_bias = act, x.shape, x.dtype, bias is not None
        ctx.w_dtype = weight.dtype
        return h.reshape(*x.shape[:-1], h.shape[-1])

    @staticmethod
    def backward(ctx, dh):
        x2, wdense, wtc, z = ctx.saved_tensors
        dh2 = ops.as_2d(dh.to(z.dtype))
        dz, dw = _act_grad_dw(z, dh2, x2, ctx.act, ctx.needs_input_grad[1])
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = _dx_gemm(dz, x2, wdense, wtc, ctx.dx).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dz.sum(0)
        return dx, None if dw is None else dw.to(ctx.w_dtype), db, None, None, None, None, None, None


def _act_grad_dw(z: torch.Tensor, dh2: torch.Tensor, x2: torch.Tensor, act,
                 need_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dz, dW) for an FFN's first linear with MVUE. Where the fused kernel runs, three whole routes
    are timed once per shape (as :func:`_mvue_dw`'s two): ``sparse_fused``, the activation gradient
    and the MVUE estimate of dz^T in one kernel, then the 2:4 dW GEMM; ``sparse``, the activation
    gradient, then :func:`_mvue_dw`'s sparse route (the MVUE compression kernel reading dz^T, the
    2:4 GEMM); ``dense``, the activation gradient and the exact dense GEMM. Elsewhere the
    activation gradient, then :func:`_mvue_dw`."""
    if not (need_dw and act.fuses_mvue(z)):
        dz = act.grad(z, dh2)
        return dz, _dw_gemm(dz, x2, True) if need_dw else None
    n = z.shape[1]

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        dz, buf = act.grad_mvue(z, dh2, _seed(z.device))
        return dz, ops.spmm(buf, x2, n, False)

    def sparse() -> tuple[torch.Tensor, torch.Tensor]:
        dz = act.grad(z, dh2)
        return dz, _mvue_sparse_dw(dz, x2)

    def dense() -> tuple[torch.Tensor, torch.Tensor]:
        dz = act.grad(z, dh2)
        return dz, dz.t() @ x2

    cands = {"sparse_fused": fused, "sparse": sparse, "dense": dense}
    return cands[dispatch.choose(f"dw-mvue+{act.name}", n, z.shape[0], x2.shape[1], ops.order(x2), z.dtype, cands)]()


def _seed(device: torch.device) -> torch.Tensor:
    """A fresh Philox seed for one MVUE draw, on the device (no host sync)."""
    return torch.randint(0, 2**31 - 1, (1,), device=device)


def _mvue_sparse_dw(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """dW on the MVUE 2:4 estimate of dY^T: the MVUE compression kernel reading dY^T in place and
    writing the compressed estimate, then the 2:4 GEMM."""
    buf = ops.compress(dy2.t(), "mvue", seed=_seed(dy2.device), out_dtype=dy2.dtype)[0]
    return ops.spmm(buf, x2, dy2.shape[1], False)


def _mvue_dw(dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """dW on the MVUE 2:4 estimate of dY^T where that pays, else the exact dense dW.

    The two routes are timed whole, once per shape: the sparse one is the fused kernel reading
    dY^T in place (cheaper than a transposing copy: docs/notes/fastpath-experiments.md) and
    writing the compressed estimate, then the 2:4 GEMM; the dense one is the plain dY^T X GEMM,
    with no estimate at all. So MVUE runs only where its compression plus the sparse GEMM beat
    the dense GEMM, and elsewhere dW is exact (unbiased either way)."""
    t, n = dy2.shape
    cands = {"sparse": lambda: _mvue_sparse_dw(dy2, x2), "dense": lambda: dy2.t() @ x2}
    return cands[dispatch.choose("dw-mvue", n, t, x2.shape[1], ops.order(x2), dy2.dtype, cands)]()


# --------------------------------------------------------------------------------------------
# the same routes as one custom op with its backward, for torch.compile
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("twofour::sparse_linear", mutates_args=())
def _linear_op(x2: torch.Tensor, weight: torch.Tensor, wc: torch.Tensor, wdense: torch.Tensor, wtc: torch.Tensor,
               bias: torch.Tensor | None, mvue: bool, dx: str) -> torch.Tensor:
    """y (row-major) = x2 W_eff^T + bias; ``weight`` is only there to receive dW."""
    return _forward_gemm(x2, wc, wdense, bias, False).contiguous()


@_linear_op.register_fake
def _(x2, weight, wc, wdense, wtc, bias, mvue, dx):
    return x2.new_empty(x2.shape[0], wdense.shape[0])


@torch.library.custom_op("twofour::sparse_linear_backward", mutates_args=())
def _linear_backward_op(dy2: torch.Tensor, x2: torch.Tensor, wdense: torch.Tensor, wtc: torch.Tensor, mvue: bool,
                        dx_route: str, need_dx: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dX or an empty tensor, dW or an empty tensor), both row-major, in dY's dtype."""
    dx = _dx_gemm(dy2, x2, wdense, wtc, dx_route).contiguous() if need_dx else dy2.new_empty(0)
    dw = _dw_gemm(dy2, x2, mvue).contiguous() if need_dw else dy2.new_empty(0)
    return dx, dw


@_linear_backward_op.register_fake
def _(dy2, x2, wdense, wtc, mvue, dx_route, need_dx, need_dw):
    dx = dy2.new_empty(x2.shape) if need_dx else dy2.new_empty(0)
    dw = dy2.new_empty(wdense.shape) if need_dw else dy2.new_empty(0)
    return dx, dw


def _setup_context(ctx, inputs, output):
    x2, weight, wc, wdense, wtc, bias, mvue, dx = inputs
    ctx.save_for_backward(x2, wdense, wtc)
    ctx.mvue, ctx.dx, ctx.w_dtype, ctx.has_bias = mvue, dx, weight.dtype, bias is not None


def _linear_backward(ctx, dy):
    x2, wdense, wtc = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _linear_backward_op(dy.contiguous(), x2, wdense, wtc, ctx.mvue, ctx.dx, need_dx, need_dw)
    db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[5] else None
    return (dx if need_dx else None, dw.to(ctx.w_dtype) if need_dw else None, None, None, None, db, None, None)


_linear_op.register_autograd(_linear_backward, setup_context=_setup_context)


def compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wc: torch.Tensor,
                    wdense: torch.Tensor, wtc: torch.Tensor, mvue: bool, dx: str = "dense") -> torch.Tensor:
    """The fast path as torch.compile sees it: one ``twofour::sparse_linear`` node (row-major
    output, whatever order x had) with dX (by the dX route ``dx``) and dW from
    ``twofour::sparse_linear_backward``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    b = None if bias is None else bias.to(x2.dtype)
    return _linear_op(x2, weight, wc, wdense, wtc, b, mvue, dx).reshape(*x.shape[:-1], wdense.shape[0])
