"""The CUTLASS sm90 2:4 GEMM route (Hopper, bf16): ``Y = X @ W^T`` with W (M, K) 2:4 in CUTLASS's
layout (:mod:`sm90.layout`) and X (N, K) row-major, Y (N, M) row-major; one
library built by :mod:`sm90.cutlass`, loaded with ctypes (no torch C++ ABI).

Without a compiler, CUTLASS headers or an sm90 GPU, :func:`available` is False and the reason is
recorded once (:func:`twofour.dispatch.record_failure`, one log line: INFO where nvcc or the
CUTLASS headers are not installed, else a warning); callers fall back.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from twofour import dispatch

from . import cutlass
from . import layout as sm90_layout
from .cutlass import CONFIGS, GemmConfig, ToolchainMissing, library_path

__all__ = ["available", "configs", "load", "gemm", "compress_cutlass", "workspace_bytes"]

_ROUTE = ("sm90-cutlass", "load")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
_sm_count: dict[int, int] = {}

_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


def _declare(lib: ctypes.CDLL) -> None:
    lib.twofour_sm90_sizes.argtypes = [_I, _I, ctypes.POINTER(_LL), ctypes.POINTER(_LL), ctypes.POINTER(_LL)]
    lib.twofour_sm90_layout_e.argtypes = [_I, _I, ctypes.POINTER(_LL)]
    lib.twofour_sm90_compress.argtypes = [_P, _P, _P, _I, _I, _I, _P, _P]
    lib.twofour_sm90_compress_workspace.argtypes = [_I, _I]
    lib.twofour_sm90_compress_workspace.restype = _LL


def load(path: str | None = None) -> ctypes.CDLL:
    """The library (found at first call, and built then only where
    :data:`sm90.cutlass.build_kernels` allows; ``path`` loads that file instead). Loading
    needs no GPU: the host-side layout probe runs anywhere."""
    global _lib
    with _lock:
        if _lib is None or path is not None:
            lib = ctypes.CDLL(str(path or library_path(cutlass.build_kernels)))
            _declare(lib)
            if path is not None:
                return lib
            _lib = lib
        return _lib


def configs(lib: ctypes.CDLL | None = None) -> list[GemmConfig]:
    """The shipped configurations the library holds."""
    lib = lib or load()
    return [c for c in CONFIGS if hasattr(lib, f"twofour_sm90_gemm_{c.name}")]


def available(device: torch.device | int | None = None) -> bool:
    """The route can run here: an sm90 GPU and a library that loads (built beforehand, or now where
    :data:`sm90.cutlass.build_kernels` allows). The first failure is logged once per process
    and remembered: later calls, at any shape, return False at once."""
    if dispatch.failed(_ROUTE) or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        load()
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, a failed build: the route is skipped
        # the extra not installed is a choice (logged at INFO), unless a build was asked for; a
        # build or load that broke, a warning
        level = logging.INFO if isinstance(e, ToolchainMissing) and not cutlass.build_kernels else logging.WARNING
        dispatch.record_failure(_ROUTE, "the CUTLASS sm90 2:4 GEMM", e, instead="cuSPARSELt", level=level)
        return False
    return True


def _use_device(dev: torch.device) -> None:
    """Make ``dev`` current for the library's own CUDA runtime (separate from torch's); a library
    built without that entry point runs on device 0 only."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    lib = load()
    if hasattr(lib, "twofour_sm90_set_device"):
        _check_status(lib.twofour_sm90_set_device(idx), "selecting the device")
    elif idx != 0:
        raise RuntimeError("this build of the sm90 library runs on device 0 only (rebuild it)")


def _sms(dev: torch.device) -> int:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def _workspace(dev: torch.device, nbytes: int) -> torch.Tensor:
    key = (dev.index or 0, torch.cuda.current_stream(dev).stream_id)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < nbytes:
        ws = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=dev)
        _workspaces[key] = ws
    return ws


_fns: dict[str, tuple] = {}


def _entry(config: GemmConfig) -> tuple:
    """(workspace query, launcher) of a configuration, declared once."""
    hit = _fns.get(config.name)
    if hit is None:
        lib = load()
        ws = getattr(lib, f"twofour_sm90_workspace_{config.name}")
        ws.argtypes, ws.restype = [_I, _I, _I, _I], _LL
        fn = getattr(lib, f"twofour_sm90_gemm_{config.name}")
        fn.argtypes, fn.restype = [_P, _P, _P, _P, _I, _I, _I, _I, _P, _P], _I
        hit = _fns[config.name] = (ws, fn)
    return hit


def workspace_bytes(config: GemmConfig, m: int, n: int, k: int, sm_count: int = 132) -> int:
    """Workspace the configuration needs at (M, N, K); -1 where it cannot run the shape."""
    return int(_entry(config)[0](m, n, k, sm_count))


def _check_status(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with status {rc} (>= 1000: a CUDA error + 1000; else a CUTLASS status + 1)")


def gemm(values: torch.Tensor, e: torch.Tensor, x: torch.Tensor, config: GemmConfig,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Y (N, M) = X (N, K) @ W^T, W given as ``values`` (M, K/2) and ``e`` (its metadata)."""
    m, half = values.shape
    n, k = x.shape
    if half * 2 != k or not sm90_layout.supported_shape(m, k) or x.dtype != torch.bfloat16 \
            or values.dtype != torch.bfloat16 or not x.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"sm90 2:4 GEMM: needs bf16 contiguous X (N, K) and values (M, K/2), K % 128 == 0 and "
                         f"M % 8 == 0; got values {tuple(values.shape)} {values.dtype}, X {tuple(x.shape)} {x.dtype}")
    ws_fn, fn = _entry(config)
    dev = x.device
    sms = _sms(dev)
    nbytes = ws_fn(m, n, k, sms)
    if nbytes < 0:
        raise ValueError(f"sm90 2:4 GEMM {config.name} cannot run M={m} N={n} K={k}")
    if out is None:
        out = torch.empty((n, m), dtype=torch.bfloat16, device=dev)
    ws = _workspace(dev, nbytes).data_ptr() if nbytes else None  # the persistent schedules need none
    _use_device(dev)
    rc = fn(values.data_ptr(), e.data_ptr(), x.data_ptr(), out.data_ptr(), m, n, k, sms, ws,
            torch.cuda.current_stream(dev).cuda_stream)
    _check_status(rc, f"sm90 2:4 GEMM {config.name}")
    return out


def compress_cutlass(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, E) of a 2:4 bf16 ``a`` (M, K) by CUTLASS's own compressor kernel: the reference
    for the layout twofour writes."""
    m, k = a.shape
    lib = load()
    rows, cols, eb = _LL(), _LL(), _LL()
    lib.twofour_sm90_sizes(m, k, ctypes.byref(rows), ctypes.byref(cols), ctypes.byref(eb))
    values = torch.zeros((rows.value, cols.value), dtype=a.dtype, device=a.device)
    e = torch.zeros(eb.value, dtype=torch.uint8, device=a.device)
    ws = torch.empty(max(1, lib.twofour_sm90_compress_workspace(m, k)), dtype=torch.uint8, device=a.device)
    a = a.contiguous()
    _use_device(a.device)
    rc = lib.twofour_sm90_compress(a.data_ptr(), values.data_ptr(), e.data_ptr(), m, k, _sms(a.device),
                                   ws.data_ptr(), torch.cuda.current_stream(a.device).cuda_stream)
    _check_status(rc, "CUTLASS's sm90 compressor")
    return values, e


def layout_e_offsets(m: int, k: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """(M, K/8) byte offsets in E of each row's pair of groups, from cute's own layout (host code)."""
    lib = lib or load()
    out = (ctypes.c_longlong * (m * (k // 8)))()
    rc = lib.twofour_sm90_layout_e(m, k, out)
    _check_status(rc, "the metadata layout probe")
    return torch.frombuffer(bytearray(out), dtype=torch.int64).reshape(m, k // 8)
