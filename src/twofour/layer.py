"""SparseLinear: an nn.Linear whose forward multiplies by a 2:4 effective weight.

The dense ``weight`` stays the master the optimizer updates (so state-dict keys, optimizers,
DDP and FSDP see a plain nn.Linear); the recipe's state (scale, masks, step counter, phase)
lives in buffers. One autograd function carries the whole layer: the forward on the effective
weight, dX from the dense dY, dW from dY^T (or its MVUE 2:4 estimate) and X, passed straight
through to the master weight, plus SR-STE's masked decay.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .fp8 import E4M3, E5M2, fake_fp8
from .kernels import ops
from .pruning import _fixed_scale, _mask_24, _soft_threshold_24, _transposable_mask_24, mvue_24_padded
from .recipes import DEFAULT_RECIPE, Recipe, make_recipe

__all__ = ["SparseLinear", "effective_weight", "RECIPE_BUFFERS"]

#: The buffers a SparseLinear keeps its recipe state in (None, and not saved, where unused).
RECIPE_BUFFERS = ("step", "flips", "dense", "beta", "mask")


def effective_weight(weight: torch.Tensor, recipe: Recipe, beta: torch.Tensor | None,
                     mask: torch.Tensor | None, dense: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the forward multiplies by, and the hard mask used for masked decay (or None)."""
    w = weight.detach()
    if dense or recipe.pruning == "none":
        return w, None
    if recipe.pruning == "soft":
        return beta.to(w.dtype) * _soft_threshold_24(w), None
    m = mask if recipe.pruning == "transposable" else _mask_24(w)
    return w * m, m


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _SparseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, beta, mask, recipe: Recipe, dense: bool):
        cdt = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            w_eff, m = effective_weight(weight, recipe, beta, mask, dense)
            x2 = x.reshape(-1, x.shape[-1]).to(cdt)
            w_eff = w_eff.to(cdt)
            if recipe.fp8:
                x2, w_eff = fake_fp8(x2, E4M3), fake_fp8(w_eff, E4M3)
            y = x2 @ w_eff.t()
            if bias is not None:
                y = y + bias.to(cdt)
        ctx.save_for_backward(x2, w_eff, weight if m is not None and recipe.decay else None, m)
        ctx.recipe, ctx.dense, ctx.x_shape, ctx.x_dtype = recipe, dense, x.shape, x.dtype
        ctx.has_bias, ctx.w_dtype = bias is not None, weight.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w_eff, weight, m = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1]).to(w_eff.dtype)
        if recipe.fp8:
            dy2 = fake_fp8(dy2, E5M2)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy2 @ w_eff).reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dyt = dy2.t()
            if recipe.mvue and not ctx.dense:
                dyt = mvue_24_padded(dyt.contiguous())  # unbiased 2:4 along tokens
            dw = (dyt @ x2).float()
            if weight is not None:  # SR-STE: dL/dW = dL/dW_eff + lambda * (1 - m) * W
                dw = dw + recipe.decay * (~m) * weight.float()
            dw = dw.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """(tokens, features) view of ``t`` in row- or column-major order (a copy only if neither)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if ops.order(t2) is not None else t2.contiguous()


class _FastSparseLinearFn(torch.autograd.Function):
    """The GPU path: cuSPARSELt 2:4 GEMMs where they measure faster than dense (forward, dX for
    transposable masks, dW on the fused MVUE-compressed dY^T), operands read in whatever order
    they are stored; the same math as _SparseLinearFn.

    The output is row-major, as nn.Linear's, unless ``transposed_output`` allows y^T stored
    row-major (a column-major y) where that is faster; dX comes back in x's own order, so that
    elementwise backward ops see operands of one order."""

    @staticmethod
    def forward(ctx, x, weight, bias, wc, wdense, wtc, recipe: Recipe, transposed_output: bool):
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
        ctx.save_for_backward(x2, weight if recipe.decay else None, wc, wdense, wtc)
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.has_bias = recipe, x.shape, x.dtype, bias is not None
        ctx.w_dtype = weight.dtype
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, wc, wdense, wtc = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
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
            if recipe.mvue:
                seed = torch.randint(0, 2**31 - 1, (1,), device=dy2.device)
                key = ("dw", n, t, k, ops.order(x2), dy2.dtype)
                known = ops.choice_of(*key)  # once measured, only the operand its GEMM reads is written
                # read dY^T in place: a transposing copy first measured slower (docs/PERFORMANCE.md)
                buf, dense = ops.compress(dy2.t(), "mvue", None, None, seed, known != "sparse", dy2.dtype,
                                          known != "dense")
                cands = {}
                if known != "dense":
                    cands["sparse"] = lambda: ops.spmm(buf, x2, n, False)
                if known != "sparse":
                    cands["dense"] = lambda: dense @ x2
                choice = known or ops.choose(*key, cands)
                dw = cands[choice]()
            else:
                dw = dy2.t() @ x2
            dw = dw.float()
            if weight is not None:  # SR-STE masked decay; W_eff's zeros are the dropped positions
                dw = dw + recipe.decay * (wdense == 0) * weight.float()
            dw = dw.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None, None, None, None, None


class SparseLinear(nn.Linear):
    """A drop-in ``nn.Linear`` trained with a 2:4 recipe (default S-STE).

    ``weight`` is the dense master; :meth:`effective_weight` is what the forward uses. Call
    :meth:`advance` once per optimizer step (``twofour.attach(model, optimizer)`` does it for
    every layer): it refreshes masks, counts flips, and moves step-based phases on.

    ``transposed_output=True`` lets the GPU path return its output as a column-major view (y^T
    stored row-major) where that GEMM is faster: right for a layer whose output only feeds
    elementwise ops and another linear, such as an FFN's first linear (the next SparseLinear
    reads it in place). Otherwise the output is row-major, as nn.Linear's.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None, recipe: str | Recipe = DEFAULT_RECIPE,
                 transposed_output: bool = False, **options: Any):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = make_recipe(recipe, **options)
        self.transposed_output = transposed_output
        self._init_state()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | Recipe = DEFAULT_RECIPE, **options: Any) -> SparseLinear:
        """A SparseLinear sharing ``linear``'s parameters (same objects: optimizers and ties stay valid)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta",
                  recipe=recipe, **options)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_state()
        return new

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: str | Recipe = DEFAULT_RECIPE, **options: Any) -> SparseLinear:
        """From a Hugging Face ``Conv1D`` (GPT-2's linear, weight stored (in, out)).

        The weight becomes a new (out, in) parameter; the state dict keeps Conv1D's (in, out)
        layout, so Hugging Face checkpoints load and save unchanged.
        """
        in_f, out_f = conv.weight.shape
        new = cls(in_f, out_f, conv.bias is not None, device="meta", recipe=recipe, **options)
        new.weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=conv.weight.requires_grad)
        new.bias = conv.bias
        new._conv1d_layout = True
        new._init_state()
        return new

    _conv1d_layout = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._conv1d_layout:
            destination[prefix + "weight"] = destination[prefix + "weight"].t()

    # -- recipe state ------------------------------------------------------------------------

    def _check_shape(self) -> None:
        if self.recipe.sparse and self.in_features % 4:
            raise ValueError(f"SparseLinear: in_features={self.in_features} is not a multiple of 4 "
                             f"(weight shape {tuple(self.weight.shape)}), so it cannot be 2:4")
        if self.recipe.pruning == "transposable" and self.out_features % 4:
            raise ValueError(f"SparseLinear: recipe {self.recipe.name!r} needs both dimensions to be multiples "
                             f"of 4, got weight shape {tuple(self.weight.shape)}")

    def _initial_state(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Buffers for a layer made sparse from weight ``w`` (fresh init or a dense checkpoint)."""
        r, dev = self.recipe, w.device
        state = {"step": torch.zeros((), dtype=torch.long, device=dev),
                 "flips": torch.zeros((), dtype=torch.long, device=dev),
                 "dense": torch.tensor(r.starts_dense, device=dev)}
        if r.pruning == "soft":
            state["beta"] = _fixed_scale(w)  # computed once, then frozen (DESIGN.md: it drifts otherwise)
        state["mask"] = self._mask_of(w)
        return state

    def _mask_of(self, w: torch.Tensor) -> torch.Tensor:
        """The recipe's hard mask of ``w`` (the whole weight, also when FSDP2 holds a shard)."""
        if hasattr(w, "full_tensor"):
            w = w.full_tensor()
        return _transposable_mask_24(w) if self.recipe.pruning == "transposable" else _mask_24(w)

    def _init_state(self) -> None:
        self._check_shape()
        state = self._initial_state(self.weight.detach()) if self.recipe.sparse else {}
        for name in RECIPE_BUFFERS:
            self.register_buffer(name, state.get(name))  # None (not in the state dict) if unused
        self._step, self._dense = 0, not self.recipe.sparse or self.recipe.starts_dense

    def reset_recipe_state(self) -> None:
        """Recompute scale and masks from the current weight and restart the step counter."""
        self._init_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A dense checkpoint (no recipe buffers) is loaded as "made sparse from these weights".
        wkey = prefix + "weight"
        if self._conv1d_layout and wkey in state_dict:
            state_dict[wkey] = state_dict[wkey].t()
        if self.recipe.sparse and wkey in state_dict and prefix + "mask" not in state_dict:
            for name, value in self._initial_state(state_dict[wkey].detach().to(self.weight.device)).items():
                state_dict[prefix + name] = value
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self.recipe.sparse:
            self._step, self._dense = int(self.step), bool(self.dense)

    def _set_dense(self, dense: bool) -> None:
        if dense == self._dense:
            return
        self._dense = dense
        self.dense.fill_(dense)
        if not dense:  # (re)entering the sparse phase: start from the current weight's mask
            self.mask.copy_(self._mask_of(self.weight.detach()))

    @torch.no_grad()
    def advance(self, sparse_phase: bool | None = None) -> None:
        """Move the recipe on by one optimizer step: masks, flip count, phases.

        ``sparse_phase`` (from an Adam-aware optimizer such as STEPAdamW) turns a STEP layer's
        sparse phase on once the optimizer has switched.
        """
        r = self.recipe
        if not r.sparse:
            return
        self._step += 1
        self.step.fill_(self._step)
        if r.starts_dense and sparse_phase:
            self._set_dense(False)
        if r.dense_finetune and r.total_steps and self._step >= r.total_steps * (1 - r.dense_finetune):
            self._set_dense(True)
        if self._dense:
            self.flips.zero_()
            return
        if r.pruning == "transposable" and self._step % r.mask_interval:
            self.flips.zero_()
            return
        w = self.weight.detach()
        if hasattr(w, "full_tensor"):
            w = w.full_tensor()
        if r.pruning != "transposable" and ops.triton_ok(w) and w.is_contiguous() and self.mask.device == w.device:
            ops.refresh_mask_(w, self.mask, self.flips)  # one fused kernel, no host sync
            return
        new = self._mask_of(w)
        self.flips.copy_((new != self.mask).sum())
        self.mask.copy_(new)

    @property
    def is_dense_phase(self) -> bool:
        """True while the layer trains dense (dense recipe, STEP's phase 1, final dense fine-tune)."""
        return self._dense

    # -- forward -----------------------------------------------------------------------------

    def effective_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by: W, W*m or beta*S(W) (no gradient)."""
        return effective_weight(self.weight, self.recipe, self.beta, self.mask, self._dense)[0]

    def _fast_ok(self, x: torch.Tensor) -> bool:
        r = self.recipe
        return (x.is_cuda and not r.fp8 and not self._dense and _compute_dtype(x) in (torch.bfloat16, torch.float16)
                and self.in_features % 32 == 0 and self.out_features % 32 == 0
                and (x.numel() // self.in_features) % 32 == 0 and ops.fast_available())

    def _fast_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Compressed W_eff (and W_eff^T for transposable masks) plus the dense W_eff, built by one
        fused kernel once per optimizer step (the weight's version counter says when it changed),
        and inside every captured CUDA graph, so that each replay compresses the current weight."""
        w = self.weight.detach()
        key = (self.weight._version, w.data_ptr(), dtype, self._step)
        capturing = torch.cuda.is_current_stream_capturing()  # a CUDA graph must hold the compression:
        if not capturing and self._wcache is not None and self._wcache[0] == key:  # replays see new weights
            return self._wcache[1]
        r = self.recipe
        wtc = w.new_empty(0, dtype=torch.uint8)  # compressed W^T: transposable masks only
        if r.pruning == "soft":
            wc, wd = ops.compress(w, "soft", self.beta.reshape(1), None, None, True, dtype)
        elif r.pruning == "transposable":
            wc, wd = ops.compress(w, "mask", None, self.mask, None, True, dtype)
            wtc = ops.compress(w.t(), "mask", None, self.mask.t(), None, False, dtype)[0]
        else:
            wc, wd = ops.compress(w, "hard", None, None, None, True, dtype)
        if not capturing:  # the graph's own buffers stay out of the cache
            self._wcache = (key, (wc, wd, wtc))
        return wc, wd, wtc

    _wcache = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recipe.sparse:
            return super().forward(x)
        if not torch.compiler.is_compiling() and self._fast_ok(x):  # compiled: the reference math
            cdt = _compute_dtype(x)
            with torch.autocast("cuda", enabled=False):
                wc, wd, wtc = self._fast_weights(cdt)
                return _FastSparseLinearFn.apply(x.to(cdt), self.weight, self.bias, wc, wd, wtc, self.recipe,
                                                 self.transposed_output)
        return _SparseLinearFn.apply(x, self.weight, self.bias, self.beta, self.mask, self.recipe, self._dense)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.recipe.to_dict().items() if k not in ("name", "pruning"))
        extra = ", transposed_output=True" if self.transposed_output else ""
        return f"{super().extra_repr()}, recipe={self.recipe.name}({opts}){extra}"
