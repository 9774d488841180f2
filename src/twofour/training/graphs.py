"""The eager training step's forward and backward passes as CUDA graphs, so that the host's
per-layer work (Python, autograd, kernel launches) runs once at capture instead of every step.

At small batches a step's GPU work takes less time than the host needs to issue it, and the
2:4 layers issue more than dense ones (compression, MVUE, the GEMM dispatch), so the sparse
step waits on the host. :class:`StepGraphs` records the forward and backward passes of all the
step's micro-batches and the gradient clip as one CUDA graph and replays it with each step's
batches copied into its static inputs. Under DDP the model is not wrapped in
``DistributedDataParallel``: the graph holds the local passes and :class:`GradAllReduce`
averages the gradients after it, in one collective, before the clip. (DDP keeps each
parameter's gradient-accumulation node from its construction, on the stream it was built on;
a backward captured on the graph's stream then syncs with the legacy default stream, which
voids the capture.) The optimizer step, the masks' refresh (``twofour.attach``'s hook) and the
schedule stay eager: they are a few launches, and they keep the recipes' host-side state exact.

A graph replays exactly the kernels it recorded, so it is kept per *route signature*: each
sparse layer's phase (dense or 2:4, FP8 or not), which decides what its forward runs. When the
signature changes (a dense fine-tune begins, FP8 ends), the step runs eagerly for a few steps
(the new routes' GEMM choices are measured then, which a capture cannot do) and a new graph is
captured. Gradients are allocated once and never set to None; each step zeroes them first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import timing
from ..errors import TrainError, one_line
from ..sparse.layer import SparseLinear
from .config import TrainConfig
from .parallel import everywhere

log = logging.getLogger("twofour")

__all__ = ["StepGraphs", "GradAllReduce", "WARMUP_STEPS", "capture_plan"]

#: Eager steps with a route signature before its graph is captured: the dispatch measures each
#: GEMM's routes on its first call, and cuBLAS and Triton initialize on theirs.
WARMUP_STEPS = 3

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def capture_plan(cfg: TrainConfig, world: int, micro_batches: int, sharded: bool, device: torch.device,
                 starts_dense: bool) -> str:
    """Which CUDA graphs a run's steps replay, decided once per run: ``"compiled"`` (a
    ``--compile-mode`` that captures, torch.compile's own), ``"step"`` (:class:`StepGraphs` around
    the eager step: ``--step-graphs`` on a GPU, neither sharded, compiled nor STEP, whose
    optimizer switches the layers' phases from inside its step) or ``""`` (none). Raises
    :class:`~twofour.errors.TrainError` for a capturing compile mode with several processes or
    micro-batches, which torch.compile's graphs do not replay correctly."""
    if cfg.cuda_graphs:
        if world > 1 or micro_batches > 1:
            raise TrainError(f"--compile-mode {cfg.compile_mode} (CUDA graphs) runs in one process with one "
                             f"micro-batch a step; this run has {world} process(es) and {micro_batches} "
                             "micro-batches: use --grad-accum 1 and no torchrun, or another --compile-mode")
        return "compiled"
    if cfg.step_graphs and device.type == "cuda" and not sharded and not cfg.compile and not starts_dense:
        return "step"
    return ""


class StepGraphs:
    """Forward, backward and clip of one optimizer step, replayed from a CUDA graph per route
    signature where one is captured, else run eagerly (the warm-up steps of a signature, and
    every step after a capture failed).

    ``micro_step(x, y)`` runs one micro-batch's forward and backward and returns its loss
    (already divided by the number of micro-batches); ``clip()`` clips the gradients and returns
    their norm; ``reduce``: the gradients' average over the processes, run after the local passes
    (under DDP; the model must not be wrapped in DDP). Calling the object runs a step and returns
    (summed loss, gradient norm), tensors a later replay may overwrite. :attr:`replayed`,
    :attr:`eager` and :attr:`failure` say how the steps ran (:meth:`report`).
    """

    def __init__(self, model: torch.nn.Module, micro_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 clip: Callable[[], torch.Tensor], warmup: int = WARMUP_STEPS,
                 reduce: GradAllReduce | None = None) -> None:
        self.micro_step, self.clip, self.warmup, self.reduce = micro_step, clip, warmup, reduce
        self.layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.seen: dict[tuple, int] = {}
        self.pool = None
        self.failure: str | None = None  # why a capture failed; the steps stay eager from then on
        self.replayed = self.eager = 0

    @property
    def disabled(self) -> bool:
        """Whether a capture failed, so that every step from then on runs eagerly."""
        return self.failure is not None

    def signature(self) -> tuple:
        """What each sparse layer's forward runs: its dense phase and FP8 phase."""
        return tuple((layer.is_dense_phase, layer.is_fp8_phase) for layer in self.layers)

    def report(self) -> dict[str, Any]:
        """How the steps ran, for the run's summary: replayed or eager, graphs captured, and why a
        capture failed (None: none did)."""
        return {"replayed_steps": self.replayed, "eager_steps": self.eager, "graphs": len(self.graphs),
                "capture_failure": self.failure}

    def release(self) -> None:
        """Nothing: the gradients stay allocated, at the addresses the graphs keep."""

    def zero_grad(self) -> None:
        """Zero the gradients in place (graphs hold their addresses), allocating any missing."""
        if self.reduce is not None:
            self.reduce.zero_grad()
            return
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)

    def __call__(self, batches: Batches) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's passes, gradient average and clip: (summed loss, gradient norm)."""
        entry = self._graph(batches)
        if entry is None:
            self.eager += 1
            self.zero_grad()
            loss = sum(self.micro_step(x, y) for x, y in batches)
            if self.reduce is not None:
                self.reduce()
            return loss, self.clip()
        graph, inputs, (loss, norm) = entry
        for (sx, sy), (x, y) in zip(inputs, batches):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        graph.replay()
        self.replayed += 1
        if self.reduce is None:
            return loss, norm
        self.reduce()  # the gradients averaged over the processes, then clipped (eager: a few launches)
        return loss, self.clip()

    def _graph(self, batches: Batches) -> tuple | None:
        """The graph to replay for this step, captured now if its signature's warm-up is over;
        None for an eager step."""
        if self.disabled:
            return None
        sig = self.signature() + (tuple((tuple(x.shape), tuple(y.shape)) for x, y in batches),)
        entry = self.graphs.get(sig)
        if entry is None:
            self.seen[sig] = self.seen.get(sig, 0) + 1
            if self.seen[sig] > self.warmup:
                entry = self._capture(sig, batches)
        return entry

    def _capture(self, sig: tuple, batches: Batches) -> tuple | None:
        inputs = [(x.clone(), y.clone()) for x, y in batches]
        self.zero_grad()  # every gradient exists before capture, at an address the graph keeps
        grads = [p.grad for p in self.params]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        stream, device = torch.cuda.current_stream(), grads[0].device
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        failure = None  # why the capture failed, in words (no exception kept: its frames would hold the graph)
        try:  # thread_local: CUDA calls of other threads (NCCL's watchdog, a loader's) can't void it
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                torch._foreach_zero_(grads)
                loss = torch.zeros((), device=device)
                for x, y in inputs:
                    loss += self.micro_step(x, y).detach()
                norm = self.clip() if self.reduce is None else None  # under DDP: clipped after the average
        except Exception as e:  # noqa: BLE001 - any capture failure: the step stays eager from now on
            torch.cuda.set_stream(stream)  # a capture that fails to end leaves its side stream current
            # what failed inside comes second, where ending the voided capture raised over it
            failure = one_line(e) + (f" (after {one_line(e.__context__)})" if e.__context__ is not None else "")
            timing.end_failed_capture(device, pool)
        if self.reduce is not None and not everywhere(failure is None, self.reduce.world, self.reduce.group):
            failure = failure or "another process could not capture its step"  # all go eager together
        if failure is not None:
            self.failure = failure
            log.warning("twofour: the training step could not be captured as a CUDA graph (%s); it runs eagerly "
                        "from now on", failure)
            torch.cuda.synchronize()
            return None
        self.pool = graph.pool()
        self.graphs[sig] = (graph, inputs, (loss, norm))
        return self.graphs[sig]


class GradAllReduce:
    """The gradients' average over the processes of a run whose model is not wrapped in DDP (the
    captured step), as one collective: the gradients are views of one flat buffer per dtype,
    which :meth:`__call__` all-reduces. It runs after the backward instead of overlapping it,
    and costs no Python per bucket. :meth:`broadcast` makes the replicas start equal (DDP's
    constructor does this for a wrapped model)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], world: int, group=None) -> None:
        self.params, self.world, self.group = list(params), world, group
        self.avg = dist.get_backend(group) == "nccl"  # NCCL averages in the collective: no pass after it
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        for dtype in {p.dtype for p in self.params}:
            ps = [p for p in self.params if p.dtype == dtype]
            self.flat[dtype] = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
        offsets = dict.fromkeys(self.flat, 0)
        self.views = []  # each parameter's gradient: its slice of the flat buffer, made once
        for p in self.params:
            off = offsets[p.dtype]
            self.views.append(self.flat[p.dtype][off:off + p.numel()].view_as(p))
            offsets[p.dtype] = off + p.numel()

    @staticmethod
    def broadcast(module: torch.nn.Module, group=None) -> None:
        """Rank 0's parameters and buffers on every rank."""
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)

    def zero_grad(self) -> None:
        """Zero the flat buffers, making each parameter's gradient its view into them again."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view
        torch._foreach_zero_(list(self.flat.values()))

    def __call__(self) -> None:
        for flat in self.flat.values():
            dist.all_reduce(flat, op=dist.ReduceOp.AVG if self.avg else dist.ReduceOp.SUM, group=self.group)
            if not self.avg:
                flat.div_(self.world)
