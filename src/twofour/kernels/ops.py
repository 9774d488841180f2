"""The fast path's operations (plain calls in eager mode, torch custom ops, one opaque node each,
under torch's tracers, so that ``torch.compile`` keeps them; ``twofour.sparse.fastpath`` builds the
layer's compiled op on them). Which route each GEMM takes, dense or 2:4, is measured once per
shape by :func:`twofour.dispatch.choose`.

``spmm(a, b, m, d_col, bias)``: D (m x n) = A @ B (+ bias[:, None], in cuSPARSELt's epilogue)
with A compressed 2:4 (cuSPARSELt layout) and B a (k, n) tensor in row- or column-major order
(read in place, no transposes); D comes back column-major when ``d_col`` (so ``D.t()`` is a
row-major (n, m) tensor). Its first call at each shape, orders and epilogue runs every one of
cuSPARSELt's algorithm configurations and keeps the fastest (the library's default is often not:
``benchmarks/gemm/spmm_configs.py``).
``compress(...)``: the fused Triton prune/MVUE + compression kernel (``compress.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from .. import dispatch
from . import compress as _ck
from . import cusparselt as _cs
from . import decay as _decay
from .layout import compressed_size, supported_shape
from .mask import refresh_mask_, refresh_masks_
from .triton_common import HAS_TRITON

log = logging.getLogger(__name__)

__all__ = ["spmm", "compress", "compress_both", "refresh_mask_", "refresh_masks_", "masked_decay_", "order",
           "fast_available", "triton_ok", "as_2d"]


def order(t: torch.Tensor) -> str | None:
    """'row' or 'col' for a dense 2-D tensor stored row- or column-major, else None."""
    rows, cols = t.shape
    if t.stride(1) == 1 and (t.stride(0) == cols or rows == 1):
        return "row"
    if t.stride(0) == 1 and (t.stride(1) == rows or cols == 1):
        return "col"
    return None


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """(tokens, features) view of ``t`` in row- or column-major order (a copy only if neither)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if order(t2) is not None else t2.contiguous()


def _enabled() -> bool:
    return HAS_TRITON and dispatch.fast


def fast_available() -> bool:
    """cuSPARSELt bindings, Triton and an sm80+ GPU are all here (and the fast path is on:
    :mod:`twofour.dispatch`)."""
    return _enabled() and _cs.available()


def triton_ok(t: torch.Tensor) -> bool:
    """Triton kernels can run on ``t``: a CUDA tensor, Triton installed, the fast path on."""
    return t.is_cuda and _enabled()


def _spmm(a: torch.Tensor, b: torch.Tensor, m: int, d_col: bool, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    k, n = b.shape
    bo = order(b)
    if bo is None:
        b, bo = b.contiguous(), "row"
    out_dtype = b.dtype if out_dtype is None else out_dtype
    plan = _cs.get_plan(m, k, n, _cs.ROW if bo == "row" else _cs.COL, _cs.COL if d_col else _cs.ROW, b.dtype,
                        b.device.index, bias is not None, out_dtype=out_dtype)
    out = torch.empty((n, m) if d_col else (m, n), dtype=out_dtype, device=b.device)
    (plan.tuned or _tune(plan, a, b, out, bias)).matmul(a, b, out, bias)
    return out.t() if d_col else out


_tune_lock = threading.Lock()


def _forget_tuning() -> None:
    _cs.forget_tuning()


dispatch.on_choice_change(_forget_tuning)  # a plan's tuned configuration follows the recorded choice


def _tune(plan: _cs.Plan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> _cs.Plan:
    """The plan of the fastest of cuSPARSELt's algorithm configurations for this GEMM.

    Measured once per shape, orders, dtype and epilogue on these operands and recorded like the
    other choices (:func:`twofour.dispatch.choices` key
    ``spmm-d{row,col}[+bias][->D's dtype]:MxKxN:B..:dtype:configs``, value ``sparse#N``;
    :func:`twofour.dispatch.set_choice` pins one). Each configuration's product is checked on a
    sample of the output against the default's before it is timed; one that fails to build or
    run, or disagrees, is left out. The choice is made by timing, so two processes can pick
    different configurations (products equal up to the GEMM's rounding). While tracing or
    capturing nothing is built or measured: a recorded choice whose plan exists is used, else
    the default.
    """
    key = plan.key
    to = "" if key.out_dtype is None else "->" + str(key.out_dtype).split(".")[-1]
    kind = f"spmm-d{'col' if key.d_order == _cs.COL else 'row'}{'+bias' if key.bias else ''}{to}"
    name = dispatch.choice_key(kind, key.m, key.k, key.n, "row" if key.b_order == _cs.ROW else "col", key.dtype,
                               ("configs",))

    def config_key(config: int) -> _cs.PlanKey:
        return dataclasses.replace(key, config=None if config == plan.config_id else config)

    if not dispatch.can_measure():
        config = _recorded_config(name)
        return (_cs.cached_plan(config_key(config)) if config is not None else None) or plan
    with _tune_lock:
        config = _recorded_config(name)
        if config is not None:
            try:
                plan.tuned = _cs.plan_for(config_key(config))
            except Exception as e:
                raise ValueError(f"{name}: cuSPARSELt cannot run configuration {config} for this GEMM "
                                 f"({type(e).__name__}: {e})") from e
            return plan.tuned
        plans = _working_configs(plan, config_key, a, b, out, bias)
        best = int(dispatch.measure(name, {f"sparse#{c}": (lambda p=p: p.matmul(a, b, out, bias))
                                   for c, p in plans.items()})[7:])
        for c, p in plans.items():
            if c not in (best, plan.config_id):
                _cs.drop_plan(p)
        plan.tuned = plans[best]
        return plan.tuned


def _recorded_config(name: str) -> int | None:
    """The cuSPARSELt configuration recorded under choice ``name`` (``sparse#N``), or None."""
    choice = dispatch.recorded(name)
    if choice is None:
        return None
    if not (choice.startswith("sparse#") and choice[7:].isdigit()):
        raise ValueError(f"the choice for {name} must be 'sparse#N' (a cuSPARSELt configuration), got {choice!r}")
    return int(choice[7:])


def _working_configs(plan: _cs.Plan, config_key, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                     bias: torch.Tensor | None) -> dict[int, _cs.Plan]:
    """{configuration: plan} of every cuSPARSELt configuration that builds, runs and gives the
    default's product on a sample of the output (``plan``'s own included): the candidates to time."""
    key = plan.key
    plan.matmul(a, b, out, bias)
    flat = out.view(-1)
    sample = slice(None, None, max(1, flat.numel() // 65536))
    ref = flat[sample].to(torch.float32, copy=True)
    finite = ref[ref.isfinite()]  # a NaN or inf in the data must not count as a disagreement
    atol = 1e-2 * (finite.abs().max().item() if finite.numel() else 0.0) + 1e-6
    plans = {plan.config_id: plan}
    for config in range(plan.num_configs):
        if config in plans:
            continue
        p = None
        try:
            p = _cs.plan_for(config_key(config))
            p.matmul(a, b, out, bias)
        except Exception as e:  # noqa: BLE001 - a configuration this shape cannot run is not a candidate
            log.debug("cuSPARSELt configuration %d left out for %s: %s: %s", config, key, type(e).__name__, e)
            if p is not None:
                _cs.drop_plan(p)
            continue
        if p.config_id != config or p.compressed_size != plan.compressed_size or not torch.allclose(
                flat[sample].float(), ref, rtol=2e-2, atol=atol, equal_nan=True):
            log.warning("twofour: cuSPARSELt configuration %d gave another product than the default for %s; "
                        "left out", config, key)
            _cs.drop_plan(p)
            continue
        plans[config] = p
    return plans


def _compress(x: torch.Tensor, mode: str, scale: torch.Tensor | None, mask: torch.Tensor | None,
              seed: torch.Tensor | None, dense_out: bool, out_dtype: torch.dtype,
              sparse_out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    buf, dense = _ck.compress(x, mode, out_dtype=out_dtype, scale=scale, mask=mask, seed=seed, dense_out=dense_out,
                              sparse_out=sparse_out)
    return buf, dense if dense is not None else buf.new_empty(0, dtype=out_dtype)


def _compress_both(x: torch.Tensor, mode: str, scale: torch.Tensor | None, mask: torch.Tensor | None,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ck.compress_both(x, mode, out_dtype=out_dtype, scale=scale, mask=mask, dense_out=True)


_spmm_op = torch.library.custom_op("twofour::spmm", _spmm, mutates_args=())
_compress_op = torch.library.custom_op("twofour::compress", _compress, mutates_args=())
_compress_both_op = torch.library.custom_op("twofour::compress_both", _compress_both, mutates_args=())


@_spmm_op.register_fake
def _(a, b, m, d_col, bias=None, out_dtype=None):
    n = b.shape[1]
    return torch.empty_strided((m, n), (1, m) if d_col else (n, 1), dtype=b.dtype if out_dtype is None else out_dtype,
                               device=b.device)


@_compress_op.register_fake
def _(x, mode, scale, mask, seed, dense_out, out_dtype, sparse_out=True):
    m, k = x.shape
    size = compressed_size(m, k, torch.finfo(out_dtype).bits // 8) if sparse_out else 0
    buf = torch.empty(size, dtype=torch.uint8, device=x.device)
    return buf, torch.empty((m, k) if dense_out else (0,), dtype=out_dtype, device=x.device)


@_compress_both_op.register_fake
def _(x, mode, scale, mask, out_dtype):
    m, k = x.shape
    return (torch.empty(compressed_size(m, k, 2), dtype=torch.uint8, device=x.device),
            torch.empty((m, k), dtype=out_dtype, device=x.device),
            torch.empty(compressed_size(k, m, 2), dtype=torch.uint8, device=x.device))


def spmm(a: torch.Tensor, b: torch.Tensor, m: int, d_col: bool, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """D (m x n) = A @ B (+ bias[:, None]), A compressed 2:4, B (k, n) read in its own order (see
    the module doc); ``bias`` has m values in D's dtype; D is in ``out_dtype`` (default B's dtype:
    bf16 from FP8 operands, for example).

    Eager calls go straight to cuSPARSELt (a custom op's dispatch costs host time on every call);
    under torch's tracers the registered op ``twofour::spmm`` is used.
    """
    args = (a, b, m, d_col, bias, out_dtype)
    return _spmm_op(*args) if torch.compiler.is_compiling() else _spmm(*args)


def compress(x: torch.Tensor, mode: str, *, scale: torch.Tensor | None = None, mask: torch.Tensor | None = None,
             seed: torch.Tensor | None = None, dense_out: bool = False, out_dtype: torch.dtype = torch.bfloat16,
             sparse_out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused prune + compress kernel (:func:`twofour.kernels.compress.compress`): the
    compressed buffer (empty without ``sparse_out``) and the dense effective matrix (empty
    without ``dense_out``). Eager calls launch it directly, traced ones go through
    ``twofour::compress``."""
    args = (x, mode, scale, mask, seed, dense_out, out_dtype, sparse_out)
    return _compress_op(*args) if torch.compiler.is_compiling() else _compress(*args)


def compress_both(x: torch.Tensor, mode: str, *, scale: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compressed W_eff, dense W_eff, compressed W_eff^T 2:4) of the weight ``x`` in one pass of the
    fused kernel (:func:`twofour.kernels.compress.compress_both`): the ``pruned-t`` dX route's
    operands (``mode`` ``hard`` or ``soft``), or a transposable mask's (``mask``). Eager calls
    launch it directly, traced ones go through ``twofour::compress_both``."""
    args = (x, mode, scale, mask, out_dtype)
    return _compress_both_op(*args) if torch.compiler.is_compiling() else _compress_both(*args)


def prune_transpose(w: torch.Tensor) -> torch.Tensor:
    """``w`` with ``w^T`` pruned 2:4 as well (the ``pruned-t`` dX route's weight; its plain-torch
    reference is :func:`twofour.functional.prune_transpose_24`), by one pass of the compression
    kernel over ``w^T``: a bf16/fp16 ``w`` whose output features are a multiple of 32
    (:func:`prune_transpose_ok`)."""
    return compress(w.t(), "hard", dense_out=True, sparse_out=False, out_dtype=w.dtype)[1].t()


def prune_transpose_ok(w: torch.Tensor) -> bool:
    """:func:`prune_transpose` runs on ``w``: Triton on its device, bf16/fp16, output features a
    multiple of 32."""
    return triton_ok(w) and w.dtype in (torch.bfloat16, torch.float16) and supported_shape(w.shape[1], w.shape[0])


def masked_decay_(g: torch.Tensor, w: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """SR-STE's masked decay ``g += decay * W * (1 - mask)`` in place: one Triton pass where the
    tensors are on the GPU and :func:`twofour.kernels.decay.fits` them (eagerly), else its
    plain-torch reference. Returns ``g``."""
    if triton_ok(g) and _decay.fits(g, w, mask) and not torch.compiler.is_compiling():
        return _decay.masked_decay_(g, w, mask, decay)
    return _decay.masked_decay_reference_(g, w, mask, decay)
