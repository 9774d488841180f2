"""Process-wide switches of the GPU fast path, read from the environment once at import.

``TWOFOUR_FAST=0`` turns the fast path off (plain torch everywhere); ``TWOFOUR_GEMM=dense`` or
``=sparse`` forces one side for every GEMM instead of the measured choice (``auto``). Change
them at run time with :func:`set_fast` and :func:`set_gemm` (or the :func:`override` context);
the hot path reads these module attributes, never the environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["fast", "gemm", "set_fast", "set_gemm", "override", "GEMM_MODES"]

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
