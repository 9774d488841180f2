"""The fast path's process-wide state, in one place: the switches, the measured choices and the
routes that failed.

Switches, read from the environment once at import: ``TWOFOUR_FAST=0`` turns the fast path off
(plain torch everywhere); ``TWOFOUR_GEMM=dense`` or ``=sparse`` forces one side for every GEMM
instead of the measured choice (``auto``). Change them at run time with :func:`set_fast` and
:func:`set_gemm` (or the :func:`override` context); the hot path reads these module attributes,
never the environment.

Measured choices: where an operation has several routes (dense or 2:4 GEMMs, Triton or compiled
quantization, cuSPARSELt's algorithm configurations), :func:`choose` times each once per shape
and keeps the fastest; :func:`choices` lists them, :func:`set_choice` pins one.

Failed routes: a route that raises (a kernel that does not compile, a GEMM a library refuses) is
recorded with :func:`record_failure`, logged once as a warning on the ``twofour`` logger, and
skipped from then on (:func:`failed`); :func:`failures` lists them.

What stays with its module is memoization, not policy: compiled functions (``fp8/quantize.py``),
Triton launch configurations and cuSPARSELt plans (``kernels/``). This module imports only torch,
the standard library and :mod:`twofour.timing` (its timers), so that every part of the package,
the kernels included, may read it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator

import torch

from . import timing
from .timing import _one_line

__all__ = ["fast", "gemm", "set_fast", "set_gemm", "override", "GEMM_MODES",
           "choice_key", "can_measure",
           "choose", "measure", "recorded", "choices", "choice_lines", "set_choice", "clear_choices",
           "on_choice_change", "failed", "record_failure", "working", "failures", "clear_failures"]

log = logging.getLogger("twofour")

GEMM_MODES = ("auto", "dense", "sparse")


def _gemm_from_env() -> str:
    value = os.environ.get("TWOFOUR_GEMM", "auto").strip().lower() or "auto"
    if value not in GEMM_MODES:
        raise ValueError(f"TWOFOUR_GEMM={value!r}: expected one of {', '.join(GEMM_MODES)}")
    return value


#: Whether the fast path may run (TWOFOUR_FAST, default on).
fast: bool = os.environ.get("TWOFOUR_FAST", "1").strip() != "0"
#: ``auto`` (measure dense and 2:4 once per GEMM and keep the faster), ``dense`` or ``sparse``.
gemm: str = _gemm_from_env()


def set_fast(enabled: bool) -> None:
    """Turn the GPU fast path on or off for this process."""
    global fast
    fast = bool(enabled)


def set_gemm(mode: str) -> None:
    """Force every GEMM to ``dense`` or ``sparse``, or let the dispatch measure (``auto``)."""
    global gemm
    if mode not in GEMM_MODES:
        raise ValueError(f"set_gemm: expected one of {', '.join(GEMM_MODES)}, got {mode!r}")
    gemm = mode


@contextlib.contextmanager
def override(*, fast: bool | None = None, gemm: str | None = None) -> Iterator[None]:
    """Set the switches inside a ``with`` block and restore them after (tests, benchmarks)."""
    old = (globals()["fast"], globals()["gemm"])
    try:
        if fast is not None:
            set_fast(fast)
        if gemm is not None:
            set_gemm(gemm)
        yield
    finally:
        set_fast(old[0])
        set_gemm(old[1])


# --------------------------------------------------------------------------------------------
# measured choices: one route per operation, shape and operand order, timed once
# --------------------------------------------------------------------------------------------

_choices: dict[str, dict] = {}
_on_change: list[Callable[[], None]] = []


def choice_key(kind: str, m: int, k: int, n: int, b_order: str, dtype: torch.dtype,
               candidates=("dense", "sparse")) -> str:
    """The name of one choice: operation, shape, operand order, dtype and set of candidates (a
    dense-only dX of one recipe must not answer for another recipe's sparse W^T)."""
    return f"{kind}:{m}x{k}x{n}:B{b_order}:{str(dtype).split('.')[-1]}:{'|'.join(sorted(candidates))}"


def can_measure() -> bool:
    """Whether timing may run now: not while torch.compile traces (dynamo or AOTAutograd's fake
    tensors) nor while a CUDA graph is being captured."""
    from torch._guards import detect_fake_mode  # noqa: PLC0415

    tracing = torch.compiler.is_compiling() or detect_fake_mode() is not None
    return not (tracing or torch.cuda.is_current_stream_capturing())


def choose(kind: str, m: int, k: int, n: int, b_order: str, dtype: torch.dtype,
           candidates: dict[str, Callable[[], object]], timer: Callable[[Callable[[], object]], float] | None = None,
           *, graphed: bool = False) -> str:
    """The candidate to run for this operation and shape: an override, a recorded measurement,
    or measure now (:func:`measure`).

    :data:`gemm` (``TWOFOUR_GEMM``) ``dense`` or ``sparse`` forces a side for every GEMM;
    :func:`set_choice` forces one. Where nothing may be measured (:func:`can_measure`) the
    recorded choice is used, else the first sparse candidate. ``timer`` times a candidate in ms
    (default :func:`twofour.timing.median_ms`); ``graphed`` times it as a caller that replays CUDA
    graphs runs it (:func:`twofour.timing.graph_median_ms`), for the kernels, which import no timer.
    """
    if len(candidates) == 1:
        return next(iter(candidates))
    if gemm != "auto":
        return next((c for c in candidates if c.startswith(gemm)), next(iter(candidates)))
    key = choice_key(kind, m, k, n, b_order, dtype, candidates)
    hit = _choices.get(key)
    if hit is not None and hit["choice"] in candidates:
        return hit["choice"]
    if not can_measure():
        return next((c for c in candidates if c.startswith("sparse")), next(iter(candidates)))
    return measure(key, candidates, timing.graph_median_ms if graphed and timer is None else timer)


def measure(key: str, candidates: dict[str, Callable[[], object]],
            timer: Callable[[Callable[[], object]], float] | None = None) -> str:
    """Time every candidate (``timer``, default :func:`twofour.timing.median_ms`), record the times and the
    fastest under ``key``, and return its name."""
    timer = timer or timing.median_ms  # looked up now, not when this function was defined
    times = {name: timer(fn) for name, fn in candidates.items()}
    best = min(times, key=times.get)
    _choices[key] = {"choice": best, "ms": {k2: round(v, 4) for k2, v in times.items()}}
    return best


def recorded(key: str) -> str | None:
    """The choice recorded (measured or set) under ``key``, or None."""
    hit = _choices.get(key)
    return None if hit is None else hit["choice"]


def choices() -> dict[str, dict]:
    """What was measured and chosen so far: {key: {"choice", "ms": {candidate: time}}}."""
    return json.loads(json.dumps(_choices))


def choice_lines(prefix: str = "") -> list[str]:
    """:func:`choices` as one line per key, ``key: chosen  {candidate: ms}``, keys starting with
    ``prefix``; a choice among cuSPARSELt's configurations lists the chosen and the default (the
    first measured) and how many were timed."""
    lines = []
    for key, value in sorted(_choices.items()):
        if not key.startswith(prefix):
            continue
        ms, note = value["ms"], ""
        if key.endswith(":configs") and len(ms) > 2:
            default = next(iter(ms))
            note = f" of {len(ms)} configurations"
            ms = {value["choice"]: ms.get(value["choice"]), f"{default} (default)": ms[default]}
        lines.append(f"{key}: {value['choice']}  {ms}{note}")
    return lines


def set_choice(key: str, choice: str) -> None:
    """Force ``choice`` (e.g. ``"dense"``, ``"sparse_dr"``, ``"sparse#3"``) for the key ``key``
    from :func:`choices`."""
    _choices[key] = {"choice": choice, "ms": _choices.get(key, {}).get("ms", {})}
    _changed()


def clear_choices() -> None:
    """Forget every measurement (the next call of each operation measures again)."""
    _choices.clear()
    _changed()


def on_choice_change(fn: Callable[[], None]) -> None:
    """Call ``fn`` after every :func:`set_choice` and :func:`clear_choices`: for a module that
    keeps what it looked up in the choices (the kernels' tuned cuSPARSELt plans)."""
    _on_change.append(fn)


def _changed() -> None:
    for fn in _on_change:
        fn()


# --------------------------------------------------------------------------------------------
# failed routes: recorded once, logged once, skipped from then on
# --------------------------------------------------------------------------------------------

_failures: dict[tuple, str] = {}
_probed: set[tuple] = set()


def failed(route: tuple) -> bool:
    """Whether the route ``route`` (a tuple: its name first, then where it ran) failed before."""
    return route in _failures


def record_failure(route: tuple, what: str, exc: BaseException, instead: str | None = None,
                   level: int = logging.WARNING) -> None:
    """Remember that ``route`` raised ``exc`` and log one line the first time (at ``level``: a
    warning, or INFO for an optional extra that is not installed): ``what`` (the operation, in
    words), the route, the exception's type and the first line of its message, and what runs
    ``instead`` where the caller has a fallback."""
    if route in _failures:
        return
    _failures[route] = _one_line(exc)
    log.log(level, "%s failed for %s (%s); it is not used from now on%s", what, route, _failures[route],
            f": {instead} runs instead" if instead else "")


def working(kind: str, routes: dict[str, Callable[[], object]], where: tuple,
            what: str) -> dict[str, Callable[[], object]]:
    """``routes`` less those that failed at ``where``. The first time at ``where`` (outside a
    CUDA-graph capture) each route runs once, and one that raises is recorded (route key
    ``(kind, name, *where)``, ``what`` naming it in the warning), so that a measurement that
    follows times only routes that run. RuntimeError if every route failed."""
    probe = (kind, *where)
    if probe not in _probed and not torch.cuda.is_current_stream_capturing():
        _probed.add(probe)
        for name, fn in routes.items():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - any build or launch failure drops the route here
                record_failure((kind, name, *where), f"{what} {name!r}", e)
    left = {name: fn for name, fn in routes.items() if (kind, name, *where) not in _failures}
    if not left:
        raise RuntimeError(f"every route of {what} failed at {where}: "
                           + "; ".join(f"{name}: {_failures[(kind, name, *where)]}" for name in routes))
    return left


def failures() -> dict[tuple, str]:
    """The routes that failed so far: {route: "ExceptionType: first line of its message"}."""
    return dict(_failures)


def clear_failures() -> None:
    """Forget every failure (each route is tried again at its next call)."""
    _failures.clear()
    _probed.clear()
