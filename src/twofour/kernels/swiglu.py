"""The gated FFN's activation (SwiGLU) as two Triton kernels, with their plain-torch references.

The FFN's first GEMM writes one matrix ``z`` of 2H columns in which gate and up alternate:
column 2j is gate_j and column 2j+1 is up_j (the rows of the fused gate|up weight interleave,
``twofour.activations.interleave_gate_up``). So every pair the activation needs sits side by side:

    forward   h_j  = silu(g_j) * u_j                                  reads z, writes h
    backward  dg_j = dh_j * u_j * s_j * (1 + g_j * (1 - s_j))         reads z and dh, writes dz
              du_j = dh_j * silu(g_j)            (s = sigmoid(g); dz interleaved like z)

Each kernel reads its inputs once and writes its output once, computing in float32. ``z`` may
be row-major (T, 2H) or column-major (its transpose stored row-major, as a 2:4 GEMM with
``transposed_output`` leaves it); ``h`` and ``dz`` come out in ``z``'s order, which is the order
the next GEMM reads (the down projection reads ``h`` in place, the gate|up backward reads
``dz``). Row-major, a tile is one contiguous (rows, 2 x cols) load split into gate and up;
column-major, the gate and up rows of z^T are two contiguous loads each. On the GPU the tile
and warps are autotuned once per shape; tested against the references on the CPU under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .triton_common import HAS_TRITON, launch_tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["swiglu_forward", "swiglu_backward", "swiglu_reference", "swiglu_backward_reference", "DTYPES"]

#: The dtypes the kernels take (computing in float32 whatever they read).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TILE = (16, 64)  # (rows, cols) per program off the GPU (the interpreter): a few large programs


def _math_dtype(z: torch.Tensor) -> torch.dtype:
    return torch.promote_types(z.dtype, torch.float32)  # float32, or float64 for float64 input


def swiglu_reference(z: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up for ``z`` (..., 2H) with gate and up interleaved, computed in float32
    (float64 for float64 input) and returned in z's dtype."""
    dt = _math_dtype(z)
    g, u = z[..., 0::2].to(dt), z[..., 1::2].to(dt)
    return (F.silu(g) * u).to(z.dtype)


def swiglu_backward_reference(z: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d(gate|up), interleaved like ``z``, from ``dh`` = dL/dh (float32 math, z's dtype)."""
    dt = _math_dtype(z)
    g, u, d = z[..., 0::2].to(dt), z[..., 1::2].to(dt), dh.to(dt)
    s = torch.sigmoid(g)
    dg = d * u * s * (1 + g * (1 - s))
    du = d * g * s
    return torch.stack((dg, du), dim=-1).reshape(z.shape).to(z.dtype)


if HAS_TRITON:

    @triton.jit
    def _offsets(BR: tl.constexpr, BC: tl.constexpr, BIG: tl.constexpr):
        """This program's rows (BR, 1) and pair columns (1, BC)."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
        c = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        if BIG:  # offsets past 2^31: 64-bit index arithmetic
            r, c = r.to(tl.int64), c.to(tl.int64)
        return r, c

    @triton.jit
    def _load_pairs(z, r, c, n_rows, n_cols, s_r, s_c, s_p, BR: tl.constexpr, BC: tl.constexpr,
                    PAIR_INNER: tl.constexpr):
        """(gate, up) of the tile as two float32 (BR, BC) tensors."""
        if PAIR_INNER:  # gate, up side by side in memory: one contiguous (BR, 2 BC) load, then split
            c2 = tl.program_id(1) * (2 * BC) + tl.arange(0, 2 * BC)[None, :]
            x = tl.load(z + r * s_r + c2, mask=(r < n_rows) & (c2 < 2 * n_cols), other=0.0).to(tl.float32)
            g, u = tl.split(tl.reshape(x, (BR, BC, 2)))
        else:  # gate and up rows of z^T: two contiguous loads
            ok = (r < n_rows) & (c < n_cols)
            off = r * s_r + c * s_c
            g = tl.load(z + off, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(z + off + s_p, mask=ok, other=0.0).to(tl.float32)
        return g, u

    @triton.jit
    def _swiglu_fwd_kernel(z, h, n_rows, n_cols, s_r, s_c, s_p, h_r, h_c, BR: tl.constexpr, BC: tl.constexpr,
                           PAIR_INNER: tl.constexpr, BIG: tl.constexpr):
        r, c = _offsets(BR, BC, BIG)
        g, u = _load_pairs(z, r, c, n_rows, n_cols, s_r, s_c, s_p, BR, BC, PAIR_INNER)
        out = g * tl.sigmoid(g) * u
        tl.store(h + r * h_r + c * h_c, out.to(h.dtype.element_ty), mask=(r < n_rows) & (c < n_cols))

    @triton.jit
    def _swiglu_bwd_kernel(z, dh, dz, n_rows, n_cols, s_r, s_c, s_p, d_r, d_c, BR: tl.constexpr, BC: tl.constexpr,
                           PAIR_INNER: tl.constexpr, BIG: tl.constexpr):
        r, c = _offsets(BR, BC, BIG)
        ok = (r < n_rows) & (c < n_cols)
        g, u = _load_pairs(z, r, c, n_rows, n_cols, s_r, s_c, s_p, BR, BC, PAIR_INNER)
        d = tl.load(dh + r * d_r + c * d_c, mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = d * u * s * (1.0 + g * (1.0 - s))
        du = d * g * s
        if PAIR_INNER:  # interleaved back into one contiguous (BR, 2 BC) store
            c2 = tl.program_id(1) * (2 * BC) + tl.arange(0, 2 * BC)[None, :]
            both = tl.reshape(tl.join(dg, du), (BR, 2 * BC))
            tl.store(dz + r * s_r + c2, both.to(dz.dtype.element_ty), mask=(r < n_rows) & (c2 < 2 * n_cols))
        else:
            off = r * s_r + c * s_c
            tl.store(dz + off, dg.to(dz.dtype.element_ty), mask=ok)
            tl.store(dz + off + s_p, du.to(dz.dtype.element_ty), mask=ok)

    _CONFIGS = [triton.Config({"BR": br, "BC": bc}, num_warps=w)
                for br, bc, w in ((4, 512, 4), (8, 256, 4), (16, 256, 8), (32, 128, 4), (8, 512, 8), (64, 64, 4))]
    _KEY = ["n_rows", "n_cols", "s_r", "s_c", "s_p", "PAIR_INNER"]
    #: name -> (the kernel, the same kernel autotuned over _CONFIGS)
    _KERNELS = {"fwd": (_swiglu_fwd_kernel, triton.autotune(configs=_CONFIGS, key=_KEY)(_swiglu_fwd_kernel)),
                "bwd": (_swiglu_bwd_kernel, triton.autotune(configs=_CONFIGS, key=[*_KEY, "d_r", "d_c"])(
                    _swiglu_bwd_kernel))}

_launch: dict[tuple, tuple[int, int, int]] = {}  # (kernel, shape, strides, dtype) -> the tuned (BR, BC, warps)


def _plan(z: torch.Tensor) -> tuple[int, int, int, int, int, bool]:
    """How the kernels walk ``z`` (T, 2H): (rows, pair columns, row stride, pair-column stride,
    gate->up stride, gate and up adjacent). Row-major: rows are tokens; column-major: rows are
    the H features of z^T, each gate row followed by its up row."""
    t, n = z.shape
    if z.stride(1) == 1 and (z.stride(0) == n or t == 1):
        return t, n // 2, z.stride(0), 2, 1, True
    if z.stride(0) == 1 and (z.stride(1) == t or n == 1):
        return n // 2, t, 2 * z.stride(1), 1, z.stride(1), False
    raise ValueError(f"swiglu: z must be row- or column-major, got strides {z.stride()} for shape {tuple(z.shape)}")


def _check(z: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("twofour's SwiGLU kernels need Triton (pip install triton)")
    if z.dim() != 2 or z.shape[1] % 2:
        raise ValueError(f"swiglu: z must be (tokens, 2H) with gate and up interleaved, got shape {tuple(z.shape)}")
    if z.dtype not in DTYPES:
        raise TypeError(f"swiglu: z must be bfloat16, float16 or float32, got {z.dtype}")


def _run(name: str, args: tuple, rows: int, cols: int, key: tuple, consts: dict,
         tile: tuple[int, int, int] | None, on_gpu: bool) -> None:
    """Launch with the autotuned tile (measured once per shape, then launched directly: the
    autotuner's own dispatch costs host time on every call), ``tile`` if given, or the
    interpreter's tile off the GPU."""
    kernel, tuned = _KERNELS[name]
    launch_tuned(kernel, tuned, lambda meta: (triton.cdiv(rows, meta["BR"]), triton.cdiv(cols, meta["BC"])), args,
                 consts, names=("BR", "BC"), default=_TILE, cache=_launch, key=(name, *key), tile=tile, on_gpu=on_gpu)


def _big(*ts: torch.Tensor) -> bool:
    return any(sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1 >= 2**31 for t in ts)


def swiglu_forward(z: torch.Tensor, *, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """h (T, H) = silu(gate) * up from ``z`` (T, 2H), gate and up interleaved, row- or
    column-major; ``h`` comes out in z's order and dtype. ``tile`` = (rows, cols, warps) fixes
    the launch instead of the autotuned one (tests, benchmarks)."""
    _check(z)
    rows, cols, s_r, s_c, s_p, inner = _plan(z)
    t, h_features = z.shape[0], z.shape[1] // 2
    h = (torch.empty(t, h_features, dtype=z.dtype, device=z.device) if inner
         else torch.empty(h_features, t, dtype=z.dtype, device=z.device).t())
    h_r, h_c = (h.stride(0), h.stride(1)) if inner else (h.stride(1), h.stride(0))
    consts = dict(PAIR_INNER=inner, BIG=_big(z, h))
    key = (rows, cols, s_r, s_c, s_p, z.dtype, inner)
    _run("fwd", (z, h, rows, cols, s_r, s_c, s_p, h_r, h_c), rows, cols, key, consts, tile, z.is_cuda)
    return h


def swiglu_backward(z: torch.Tensor, dh: torch.Tensor, *, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """d(gate|up) (T, 2H), interleaved and in z's order and dtype, from the saved ``z`` and
    ``dh`` (T, H, any strides; read fastest in z's order)."""
    _check(z)
    t, h_features = z.shape[0], z.shape[1] // 2
    if dh.shape != (t, h_features):
        raise ValueError(f"swiglu_backward: dh must have shape {(t, h_features)}, got {tuple(dh.shape)}")
    rows, cols, s_r, s_c, s_p, inner = _plan(z)
    dz = torch.empty_strided(z.shape, z.stride(), dtype=z.dtype, device=z.device)
    d_r, d_c = (dh.stride(0), dh.stride(1)) if inner else (dh.stride(1), dh.stride(0))
    consts = dict(PAIR_INNER=inner, BIG=_big(z, dh))
    key = (rows, cols, s_r, s_c, s_p, z.dtype, dh.dtype, d_r, d_c, inner)
    _run("bwd", (z, dh, dz, rows, cols, s_r, s_c, s_p, d_r, d_c), rows, cols, key, consts, tile, z.is_cuda)
    return dz
