"""How ``twofour train`` spreads a model over the processes of a ``torchrun``: DDP, or FSDP2 as
an :class:`FSDPPolicy` says, optionally with activation checkpointing of every block.

The sparse layers need nothing of their own here: their masks, S-STE's scale and step counters
are buffers, replicated on every rank and advanced the same way on each; under FSDP2 a layer's
mask is refreshed in its forward, from the weight FSDP2 gathered there, so every rank computes
the same mask with no collective of its own (:mod:`twofour.sparse.sharded`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import TrainError
from ..sparse.layer import SparseLinear
from ..sparse.sharded import set_gathered_dtype

__all__ = ["world_size", "launched_main", "Parallel", "FSDPPolicy", "FSDP_POLICIES", "DEFAULT_FSDP", "fsdp_policy",
           "shard", "checkpoint_blocks", "grad_norm", "everywhere"]


@dataclass(frozen=True)
class FSDPPolicy:
    """How FSDP2 shards the model: each block a unit (gathered just before it runs), the rest
    (embeddings, final norm, head) the root unit.

    ``param_dtype``: the dtype weights are gathered in and the forward sees (None: as stored,
    float32); ``reduce_dtype``: the gradients' dtype in the reduce-scatter; ``reshard``: free a
    block's gathered weights after its forward and gather them again for its backward (less
    memory, one more all-gather per block per step) rather than keep them to the backward;
    ``per_block``: each block a unit, else the whole model one unit (one all-gather and one
    reduce-scatter a step, the least host work, but every weight gathered for the whole step)."""

    name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard: bool
    per_block: bool = True


#: The policies ``--fsdp NAME`` takes. ``bf16`` (the default) gathers bf16 weights: half the
#: all-gather bytes of ``fp32`` and no per-step cast under autocast; the masks are then computed
#: from the bf16 weights the forward multiplies by. ``bf16-keep`` also keeps gathered weights from
#: forward to backward (ZeRO-2-like memory, for models that fit that way); ``bf16-flat`` gathers
#: the whole model at once (for models whose weights fit on each GPU: the optimizer state and the
#: gradients stay sharded).
FSDP_POLICIES: dict[str, FSDPPolicy] = {p.name: p for p in (
    FSDPPolicy("bf16", torch.bfloat16, torch.float32, True),
    FSDPPolicy("bf16-keep", torch.bfloat16, torch.float32, False),
    FSDPPolicy("fp32", None, None, True),
    FSDPPolicy("bf16-flat", torch.bfloat16, torch.float32, False, per_block=False),
)}
DEFAULT_FSDP = "bf16"


def world_size() -> int:
    """The number of processes torchrun launched (``WORLD_SIZE``; 1 without torchrun): the one
    place it is read. TrainError, one line, when ``WORLD_SIZE`` is not a positive whole number, or
    says several processes while nothing set up their rendezvous (no ``MASTER_ADDR``: not torchrun)."""
    text = os.environ.get("WORLD_SIZE", "1").strip()
    if not text.isdigit() or int(text) < 1:
        raise TrainError(f"WORLD_SIZE={text!r} is not a number of processes: launch with torchrun, which sets it, "
                         "or unset WORLD_SIZE")
    world = int(text)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK") if v not in os.environ]
    if world > 1 and missing and not dist.is_initialized():
        raise TrainError(f"WORLD_SIZE={world} is set, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not: launch with torchrun --nproc-per-node N, which sets them all, or unset WORLD_SIZE to "
                         "run one process")
    return world


def launched_main() -> bool:
    """Whether this process is rank 0 of its launch (torchrun's ``RANK``; a lone process is), known
    before any process group: what a comparison's lock, records and report go by."""
    return int(os.environ.get("RANK", "0")) == 0


@dataclass(frozen=True)
class Parallel:
    """How this process takes part in a run: its rank, the number of processes, its GPU, and the
    mode (one process; DDP; FSDP2 with ``fsdp``'s policy), decided once by :meth:`start`."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: FSDPPolicy | None = None

    @classmethod
    def start(cls, fsdp: str | None = None) -> Parallel:
        """This process's part, from torchrun's environment; initializes the process group under
        torchrun (NCCL on GPUs, gloo otherwise). ``fsdp``: the FSDP2 policy's name (None: DDP),
        used only with several processes."""
        world = world_size()
        if world == 1:
            return cls()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            if torch.cuda.is_available():
                # each rank on its own GPU before NCCL starts: otherwise every rank's first
                # collective lands on GPU 0 and a 2-GPU run hangs there
                torch.cuda.set_device(local_rank)
                dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
            else:
                dist.init_process_group("gloo")
        return cls(dist.get_rank(), world, local_rank, fsdp_policy(fsdp) if fsdp is not None else None)

    @property
    def main(self) -> bool:
        """Whether this process logs and writes the run folder's shared files (rank 0)."""
        return self.rank == 0

    @property
    def ddp(self) -> bool:
        """Whether the gradients are averaged over replicas (several processes, no FSDP2)."""
        return self.world > 1 and self.fsdp is None

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded with FSDP2 (checkpoints then sharded too)."""
        return self.fsdp is not None

    def barrier(self) -> None:
        """Wait for every process (nothing in one process)."""
        if self.world > 1:
            dist.barrier()

    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` averaged over the processes, in place."""
        if self.world > 1:
            dist.all_reduce(t)
            t /= self.world
        return t

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s maximum over the processes, in place."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t


def fsdp_policy(name: str) -> FSDPPolicy:
    """The policy ``name`` names; TrainError listing the names otherwise."""
    try:
        return FSDP_POLICIES[name]
    except KeyError:
        raise TrainError(f"unknown FSDP policy {name!r}; choose one of {', '.join(FSDP_POLICIES)}") from None


def _units(model: nn.Module) -> list[nn.Module]:
    units = getattr(model, "fsdp_units", None)
    if units is None:
        raise TrainError(f"{type(model).__name__} has no fsdp_units(): FSDP2 needs to know its blocks")
    return list(units())


def shard(model: nn.Module, policy: FSDPPolicy, mesh=None) -> nn.Module:
    """Apply FSDP2 (``fully_shard``) to ``model`` in place as ``policy`` says and return it: each
    block a unit, then the root. The last block keeps its weights to the backward (which starts
    with it), as torchtitan does; FSDP2 itself keeps the root's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    mp = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    units = _units(model) if policy.per_block else []
    for i, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=policy.reshard and i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    set_gathered_dtype(model, policy.param_dtype)  # a mask saved before any forward is computed in it too
    return model


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Recompute each block's activations in the backward instead of keeping them (activation
    checkpointing): the memory a deep model at a large batch needs, for about a third more
    compute. The blocks' sparse layers keep no compressed weight past a call, in evaluations
    either (:class:`~twofour.sparse.fastpath.CompressedWeight`). In place, before :func:`shard`;
    returns ``model``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: PLC0415
        CheckpointImpl,
        checkpoint_wrapper,
    )

    blocks = _units(model)
    for block in blocks:
        for layer in block.modules():
            if isinstance(layer, SparseLinear):
                layer.keep_compressed(False)
    for child in list(model.modules()):
        for attr, sub in list(child.named_children()):
            if any(sub is b for b in blocks):
                setattr(child, attr, checkpoint_wrapper(sub, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model


def grad_norm(model: nn.Module, clip: float) -> torch.Tensor:
    """The gradients' total norm, a tensor on their device (no host sync); clips them to ``clip``
    when it is set (not 0). Under FSDP2 from the local shards: one norm per shard, one
    all-reduce, the scale applied in place (no DTensor op per gradient, which costs the host)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if params and all(isinstance(p.grad, DTensor) for p in params):
        return _sharded_grad_norm([p.grad for p in params], clip)
    if clip:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    return torch.nn.utils.get_total_norm([p.grad for p in params])


def _sharded_grad_norm(grads: list[DTensor], clip: float) -> torch.Tensor:
    """:func:`grad_norm` of FSDP2's sharded gradients (each sharded over the whole group, as
    :func:`shard` leaves them): sum of the shards' squared norms over the ranks, then the root."""
    local = [g.to_local() for g in grads]
    total = torch.stack([n.float() for n in torch._foreach_norm(local)]).square().sum()
    group = grads[0].device_mesh.get_group()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    if clip:
        torch._foreach_mul_(local, (clip / (norm + 1e-6)).clamp(max=1.0))  # clip_grad_norm_'s rule
    return norm


def everywhere(ok: bool | torch.Tensor, world: int, group=None) -> bool:
    """Whether ``ok`` (a bool, or a 0-dim tensor on its device) holds on every rank: one
    all-reduce and one host sync when ``world`` > 1 (every rank must call it)."""
    flag = ok.to(torch.int32) if isinstance(ok, torch.Tensor) else torch.tensor(int(ok))
    if world > 1:
        if flag.device.type == "cpu" and dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
