"""A run's set-up, built once before the loop: data, run folder, model and its parallel form,
optimizer, schedule, the resumed state, and the step that runs forward, backward and clip
(replayed from CUDA graphs where it can be). The loop (:mod:`twofour.training.loop`) reads it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import dispatch
from ..errors import warn
from ..kernels import ops
from ..models.presets import build_model as _build_model
from ..sparse.compiled import plan_compiled
from ..sparse.convert import attach, sparse_layers
from ..sparse.optim import STEPAdamW
from ..sparse.recipes import Recipe
from .checkpoint import load_checkpoint
from .checkpointer import Checkpointer
from .config import TrainConfig, lr_at
from .data import TokenData, load_data
from .graphs import Batches, GradAllReduce, StepGraphs
from .memory import check_memory
from .parallel import Parallel, checkpoint_blocks, grad_norm, shard
from .plan import Plan, plan_run
from .runs import check_resumable, prepare_run_dir

__all__ = ["Run", "EagerStep", "setup", "build_model", "slow_path_warning"]


def build_model(cfg: TrainConfig, recipe: Recipe, vocab_size: int) -> torch.nn.Module:
    """``cfg``'s preset model with ``recipe`` applied (:func:`twofour.models.build_model`)."""
    return _build_model(cfg.model, recipe, vocab_size=vocab_size, block_size=cfg.seq_len,
                        sparse_attention=cfg.sparse_attention, n_layer=cfg.n_layer)


def slow_path_warning(device: torch.device, recipe: Recipe) -> str | None:
    """What to tell a user whose sparse run on a GPU can't take the fast path (cuSPARSELt
    bindings or Triton missing) and so runs the reference math, slower than dense; else None.
    Nothing when the fast path was turned off on purpose (``TWOFOUR_FAST=0``)."""
    if device.type != "cuda" or not recipe.sparse or not dispatch.fast or ops.fast_available():
        return None
    return ("twofour: the 2:4 fast path is unavailable here (it needs an sm80+ GPU, Triton and nvmath-python's "
            "cuSPARSELt bindings: pip install 'twofour[gpu]'), so the sparse layers run the plain-torch "
            "reference math, slower than dense")


class EagerStep:
    """Forward, backward and clip of one optimizer step, run eagerly: each micro-batch through
    ``micro_step(x, y, last)`` (DDP reduces on the last), then ``clip()``. The gradients are set
    to None after the optimizer's step (:meth:`release`), as ``optimizer.zero_grad`` does."""

    def __init__(self, micro_step: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
                 clip: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> None:
        self.micro_step, self.clip, self.opt = micro_step, clip, opt

    def __call__(self, batches: Batches) -> tuple[torch.Tensor, torch.Tensor]:
        loss = sum(self.micro_step(x, y, i == len(batches) - 1) for i, (x, y) in enumerate(batches))
        return loss, self.clip()

    def release(self) -> None:
        """Drop the gradients once the optimizer has used them."""
        self.opt.zero_grad(set_to_none=True)

    def report(self) -> dict[str, Any]:
        """How the steps ran, for the summary: no graphs."""
        return {"replayed_steps": 0}


@dataclass
class Run:
    """Everything the loop needs, built once by :func:`setup`."""

    cfg: TrainConfig
    par: Parallel
    plan: Plan  # the run's decisions (recipe, device, micro-batches, precision, graphs, optimizer)
    data: TokenData
    out: Path
    raw: torch.nn.Module  # the unwrapped model: state dicts, recipe state, flip rates
    fwd: Callable  # the model as the forward calls it (DDP-wrapped, compiled)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data_gen: torch.Generator
    step: EagerStep | StepGraphs  # forward, backward and clip of one optimizer step
    autocast: contextlib.AbstractContextManager
    start: int  # the first step to run (after a resume: the checkpoint's)
    resumed: bool
    resumed_elapsed: float  # the run's wall time before this process: it goes on across a resume
    checkpointer: Checkpointer  # where and how the run is saved (whole or sharded)

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def recipe(self) -> Recipe:
        return self.plan.recipe

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step in this process."""
        return self.plan.accum

    @property
    def stop(self) -> int:
        """The step this process stops after (``--stop-at``, else the schedule's end)."""
        return self.cfg.stop_at or self.cfg.steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all processes."""
        return self.cfg.batch_size * self.cfg.seq_len * self.accum * self.par.world

    @property
    def header(self) -> str:
        """Where and how the run computes, for its first line: the device (the GPU's name), the
        precision of the matmuls, and the processes under torchrun."""
        where = str(self.device)
        if self.device.type == "cuda":
            where += f" ({torch.cuda.get_device_name(self.device)})"
        how = self.plan.precision
        if self.cfg.precision != "bf16":
            layers = "FFN and attention" if self.cfg.sparse_attention else "FFN"
            how += f", {self.cfg.precision} GEMMs in the {layers} linears"
        if self.par.world > 1:
            how += f", {self.par.world} processes ({'FSDP2' if self.par.sharded else 'DDP'})"
        if self.resumed and self.cfg.reschedule:
            how += f"; --reschedule: the learning-rate schedule now spans {self.cfg.steps} steps"
        return f"on {where}, {how}"

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's training micro-batches on the device."""
        cfg = self.cfg
        return [self.data.batch("train", cfg.batch_size, cfg.seq_len, self.data_gen, self.device)
                for _ in range(self.accum)]

    def end_step(self) -> None:
        """The schedule's step, and the gradients released where the step does not keep them."""
        self.sched.step()
        self.step.release()


def setup(cfg: TrainConfig, data: TokenData | None, par: Parallel) -> Run:
    """Build the run ``cfg`` describes in this process (its folder prepared by rank 0, its
    checkpoint loaded with ``--resume``)."""
    plan = plan_run(cfg, par)
    recipe, device = plan.recipe, plan.device
    slow = slow_path_warning(device, recipe)
    if slow and par.main:
        warn(slow)
    if data is None:
        data = load_data(cfg.data, cfg.vocab_size)
    data.check(cfg.seq_len)
    check_memory(cfg, data.vocab_size, device, par.world if par.sharded else 1)  # before the run folder is touched
    out = prepare_run_dir(cfg) if par.main else Path(cfg.out_dir)
    par.barrier()
    ckpt = load_checkpoint(out, cfg) if cfg.resume else None  # ckpt.pt, or the sharded ckpt/'s meta.pt
    if ckpt is not None:
        check_resumable(ckpt, cfg, out)

    torch.manual_seed(cfg.seed)
    # an FSDP2 run's model is built on its GPU (a large model's init on the CPU takes minutes)
    with torch.device(device) if par.sharded else contextlib.nullcontext():
        raw = build_model(cfg, recipe, data.vocab_size).to(device)
    if cfg.activation_checkpointing:
        checkpoint_blocks(raw)
    if par.sharded:
        shard(raw, par.fsdp)
    opt = _optimizer(cfg, raw, plan)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(cfg, s) / cfg.peak_lr)
    data_gen = torch.Generator().manual_seed(cfg.seed + 7919 * par.rank)
    saver = Checkpointer(out, cfg, raw, opt, sched, data_gen, par.rank, par.world, par.sharded)
    start = 0 if ckpt is None else saver.resume(ckpt)
    attach(raw, opt)  # masks, refreshes and phases advance once per optimizer step
    autocast = plan.autocast_context()
    if plan.plan_layers:  # each layer shape compiled as the 2:4 op or dense GEMMs
        for key, choice in par.from_main(plan_compiled(raw, cfg.batch_size * cfg.seq_len)).items():
            dispatch.set_choice(key, choice)  # rank 0's measurement on every rank: the same code everywhere
    graphed = plan.graphs == "step"
    model = raw
    if par.ddp and not graphed:  # the recipes' buffers follow from the weights, equal on every rank
        ids = [par.local_rank] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(raw, device_ids=ids, broadcast_buffers=False)
    fwd = torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
    step = _step(cfg, plan, par, raw, model, fwd, opt, autocast)
    if par.main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    return Run(cfg, par, plan, data, out, raw, fwd, opt, sched, data_gen, step, autocast, start,
               ckpt is not None, ckpt.get("elapsed_s", 0.0) if ckpt is not None else 0.0, saver)


def _optimizer(cfg: TrainConfig, raw: torch.nn.Module, plan: Plan) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only (fused on a GPU), or STEP's AdamW, which decides
    when the masks switch on, as the plan says."""
    decay = [p for p in raw.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if plan.optimizer == "step-adamw":
        return STEPAdamW(groups, total_steps=cfg.steps, lr=cfg.peak_lr, betas=cfg.betas)
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=cfg.betas, fused=plan.device.type == "cuda")


def _step(cfg: TrainConfig, plan: Plan, par: Parallel, raw: torch.nn.Module, model: torch.nn.Module, fwd: Callable,
          opt: torch.optim.Optimizer, autocast) -> EagerStep | StepGraphs:
    """The step object: CUDA graphs where the plan says ``step`` (under DDP with the model
    unwrapped and the gradients averaged after the passes), else eager (DDP reducing on the last
    micro-batch)."""
    accum = plan.accum
    ddp_wrapped = model is not raw

    def micro_step(x: torch.Tensor, y: torch.Tensor, last: bool = True) -> torch.Tensor:
        """One micro-batch's forward and backward; a DDP-wrapped model reduces on the last one only."""
        if cfg.cuda_graphs:  # a new step for the CUDA graphs: the previous call's outputs are consumed
            torch.compiler.cudagraph_mark_step_begin()
        with (model.no_sync() if ddp_wrapped and not last else contextlib.nullcontext()), autocast:
            loss = fwd(x, y)[1] / accum
        loss.backward()
        return loss.detach()

    def clip() -> torch.Tensor:  # the gradients clipped, their norm returned
        return grad_norm(raw, cfg.grad_clip)

    if plan.graphs != "step":
        return EagerStep(micro_step, clip, opt)
    reduce = None
    if par.ddp:
        GradAllReduce.broadcast(raw)  # the replicas start equal, as DDP's constructor makes them
        reduce = GradAllReduce([p for p in raw.parameters() if p.requires_grad], par.world)
    return StepGraphs(raw, micro_step, clip, reduce=reduce)


def flip_counters(raw: torch.nn.Module) -> list:
    """The sparse layers whose masks move (each keeps a flip count, a buffer updated in place)."""
    return [layer for _, layer in sparse_layers(raw) if layer.recipe.sparse]
