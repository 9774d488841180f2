"""Builds the CUTLASS sm90 2:4 GEMM library (``gemm_config.cu`` once per configuration plus
``common.cu``) into one shared library with plain ``extern "C"`` entry points (raw device
pointers, sizes, a stream; cudart linked statically), so that the same file loads under any torch
through ctypes (:mod:`sm90.gemm`).

Compiled into a per-user cache keyed by the sources, the configurations, the flags and the
compiler, with a pip-only toolchain: ``nvcc`` from ``nvidia-cuda-nvcc``
and the CUTLASS headers from ``nvidia-cutlass`` (``TWOFOUR_NVCC`` and ``TWOFOUR_CUTLASS`` point
elsewhere; ``TWOFOUR_SM90_LIB`` names a library built beforehand). The build takes minutes, so it
runs only when asked: ``python -m sm90.cutlass`` from ``benchmarks/gemm/``, or at first use where
``TWOFOUR_BUILD_KERNELS=1`` (:data:`build_kernels`, :func:`set_build_kernels`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["build_kernels", "set_build_kernels",
           "GemmConfig", "CONFIGS", "Toolchain", "ToolchainMissing", "toolchain", "build", "library_path", "LIB_NAME"]

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent

#: Whether a library missing from the cache is compiled at its first use (TWOFOUR_BUILD_KERNELS=1;
#: default off: ``python -m sm90.cutlass`` builds it beforehand).
build_kernels: bool = os.environ.get("TWOFOUR_BUILD_KERNELS", "0").strip() == "1"


def set_build_kernels(enabled: bool) -> None:
    """Let the library compile at its first use (minutes) when it is not built yet, or not."""
    global build_kernels
    build_kernels = bool(enabled)

SOURCES = ("sm90_sparse.cuh", "gemm_config.cu", "common.cu")
LIB_NAME = "libtwofour_sm90.so"


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One kernel instance: CTA tile (M, N, K), cluster (M, N) and schedule (pingpong or cooperative);
    persistent tile scheduler, pipeline stages as many as shared memory holds."""

    tile: tuple[int, int, int]
    cluster: tuple[int, int] = (1, 1)
    pingpong: bool = False

    @property
    def name(self) -> str:
        m, n, k = self.tile
        return f"t{m}x{n}x{k}_c{self.cluster[0]}x{self.cluster[1]}_{'pp' if self.pingpong else 'coop'}"

    def defines(self) -> list[str]:
        m, n, k = self.tile
        flags = [f"-DTWOFOUR_NAME={self.name}", f"-DTWOFOUR_TM={m}", f"-DTWOFOUR_TN={n}", f"-DTWOFOUR_TK={k}",
                 f"-DTWOFOUR_CM={self.cluster[0]}", f"-DTWOFOUR_CN={self.cluster[1]}"]
        return flags + (["-DTWOFOUR_PINGPONG"] if self.pingpong else [])


#: The shipped configurations (all K tiles 128: they share one compressed layout).
CONFIGS: tuple[GemmConfig, ...] = (
    GemmConfig((128, 128, 128)),
    GemmConfig((128, 256, 128)),
    GemmConfig((256, 128, 128)),
    GemmConfig((128, 128, 128), (2, 1)),
    GemmConfig((128, 256, 128), (2, 1)),
    GemmConfig((256, 128, 128), (2, 1)),
    GemmConfig((128, 128, 128), (1, 2)),
    GemmConfig((128, 128, 128), pingpong=True),
    GemmConfig((128, 128, 128), (2, 1), pingpong=True),
)

ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC")


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """Where the compiler and the headers are."""

    nvcc: Path
    cutlass: Path  # the folder holding include/ and tools/util/include/

    def includes(self) -> list[str]:
        cuda_inc = self.nvcc.parent.parent / "include"
        return [f"-I{self.cutlass / 'include'}", f"-I{self.cutlass / 'tools' / 'util' / 'include'}",
                f"-I{cuda_inc}", f"-I{HERE}"]

    def version(self) -> str:
        out = subprocess.run([str(self.nvcc), "--version"], capture_output=True, text=True, check=True).stdout
        return out.strip().splitlines()[-1]


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _find_nvcc() -> Path | None:
    if os.environ.get("TWOFOUR_NVCC"):
        return Path(os.environ["TWOFOUR_NVCC"])
    nv = _package_dir("nvidia")
    for cand in ([nv / "cu13" / "bin" / "nvcc", nv / "cuda_nvcc" / "bin" / "nvcc"] if nv else []):
        if cand.is_file():
            return cand
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    return Path(found) if found else None


def _find_cutlass() -> Path | None:
    if os.environ.get("TWOFOUR_CUTLASS"):
        return Path(os.environ["TWOFOUR_CUTLASS"])
    lib = _package_dir("cutlass_library")
    if lib and (lib / "source" / "include" / "cutlass" / "cutlass.h").is_file():
        return lib / "source"
    return None


class ToolchainMissing(RuntimeError):
    """The optional build tools (nvcc, CUTLASS's headers) are not installed: the sm90 route is
    skipped as an absent extra, not reported as a failure."""


def toolchain() -> Toolchain:
    """The compiler and CUTLASS headers to build with; :class:`ToolchainMissing` (one line) if either
    is missing."""
    nvcc, cutlass = _find_nvcc(), _find_cutlass()
    if nvcc is None or cutlass is None:
        missing = " and ".join(w for w, p in (("nvcc", nvcc), ("the CUTLASS headers", cutlass)) if p is None)
        raise ToolchainMissing(f"the sm90 2:4 GEMM needs {missing}: pip install nvidia-cuda-nvcc "
                               "nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cutlass "
                               "(or set TWOFOUR_NVCC / TWOFOUR_CUTLASS)")
    return Toolchain(nvcc, cutlass)


def _cache_root() -> Path:
    base = os.environ.get("TWOFOUR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "twofour")
    return Path(base) / "sm90"


def _key(tc: Toolchain, configs: tuple[GemmConfig, ...]) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    h.update(repr([c.name for c in configs] + list(ARCH_FLAGS) + list(FLAGS)).encode())
    h.update(tc.version().encode())
    return h.hexdigest()[:16]


def _compile(tc: Toolchain, src: str, obj: Path, defines: list[str]) -> None:
    cmd = [str(tc.nvcc), *FLAGS, *ARCH_FLAGS, *tc.includes(), *defines, "-c", str(HERE / src), "-o", str(obj)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed on {obj.name}: {res.stderr.strip()[-2000:]}")


def build(configs: tuple[GemmConfig, ...] = CONFIGS, out_dir: Path | None = None, jobs: int | None = None,
          tc: Toolchain | None = None) -> Path:
    """Compile (in parallel, ``jobs`` at once) and link the library; return its path. An existing
    build with the same key is reused."""
    tc = tc or toolchain()
    out_dir = Path(out_dir) if out_dir is not None else _cache_root() / _key(tc, configs)
    lib = out_dir / LIB_NAME
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        objs = [(("common.cu"), Path(tmp) / "common.o", [])]
        objs += [("gemm_config.cu", Path(tmp) / f"{c.name}.o", c.defines()) for c in configs]
        workers = jobs or max(1, min(len(objs), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futs = [pool.submit(_compile, tc, src, obj, d) for src, obj, d in objs]
            futs[0].result()  # the shared part must build; a configuration that does not is left out
            for fut, (_, obj, _) in zip(futs[1:], objs[1:]):
                try:
                    fut.result()
                except RuntimeError as e:
                    log.warning("sm90 2:4 GEMM configuration %s left out of the library: %s", obj.stem,
                                (str(e).splitlines() or [""])[0])
        objs = [o for o in objs if o[1].is_file()]
        part = Path(tmp) / LIB_NAME
        cmd = [str(tc.nvcc), "-shared", "-cudart", "static", *ARCH_FLAGS, *[str(o) for _, o, _ in objs],
               f"-L{tc.nvcc.parent.parent / 'lib'}", "-o", str(part)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"linking {LIB_NAME} failed: {res.stderr.strip()[-2000:]}")
        os.replace(part, lib)  # atomic: a concurrent builder sees the whole file or none
    return lib


def library_path(build_missing: bool = False) -> Path:
    """The library to load: ``TWOFOUR_SM90_LIB`` if set, else the cached build; one not built yet
    is compiled now only with ``build_missing`` (minutes), else RuntimeError (one line)."""
    prebuilt = os.environ.get("TWOFOUR_SM90_LIB")
    if prebuilt:
        return Path(prebuilt)
    tc = toolchain()
    lib = _cache_root() / _key(tc, CONFIGS) / LIB_NAME
    if lib.is_file():
        return lib
    if build_missing:
        return build(tc=tc)
    raise RuntimeError(f"the sm90 2:4 GEMM library is not built (minutes of nvcc): run `python -m "
                       f"sm90.cutlass` (in benchmarks/gemm) once, or set TWOFOUR_BUILD_KERNELS=1 to build it at "
                       f"first use or TWOFOUR_SM90_LIB to a built {LIB_NAME}")
