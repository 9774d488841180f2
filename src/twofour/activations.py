"""FFN activations as small objects, so that a linear can fuse the one that follows it.

An FFN's first linear feeds its output ``z`` to an activation only. S-STE's weight gradient of that
linear needs the MVUE 2:4 estimate of ``dz^T``, and ``dz`` comes from the activation's backward:
on the GPU fast path one kernel computes both (``kernels/actgrad.py``). So the model says which
activation follows the linear, ``linear_act(model.fc, x, GELU_TANH)``, and a layer that can fuse
it (``SparseLinear``: ``takes_activation``) gets it as ``layer(x, act=...)``; any other layer
computes ``act(layer(x))``, the same function.

``GELU_TANH``: GPT-2's ``gelu(z, approximate="tanh")``. ``SWIGLU``: ``silu(gate) * up`` of an
interleaved gate|up output (below).

The gated FFN's activation, SwiGLU, is one op: ``h = silu(gate) * up`` read from the single
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
from torch import nn
from torch.nn import functional as F

from .kernels import actgrad, ops
from .kernels import swiglu as _k

__all__ = ["Activation", "GELU_TANH", "SWIGLU", "linear_act", "swiglu", "SwiGLUFn", "interleave_gate_up",
           "split_gate_up", "swiglu_reference", "swiglu_backward_reference", "swiglu_values", "swiglu_grad"]

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


class Activation:
    """An activation ``h = act(z)`` with what a fused linear + activation op needs: the values and
    the gradient without autograd, and the gradient fused with the MVUE compression of ``dz^T``."""

    name: str = ""
    code: int = -1  # the kernel's ACT code (kernels/actgrad.py)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """``act(z)`` with autograd (unfused)."""
        raise NotImplementedError

    def values(self, z: torch.Tensor) -> torch.Tensor:
        """``act(z)`` with no autograd, in z's memory order."""
        raise NotImplementedError

    def grad(self, z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
        """``dz`` from ``z`` and ``dh`` with no autograd, in z's memory order."""
        raise NotImplementedError

    def fuses_mvue(self, z: torch.Tensor) -> bool:
        """Whether :meth:`grad_mvue` runs for this ``z``: a CUDA bf16/fp16 (tokens, features) matrix
        stored column-major (z^T row-major, as a 2:4 GEMM with ``transposed_output`` leaves it),
        tokens a multiple of 32, Triton present and the fast path on."""
        return (ops.triton_ok(z) and z.dim() == 2 and z.dtype in actgrad.DTYPES and z.shape[0] % 32 == 0
                and ops.order(z) == "col")

    def grad_mvue(self, z: torch.Tensor, dh: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``dz``, the MVUE 2:4 estimate of ``dz^T`` compressed for cuSPARSELt) in one kernel."""
        return actgrad.act_backward_mvue(z, dh, self.code, seed)

    def __repr__(self) -> str:
        return self.name


class _GELUTanh(Activation):
    name, code = "gelu_tanh", actgrad.GELU_TANH

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return F.gelu(z, approximate="tanh")

    values = __call__

    def grad(self, z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(dh, z, approximate="tanh")


class _SwiGLU(Activation):
    name, code = "swiglu", actgrad.SWIGLU

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        return swiglu(z)

    def values(self, z: torch.Tensor) -> torch.Tensor:
        return swiglu_values(z)

    def grad(self, z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
        return swiglu_grad(z, dh)


GELU_TANH: Activation = _GELUTanh()
SWIGLU: Activation = _SwiGLU()


def linear_act(linear: nn.Module, x: torch.Tensor, act: Activation) -> torch.Tensor:
    """``act(linear(x))``; a layer that can fuse the activation into its own op
    (``takes_activation``, as :class:`twofour.SparseLinear`) is called as ``linear(x, act=act)``."""
    if getattr(linear, "takes_activation", False):
        return linear(x, act=act)
    return act(linear(x))
