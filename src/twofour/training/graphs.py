"""The eager training step's forward and backward passes as CUDA graphs, so that the host's
per-layer work (Python, autograd, kernel launches) runs once at capture instead of every step.

At small batches a step's GPU work takes less time than the host needs to issue it, and the
2:4 layers issue more than dense ones (compression, MVUE, the GEMM dispatch), so the sparse
step waits on the host (``benchmarks/step/host_bound.py`` measures it). :class:`StepGraphs`
records the forward and backward passes of all the step's micro-batches and the gradient clip
as one CUDA graph (under DDP the clip runs after the replay, behind one all-reduce:
:class:`GradAllReduce`), and replays it with each step's batches copied into its static inputs. The
optimizer step, the masks' refresh (``twofour.attach``'s hook) and the schedule stay eager: they
are a few launches, and they keep the recipes' host-side state (step counts, phases) exact.

A graph replays exactly the kernels it recorded, so it is kept per *route signature*: each
sparse layer's phase (dense or 2:4, FP8 or not), which decides what its forward runs. When the
signature changes (a dense fine-tune begins, FP8 ends), the step runs eagerly for a few steps
(the new routes' GEMM choices are measured then, which a capture cannot do) and a new graph is
captured. Gradients are allocated once and never set to None; each graph zeroes them first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import dispatch
from ..errors import one_line
from ..sparse.layer import SparseLinear
from .parallel import everywhere

log = logging.getLogger("twofour")

__all__ = ["StepGraphs", "GradAllReduce", "WARMUP_STEPS"]

#: Eager steps with a route signature before its graph is captured: the dispatch measures each
#: GEMM's routes on its first call, and cuBLAS and Triton initialize on theirs.
WARMUP_STEPS = 3


class StepGraphs:
    """Forward, backward and clip of one optimizer step as a CUDA graph per route signature.

    ``micro_step(x, y, last)`` runs one micro-batch's forward and backward eagerly and returns
    its loss (already divided by the number of micro-batches; ``last``: the micro-batch on which
    DDP would reduce the gradients, never set under ``world`` > 1, where :class:`GradAllReduce`
    averages them after the replay); ``clip()`` clips the gradients and returns their norm. :meth:`step`
    runs both for a step's batches, replaying a graph where one is captured for the current
    signature, and returns the summed loss and the norm, or None where this step must run eagerly
    (the caller then runs it as it would without graphs, with :meth:`zero_grad` instead of
    ``optimizer.zero_grad``).
    ``warmup``: eager steps of a signature before its capture; ``world``: the DDP processes.
    """

    def __init__(self, model: torch.nn.Module, micro_step: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
                 clip: Callable[[], torch.Tensor], warmup: int = WARMUP_STEPS, world: int = 1) -> None:
        self.model = model
        self.micro_step, self.clip, self.warmup = micro_step, clip, warmup
        self.layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
        self.params = [p for p in model.parameters() if p.requires_grad]
        # under DDP (``world`` > 1) the gradients' average runs after each replay
        self.reduce = GradAllReduce(self.params, world) if world > 1 else None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.seen: dict[tuple, int] = {}
        self.pool = None
        self.disabled = False

    def signature(self) -> tuple:
        """What each sparse layer's forward runs: its dense phase and FP8 phase."""
        return tuple((layer.is_dense_phase, layer.is_fp8_phase) for layer in self.layers)

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

    def step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's forward and backward passes and clip, from a graph where possible: (loss,
        gradient norm), tensors the next replay overwrites; None for an eager step (see the class)."""
        if self.disabled:
            return None
        sig = self.signature() + (tuple((tuple(x.shape), tuple(y.shape)) for x, y in batches),)
        entry = self.graphs.get(sig)
        if entry is None:
            self.seen[sig] = self.seen.get(sig, 0) + 1
            if self.seen[sig] <= self.warmup:
                return None
            entry = self._capture(sig, batches)
            if entry is None:
                return None
        graph, inputs, outputs = entry
        for (sx, sy), (x, y) in zip(inputs, batches):
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
        graph.replay()
        if self.reduce is None:
            return outputs
        self.reduce()  # the gradients summed over the processes, then clipped (eager: a few launches)
        return outputs[0], self.clip()

    def _capture(self, sig: tuple, batches) -> tuple | None:
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
                for i, (x, y) in enumerate(inputs):  # with ``reduce``, no micro-batch reduces in the graph
                    loss += self.micro_step(x, y, self.reduce is None and i == len(inputs) - 1).detach()
                norm = self.clip() if self.reduce is None else None  # under DDP: clipped after the all-reduce
        except Exception as e:  # noqa: BLE001 - any capture failure: the step stays eager from now on
            torch.cuda.set_stream(stream)  # a capture that fails to end leaves its side stream current
            # what failed inside comes second, where ending the voided capture raised over it
            failure = one_line(e) + (f" (after {one_line(e.__context__)})" if e.__context__ is not None else "")
            dispatch.end_failed_capture(device, pool)
        if self.reduce is not None and not everywhere(failure is None, self.reduce.world, self.reduce.group):
            failure = failure or "another process could not capture its step"  # all go eager together
        if failure is not None:
            self.disabled = True
            log.warning("twofour: the training step could not be captured as a CUDA graph (%s); it runs eagerly "
                        "from now on", failure)
            torch.cuda.synchronize()
            self.zero_grad()
            return None
        self.pool = graph.pool()
        self.graphs[sig] = (graph, inputs, (loss, norm))
        return self.graphs[sig]


class GradAllReduce:
    """DDP's gradient average for a captured step, as one collective: the gradients are views
    of one flat buffer per dtype, which :meth:`__call__` all-reduces after the graph's replay.

    A step captured with DDP's own bucketed all-reduces inside measured slower than the eager
    DDP step (docs/notes/training-speed.md), so under DDP the graph holds the local forward and
    backward passes only (every micro-batch under ``no_sync``), and the average runs after it:
    one launch, no Python per bucket, at the price of not overlapping the backward."""

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

    def zero_grad(self) -> None:
        """Zero the flat buffers, making each parameter's gradient its view into them again
        (an eager DDP step may have set another tensor)."""
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view
        torch._foreach_zero_(list(self.flat.values()))

    def __call__(self) -> None:
        for flat in self.flat.values():
            dist.all_reduce(flat, op=dist.ReduceOp.AVG if self.avg else dist.ReduceOp.SUM, group=self.group)
            if not self.avg:
                flat.div_(self.world)
