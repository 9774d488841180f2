"""FFN activations as small objects, so that a linear can fuse the one that follows it.

An FFN's first linear feeds its output ``z`` to an activation only. S-STE's weight gradient of that
linear needs the MVUE 2:4 estimate of ``dz^T``, and ``dz`` comes from the activation's backward:
on the GPU fast path one kernel computes both (``kernels/actgrad.py``). So the model says which
activation follows the linear, ``linear_act(model.fc, x, GELU_TANH)``, and a layer that can fuse
it (``SparseLinear``: ``takes_activation``) gets it as ``layer(x, act=...)``; any other layer
computes ``act(layer(x))``, the same function.

``GELU_TANH``: GPT-2's ``gelu(z, approximate="tanh")``. ``SWIGLU``: ``silu(gate) * up`` of an
interleaved gate|up output (:mod:`twofour.gated`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import gated
from .kernels import actgrad, ops

__all__ = ["Activation", "GELU_TANH", "SWIGLU", "linear_act"]


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
        return gated.swiglu(z)

    def values(self, z: torch.Tensor) -> torch.Tensor:
        return gated.swiglu_values(z)

    def grad(self, z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
        return gated.swiglu_grad(z, dh)


GELU_TANH: Activation = _GELUTanh()
SWIGLU: Activation = _SwiGLU()


def linear_act(linear: nn.Module, x: torch.Tensor, act: Activation) -> torch.Tensor:
    """``act(linear(x))``; a layer that can fuse the activation into its own op
    (``takes_activation``, as :class:`twofour.SparseLinear`) is called as ``linear(x, act=act)``."""
    if getattr(linear, "takes_activation", False):
        return linear(x, act=act)
    return act(linear(x))
