"""What keeps a :class:`~twofour.sparse.layer.SparseLinear` correct when FSDP2 shards its weight.

Under FSDP2 a layer's ``weight`` is a DTensor holding this rank's rows; the whole weight exists
only where FSDP2 gathers it, just before its unit's forward. A mask is a function of the whole
weight, so :func:`~twofour.sparse.layer.advance_layers` leaves a sharded layer's refresh pending
(:class:`DeferredRefresh`) and it runs where the weight is whole: in a forward pre-hook on the
layer's FSDP2 unit (:func:`refresh_where_gathered`, installed by :func:`twofour.advance`), else
in the layer's forward, else in :meth:`DeferredRefresh.settle` (a state dict: a checkpoint) from
``full_tensor()``. Every rank computes the same mask from the same gathered weight, with no
collective of its own. SR-STE's masked decay adds to this rank's rows only (:func:`local_rows`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["is_shard", "whole", "local_rows", "DeferredRefresh", "refresh_where_gathered", "set_gathered_dtype"]


def is_shard(w: torch.Tensor) -> bool:
    """Whether ``w`` is one rank's shard of a weight (a DTensor, as FSDP2's parameters are)."""
    return hasattr(w, "to_local")


def whole(w: torch.Tensor) -> torch.Tensor:
    """The whole weight, also when ``w`` is a shard of it (gathered: a collective, every rank calls it)."""
    return w.full_tensor() if hasattr(w, "full_tensor") else w


def local_rows(g: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gradient, its weight and the whole weight's mask as this rank holds them: the local
    rows (torch.chunk's split, FSDP2's) when the gradient is a shard, else as they are."""
    if not is_shard(g):
        return g, w, m
    mesh = w.device_mesh
    rows = m.chunk(mesh.size(), dim=0)
    mine = rows[mesh.get_local_rank()] if mesh.get_local_rank() < len(rows) else m[:0]
    return g.to_local(), w.to_local(), mine


class DeferredRefresh:
    """A layer's mask refresh left from the optimizer step for where its whole weight is gathered.

    ``pending``: a refresh was due at the last step (set by
    :func:`~twofour.sparse.layer.advance_layers` for a sharded weight); ``fresh_flips``: a refresh
    since the last step wrote the flip counter, which the loop reads at the next step;
    ``gathered_dtype``: the dtype the forward sees the weight in (FSDP2's ``param_dtype``), so a
    mask settled from ``full_tensor()`` is the one the forward would compute."""

    def __init__(self) -> None:
        self.gathered_dtype: torch.dtype | None = None
        self.reset()

    def reset(self) -> None:
        """Nothing pending, no flips counted since the last step (a layer's state at step 0)."""
        self.pending = False
        self.fresh_flips = False

    @torch.compiler.disable  # a kernel launch and buffer writes, once a step: eager under torch.compile
    def apply(self, layer: nn.Module, w: torch.Tensor | None = None) -> None:
        """The pending refresh of ``layer``, from its weight as gathered for the forward (the unit's
        hook, or the layer's forward), or from ``w``, the whole weight gathered elsewhere
        (:meth:`settle`)."""
        self.pending, self.fresh_flips = False, True
        if w is None:
            w = layer.weight.detach()
            self.gathered_dtype = w.dtype
        layer.refresh_mask(w)

    @torch.no_grad()
    def settle(self, layer: nn.Module) -> None:
        """Apply a pending refresh now, from the whole weight in the dtype the forward gathers it
        in. A collective on a sharded weight: every rank must call it. A mask of the top-2 of |W|
        in each row's groups of 4, on a weight sharded by rows (FSDP2's), comes from this rank's
        rows and an all-gather of the mask's bytes (:func:`_settle_from_rows`: a quarter of the
        bytes the float32 weight's gather moves)."""
        if not self.pending:
            return
        w = layer.weight.detach()
        if layer.pruner.fused_refresh and _row_sharded(w):
            local = w.to_local()
            _settle_from_rows(layer, local if self.gathered_dtype is None else local.to(self.gathered_dtype))
            self.pending, self.fresh_flips = False, True
            return
        w = whole(w)
        self.apply(layer, w if self.gathered_dtype is None else w.to(self.gathered_dtype))


def _row_sharded(w: torch.Tensor) -> bool:
    """Whether ``w`` is a DTensor sharded by rows over a one-dimensional mesh (FSDP2's layout)."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    return is_shard(w) and w.device_mesh.ndim == 1 and tuple(w.placements) == (Shard(0),)


def _settle_from_rows(layer: nn.Module, local: torch.Tensor) -> None:
    """``layer``'s mask and flip count from this rank's rows ``local`` of its weight: each rank's rows
    of the new mask (torch.chunk's split, FSDP2's), gathered into the whole mask on every rank, and
    the flips summed over the ranks."""
    import torch.distributed as dist  # noqa: PLC0415

    mesh, n, k = layer.weight.device_mesh, layer.weight.shape[0], layer.weight.shape[1]
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    rows = -(-n // world)  # rows per rank, the last ones fewer (or none)
    mine = layer.pruner.mask(local)
    flips = (mine != layer.mask[rank * rows: rank * rows + mine.shape[0]]).sum()
    padded = torch.zeros((rows, k), dtype=torch.uint8, device=local.device)
    padded[: mine.shape[0]] = mine
    gathered = torch.empty((world * rows, k), dtype=torch.uint8, device=local.device)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    dist.all_reduce(flips, group=group)
    layer.mask.copy_(gathered[:n].bool())
    layer.flips.copy_(flips)


def _deferred(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of ``model`` that carry a :class:`DeferredRefresh` (its sparse layers)."""
    return (m for m in model.modules() if isinstance(getattr(m, "deferred", None), DeferredRefresh))


def set_gathered_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Tell every sparse layer of ``model`` the dtype FSDP2 gathers its weight in (None: as
    stored), so that a mask saved before any forward is computed in it too."""
    for layer in _deferred(model):
        layer.deferred.gathered_dtype = dtype or layer.weight.dtype


_HOOKED: weakref.WeakSet = weakref.WeakSet()  # the FSDP2 units that already carry the refresh hook
_WALKED: weakref.WeakSet = weakref.WeakSet()  # the models whose units were all looked at


def refresh_where_gathered(model: nn.Module, layers: Iterable[nn.Module]) -> None:
    """Under FSDP2, a forward pre-hook on each unit holding some of ``layers`` (``model``'s sparse
    layers), run after FSDP2's own (which gathers the unit's weights): it applies the refreshes
    left pending, eagerly, before the unit's forward. So a unit wrapped whole by ``torch.compile``
    (torchtitan 0.2.2's blocks, ``fullgraph``) never meets a refresh in its traced code; one
    compiled in place (``module.compile()``, torchtitan 0.3's) traces its hooks too, so there the
    refresh is settled right after the optimizer step instead (``integrations/titan3.py``). Walks
    ``model`` once, the first time a refresh is pending; installed once per unit."""
    layers = list(layers)
    if model in _WALKED or not any(layer.deferred.pending for layer in layers):
        return
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:
        return
    _WALKED.add(model)
    ours = set(layers)
    for unit in model.modules():
        if not isinstance(unit, FSDPModule) or unit in _HOOKED:
            continue
        own = [m for m in _unit_modules(unit, FSDPModule) if m in ours]
        if own:
            unit.register_forward_pre_hook(lambda module, args, own=own: _apply_pending(own))
        _HOOKED.add(unit)


def _unit_modules(unit: nn.Module, unit_type: type) -> Iterator[nn.Module]:
    """``unit`` and its submodules, leaving out those of nested units (their own FSDP2 units)."""
    yield unit
    for child in unit.children():
        if not isinstance(child, unit_type):
            yield from _unit_modules(child, unit_type)


def _apply_pending(layers: list[nn.Module]) -> None:
    for layer in layers:
        if layer.deferred.pending:
            layer.deferred.apply(layer)
