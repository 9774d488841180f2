"""SparseLinear: an nn.Linear whose forward multiplies by a 2:4 effective weight.

The dense ``weight`` stays the master the optimizer updates (so state-dict keys, optimizers and
data-parallel wrappers see a plain nn.Linear); the recipe's state (scale, mask, step counter,
phase) lives in buffers. The recipe's :class:`~twofour.sparse.pruners.Pruner` says what the effective
weight is, its :class:`~twofour.fp8.precision.Precision` which GEMMs run in FP8. The forward runs
the first of its routes that applies (``routes.py``: the GPU fast path of ``fastpath.py``, FP8,
else the reference math of ``reference.py``): y = x W_eff^T + b, dX = dY W_eff, dW = dY^T X (or
its MVUE 2:4 estimate) passed straight through to the master weight. SR-STE's masked decay is
added once per optimizer step (:meth:`SparseLinear.add_masked_decay_`), not in the backward.
What a sharded weight needs (a mask refresh deferred to where the whole weight is gathered)
lives in ``sharded.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..activations import Activation
from ..kernels import ops
from .fastpath import CompressedWeight
from .recipes import DEFAULT_RECIPE, Recipe, make_recipe
from .routes import route_for
from .sharded import DeferredRefresh, is_shard, local_rows

__all__ = ["SparseLinear", "RECIPE_BUFFERS", "advance_layers"]

#: The buffers a SparseLinear keeps its recipe state in (None, and not saved, where unused).
RECIPE_BUFFERS = ("step", "flips", "dense", "beta", "mask")


class SparseLinear(nn.Linear):
    """A drop-in ``nn.Linear`` trained with a 2:4 recipe (default :data:`~twofour.DEFAULT_RECIPE`).

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

    @property
    def conv1d_layout(self) -> bool:
        """Whether the state dict keeps Hugging Face Conv1D's (in, out) weight layout (:meth:`from_conv1d`)."""
        return self._conv1d_layout

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.settle()  # a refresh left for the next forward: the saved mask is that forward's
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._conv1d_layout:
            destination[prefix + "weight"] = destination[prefix + "weight"].t()

    # -- recipe state ------------------------------------------------------------------------

    @property
    def pruner(self):
        """The recipe's :class:`~twofour.sparse.pruners.Pruner`."""
        return self.recipe.pruning

    def _init_state(self) -> None:
        """Check the shape, register the recipe's buffers and set the host flags.

        Host flags: ``_step``, ``_dense`` and ``_fp8`` mirror the ``step`` and ``dense`` buffers
        (and the FP8 phase they imply) as plain Python values, read as :attr:`step_count`,
        :attr:`is_dense_phase` and :attr:`is_fp8_phase`. The forward's routes
        (:mod:`twofour.sparse.routes`) branch on them and the fast path keys its weight cache on
        the step count; under ``torch.compile`` a Python value is a constant that dynamo guards on (a
        phase change recompiles once), where reading a buffer would cost a host sync per call.
        :meth:`_next_step` and :meth:`_load_from_state_dict` keep them equal to the buffers."""
        reason = self.recipe.unsupported(self.out_features, self.in_features)
        if reason:
            raise ValueError(f"SparseLinear: recipe {self.recipe.name!r} can't prune weight shape "
                             f"{tuple(self.weight.shape)}: {reason}")
        state = self._initial_state(self.weight.detach()) if self._keeps_state else {}
        for name in RECIPE_BUFFERS:
            self.register_buffer(name, state.get(name))  # None (not in the state dict) if unused
        self.deferred = DeferredRefresh()  # a mask refresh left for where the whole weight is (sharded.py)
        self._reset_host_state()

    def _reset_host_state(self) -> None:
        """The host-side state of step 0: step count, phases, no cached 2:4 weight, nothing pending."""
        self._step, self._dense = 0, not self.recipe.sparse or self.recipe.starts_dense
        self._fp8 = self._fp8_phase()
        self.compressed = CompressedWeight()
        self.deferred.reset()

    @property
    def _keeps_state(self) -> bool:
        """Whether the layer keeps recipe buffers: a sparse recipe's, or the step counter of a
        dense one whose FP8 phase ends (``bf16_finetune``)."""
        return self.recipe.sparse or self._fp8_ends

    @property
    def _fp8_ends(self) -> bool:
        r = self.recipe
        return bool(r.precision.fp8 and r.bf16_finetune and r.total_steps)

    def _initial_state(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Buffers for a layer made sparse from weight ``w`` (fresh init or a dense checkpoint);
        for a dense recipe the step counter alone."""
        dev = w.device
        step = {"step": torch.zeros((), dtype=torch.long, device=dev)}
        if not self.recipe.sparse:
            return step
        return {**step, "flips": torch.zeros((), dtype=torch.long, device=dev),
                "dense": torch.tensor(self.recipe.starts_dense, device=dev),
                **self.pruner.initial_state(w)}

    @torch.no_grad()
    def reset_state(self) -> None:
        """Recompute the recipe's buffers from the current weight, as at step 0, in place.

        For engines that build the model on the meta device, then allocate it uninitialised
        (``to_empty``) and initialise the weights afterwards (torchtitan): the buffers made on the
        meta device hold nothing until this runs. Works on a sharded weight (gathers it)."""
        if not self._keeps_state:
            return
        for name, value in self._initial_state(self.weight.detach()).items():
            getattr(self, name).copy_(value)
        self._reset_host_state()  # no cached 2:4 weight of the old values

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A dense checkpoint (no recipe buffers) is loaded as "made sparse from these weights".
        wkey = prefix + "weight"
        if self._conv1d_layout and wkey in state_dict:
            state_dict[wkey] = state_dict[wkey].t()
        # the key only this recipe's state has (a dense FP8 run's checkpoint holds ``step`` alone)
        own = prefix + ("mask" if self.recipe.sparse else "step")
        if self._keeps_state and wkey in state_dict and own not in state_dict:
            for name, value in self._initial_state(state_dict[wkey].detach().to(self.weight.device)).items():
                state_dict[prefix + name] = value
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if self._keeps_state:
            self._step = int(self.step)
            self._fp8 = self._fp8_phase()
        if self.recipe.sparse:
            self._dense = bool(self.dense)

    def _set_dense(self, dense: bool) -> None:
        if dense == self._dense:
            return
        self._dense = dense
        self.dense.fill_(dense)
        if not dense:  # (re)entering the sparse phase: start from the current weight's mask
            self.mask.copy_(self.pruner.mask(self.weight.detach()))

    @torch.no_grad()
    def advance(self, sparse_phase: bool | None = None) -> None:
        """Move the recipe on by one optimizer step: masks, flip count, phases.

        ``sparse_phase`` (from an Adam-aware optimizer such as STEPAdamW) turns a STEP layer's
        sparse phase on once the optimizer has switched. :func:`twofour.advance` does the same for
        every layer of a model at once (:func:`advance_layers`).
        """
        advance_layers([self], sparse_phase)

    def _next_step(self, sparse_phase: bool | None) -> bool:
        """Count one optimizer step and move the phases on (host state only; the ``step`` buffer is
        the caller's to update). False for a layer that keeps no state (a dense recipe's, unless
        its FP8 phase ends). The FP8 phase follows ``step`` and ``total_steps``, so a run resumed
        with more steps (``--reschedule``) is in FP8 again until its new last fraction."""
        r = self.recipe
        if not self._keeps_state:
            return False
        self._step += 1
        self._fp8 = self._fp8_phase()
        if not r.sparse:
            return True
        if r.starts_dense and sparse_phase:
            self._set_dense(False)
        if r.dense_finetune and r.total_steps and self._step >= r.total_steps * (1 - r.dense_finetune):
            self._set_dense(True)
        return True

    def _fp8_phase(self) -> bool:
        """Whether the GEMMs run in FP8 at the current step: an FP8 precision before the recipe's
        ``bf16_finetune`` (kept in ``_fp8``, a host flag: :meth:`_init_state`)."""
        r = self.recipe
        return r.precision.fp8 and not (self._fp8_ends and self._step >= r.total_steps * (1 - r.bf16_finetune))

    def _refresh_due(self) -> bool:
        return not self._dense and self.pruner.refresh_due(self._step, self.recipe.mask_interval)

    def _refit_beta(self) -> None:
        """Refit the scale beta to the current weight every ``beta_interval`` steps (S-STE with
        that option; the default 0 keeps the beta fitted when the layer was made sparse)."""
        n = self.recipe.beta_interval
        if n and not self._dense and self._step % n == 0 and self.beta is not None:
            self.beta.copy_(self.pruner.scale(self.weight.detach()))

    def _fused_refresh_ok(self) -> bool:
        """The mask refresh can run as the fused GPU kernel: a plain contiguous CUDA weight with
        Triton present (not a shard), a recipe whose mask is a top-2 of |W|."""
        w = self.weight
        return (self.pruner.fused_refresh and ops.triton_ok(w) and w.is_contiguous() and not is_shard(w)
                and self.mask.device == w.device)

    def _refresh_mask_torch(self, w: torch.Tensor | None = None) -> None:
        """Recompute the mask from the current weight (or ``w``) in plain torch and count the flips."""
        new = self.pruner.mask(self.weight.detach() if w is None else w)
        self.flips.copy_((new != self.mask).sum())
        self.mask.copy_(new)

    @torch.no_grad()
    def refresh_mask(self, w: torch.Tensor | None = None) -> None:
        """Recompute the mask from the current weight (or ``w``, the whole weight gathered
        elsewhere) and count the flips: the fused GPU kernel where it can run, else plain torch."""
        if self._fused_refresh_ok():
            ops.refresh_masks_([self.weight.detach() if w is None else w], [self.mask], [self.flips])
        else:
            self._refresh_mask_torch(w)

    def settle(self) -> None:
        """Apply a mask refresh left pending for the next forward (a sharded weight's:
        :class:`~twofour.sparse.sharded.DeferredRefresh`) now: the mask is then the one the next
        forward would compute. A collective on a sharded weight: every rank must call it."""
        self.deferred.settle(self)

    def keep_compressed(self, keep: bool) -> None:
        """Whether the fast path keeps its compressed weight from one call to the next (the
        default) or builds it for each call alone: less memory, as activation checkpointing wants
        (:class:`~twofour.sparse.fastpath.CompressedWeight`)."""
        self.compressed.keep = keep

    @torch.no_grad()
    def add_masked_decay_(self) -> None:
        """SR-STE's masked decay, once per optimizer step: ``weight.grad += decay * (1 - m) * W``
        with ``m`` the current mask (after gradient clipping, before ``optimizer.step()``;
        :func:`twofour.attach` calls it). A no-op for recipes without decay and in dense phases."""
        g = self.weight.grad
        if not self.recipe.decay or self._dense or g is None:
            return
        g, w, m = local_rows(g, self.weight.detach(), self.mask)  # this rank's rows of a sharded weight
        ops.masked_decay_(g, w, m, self.recipe.decay)  # one pass over g, W and the mask on the GPU

    @property
    def is_fp8_phase(self) -> bool:
        """True while the layer's GEMMs run in FP8 (an FP8 recipe before its ``bf16_finetune``)."""
        return self._fp8

    @property
    def is_dense_phase(self) -> bool:
        """True while the layer trains dense (dense recipe, STEP's phase 1, final dense fine-tune)."""
        return self._dense

    @property
    def step_count(self) -> int:
        """Optimizer steps the layer has advanced by (the ``step`` buffer's value, kept on the host)."""
        return self._step

    # -- forward -----------------------------------------------------------------------------

    def effective_weight(self) -> torch.Tensor:
        """The weight the forward multiplies by: W, W*m or beta*S(W) (no gradient)."""
        w = self.weight.detach()
        return w if self._dense else self.pruner.effective(w, self.beta, self.mask)

    #: :func:`twofour.activations.linear_act` passes the activation that follows (``forward(x, act=...)``)
    takes_activation = True

    def forward(self, x: torch.Tensor, act: Activation | None = None) -> torch.Tensor:
        """``x W_eff^T + b``, or with ``act`` (an activation of :mod:`twofour.activations` that
        alone reads the output, as in an FFN) ``act(x W_eff^T + b)``, by the first route of
        :data:`twofour.sparse.routes.ROUTES` that applies: the fused linear+activation (GPU fast
        path with MVUE, eager), FP8, dense, the fast path eager or compiled, else the reference."""
        if self.deferred.pending:  # unless a hook before this forward applied it already (sharded.py)
            self.deferred.apply(self)
        return route_for(self, x, act).run(self, x, act)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.recipe.to_dict().items() if k not in ("name", "pruning"))
        extra = ", transposed_output=True" if self.transposed_output else ""
        return f"{super().extra_repr()}, recipe={self.recipe.name}({opts}){extra}"


@torch.no_grad()
def advance_layers(layers: Iterable[SparseLinear], sparse_phase: bool | None = None) -> None:
    """Move each of ``layers`` on by one optimizer step (:meth:`SparseLinear.advance`), with one
    launch for all the step counters, one for the flip counters of layers not refreshed this step
    and one fused kernel launch per device and weight dtype for the masks refreshed on the GPU (a
    model has tens of layers, and each launch costs host time). A layer whose weight is a shard
    refreshes its mask where the whole weight is next gathered instead
    (:class:`~twofour.sparse.sharded.DeferredRefresh`): its flip count then shows at that forward."""
    moved = [layer for layer in layers if layer._next_step(sparse_phase)]
    if not moved:
        return
    torch._foreach_add_([layer.step for layer in moved], 1)
    due = [layer for layer in moved if layer._refresh_due()]
    due_set = set(due)
    # a layer not refreshed this step counts no flips, unless its forward just counted the last
    # step's (a refresh left to the forward): those stay for the loop to read once
    idle = []
    for layer in moved:
        if layer not in due_set and layer.flips is not None and not layer.deferred.fresh_flips:
            idle.append(layer.flips)
        layer.deferred.fresh_flips = False
    if idle:
        torch._foreach_zero_(idle)
    fused = [layer for layer in due if layer._fused_refresh_ok()]
    fused_set = set(fused)
    if fused:
        ops.refresh_masks_([m.weight.detach() for m in fused], [m.mask for m in fused], [m.flips for m in fused])
    for layer in due:
        if layer in fused_set:
            continue
        if is_shard(layer.weight):  # refreshed where the whole weight is next gathered
            layer.deferred.pending = True
        else:
            layer._refresh_mask_torch()
    for layer in moved:
        if layer.recipe.beta_interval:
            layer._refit_beta()
