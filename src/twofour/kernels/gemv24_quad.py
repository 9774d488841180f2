"""The 2:4 GEMV kernels that read the stored weight in quads: y = x W^T (+ b) for 1-16 tokens,
bf16/fp16 values, inputs a multiple of 8 (:func:`twofour.kernels.gemv24.gemv24` launches them).

A row's values viewed as int64 words hold two groups each (four 16-bit values), exactly the
groups whose two 4-bit codes share one position byte. So a program loads two tiles of one
(rows, quads) shape: the words (8 bytes an element, 16-byte vector loads along the row) and the
position bytes, and everything after is elementwise in that layout: no split, join or reshape
(each a round trip through shared memory), one layout for the whole loop. The two groups of a
quad are handled one after the other (low half of the word with the low nibble, then the high
ones), so the sum over the inputs runs in an order other than the columns', which a sum may.

* :func:`_quad_fma_kernel` (CUDA cores, one token): each kept value is multiplied by the entry
  of x its position selects, x read from L1 as int64 words of a group's four inputs and the
  entry taken by a shift of 16 x its position, so a group costs two multiply-adds rather than
  the dense four. (With more tokens, a (tokens, rows, quads) accumulator needs layout
  conversions in the loop; those go to the next kernel.)
* :func:`_quad_dot_kernel` (tensor cores, tokens padded to 16): each group's four weight entries
  are placed in four (rows, quads) planes, one per position in the group, each multiplied with
  the matching (quads, tokens) columns of x by ``tl.dot``; the work per weight byte does not grow
  with the tokens. x is read as int64 words of a group's four inputs where its rows allow. On
  Hopper the weight tiles stream into shared memory by ``cp.async`` (16-byte, software-pipelined),
  are decoded in the tensor cores' register layout, and feed ``wgmma`` from registers
  (``benchmarks/inference/gemv_sass.py``).

Both split the inputs over several programs per band of rows where asked (float32 partials,
summed by :func:`_sum_splits`), so that a layer with few output rows still fills the GPU.
"""

from __future__ import annotations

from .triton_common import HAS_TRITON

if HAS_TRITON:
    import triton.language as tl
    from triton import jit
else:  # the module imports without Triton; its kernels are then never launched
    def jit(fn):
        return fn


@jit
def _store_rows(y, y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """y (BT, BO) to y[t, o] (+ bias) in y's dtype, or with PARTIAL (inputs split) as this split's float32
    partial at ``y_ptr`` + s T N (no bias), for :func:`_sum_splits`."""
    mask = tm[:, None] & om[None, :]
    if PARTIAL:
        tl.store(y_ptr + tl.program_id(1) * T * N + t[:, None] * N + o[None, :], y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + o, mask=om, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + t[:, None] * N + o[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _sum_splits(part_ptr, bias_ptr, y_ptr, TN, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = the SPLIT float32 partials summed (+ bias), in y's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < TN
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        y += tl.load(part_ptr + s * TN + i, mask=m, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + i % N, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=m)


@jit
def _load_quads(q_ptr, p_ptr, o, om, q, Q, EVEN: tl.constexpr):
    """The (BO, BQ) int64 words (two groups' four values each) and int32 position bytes of rows
    ``o`` and quads ``q``; unmasked where the launch knows every row and quad is in range."""
    offs = o[:, None] * Q + q[None, :]
    if EVEN:
        w = tl.load(q_ptr + offs)
        p = tl.load(p_ptr + offs)
    else:
        m = om[:, None] & (q < Q)[None, :]
        w = tl.load(q_ptr + offs, mask=m, other=0)
        p = tl.load(p_ptr + offs, mask=m, other=0x44)  # any valid code: its values are 0
    return w, p.to(tl.int32)


@jit
def _program(T, N, q_per, BT: tl.constexpr, BO: tl.constexpr):
    """This program's rows ``o`` (BO,), first quad, tokens ``t`` (BT,) and their masks."""
    o = tl.program_id(0) * BO + tl.arange(0, BO)
    t = tl.arange(0, BT)
    return o, tl.program_id(1) * q_per, t, o < N, t < T


@jit
def _half(w, p, S: tl.constexpr):
    """Group S (0: low, 1: high) of each quad: its 32-bit pair word and its two kept positions."""
    word = (w >> (32 * S)).to(tl.int32)  # truncates to the low 32 bits
    code = (p >> (4 * S)) & 15
    return word, code & 3, code >> 2


@jit
def _pair_f32(word, IS_BF16: tl.constexpr):
    """The two 16-bit values of a pair word in float32 (bf16 by shifts alone)."""
    if IS_BF16:
        v0 = (word << 16).to(tl.float32, bitcast=True)
        v1 = (word & -65536).to(tl.float32, bitcast=True)
    else:
        v0 = (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        v1 = ((word >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return v0, v1


@jit
def _pick(xw, i, IS_BF16: tl.constexpr):
    """Entry ``i`` (0-3) of each int64 word ``xw`` of four 16-bit inputs, in float32: one
    variable shift instead of a chain of selects."""
    bits = (xw >> (16 * i).to(tl.int64)).to(tl.int32)
    if IS_BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _quad_fma_kernel(x_ptr, sxt, sxk, q_ptr, p_ptr, bias_ptr, y_ptr, T, N, Q, q_per, HAS_BIAS: tl.constexpr,
                     BT: tl.constexpr, BO: tl.constexpr, BQ: tl.constexpr, PARTIAL: tl.constexpr,
                     EVEN: tl.constexpr, IS_BF16: tl.constexpr):
    """Rows ``BO`` of y over quads [s q_per, (s + 1) q_per) for split s, one token (BT = 1), on
    CUDA cores, x given as int64 words of 4 inputs (``x_ptr``: one group's inputs a word); the
    float32 partial sums kept per quad."""
    o, q_lo, t, om, tm = _program(T, N, q_per, BT, BO)
    acc = tl.zeros((BO, BQ), dtype=tl.float32)
    for q0 in range(q_lo, tl.minimum(Q, q_lo + q_per), BQ):
        q = q0 + tl.arange(0, BQ)
        w, p = _load_quads(q_ptr, p_ptr, o, om, q, Q, EVEN)
        for s in tl.static_range(2):
            word, i0, i1 = _half(w, p, s)
            v0, v1 = _pair_f32(word, IS_BF16)
            xw = tl.load(x_ptr + (2 * q + s)[None, :], mask=(q < Q)[None, :], other=0)  # the group's 4 inputs
            acc += v0 * _pick(xw, i0, IS_BF16) + v1 * _pick(xw, i1, IS_BF16)
    _store_rows(tl.sum(acc, axis=1)[None, :], y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS, PARTIAL)


@jit
def _plane(v0, v1, i0, i1, E: tl.constexpr):
    """Entry ``E`` of each group: v0 where it is the first kept position, v1 the second, else 0."""
    if E == 0:
        return tl.where(i0 == 0, v0, 0.0)
    elif E == 3:
        return tl.where(i1 == 3, v1, 0.0)
    else:
        return tl.where(i0 == E, v0, tl.where(i1 == E, v1, 0.0))


@jit
def _x_entry(xw, E: tl.constexpr, IS_BF16: tl.constexpr):
    """Entry ``E`` of int64 words of four 16-bit inputs, in their dtype (shift and bit cast)."""
    bits = (xw >> (16 * E)).to(tl.int32).to(tl.uint16)
    if IS_BF16:
        return bits.to(tl.bfloat16, bitcast=True)
    else:
        return bits.to(tl.float16, bitcast=True)


@jit
def _quad_dot_kernel(x_ptr, sxt, sxk, q_ptr, p_ptr, bias_ptr, y_ptr, T, N, Q, q_per, HAS_BIAS: tl.constexpr,
                     BT: tl.constexpr, BO: tl.constexpr, BQ: tl.constexpr, PARTIAL: tl.constexpr,
                     EVEN: tl.constexpr, IS_BF16: tl.constexpr, X_WORDS: tl.constexpr):
    """Rows ``BO`` of y over quads [s q_per, (s + 1) q_per) for split s, on tensor cores (BT >= 16).
    With ``X_WORDS`` x is given as int64 words of four inputs (``sxt`` in words): one (quads,
    tokens) load a group position instead of four."""
    o, q_lo, t, om, tm = _program(T, N, q_per, BT, BO)
    acc = tl.zeros((BO, BT), dtype=tl.float32)
    for q0 in range(q_lo, tl.minimum(Q, q_lo + q_per), BQ):
        q = q0 + tl.arange(0, BQ)
        xm = (q < Q)[:, None] & tm[None, :]
        w, p = _load_quads(q_ptr, p_ptr, o, om, q, Q, EVEN)
        for s in tl.static_range(2):
            word, i0, i1 = _half(w, p, s)
            v0, v1 = _pair_f32(word, IS_BF16)  # exact; each plane is rounded back to 16 bits losslessly
            if X_WORDS:
                xw = tl.load(x_ptr + (2 * q + s)[:, None] + t[None, :] * sxt, mask=xm, other=0)
            for e in tl.static_range(4):
                if X_WORDS:
                    xs = _x_entry(xw, e, IS_BF16)
                else:
                    xs = tl.load(x_ptr + (8 * q + 4 * s + e)[:, None] * sxk + t[None, :] * sxt, mask=xm, other=0.0)
                acc = tl.dot(_plane(v0, v1, i0, i1, e).to(xs.dtype), xs, acc)
    _store_rows(tl.trans(acc), y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS, PARTIAL)


def quad_kernels() -> dict[str, object]:
    """The kernels by variant name (empty without Triton)."""
    return {"quad": _quad_fma_kernel, "quad_dot": _quad_dot_kernel} if HAS_TRITON else {}
