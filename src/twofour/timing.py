"""The CUDA timers the package measures with, at its lowest level: the dispatch times its
candidates with them, the step graphs end a failed capture with :func:`end_failed_capture`, the
inference speed rows and the benchmarks replay captured graphs (:func:`graph_ms`).

Imports only torch and the standard library; the kernels import none of it (they ask
:func:`twofour.dispatch.choose` to time, ``graphed=True`` for calls that run inside CUDA graphs).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch

__all__ = ["LEAD_CYCLES", "median_ms", "graph_median_ms", "replay_ms", "end_failed_capture", "captured", "graph_ms"]

log = logging.getLogger("twofour")

#: A device-side wait before a timed window: longer than one call's launch
LEAD_CYCLES = 150_000  # about 80 us of device time at Hopper's clocks: longer than one call's launch


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (:func:`twofour.errors.one_line`, which this module, at the
    package's lowest level, does not import)."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def median_ms(fn: Callable[[], object], reps: int = 5, calls: int = 4) -> float:
    """Median over ``reps`` windows of the CUDA-event time per call of ``fn``, each window
    ``calls`` calls back to back behind a short device-side wait, after 2 warm-up calls: how the
    dispatch times its candidates.

    The wait keeps the device busy while the host launches the window's first call, and later
    calls launch while earlier ones run, as in a training loop whose GPU runs ahead of the host:
    a candidate's host time counts only where it is longer than its device time (timing each
    call alone from an idle device would add its whole launch cost, which under
    ``torch.compile`` and CUDA graphs the loop does not pay)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(LEAD_CYCLES)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def graph_median_ms(fn: Callable[[], object], reps: int = 5, calls: int = 4) -> float:
    """Median over ``reps`` replays of a CUDA graph of ``calls`` calls of ``fn``, per call: the
    device time alone, as a caller that replays graphs (decoding) runs it; a candidate whose
    host time exceeds its kernel's (a Triton launch at a few tokens) is not charged for it, as
    :func:`median_ms` would. A candidate that can't be captured scores infinity (it could not run
    inside the caller's graph either), and the device is left as it was (:func:`end_failed_capture`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph, pool, failure = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), None
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up on the capturing stream: what a library sets up per stream, set up now
            fn()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                fn()
        except Exception as e:  # noqa: BLE001 - the capture still has to end
            failure = e
        try:
            graph.capture_end()
        except Exception as e:  # noqa: BLE001 - a voided capture
            failure = failure or e
    torch.cuda.current_stream().wait_stream(side)
    if failure is not None:
        log.debug("twofour: a candidate could not be captured for timing: %s", _one_line(failure))
        del failure
        graph.reset()
        end_failed_capture(side.device, pool)
        return float("inf")
    return replay_ms(graph, reps, calls)


def end_failed_capture(device: torch.device, pool: tuple) -> None:
    """Undo what a capture that failed to end leaves behind in torch 2.11 (later versions clean up
    themselves, and then both steps change nothing).

    Its ``capture_end`` stops at the failed ``cudaStreamEndCapture``, before it ends the
    allocator's routing of the device's new blocks to the capture's pool, so that routing is
    ended here. And its generator keeps one capture flag, set when a capture begins and cleared
    only when one ends well, so every later random draw outside a graph (MVUE's seeds, dropout)
    would stop with "Offset increment outside graph capture encountered unexpectedly": a capture
    of one small kernel, which ends well, clears it again."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except (AttributeError, RuntimeError):  # already ended (the capture got that far, or a later torch)
        pass
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - what is left wrong then shows where it matters
        log.warning("twofour: could not reset the CUDA generator after a failed capture (%s)", _one_line(e))
    finally:
        graph.reset()


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int, calls: int = 1) -> float:
    """Median over ``reps`` replays of ``graph`` of its CUDA-event time, divided by the ``calls``
    it holds."""
    graph.replay()  # the first replay uploads the graph: not timed
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def captured(fn: Callable[[], object], inner: int = 1) -> torch.cuda.CUDAGraph:
    """``inner`` calls of ``fn`` captured back to back in a CUDA graph, after 2 calls on a side
    stream (where the dispatch measures and the kernels tune: nothing is measured while capturing)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return graph


def graph_ms(fn: Callable[[], object], reps: int, inner: int = 1) -> float:
    """Median ms of ``reps`` replays of ``fn`` captured in a CUDA graph (:func:`captured`; ``inner``
    calls back to back, the time divided by ``inner``)."""
    graph = captured(fn, inner)
    ms = replay_ms(graph, reps, inner)
    del graph
    return ms
