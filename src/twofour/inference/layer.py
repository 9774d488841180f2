"""SparseInferenceLinear: a linear layer whose 2:4 weight is stored as kept values and 2-bit
positions, run by 2:4 kernels on a GPU (cuSPARSELt, or the streaming GEMV for a few tokens)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import dispatch
from ..kernels import gemv24 as _gemv
from ..kernels import ops
from ..kernels.layout import compress_codes, position_codes, positions_width, unpack_24
from .packed import pack_24

#: ``model_config.json``'s ``format`` and the version this code writes and reads.
FORMAT, FORMAT_VERSION = "twofour-inference", 1
#: The attribute of a Hugging Face model's config that lists its 2:4 layers (saved in config.json).
HF_CONFIG_KEY = "twofour"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SparseInferenceLinear(nn.Module):
    """y = x W^T + b for a fixed 2:4 weight W (out, in), held as ``values`` (out, in/2) and
    ``positions`` (out, ceil(in/8)) uint8 buffers (:mod:`twofour.inference.packed`), for inference.

    ``packed_state`` (default): the state dict holds ``values``, ``positions`` and ``bias``
    (twofour's export format). Otherwise it holds a dense ``weight`` as ``nn.Linear`` does, or
    (in, out) as Hugging Face's ``Conv1D`` does with ``conv1d``, so that ``save_pretrained`` and
    ``from_pretrained`` see the model's own layout; loading a weight that isn't 2:4 fails.

    ``transposed_output`` (as :class:`~twofour.SparseLinear`'s): the GPU may return the output
    column-major where that GEMM is faster; right for an FFN's first linear, whose output feeds
    only the activation and the second linear (which reads it in place).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device: Any = None,
                 dtype: torch.dtype | None = None, packed_state: bool = True, conv1d: bool = False,
                 transposed_output: bool = False):
        super().__init__()
        self.transposed_output = transposed_output
        if in_features % 4 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"SparseInferenceLinear: in_features must be a positive multiple of 4, got "
                             f"{in_features} (out_features {out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.packed_state, self.conv1d = packed_state, conv1d
        self.register_buffer("values", torch.zeros(out_features, in_features // 2, device=device, dtype=dtype))
        self.register_buffer("positions", torch.full((out_features, positions_width(in_features)), 0x44,
                                                     dtype=torch.uint8, device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)
        self._packed: torch.Tensor | None = None  # cuSPARSELt's operand; ``values`` is a view into it
        self._packed_key: tuple | None = None
        self._dense: torch.Tensor | None = None  # the fallback's dense weight
        self._dense_key: tuple | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed_state: bool = True,
                    conv1d: bool = False, transposed_output: bool = False) -> SparseInferenceLinear:
        """From a 2:4 ``weight`` (out, in); ValueError naming the first group that isn't 2:4."""
        values, positions = pack_24(weight.detach())
        out_f, in_f = weight.shape
        new = cls(in_f, out_f, bias is not None, device="meta", packed_state=packed_state, conv1d=conv1d,
                  transposed_output=transposed_output)
        new.values, new.positions = values, positions
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return new

    def dense_weight(self) -> torch.Tensor:
        """The dense (out, in) 2:4 matrix, in ``values``' dtype and device."""
        return unpack_24(self.values, self.positions, self.in_features)

    # -- state dict in the dense layout ------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.packed_state:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self.dense_weight()
        destination[prefix + "weight"] = w.t().contiguous() if self.conv1d else w
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if not self.packed_state and key in state_dict:
            w = state_dict.pop(key)
            w = w.t() if self.conv1d else w
            try:
                state_dict[prefix + "values"], state_dict[prefix + "positions"] = pack_24(w)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _apply(self, fn, recurse=True):
        self._packed = self._packed_key = self._dense = self._dense_key = None  # rebuilt where they're next needed
        return super()._apply(fn, recurse)

    # -- forward -----------------------------------------------------------------------------

    def runs_sparse(self) -> bool:
        """Whether the forward runs 2:4 kernels: a CUDA weight in bf16/fp16, both dimensions
        multiples of 32, and the fast path available (:func:`twofour.kernels.ops.fast_available`)."""
        v = self.values
        return (v.is_cuda and v.dtype in (torch.bfloat16, torch.float16) and self.in_features % 32 == 0
                and self.out_features % 32 == 0 and ops.fast_available())

    def prepare(self) -> None:
        """Build what the forward multiplies by, now rather than at the first call: cuSPARSELt's
        compressed operand (``values`` then lives inside it, no second copy) where the layer
        runs sparse, else the dense matrix. The forward builds it again if the buffers change."""
        if self.runs_sparse():
            packed = compress_codes(self.values, position_codes(self.positions, self.in_features))
            n = self.values.numel() * self.values.element_size()
            self.values = packed[:n].view(self.values.dtype).view(self.out_features, self.in_features // 2)
            self._packed, self._packed_key = packed, self._key()
        else:
            self._dense, self._dense_key = self.dense_weight(), self._key()

    def _key(self) -> tuple:
        return (self.values.data_ptr(), self.values._version, self.positions.data_ptr(), self.positions._version)

    def nbytes(self) -> int:
        """Bytes the layer holds for its forward: the compressed operand and positions where it
        runs sparse, else values, positions and the dense matrix (bias not counted)."""
        held = [self.positions] + ([self._packed] if self._packed is not None else [self.values])
        held += [self._dense] if self._dense is not None else []
        return sum(t.numel() * t.element_size() for t in held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_sparse():
            cdt, n = self.values.dtype, self.out_features
            x2 = ops.as_2d(x.to(cdt))
            order = ops.order(x2)
            routes = dispatch.working("inf", self.routes(x2), (n, self.in_features, x2.shape[0], order, cdt,
                                                                self.bias is not None), "the 2:4 inference kernel")
            # timed as graph replays: the decoding that pays runs as one (an eager step waits on the host anyway)
            choice = dispatch.choose("inf" if self.bias is None else "inf+bias", n, self.in_features, x2.shape[0],
                                     order, cdt, routes, graphed=True)
            return routes[choice]().reshape(*x.shape[:-1], n)
        if self._dense_key != self._key():
            self.prepare()
        return F.linear(x, self._dense, self.bias)

    def routes(self, x2: torch.Tensor) -> dict[str, Any]:
        """The 2:4 kernels that compute y = x2 W^T + b for a (tokens, in) ``x2`` in the layer's
        dtype, row- or column-major, as calls: ``sparse`` (cuSPARSELt's GEMM, the tokens padded
        to its multiple of 8; y row-major), with ``transposed_output`` also ``sparse_dr`` (the
        same writing y^T row-major: a column-major y), and for up to
        :data:`~twofour.kernels.gemv24.MAX_TOKENS` tokens ``sparse_gemv`` (:mod:`twofour.kernels.gemv24`).
        The forward runs the one
        :func:`twofour.dispatch.choose` measured fastest for the shape (a kernel that raises the first
        time at a shape is left out there: :func:`twofour.dispatch.working`). Only where
        :meth:`runs_sparse`."""
        if self._packed_key != self._key():
            self.prepare()
        n, k, t = self.out_features, self.in_features, x2.shape[0]
        b = None if self.bias is None else self.bias.to(x2.dtype)

        def cusparselt(row_major: bool) -> torch.Tensor:
            pad = -t % 8
            xp = torch.cat([x2, x2.new_zeros(pad, k)]) if pad else x2
            return ops.spmm(self._packed, xp.t(), n, row_major, b).t()[:t]

        routes = {"sparse": lambda: cusparselt(True)}
        if self.transposed_output and t % 8 == 0:  # padded, y^T's slice is no longer one column-major tensor
            routes["sparse_dr"] = lambda: cusparselt(False)
        if t <= _gemv.MAX_TOKENS and not torch.compiler.is_compiling():
            routes["sparse_gemv"] = lambda: _gemv.gemv24(x2, self.values, self.positions, b)
        return routes

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"2:4 {'values+positions' if self.packed_state else 'dense-layout'} state"
                + (", transposed_output=True" if self.transposed_output else ""))

