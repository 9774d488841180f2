"""MVUE's 2:4 estimate of dY^T written straight into cuSPARSELt's compressed e4m3 layout (Triton).

The FP8 weight gradient on the MVUE estimate, dW = est(dY^T) X, can run as an FP8 2:4 GEMM
when both of its operands are e4m3. Quantizing the estimate with current scaling would need
its amax first, so a separate estimate, amax and cast would read dY's size four times. The
estimate has a bound instead: each kept value is y / p, p its inclusion probability, and over a
group of 4 that is at most twice the group's largest magnitude (docs/design.md, section 1). So
``scale = 2 * amax(dY) / 448`` (twice the scale of dY's own e4m3 quantization, which the dX
GEMM computes anyway) can never overflow, and one kernel reads dY^T once (in place, through
its strides), draws the pair to keep, rescales it, divides by ``scale``, rounds to e4m3 and
writes the values and the e4m3 metadata tiles (``layout.py``). The draws are the standalone
MVUE kernel's (``compress.py``): for a seed, both keep the same entries.

Tested against plain torch (the reference estimate, quantized and compressed by
``layout.compress_reference``) under Triton's interpreter, and on the GPU.
"""

from __future__ import annotations

import torch

from .layout import compressed_size, supported_shape
from .triton_common import HAS_TRITON, PHILOX_ROUNDS, fp8_constants, launch_tuned

__all__ = ["mvue_e4m3", "SCALE_BOUND"]

#: The estimate's largest magnitude over dY's: ``mvue_e4m3``'s scale is this times dY's e4m3 scale.
SCALE_BOUND = 2.0

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import (
        load_groups,
        mvue_draws,
        mvue_rescale,
        mvue_weights,
        pick,
        store_compressed_e4m3,
        to_grid,
    )

    #: e4m3's constants as the quantization kernels derive them (the reciprocal is not needed here)
    _E4M3 = {k: v for k, v in fp8_constants(torch.float8_e4m3fn).items() if k != "INV_FMAX"}

    @triton.jit
    def _mvue_e4m3_kernel(src, sr, sc, m_rows, k_cols, u_ptr, seed_ptr, scale_ptr, vals, meta, n_ct,
                          HAS_U: tl.constexpr, BIG: tl.constexpr, QUAD_LOADS: tl.constexpr,
                          FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BC: tl.constexpr,
                          ROUNDS: tl.constexpr = PHILOX_ROUNDS):
        """One 64-row band x BC columns: MVUE's kept pair of each group, rescaled, divided by the
        scale, rounded to e4m3 and written compressed."""
        G: tl.constexpr = BC // 4
        band, pc = tl.program_id(0), tl.program_id(1)
        r = band * 64 + tl.arange(0, 64)[:, None]  # (64, 1)
        c = pc * BC + tl.arange(0, BC)[None, :]  # (1, BC)
        ok = (r < m_rows) & (c < k_cols)
        if BIG:  # offsets past 2^31: 64-bit index arithmetic
            r, c = r.to(tl.int64), c.to(tl.int64)
        x0, x1, x2, x3 = load_groups(src, sr, sc, r, pc, r * sr + c * sc, ok, m_rows, k_cols, G, QUAD_LOADS)
        a0, a1, a2, a3 = mvue_weights(tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3))
        k0, k1, k2, k3 = mvue_draws(a0, a1, a2, a3, u_ptr, seed_ptr, r, band, pc, m_rows, k_cols, G, HAS_U,
                                    QUAD_LOADS, ROUNDS)
        i0 = tl.where(k0, 0, tl.where(k1, 1, 2))
        i1 = tl.where(k3, 3, tl.where(k2, 2, 1))
        y0, y1 = pick(k0, k1, k2, k3, x0, x1, x2, x3)
        y0, y1 = mvue_rescale(y0, y1, k0, k1, k2, k3, a0, a1, a2, a3)
        scale = tl.load(scale_ptr)
        q0 = to_grid(tl.clamp(tl.math.div_rn(y0, scale), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), MBITS, EMIN)
        q1 = to_grid(tl.clamp(tl.math.div_rn(y1, scale), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL), MBITS, EMIN)
        vv = tl.reshape(tl.join(q0, q1), (64, BC // 2)).to(vals.dtype.element_ty)  # (64, G, 2) -> row-major
        store_compressed_e4m3(vv, i0, i1, r, band, pc, m_rows, k_cols, n_ct, vals, meta, BC)

    _mvue_e4m3_tuned = triton.autotune(
        configs=[triton.Config({"BC": bc}, num_warps=w) for bc, w in ((64, 2), (64, 4), (128, 4), (128, 8),
                                                                       (256, 8))],
        key=["m_rows", "k_cols", "sr", "sc"],
    )(_mvue_e4m3_kernel)

BC = 128  # columns per program off the GPU; on the GPU autotuned over 64-256
_launch: dict[tuple, tuple[int, int]] = {}  # (shape, strides, constants) -> the tuned (BC, warps)


def mvue_e4m3(x: torch.Tensor, scale: torch.Tensor, *, seed: torch.Tensor | None = None,
              u: torch.Tensor | None = None) -> torch.Tensor:
    """cuSPARSELt's compressed e4m3 bytes (uint8) of ``sat(mvue_24(x) / scale)``: MVUE's unbiased
    2:4 estimate of the (M, K) matrix ``x`` (any strides; groups along K, K a multiple of 64)
    divided by ``scale`` (a float32 scalar on the device) and rounded to e4m3, saturating. With
    ``scale`` at least :data:`SCALE_BOUND` times ``amax(x) / 448`` nothing saturates. The draws
    come from ``seed`` (a Philox int64 tensor of one element on the device; random if omitted) or
    the uniforms ``u`` (two per group, a contiguous (M, K/2) tensor, as ``compress``'s). On the
    GPU the tile width and warps are autotuned once per shape."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's fused compression needs Triton (pip install triton)")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mvue_e4m3 takes a 2-D float32, bf16 or fp16 matrix, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if not supported_shape(m, k, 1):
        raise ValueError(f"mvue_e4m3: K must be a multiple of 64, got shape {(m, k)}")
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != x.device:
        raise ValueError("mvue_e4m3: scale must be one float32 value on x's device")
    if u is not None and (u.shape != (m, k // 2) or not u.is_contiguous()):
        raise ValueError(f"mvue_e4m3: u must be a contiguous ({m}, {k // 2}) tensor (two uniforms per group)")
    if u is None and seed is None:
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
    buf = torch.empty(compressed_size(m, k, 1), dtype=torch.uint8, device=x.device)
    nval = m * k // 2
    vals, meta = buf[:nval].view(torch.float8_e4m3fn), buf[nval:].view(torch.int32)
    span = (m - 1) * abs(x.stride(0)) + (k - 1) * abs(x.stride(1)) + 1
    consts = dict(HAS_U=u is not None, BIG=max(span, m * k) >= 2**31, QUAD_LOADS=x.stride(0) == 1 and k > 1,
                  **_E4M3)
    args = (x, x.stride(0), x.stride(1), m, k, u if u is not None else scale, seed if seed is not None else scale,
            scale, vals, meta, k // 64)
    launch_tuned(_mvue_e4m3_kernel, _mvue_e4m3_tuned if x.is_cuda else None,
                 lambda meta_: (triton.cdiv(m, 64), triton.cdiv(k, meta_["BC"])), args, consts, names=("BC",),
                 default=(BC,), cache=_launch, key=(m, k, x.stride(0), x.stride(1), x.dtype, tuple(consts.values())),
                 on_gpu=x.is_cuda)
    return buf
