"""y = x W^T (+ b) for 1 to 16 tokens (decoding), with W 2:4 read as stored: kept values and 2-bit
positions (``twofour.inference.packed``), 0.5625x of the dense bf16 bytes.

At a few tokens a linear layer is bound by reading its weight, and cuSPARSELt's GEMM needs at
least 8 columns of padded input; these kernels stream the compact weight once instead. Four
variants, each a Triton kernel:

* ``quad``, ``quad_multi`` and ``quad_mma`` (:mod:`twofour.kernels.gemv24_quad`), for bf16/fp16
  and inputs a multiple of 8 (every layer a GPU runs sparse): the values read as int64 words of
  two groups, with the position byte of the same two groups, in one (rows, quads) layout
  throughout; the products on CUDA cores (``quad``, one token; ``quad_multi``, 2 to
  :data:`MULTI_TOKENS`) or on tensor cores (``quad_mma``, the tokens padded to 16, x permuted
  by :func:`permute_x`).
* ``pairs`` (:func:`_gemv24_pairs_kernel`), for any float dtype and inputs a multiple of 4: each
  group's two values read as one word, its code from the position byte by a shift, x as four
  loads, one per group entry.

With a split of the inputs (split-K), several programs share each band of rows, one input range
each, and a second small kernel sums their float32 partials and adds the bias: more programs in
flight where a layer has few output rows and long ones (a down projection). Variant, tile,
warps, pipeline stages and split are measured once per shape, token bucket and dtype through
:func:`twofour.dispatch.choose` (key ``gemv24:...``; :func:`twofour.dispatch.choice_lines`).

:func:`reference` is the same product in plain torch; the tests run the kernels against it
under Triton's interpreter on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F

from .. import dispatch
from .gemv24_quad import quad_kernels
from .layout import positions_width, unpack_24
from .triton_common import HAS_TRITON

if HAS_TRITON:  # the reference path needs no Triton
    import triton
    import triton.language as tl

    from .gemv24_quad import _permute_x_kernel, _store_rows, _sum_splits

__all__ = ["gemv24", "reference", "MAX_TOKENS", "MULTI_TOKENS", "permute_x",
           "HAS_TRITON", "CONFIGS", "Config", "configs_for", "launch",
           "DOT_MIN"]

#: The most tokens (rows of x) the kernels take; more go to cuSPARSELt's GEMM.
MAX_TOKENS = 16


class _Launch(NamedTuple):
    kernel: str
    rows: int
    inputs: int
    warps: int
    split: int = 1
    stages: int = 3


#: tl.dot's smallest M, N and K for 16-bit operands (Triton refuses to build a smaller one on the GPU;
#: its interpreter does not check, so :func:`dot_shape` is what the CPU tests check)
DOT_MIN = 16
_DOT_TOKENS = DOT_MIN  # the tensor-core kernels pad the tokens to tl.dot's smallest N
_DOT = ("quad_mma",)  # the variants that multiply on tensor cores
#: The most tokens the CUDA-core multi-token kernel takes (one accumulator a token)
MULTI_TOKENS = 8
_STEP = {"quad": 8, "quad_multi": 8, "quad_mma": 8, "pairs": 4}  # inputs a step: quads or groups


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


class Config(_Launch):
    """One launch of a 2:4 GEMV: the kernel variant, rows of y per program, inputs per loop step,
    warps, input splits (split-K) and software-pipeline stages. Checked when made, so that no
    configuration reaches the GPU that Triton can't build (a ``tl.dot`` under :data:`DOT_MIN`)."""

    __slots__ = ()

    def __new__(cls, kernel: str, rows: int, inputs: int, warps: int, split: int = 1, stages: int = 3) -> Config:
        if kernel not in _STEP:
            raise ValueError(f"gemv24 Config: kernel must be one of {', '.join(_STEP)}, got {kernel!r}")
        if not (_pow2(rows) and _pow2(inputs) and _pow2(warps) and inputs % _STEP[kernel] == 0
                and split >= 1 and stages >= 1):
            raise ValueError(f"gemv24 Config: rows, inputs (a multiple of {_STEP[kernel]}) and warps must be powers "
                             f"of two, split and stages >= 1; got {kernel} {rows}x{inputs} w{warps} s{split} p{stages}")
        if kernel in _DOT and min(rows, inputs // 8) < DOT_MIN:
            raise ValueError(f"gemv24 Config: {kernel}'s tl.dot needs >= {DOT_MIN} rows and >= {DOT_MIN} quads "
                             f"({8 * DOT_MIN} inputs) a step; got {rows}x{inputs}")
        return super().__new__(cls, kernel, rows, inputs, warps, split, stages)

    @property
    def name(self) -> str:
        return f"{self.kernel} {self.rows}x{self.inputs} w{self.warps} s{self.split} p{self.stages}"

    @property
    def dot_shape(self) -> tuple[int, int, int] | None:
        """(M, N, K) of each ``tl.dot`` the launch builds: (rows, padded tokens, quads a step) for
        the tensor-core variants; None for the kernels without one."""
        return (self.rows, _DOT_TOKENS, self.inputs // 8) if self.kernel in _DOT else None


_SPLITS = (1, 2, 3, 4, 6, 8)  # 3 and 6: fewer partial waves where the bands are not a multiple of the SMs
#: What the GPU measures per shape: ``quad`` (CUDA cores) tiles for one token, ``quad_multi``
#: (CUDA cores) for 2 to :data:`MULTI_TOKENS`, ``quad_mma`` (tensor cores) for 1 to
#: 16, each at every split of :data:`_SPLITS`; ``pairs`` wherever they fit (the only ones where the
#: quad kernels can't read the weight: float32, inputs not a multiple of 8).
CONFIGS = tuple(
    [Config("quad", r, i, w, s) for r, i, w in ((8, 256, 2), (16, 256, 4), (16, 512, 4), (32, 256, 4),
                                                (32, 512, 8)) for s in _SPLITS]
    + [Config("quad_multi", r, i, w, s) for r, i, w in ((128, 32, 4), (256, 32, 4), (512, 32, 8), (64, 32, 2))
       for s in _SPLITS]
    + [Config("quad_mma", r, i, w, s, p) for r, i, w, p in ((64, 256, 4, 3), (64, 512, 4, 2), (128, 512, 8, 2),
                                                            (64, 512, 4, 3)) for s in _SPLITS]
    + [Config("pairs", r, i, w, s) for r, i, w, s in ((16, 256, 4, 1), (8, 256, 4, 4))])


def _block_tokens(t: int) -> int:
    return 1 << max(0, (t - 1).bit_length())


def _quad_ok(values: torch.Tensor, k: int) -> bool:
    """Whether the quad kernels can read this weight: 16-bit values, whole quads of 8 inputs."""
    return values.element_size() == 2 and k % 8 == 0 and values.storage_offset() % 4 == 0


def configs_for(tokens: int, quad: bool = True) -> list[Config]:
    """The configurations the GPU measures for ``tokens`` rows of x: the ``pairs`` ones that fit
    (at most 32 float32 accumulators a thread), and with ``quad`` (the weight is one the quad
    kernels read, :func:`_quad_ok`) the quad kernels' for that many tokens."""
    bt = _block_tokens(tokens)
    pairs = [c for c in CONFIGS if c.kernel == "pairs" and bt * c.rows * (c.inputs // 4) <= 32 * 32 * c.warps]
    if not quad:
        return pairs or [CONFIGS[-1]]
    fits = {"quad": tokens == 1, "quad_multi": 1 < tokens <= MULTI_TOKENS, "quad_mma": True}
    return [c for c in CONFIGS if fits.get(c.kernel, False)] + pairs


_INTERPRETER_CONFIG = Config("pairs", 16, 128, 4)


if HAS_TRITON:

    @triton.jit
    def _place(v0, v1, code):
        """A group's four weight entries from its two kept values and its code i0 | i1 << 2
        (zero where neither was kept): four tensors of v0's shape."""
        i0 = code & 3
        i1 = code >> 2
        e0 = tl.where(i0 == 0, v0, tl.where(i1 == 0, v1, 0.0))
        e1 = tl.where(i0 == 1, v0, tl.where(i1 == 1, v1, 0.0))
        e2 = tl.where(i0 == 2, v0, tl.where(i1 == 2, v1, 0.0))
        e3 = tl.where(i0 == 3, v0, tl.where(i1 == 3, v1, 0.0))
        return e0, e1, e2, e3

    @triton.jit
    def _accumulate(acc, e0, e1, e2, e3, x0, x1, x2, x3):
        """acc (BT, BO, G) += each (BO, G) weight entry times its (BT, G) entry of x."""
        acc += e0[None, :, :] * x0[:, None, :]
        acc += e1[None, :, :] * x1[:, None, :]
        acc += e2[None, :, :] * x2[:, None, :]
        acc += e3[None, :, :] * x3[:, None, :]
        return acc

    @triton.jit
    def _group_entries(pairs_ptr, pos_ptr, pos_stride, o, om, g, K, VALUE_BITS: tl.constexpr,
                       IS_BF16: tl.constexpr):
        """The four weight entries of groups ``g`` in rows ``o``: four (BO, G) float32 tensors,
        each group's kept pair read as one word and placed by its 4-bit code (zero elsewhere)."""
        m2 = om[:, None] & (g < K // 4)[None, :]
        w = tl.load(pairs_ptr + o[:, None] * (K // 4) + g[None, :], mask=m2, other=0)  # (BO, G) words
        if VALUE_BITS == 16:
            lo = (w & 0xFFFF).to(tl.uint16)
            hi = ((w >> 16) & 0xFFFF).to(tl.uint16)
            if IS_BF16:
                v0 = lo.to(tl.bfloat16, bitcast=True).to(tl.float32)
                v1 = hi.to(tl.bfloat16, bitcast=True).to(tl.float32)
            else:
                v0 = lo.to(tl.float16, bitcast=True).to(tl.float32)
                v1 = hi.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            v0 = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            v1 = ((w >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        pb = tl.load(pos_ptr + o[:, None] * pos_stride + (g // 2)[None, :], mask=m2, other=0).to(tl.int32)
        return _place(v0, v1, (pb >> ((g & 1) * 4)[None, :]) & 15)

    @triton.jit
    def _gemv24_pairs_kernel(x_ptr, sxt, sxk, pairs_ptr, pos_ptr, pos_stride, bias_ptr, y_ptr, T, N, K, k_per,
                             HAS_BIAS: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                             PARTIAL: tl.constexpr, VALUE_BITS: tl.constexpr, IS_BF16: tl.constexpr):
        """Rows ``BO`` of y over inputs [s k_per, (s + 1) k_per) for split s, any float dtype,
        every operand loaded straight into the layout the products use, no splits or joins (each a
        round trip through shared memory between barriers): a group's two values as one word (two
        16-bit halves, or two 32-bit ones for float32), its 4-bit code from the position byte by a
        shift, and x as four loads, one per group entry. One token (decoding at batch 1)
        accumulates in two dimensions, in the weights' layout."""
        G: tl.constexpr = BK // 4
        o = tl.program_id(0) * BO + tl.arange(0, BO)
        k_lo = tl.program_id(1) * k_per
        t = tl.arange(0, BT)
        om = o < N
        tm = t < T
        if BT == 1:
            acc = tl.zeros((BO, G), dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BK):
                g = k0 // 4 + tl.arange(0, G)
                e0, e1, e2, e3 = _group_entries(pairs_ptr, pos_ptr, pos_stride, o, om, g, K, VALUE_BITS, IS_BF16)
                xp = x_ptr + (4 * g) * sxk
                xm = g < K // 4
                acc += e0 * tl.load(xp, mask=xm, other=0.0).to(tl.float32)[None, :]
                acc += e1 * tl.load(xp + sxk, mask=xm, other=0.0).to(tl.float32)[None, :]
                acc += e2 * tl.load(xp + 2 * sxk, mask=xm, other=0.0).to(tl.float32)[None, :]
                acc += e3 * tl.load(xp + 3 * sxk, mask=xm, other=0.0).to(tl.float32)[None, :]
            y = tl.sum(acc, axis=1)[None, :]  # (1, BO)
        else:
            acc3 = tl.zeros((BT, BO, G), dtype=tl.float32)
            for k0 in range(k_lo, tl.minimum(K, k_lo + k_per), BK):
                g = k0 // 4 + tl.arange(0, G)
                e0, e1, e2, e3 = _group_entries(pairs_ptr, pos_ptr, pos_stride, o, om, g, K, VALUE_BITS, IS_BF16)
                xp = x_ptr + t[:, None] * sxt + (4 * g)[None, :] * sxk  # (BT, G): entry 0 of each group
                xm = tm[:, None] & (g < K // 4)[None, :]
                acc3 = _accumulate(acc3, e0, e1, e2, e3, tl.load(xp, mask=xm, other=0.0).to(tl.float32),
                                   tl.load(xp + sxk, mask=xm, other=0.0).to(tl.float32),
                                   tl.load(xp + 2 * sxk, mask=xm, other=0.0).to(tl.float32),
                                   tl.load(xp + 3 * sxk, mask=xm, other=0.0).to(tl.float32))
            y = tl.sum(acc3, axis=2)  # (BT, BO)
        _store_rows(y, y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS, PARTIAL)


def reference(x: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in plain torch: x @ unpack(values, positions)^T + bias."""
    return F.linear(x, unpack_24(values, positions, x.shape[-1]).to(x.dtype), bias)


def launch(x: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None,
           y: torch.Tensor, cfg: Config) -> None:
    """Write y = x W^T (+ bias) with the configuration ``cfg`` (inputs checked by :func:`gemv24`)."""
    t, k = x.shape
    n = values.shape[0]
    quad = cfg.kernel != "pairs"
    units = k // 8 if quad else k  # what a split divides: quads, or inputs
    step = cfg.inputs // 8 if quad else cfg.inputs
    split = max(1, min(cfg.split, triton.cdiv(units, step)))  # no split without inputs
    per = triton.cdiv(triton.cdiv(units, split), step) * step
    split = triton.cdiv(units, per)
    b = bias if bias is not None else values
    out = y if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.rows), split)
    common = dict(HAS_BIAS=bias is not None, BO=cfg.rows, PARTIAL=split > 1, num_warps=cfg.warps,
                  num_stages=cfg.stages)
    if quad:
        even = n % cfg.rows == 0 and units % step == 0
        bt = {"quad": 1, "quad_multi": _block_tokens(t)}.get(cfg.kernel, _DOT_TOKENS)
        # x as int64 words of 4 inputs where its rows allow (always for the CUDA-core kernels)
        aligned = x.stride(1) == 1 and x.data_ptr() % 8 == 0
        if cfg.kernel == "quad":
            xin = (x[0] if aligned else x[0].clone()).view(torch.int64)
        elif cfg.kernel == "quad_multi":
            xin = (x if aligned and x.stride(0) % 4 == 0 else x.clone(memory_format=torch.contiguous_format)
                   ).view(torch.int64)
        else:
            xin = permute_x(x, bt)
        quad_kernels()[cfg.kernel][grid](xin, xin.stride(0), x.stride(1), values.view(torch.int64), positions, b,
                                         out, t, n, units, per, BT=bt, BQ=step, EVEN=even,
                                         IS_BF16=values.dtype == torch.bfloat16, **common)
    else:  # each group's two values as one word: (N, K/4) of twice the value's width
        words = values.view(torch.int64 if values.element_size() == 4 else torch.int32)
        _gemv24_pairs_kernel[grid](x, x.stride(0), x.stride(1), words, positions, positions.stride(0), b, out, t, n,
                                   k, per, BT=_block_tokens(t), BK=cfg.inputs, VALUE_BITS=8 * values.element_size(),
                                   IS_BF16=values.dtype == torch.bfloat16, **common)
    if split > 1:
        _sum_splits[(triton.cdiv(t * n, 1024),)](out, b, y, t * n, n, split, HAS_BIAS=bias is not None, BLOCK=1024,
                                                 num_warps=4)


def permute_x(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """x (T, K) as the ``quad_mma`` kernel reads it: (8, K/8, tokens), entry (e, q, t) = x[t, 8 q + e],
    tokens past T zero (one small kernel)."""
    t, k = x.shape
    out = torch.empty(8, k // 8, tokens, dtype=x.dtype, device=x.device)
    _permute_x_kernel[(triton.cdiv(out.numel(), 1024),)](x, x.stride(0), x.stride(1), out, t, k // 8, BT=tokens,
                                                         BLOCK=1024)
    return out


def gemv24(x: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: Config | None = None) -> torch.Tensor:
    """y (T, N) = x (T, K) W^T (+ bias), W given as ``values`` (N, K/2) and ``positions``
    (N, ceil(K/8)) uint8; T <= :data:`MAX_TOKENS`; x, values and bias of one dtype, y in it.

    ``config`` (a :class:`Config`) fixes the launch; otherwise the GPU measures
    :func:`configs_for` once per shape, token bucket and dtype (:func:`twofour.dispatch.choose`;
    while a CUDA graph is being captured an unmeasured shape takes the first)."""
    if not HAS_TRITON:
        raise RuntimeError("twofour's 2:4 GEMV kernel needs Triton (pip install triton)")
    t, k = x.shape
    n = values.shape[0]
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"gemv24: takes 1 to {MAX_TOKENS} tokens, got {t}")
    if values.shape != (n, k // 2) or k % 4 or positions.shape != (n, positions_width(k)):
        raise ValueError(f"gemv24: x {tuple(x.shape)}, values {tuple(values.shape)} and positions "
                         f"{tuple(positions.shape)} don't describe one (N, K) 2:4 weight")
    if values.dtype != x.dtype or positions.dtype != torch.uint8 or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"gemv24: x, values and bias must share a dtype and positions be uint8; got x {x.dtype}, "
                        f"values {values.dtype}, positions {positions.dtype}")
    values, positions = values.contiguous(), positions.contiguous()
    if values.storage_offset() % 2:  # read as pairs of values: words must start on a pair
        values = values.clone()
    quad = _quad_ok(values, k)
    if config is not None and config.kernel != "pairs" and not quad:
        raise ValueError(f"gemv24: the {config.kernel} kernel reads 16-bit values and inputs a multiple of 8; got "
                         f"{values.dtype}, {k} inputs")
    most = {"quad": 1, "quad_multi": MULTI_TOKENS}.get(config.kernel, MAX_TOKENS) if config else MAX_TOKENS
    if t > most:
        raise ValueError(f"gemv24: the {config.kernel} kernel takes at most {most} token(s), got {t}")
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if config is None:
        config = _config(x, values, positions, bias, y, quad) if x.is_cuda else _INTERPRETER_CONFIG
    launch(x, values, positions, bias, y, config)
    return y


_chosen: dict[tuple, Config] = {}
dispatch.on_choice_change(lambda: _chosen.clear())  # a choice set or cleared is looked up again


def _config(x, values, positions, bias, y, quad: bool) -> Config:
    """The measured configuration (:func:`_choose`), kept per shape once measured or recorded: a
    decoding step calls the GEMV per layer, and rebuilding the candidates and their dispatch key at
    each call would cost more host time than the kernel takes, which the dispatch's timing of the
    inference routes would count against ``sparse_gemv`` (docs/notes/gemv24.md, "Eager timing of the
    routes")."""
    where = (values.shape[0], x.shape[1], _block_tokens(x.shape[0]), x.dtype, bias is not None, quad, dispatch.gemm)
    hit = _chosen.get(where)
    if hit is None:
        hit = _choose(x, values, positions, bias, y, quad)
        if dispatch.can_measure():  # measured or recorded: not a CUDA-graph capture's stand-in
            _chosen[where] = hit
    return hit


def _choose(x, values, positions, bias, y, quad: bool) -> Config:
    """The measured fastest configuration for this shape (configurations that fail to build or
    run are left out, with a warning: :func:`twofour.dispatch.working`)."""
    t, k = x.shape
    n = values.shape[0]
    cands = {c.name: c for c in configs_for(t, quad)}
    calls = {name: (lambda c=c: launch(x, values, positions, bias, y, c)) for name, c in cands.items()}
    where = (n, k, _block_tokens(t), x.dtype, bias is not None)
    calls = dispatch.working("gemv24", calls, where, "the 2:4 GEMV configuration")
    order = "bias" if bias is not None else "nobias"
    return cands[dispatch.choose("gemv24", n, k, _block_tokens(t), order, x.dtype, calls, graphed=True)]
