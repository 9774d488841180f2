"""Whether a training step fits in memory, checked before the run folder is touched: a batch far
too large is refused with one line naming ``--batch-size`` instead of being killed by the kernel
(the CPU overcommits memory, so a step that can't fit is often not refused by the allocator).

The estimate is a lower bound, so it never refuses a run that fits: 16 bytes a weight (float32
weights and gradients, AdamW's two moments; an FSDP2 run's share of them), the float32 logits of
one micro-batch (``batch x seq x vocab``), and at least four ``width``-wide values a token per
block (one with activation checkpointing). It is compared with what the device has free: the
CPU's available memory and free swap (psutil, else ``/proc/meminfo``), a GPU's ``torch.cuda.mem_get_info``
plus what this process's allocator holds unused. Where that can't be read nothing is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import TrainError, size_text
from ..models.presets import PRESETS
from .config import TrainConfig

__all__ = ["StepMemory", "step_memory", "available_bytes", "check_memory"]

#: bytes a weight holds during training at the least: float32 weight and gradient, AdamW's two moments
STATE_BYTES = 16
#: ``width``-wide values a token keeps per block for the backward, at the least (a block's FFN
#: hidden activation alone is four or more), and with activation checkpointing (the block's input)
KEPT_PER_BLOCK, KEPT_CHECKPOINTED = 4, 1


@dataclass(frozen=True)
class StepMemory:
    """A lower bound of one training step's memory, in bytes, by part."""

    state: int  # weights, gradients, optimizer moments
    per_sequence: int  # activations and logits of one sequence of the micro-batch
    batch_size: int

    @property
    def total(self) -> int:
        return self.state + self.per_sequence * self.batch_size


def step_memory(cfg: TrainConfig, vocab_size: int, device: torch.device, shards: int = 1) -> StepMemory:
    """The least memory one step of ``cfg``'s run takes on one process, its weights' state split
    over ``shards`` processes (FSDP2; 1 otherwise); the model counted on the meta device: nothing
    is allocated."""
    shape = {"n_layer": cfg.n_layer} if cfg.n_layer is not None else {}
    with torch.device("meta"):
        model = PRESETS[cfg.model].build(block_size=cfg.seq_len, vocab_size=vocab_size, **shape)
    weights = sum(p.numel() for p in model.parameters())
    state = STATE_BYTES * weights // shards
    half = device.type == "cuda" and cfg.bf16
    kept = KEPT_CHECKPOINTED if cfg.activation_checkpointing else KEPT_PER_BLOCK
    activations = cfg.seq_len * model.cfg.n_embd * model.cfg.n_layer * kept * (2 if half else 4)
    logits = cfg.seq_len * vocab_size * 4  # the loss reads them as float32
    return StepMemory(state, activations + logits, cfg.batch_size)


def available_bytes(device: torch.device) -> int | None:
    """Memory free for this process on ``device`` in bytes, or None where it can't be told."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
        except RuntimeError:
            return None
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        import psutil  # noqa: PLC0415

        return int(psutil.virtual_memory().available + psutil.swap_memory().free)
    except ImportError:
        pass
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return (int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0").split()[0])) * 1024
    except (OSError, ValueError, KeyError, IndexError):
        return None


def check_memory(cfg: TrainConfig, vocab_size: int, device: torch.device, shards: int = 1) -> None:
    """TrainError, one line suggesting what to make smaller, when one step of the run can't fit in
    the memory ``device`` has free; nothing when it may fit, or when that can't be told."""
    free = available_bytes(device)
    need = step_memory(cfg, vocab_size, device, shards)
    if free is None or need.total <= free:
        return
    where = "the CPU" if device.type == "cpu" else str(device)
    if need.state > free:
        raise TrainError(f"out of memory: the model's weights, gradients and AdamW state alone need "
                         f"{size_text(need.state)} but {where} has {size_text(free)} available: choose a smaller "
                         "--model (or vocabulary); a smaller --batch-size does not help")
    fits = (free - need.state) // need.per_sequence
    advice = (f"try a smaller --batch-size (at most {fits:,} sequences could fit; --grad-accum keeps the tokens "
              "per step)" if fits else
              "no sequence of this --seq-len fits: try a shorter --seq-len (or a smaller --batch-size and --model)")
    raise TrainError(f"out of memory: a step of --batch-size {cfg.batch_size} x --seq-len {cfg.seq_len} needs at "
                     f"least {size_text(need.total)} but {where} has {size_text(free)} available: {advice}")
