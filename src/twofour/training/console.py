"""What a training run shows on the terminal, and how it answers Ctrl-C.

:class:`Progress` is a tqdm bar on a terminal and plain log lines (nanoGPT's style) anywhere
else; :class:`StopRequest` turns the first SIGINT/SIGTERM into "finish this step, write a
checkpoint, stop" (:class:`Interrupted`), so an interrupted run always resumes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

__all__ = ["Progress", "StopRequest", "Interrupted", "format_row"]


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after writing a checkpoint of step ``step`` to ``checkpoint``
    (None: the run writes no checkpoints, ``ckpt_interval=0``)."""

    def __init__(self, step: int, checkpoint: Path | None):
        super().__init__(f"interrupted after step {step}; "
                         + (f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (ckpt_interval=0)"))
        self.step, self.checkpoint = step, checkpoint


def format_row(row: dict[str, Any], total: int) -> str:
    """One log line: ``step 100/300 | loss 2.3456 | val 2.4012 | lr 6.00e-04 | 51,234 tok/s | flip 1.2e-03``
    (``loss n/a`` when every step since the last line was skipped)."""
    parts = [f"step {row['step']}/{total}", f"loss {_loss(row['train_loss'])}"]
    if row.get("val_loss") is not None:
        parts.append(f"val {row['val_loss']:.4f}")
    parts += [f"lr {row['lr']:.2e}", f"{row['tokens_per_s']:,.0f} tok/s", f"flip {row['flip_rate']:.1e}"]
    return " | ".join(parts)


def _loss(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


class Progress:
    """A progress bar (on ``stream``, stderr by default) when it and stdout are terminals and
    ``bar`` is on; otherwise (output to a file or a pipe, or ``--no-progress``) one plain line per
    logged step on stdout. Silent unless ``active`` (ranks other than 0)."""

    def __init__(self, active: bool, bar: bool, desc: str, start: int, total: int, stream: TextIO | None = None,
                 header: str = ""):
        stream = stream or sys.stderr
        self.active, self.total = active, total
        self.bar = None
        line = f"{desc}: steps {start + 1}-{total}" + (f", {header}" if header else "")
        if active and bar and stream.isatty() and sys.stdout.isatty():  # plain lines go to stdout
            print(line, file=stream, flush=True)
            self.bar = tqdm(total=total, initial=start, desc=desc, file=stream, dynamic_ncols=True)
        elif active:
            print(line, flush=True)

    def update(self) -> None:
        """One optimizer step done (host work only: no GPU sync)."""
        if self.bar is not None:
            self.bar.update(1)

    def log(self, row: dict[str, Any]) -> None:
        """A logged step: the bar's postfix (and a line for each evaluation), or a plain line."""
        if not self.active:
            return
        if self.bar is None:
            print(format_row(row, self.total), flush=True)
            return
        self.bar.set_postfix(loss=_loss(row["train_loss"], 3), tok_s=f"{row['tokens_per_s']:,.0f}",
                             flip=f"{row['flip_rate']:.1e}", refresh=False)
        if row.get("val_loss") is not None:
            self.bar.write(format_row(row, self.total))

    def close(self) -> None:
        """End the bar (a no-op for plain lines); safe to call twice."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StopRequest:
    """While active (a ``with`` block in the main thread), the first SIGINT or SIGTERM only sets a
    flag: the loop finishes its step, writes a checkpoint and raises :class:`Interrupted`. A second
    signal raises KeyboardInterrupt at once (checkpoints are atomic, so the last one stays intact).
    Under torchrun only, one within ``GRACE_S`` of the first is taken for the same Ctrl-C: torchrun
    passes a terminal's Ctrl-C on to workers that got it already, and that echo must not cancel
    the checkpoint."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    GRACE_S = 1.0

    def __init__(self, verbose: bool = True):
        self.verbose = verbose
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun for each worker
        self.grace_s = self.GRACE_S if under_torchrun else 0.0
        self.requested = False
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            if time.monotonic() - self._first < self.grace_s:
                return
            raise KeyboardInterrupt
        self.requested, self._first = True, time.monotonic()
        if self.verbose:
            print(f"\n{signal.Signals(signum).name}: finishing this step, then a checkpoint and stop "
                  "(press Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def agreed(self, boundary: bool, world: int, device: torch.device) -> bool:
        """Whether to stop after this step. One process: as soon as asked. Under torchrun every
        rank must checkpoint at the same step, so the ranks agree at log boundaries (a
        ``boundary`` step, the same on every rank) by one all-reduce of their flags."""
        if world == 1:
            return self.requested
        if not boundary:
            return False
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def graphs_line(summary: dict[str, Any]) -> str:
    """The summary's line on how the steps ran, '' where no CUDA graphs were tried: how many
    steps were replayed from graphs, and why a capture failed."""
    report = summary.get("step_graphs")
    if not report or "eager_steps" not in report:
        return ""
    total = report["replayed_steps"] + report["eager_steps"]
    line = f"\n  CUDA graphs: {report['replayed_steps']} of {total} steps replayed"
    if report.get("capture_failure"):
        line += f" (the capture failed: {report['capture_failure']})"
    return line
