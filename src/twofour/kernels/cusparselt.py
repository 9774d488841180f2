"""A thin binding to cuSPARSELt through ``nvmath-python``, with plans built once and reused.

torch's own ``torch._cslt_sparse_mm`` rebuilds its cuSPARSELt plan on every call, which costs
host time (docs/notes/torch-24-entry-points.md); a :class:`Plan` here is built once per shape,
dtype and operand order and reused. Every plan computes

    D (M x N) = A (M x K, 2:4 along K, row-major, compressed) @ B (K x N)

with B and D in row- or column-major order, as the caller's memory already is. A and B are
bf16, fp16 or FP8 (both e4m3 or both e5m2, with B column-major, on GPUs with FP8 sparse tensor
cores), D is A's dtype or another (bf16 from FP8 operands; the GEMM does not scale them, since
cuSPARSELt 0.8 refuses per-row alpha for FP8 and ignores device-side operand scales:
docs/notes/fp8.md). A plan optionally
adds a bias vector (one value per row of D) in the GEMM's epilogue: a plan built with a bias
reads the pointer from its matmul descriptor at each call, so a call with another bias tensor
only resets that pointer (docs/notes/fastpath-experiments.md).

cuSPARSELt has several algorithm configurations per shape (kernel tile shapes and schedules) and
runs the first by default; a plan can be built for any of them (``config``), and the dispatch in
:mod:`twofour.kernels.ops` measures them once per shape and keeps the fastest.

Plans live for the process and may be built inside ``torch.compile(mode="reduce-overhead")``,
which routes every allocation of the thread that warms up or records a CUDA graph into the
graph's memory pool (where a tensor outliving the graph's outputs is an error): a plan's own
memory is allocated on a helper thread, and a plan holds no reference to the caller's tensors.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["available", "version", "Plan", "PlanKey", "get_plan", "plan_for", "cached_plan", "drop_plan",
           "forget_tuning", "compress", "ROW", "COL"]

ROW, COL = 2, 1  # cusparseOrder_t
_NON_TRANSPOSE = 0
# cudaDataType_t of the operand dtypes (A, B) and output dtypes (D) a plan takes
_CUDA_DTYPE = {torch.bfloat16: 14, torch.float16: 2, torch.float8_e4m3fn: 28, torch.float8_e5m2: 29,
               torch.float32: 0}
_INPUTS = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


_allocator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twofour-cusparselt")


def _plan_memory(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` (at least 1) of device memory for a plan, allocated on a helper thread so that
    it never lands in a CUDA graph's pool (see the module's docstring), on the caller's current
    stream so that freeing it waits for that stream's work as any tensor's would (while that
    stream captures, on the helper's own: such a plan is the base plan of its GEMM, never dropped)."""
    stream = None if torch.cuda.is_current_stream_capturing() else torch.cuda.current_stream(device)

    def alloc() -> torch.Tensor:
        with torch.cuda.stream(stream):  # None: the helper thread's current stream
            return torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)

    return _allocator.submit(alloc).result()


@functools.cache
def _lib():
    from nvmath.bindings import cusparseLt  # noqa: PLC0415 - optional dependency, GPU only

    return cusparseLt


@functools.cache
def available() -> bool:
    """True when CUDA, an sm80+ GPU and nvmath-python's cuSPARSELt bindings are all here."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return False
    try:
        _handle(torch.cuda.current_device())
    except Exception:  # missing package or library: the dense path is used instead
        return False
    return True


def version() -> int:
    """The loaded cuSPARSELt library's version number (e.g. 800 for 0.8.0)."""
    return _lib().get_version(_handle(torch.cuda.current_device()))


_handles: dict[int, int] = {}
_lock = threading.RLock()


def _handle(device: int) -> int:
    with _lock:
        if device not in _handles:
            with torch.cuda.device(device):
                _handles[device] = _lib().init()
        return _handles[device]


@dataclass(frozen=True)
class PlanKey:
    m: int
    k: int
    n: int
    b_order: int
    d_order: int
    dtype: torch.dtype
    device: int
    bias: bool = False
    config: int | None = None  # cuSPARSELt's algorithm configuration id; None: the library's default
    out_dtype: torch.dtype | None = None  # D's dtype; None: A's and B's
    split_k: int = 1  # the inner dimension split over this many parts (cuSPARSELt's split-K)

    @property
    def d_dtype(self) -> torch.dtype:
        return self.dtype if self.out_dtype is None else self.out_dtype


class Plan:
    """One cuSPARSELt matmul plan: descriptors, algorithm and workspace, built once."""

    def __init__(self, key: PlanKey):
        import numpy as np  # noqa: PLC0415

        L, self.key = _lib(), key
        self.h = h = _handle(key.device)
        dt = _CUDA_DTYPE[key.dtype]

        def dense(rows, cols, order, dtype):
            return L.dense_descriptor_init(h, rows, cols, cols if order == ROW else rows, 16, dtype, order)

        self.a = _structured(h, key.m, key.k, key.dtype)
        self.b = dense(key.k, key.n, key.b_order, dt)
        self.d = dense(key.m, key.n, key.d_order, _CUDA_DTYPE[key.d_dtype])
        self.mm = L.matmul_descriptor_init(h, _NON_TRANSPOSE, _NON_TRANSPOSE, self.a, self.b, self.d, self.d,
                                           L.ComputeType.COMPUTE_32F)
        dev = torch.device("cuda", key.device)
        self._bias_ptr = np.zeros(1, dtype=np.int64)
        if key.bias:  # the epilogue is chosen when the plan is built: give it a bias to build with
            self._set_bias(torch.zeros(key.m, dtype=key.d_dtype, device=dev))
        self.alg = L.matmul_alg_selection_init(h, self.mm, L.MatmulAlg.DEFAULT)
        if key.config is not None:
            self._set_alg_attribute(L.MatmulAlgAttribute.CONFIG_ID, key.config)
        #: the split-K the plan runs (the library may keep another than asked); plans that ask for
        #: none, every plan the layers build, don't query it
        self.split_k = 1
        if key.split_k != 1:
            self._set_alg_attribute(L.MatmulAlgAttribute.SPLIT_K, key.split_k)
            self.split_k = self._get_alg_attribute(L.MatmulAlgAttribute.SPLIT_K)
        #: the configuration this plan runs, and how many the library has for its shape (ids 0..n-1)
        self.config_id = self._get_alg_attribute(L.MatmulAlgAttribute.CONFIG_ID)
        self.num_configs = self._get_alg_attribute(L.MatmulAlgAttribute.CONFIG_MAX_ID)
        #: the plan of the fastest configuration, once measured (``ops`` sets it)
        self.tuned: Plan | None = None
        self.plan = L.matmul_plan_init(h, self.mm, self.alg)
        self.workspace = _plan_memory(L.matmul_get_workspace(h, self.plan), dev)
        self.compressed_size, self._tmp_size = L.sp_mma_compressed_size(h, self.plan)
        self._tmp: torch.Tensor | None = None  # compress()'s scratch, allocated at its first call
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self._streams = np.zeros(1, dtype=np.int64)

    def _set_alg_attribute(self, attribute: int, value: int) -> None:
        import numpy as np  # noqa: PLC0415

        buf = np.array([value], dtype=np.int32)
        _lib().matmul_alg_set_attribute(self.h, self.alg, attribute, buf.ctypes.data, 4)

    def _get_alg_attribute(self, attribute: int) -> int:
        import numpy as np  # noqa: PLC0415

        buf = np.zeros(1, dtype=np.int32)
        _lib().matmul_alg_get_attribute(self.h, self.alg, attribute, buf.ctypes.data, 4)
        return int(buf[0])

    def compress(self, a: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """cuSPARSELt's own compression of a dense 2:4 ``a`` (M x K, row-major) into its layout."""
        if out is None:
            out = torch.empty(self.compressed_size, dtype=torch.uint8, device=a.device)
        if self._tmp is None:
            self._tmp = _plan_memory(self._tmp_size, a.device)
        _lib().sp_mma_compress(self.h, self.plan, a.data_ptr(), out.data_ptr(), self._tmp.data_ptr(),
                               torch.cuda.current_stream(a.device).cuda_stream)
        return out

    def _set_bias(self, bias: torch.Tensor) -> None:
        # only the address: cuSPARSELt reads it when a matmul is issued, and a later call with a
        # tensor at another address sets it again (holding the tensor would keep, e.g., a CUDA
        # graph's buffer alive past the graph's outputs)
        self._bias_ptr[0] = bias.data_ptr()
        _lib().matmul_desc_set_attribute(self.h, self.mm, _lib().MatmulDescAttribute.BIAS_POINTER,
                                         self._bias_ptr.ctypes.data, 8)

    def matmul(self, a_compressed: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """D = A @ B (+ bias[:, None]) on the current stream; ``b`` and ``d`` are raw memory in the
        plan's orders; ``bias`` (M values, D's dtype) is given exactly when the plan has one."""
        key = self.key
        if (bias is not None) != key.bias:
            raise ValueError(f"this plan was built {'with' if key.bias else 'without'} a bias epilogue")
        if bias is not None:
            if bias.shape != (key.m,) or bias.dtype != key.d_dtype or not bias.is_contiguous():
                raise ValueError(f"bias must be a contiguous ({key.m},) {key.d_dtype} tensor, got "
                                 f"{tuple(bias.shape)} {bias.dtype}")
            if bias.data_ptr() != self._bias_ptr[0]:
                self._set_bias(bias)
        stream = torch.cuda.current_stream(d.device)
        self._streams[0] = stream.cuda_stream
        _lib().matmul(self.h, self.plan, self._alpha.ctypes.data, a_compressed.data_ptr(), b.data_ptr(),
                      self._beta.ctypes.data, d.data_ptr(), d.data_ptr(), self.workspace.data_ptr(),
                      self._streams.ctypes.data, 1)
        return d


_plans: dict[PlanKey, Plan] = {}


def get_plan(m: int, k: int, n: int, b_order: int, d_order: int, dtype: torch.dtype,
             device: int | None = None, bias: bool = False, config: int | None = None,
             out_dtype: torch.dtype | None = None, split_k: int = 1) -> Plan:
    """The cached plan for this shape, orders, operand and output dtypes, device, bias epilogue,
    algorithm configuration (``None``: cuSPARSELt's default) and split-K, built on first use."""
    return plan_for(PlanKey(m, k, n, b_order, d_order, dtype, torch.cuda.current_device() if device is None else device,
                            bias, config, None if out_dtype == dtype else out_dtype, split_k))


def plan_for(key: PlanKey) -> Plan:
    """The cached plan for ``key`` (built on first use): :func:`get_plan` by its key."""
    if key.dtype not in _INPUTS or key.d_dtype not in _CUDA_DTYPE:
        raise TypeError(f"cuSPARSELt plans take bfloat16, float16 or float8 operands and outputs of those or "
                        f"float32, got {key.dtype} -> {key.d_dtype}")
    plan = _plans.get(key)
    if plan is None:
        with _lock:
            plan = _plans.get(key) or Plan(key)
            _plans[key] = plan
    return plan


def cached_plan(key: PlanKey) -> Plan | None:
    """The plan for ``key`` if it was built already (nothing is built: safe while capturing)."""
    return _plans.get(key)


def drop_plan(plan: Plan) -> None:
    """Remove ``plan`` from the cache (its workspace is freed once nothing refers to it)."""
    with _lock:
        if _plans.get(plan.key) is plan:
            del _plans[plan.key]


_descriptors: dict[tuple, int] = {}


def _structured(h: int, m: int, k: int, dtype: torch.dtype) -> int:
    """A structured (2:4 along K) row-major descriptor of an m x k matrix."""
    L = _lib()
    return L.structured_descriptor_init(h, m, k, k, 16, _CUDA_DTYPE[dtype], ROW, L.Sparsity.SPARSITY_50_PERCENT)


def compress(a: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's own compression of a dense 2:4 ``a`` (m x k, row-major, 2:4 along k) into the
    layout every plan with this A reads (no plan needed: the layout depends on A alone), on the
    current stream. For FP8 operands, what ``compress.compress_e4m3`` (the Triton kernel the FP8
    2:4 route runs) is checked against on the GPU, and the route's compression without Triton."""
    if a.dim() != 2 or not a.is_contiguous() or a.dtype not in _INPUTS:
        raise ValueError(f"compress needs a contiguous 2-D {'/'.join(str(d) for d in _INPUTS)} tensor, "
                         f"got {tuple(a.shape)} {a.dtype}")
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    key = (*a.shape, a.dtype, device)
    L, h = _lib(), _handle(device)
    with _lock:
        entry = _descriptors.get(key)
        if entry is None:
            desc = _structured(h, *a.shape, a.dtype)
            size, tmp_size = L.sp_mma_compressed_size2(h, desc)
            entry = _descriptors[key] = (desc, size, _plan_memory(tmp_size, a.device))
    desc, size, tmp = entry
    out = torch.empty(size, dtype=torch.uint8, device=a.device)
    L.sp_mma_compress2(h, desc, 1, _NON_TRANSPOSE, a.data_ptr(), out.data_ptr(), tmp.data_ptr(),
                       torch.cuda.current_stream(a.device).cuda_stream)
    return out


def forget_tuning() -> None:
    """Drop every plan's cached configuration: the next call looks it up again in the dispatch's
    choices (:mod:`twofour.dispatch`), measuring only where none is recorded."""
    with _lock:
        for plan in _plans.values():
            plan.tuned = None
