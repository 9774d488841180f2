"""The gated FFN's activation, SwiGLU, as one op: ``h = silu(gate) * up`` read from the single
GEMM output ``z`` of a fused gate|up linear, and its backward giving d(gate|up) in one pass.

Layout (docs/design.md, "The gated FFN"): the fused weight's rows interleave gate and up, so
``z``'s column 2j is gate_j and column 2j+1 is up_j (:func:`interleave_gate_up` builds such a
weight from separate gate and up weights, :func:`split_gate_up` takes it apart). The op keeps
``z``'s memory order: a column-major ``z`` (the y^T a 2:4 GEMM with ``transposed_output``
leaves) gives a column-major ``h``, which the down projection reads in place, and its backward
gives d(gate|up) in that order again.

Eager calls run :class:`SwiGLUFn` (the Triton kernels of ``kernels/swiglu.py`` on the GPU, the
plain-torch reference elsewhere), saving only ``z`` for the backward. Under ``torch.compile``
with the kernels available it is one opaque custom op (``twofour::swiglu`` with its backward
``twofour::swiglu_backward``, row-major in and out, as ``twofour::sparse_linear``); without
them the compiler gets the reference math to fuse itself.
"""

from __future__ import annotations

import torch

from .kernels import ops
from .kernels import swiglu as _k

__all__ = ["swiglu", "SwiGLUFn", "interleave_gate_up", "split_gate_up", "swiglu_reference",
           "swiglu_backward_reference", "swiglu_values", "swiglu_grad"]

swiglu_reference = _k.swiglu_reference
swiglu_backward_reference = _k.swiglu_backward_reference


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fused (2H, K) weight whose row 2j is ``gate``'s row j and row 2j+1 is ``up``'s."""
    if gate.shape != up.shape or gate.dim() != 2:
        raise ValueError(f"interleave_gate_up: gate and up must be two (H, K) weights of one shape, got "
                         f"{tuple(gate.shape)} and {tuple(up.shape)}")
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1])


def split_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) rows of a fused interleaved (2H, K) weight (views)."""
    if w.dim() != 2 or w.shape[0] % 2:
        raise ValueError(f"split_gate_up: expected a (2H, K) weight, got shape {tuple(w.shape)}")
    return w[0::2], w[1::2]


def _kernel_runs(z: torch.Tensor) -> bool:
    return ops.triton_ok(z) and z.dtype in _k.DTYPES


def swiglu_values(z: torch.Tensor) -> torch.Tensor:
    """h from ``z`` with no autograd: the Triton kernel where it runs (z's order), else the reference."""
    if not _kernel_runs(z):
        return swiglu_reference(z)
    return _k.swiglu_forward(ops.as_2d(z)).reshape(*z.shape[:-1], z.shape[-1] // 2)


def swiglu_grad(z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d(gate|up) from ``z`` and ``dh`` with no autograd: the Triton kernel where it runs, else the reference."""
    if not _kernel_runs(z):
        return swiglu_backward_reference(z, dh)
    return _k.swiglu_backward(ops.as_2d(z), dh.reshape(-1, dh.shape[-1])).reshape(z.shape)


class SwiGLUFn(torch.autograd.Function):
    """h = silu(gate) * up from the interleaved ``z``; backward d(gate|up) from ``z`` and dh (eager)."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return swiglu_values(z)

    @staticmethod
    def backward(ctx, dh):
        (z,) = ctx.saved_tensors
        return swiglu_grad(z, dh.to(z.dtype))


@torch.library.custom_op("twofour::swiglu", mutates_args=())
def _swiglu_op(z: torch.Tensor) -> torch.Tensor:
    """h (row-major) from a row-major copy of ``z``."""
    return swiglu_values(z.contiguous()).contiguous()


@_swiglu_op.register_fake
def _(z):
    return z.new_empty(*z.shape[:-1], z.shape[-1] // 2)


@torch.library.custom_op("twofour::swiglu_backward", mutates_args=())
def _swiglu_backward_op(z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d(gate|up), row-major, in z's dtype."""
    return swiglu_grad(z.contiguous(), dh.to(z.dtype)).contiguous()


@_swiglu_backward_op.register_fake
def _(z, dh):
    return torch.empty_like(z, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _op_backward(ctx, dh):
    (z,) = ctx.saved_tensors
    return _swiglu_backward_op(z, dh)


_swiglu_op.register_autograd(_op_backward, setup_context=_setup_context)


def swiglu(z: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``z`` (..., 2H) whose last dimension interleaves gate and up
    (column 2j gate_j, 2j+1 up_j); (..., H) in z's dtype and memory order."""
    if z.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension must hold H gate, up pairs (an even size), "
                         f"got shape {tuple(z.shape)}")
    if torch.compiler.is_compiling():
        return _swiglu_op(z) if _kernel_runs(z) else swiglu_reference(z)
    return SwiGLUFn.apply(z)
