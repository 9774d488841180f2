"""An FFN activation's backward fused with the MVUE 2:4 compression of its output (Triton).

In an FFN ``h = act(z)``, ``z = x W^T (+ b)``, the first linear's weight gradient is
``dW = dz^T x`` with ``dz = act'(z) * dh``; S-STE estimates ``dz^T`` by MVUE, 2:4 along tokens,
so that dW runs as a 2:4 GEMM. Computed apart, that estimate costs a second pass over ``dz``
(read it, write the compressed half). Here the kernel that produces ``dz`` also draws the
estimate from the values it holds and writes it compressed: in traffic one extra write of the
compressed operand and no extra read (its time against that bound: docs/notes/training-speed.md, "The
fused activation + MVUE kernel"). The dense ``dz`` is still written (dX = dz W needs it exactly).

Activations (``ACT``): GELU with the tanh approximation (GPT-2's), and SwiGLU on the interleaved
gate|up output (``swiglu.py``: column 2j is gate_j, 2j+1 up_j; ``dz`` interleaved alike).

``z`` is column-major: z^T stored row-major, as a 2:4 GEMM with ``transposed_output`` leaves it,
so that the rows of ``dz^T`` are contiguous and each program reads and writes a (64 features,
BC tokens) tile as it lies (32 gate, up pairs for SwiGLU). A row-major ``z`` takes the unfused
route (the gradient, then the standalone MVUE kernel): transposing each tile in registers makes
the fused kernel slower than those two (docs/notes/training-speed.md). The values
are rounded to the output dtype first, and the estimate
drawn from those, with the draws, counters and layout of ``compress.compress(dz.t(), "mvue",
seed=...)`` on a row-major ``dz^T``: the tests check the compressed bytes against that kernel run
on this kernel's ``dz``.
"""

from __future__ import annotations

import torch

from .layout import compressed_size
from .triton_common import HAS_TRITON, PHILOX_ROUNDS, launch_tuned

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import (
        group_uniforms,
        mvue_keep,
        mvue_rescale,
        mvue_weights,
        out_bits,
        pick,
        quads,
        store_compressed,
    )

__all__ = ["act_backward_mvue", "GELU_TANH", "SWIGLU", "DTYPES"]

GELU_TANH, SWIGLU = 0, 1  # the ACT codes
DTYPES = (torch.bfloat16, torch.float16)
BC = 64  # tokens per program off the GPU (the interpreter); on the GPU autotuned

if HAS_TRITON:

    @triton.jit
    def _gelu_tanh_grad(x):
        """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), as torch computes it
        (tanh(u) = 2 sigmoid(2u) - 1)."""
        k_beta: tl.constexpr = 0.7978845608028654
        k_kappa: tl.constexpr = 0.044715
        x_sq = x * x
        t = 2.0 * tl.sigmoid(2.0 * k_beta * (x + k_kappa * x_sq * x)) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k_beta * (1.0 + 3.0 * k_kappa * x_sq)

    @triton.jit
    def _swiglu_grads(g, u, d):
        """(d gate, d up) of silu(g) * u for upstream ``d``."""
        s = tl.sigmoid(g)
        return d * u * s * (1.0 + g * (1.0 - s)), d * g * s

    @triton.jit
    def _rounded(x, OUT_BF16: tl.constexpr):
        """(the output's bits, their value in float32) of float32 ``x``, rounded to nearest even."""
        bits = out_bits(x, OUT_BF16)
        if OUT_BF16:
            val = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            val = bits.to(tl.float32)
        return bits, val

    @triton.jit
    def _act_bwd_mvue_kernel(z, dh, dz, seed_ptr, vals, meta, m_rows, k_cols, z_r, h_r, h_c, n_ct,
                             ACT: tl.constexpr, OUT_BF16: tl.constexpr, BC: tl.constexpr, BIG: tl.constexpr,
                             ROUNDS: tl.constexpr = PHILOX_ROUNDS):
        """Rows band*64.. of dz^T (features) x tokens pc*BC..: z^T and dz^T row-major with row
        stride ``z_r``, dh^T read through ``h_r`` per feature and ``h_c`` per token; dz written
        densely, its MVUE estimate compressed into ``vals``/``meta``."""
        G: tl.constexpr = BC // 4
        band, pc = tl.program_id(0), tl.program_id(1)
        r = band * 64 + tl.arange(0, 64)[:, None]  # (64, 1) features
        c = pc * BC + tl.arange(0, BC)[None, :]  # (1, BC) tokens
        if BIG:  # offsets past 2^31: 64-bit index arithmetic
            r, c = r.to(tl.int64), c.to(tl.int64)
        ok = (r < m_rows) & (c < k_cols)
        if ACT == 0:  # GELU (tanh): dz = dh * gelu'(z), one feature per row of dz^T
            x = tl.load(z + r * z_r + c, mask=ok, other=0.0).to(tl.float32)
            d = tl.load(dh + r * h_r + c * h_c, mask=ok, other=0.0).to(tl.float32)
            grad = d * _gelu_tanh_grad(x)
        else:  # SwiGLU: feature pairs (gate_j, up_j) are rows 2j, 2j+1 of dz^T
            j = band * 32 + tl.arange(0, 32)[:, None]
            if BIG:
                j = j.to(tl.int64)
            okp = (j < m_rows // 2) & (c < k_cols)
            g = tl.load(z + (2 * j) * z_r + c, mask=okp, other=0.0).to(tl.float32)
            u = tl.load(z + (2 * j + 1) * z_r + c, mask=okp, other=0.0).to(tl.float32)
            d = tl.load(dh + j * h_r + c * h_c, mask=okp, other=0.0).to(tl.float32)
            dg, du = _swiglu_grads(g, u, d)
            grad = tl.reshape(tl.permute(tl.join(dg, du), (0, 2, 1)), (64, BC))  # (32, 2, BC): rows 2j, 2j+1
        bits, val = _rounded(grad, OUT_BF16)
        tl.store(dz + r * z_r + c, bits, mask=ok)
        x0, x1, x2, x3 = quads(val, G)
        a0, a1, a2, a3 = mvue_weights(tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3))
        # the counters of the standalone kernel's tile-load path (two groups of a row per Philox call)
        u1, u2 = group_uniforms(seed_ptr, r, pc, k_cols, G, ROUNDS)
        k0, k1, k2, k3 = mvue_keep(a0, a1, a2, a3, u1, u2)
        i0 = tl.where(k0, 0, tl.where(k1, 1, 2))
        i1 = tl.where(k3, 3, tl.where(k2, 2, 1))
        y0, y1 = pick(k0, k1, k2, k3, x0, x1, x2, x3)
        y0, y1 = mvue_rescale(y0, y1, k0, k1, k2, k3, a0, a1, a2, a3)
        store_compressed(out_bits(y0, OUT_BF16), out_bits(y1, OUT_BF16), i0, i1, r, band, pc, m_rows, k_cols, n_ct,
                         vals, meta, BC)

    _act_bwd_mvue_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))],
        key=["m_rows", "k_cols", "z_r", "h_r", "h_c", "ACT"],
    )(_act_bwd_mvue_kernel)

_launch: dict[tuple, tuple[int, int]] = {}  # (shape, strides, dtypes, constants) -> the tuned (BC, warps)


def _big(*ts: torch.Tensor) -> bool:
    return any(sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride())) + 1 >= 2**31 for t in ts)


def act_backward_mvue(z: torch.Tensor, dh: torch.Tensor, act: int, seed: torch.Tensor,
                      tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dz, the MVUE 2:4 estimate of dz^T compressed for cuSPARSELt) from the saved activation
    input ``z`` (T, N), column-major (z^T stored row-major), and ``dh`` (T, N/2 for SwiGLU, else
    T, N; any strides). ``dz`` comes back column-major in z's dtype; the estimate is 2:4 along tokens, with
    the Philox ``seed`` (an int tensor on the device). T must be a multiple of 32. ``tile`` =
    (tokens, warps) fixes the launch instead of the autotuned one (tests, benchmarks)."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's fused activation kernels need Triton (pip install triton)")
    if act not in (GELU_TANH, SWIGLU):
        raise ValueError(f"act_backward_mvue: act must be GELU_TANH or SWIGLU, got {act!r}")
    if z.dim() != 2 or z.dtype not in DTYPES:
        raise ValueError(f"act_backward_mvue: z must be a 2-D bfloat16 or float16 tensor, got {tuple(z.shape)} "
                         f"{z.dtype}")
    t, n = z.shape
    if t % 32 or (act == SWIGLU and n % 2):
        raise ValueError(f"act_backward_mvue: tokens must be a multiple of 32 (and SwiGLU's features even), "
                         f"got shape {(t, n)}")
    want = (t, n // 2) if act == SWIGLU else (t, n)
    if tuple(dh.shape) != want:
        raise ValueError(f"act_backward_mvue: dh must have shape {want}, got {tuple(dh.shape)}")
    if z.stride(0) != 1 or z.stride(1) < t:
        raise ValueError(f"act_backward_mvue: z must be column-major (z^T row-major), got strides {z.stride()}")
    dz = torch.empty_strided(z.shape, z.stride(), dtype=z.dtype, device=z.device)
    buf = torch.empty(compressed_size(n, t, 2), dtype=torch.uint8, device=z.device)
    nval = n * t // 2
    bits = torch.int16 if z.dtype == torch.bfloat16 else torch.float16  # bf16 is written as its bits
    args = (z, dh, dz.view(bits), seed, buf[: nval * 2].view(bits), buf[nval * 2:].view(torch.int16), n, t,
            z.stride(1), dh.stride(1), dh.stride(0), t // 32)
    consts = dict(ACT=act, OUT_BF16=z.dtype == torch.bfloat16, BIG=_big(z, dh))
    rows = triton.cdiv(n, 64)
    launch_tuned(_act_bwd_mvue_kernel, _act_bwd_mvue_tuned if z.is_cuda else None,
                 lambda meta: (rows, triton.cdiv(t, meta["BC"])), args, consts, names=("BC",), default=(BC,),
                 cache=_launch, key=(t, n, z.stride(), dh.stride(), z.dtype, dh.dtype, tuple(consts.values())),
                 tile=tile, on_gpu=z.is_cuda)
    return dz, buf
