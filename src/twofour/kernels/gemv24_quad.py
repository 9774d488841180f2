"""The 2:4 GEMV kernels that read the stored weight in quads: y = x W^T (+ b) for 1-16 tokens,
bf16/fp16 values, inputs a multiple of 8 (:func:`twofour.kernels.gemv24.gemv24` launches them).

A row's values viewed as int64 words hold two groups each (four 16-bit values), exactly the
groups whose two 4-bit codes share one position byte. So a program loads two tiles of one
(rows, quads) shape: the words (8 bytes an element, 16-byte vector loads along the row) and the
position bytes, and everything after is elementwise in that layout: no split, join or reshape
of the weight tiles (each a round trip through shared memory), one layout for the whole loop.
The two groups of a quad are handled one after the other (low half of the word with the low
nibble, then the high ones), so the sum over the inputs runs in an order other than the
columns', which a sum may.

* :func:`_quad_fma_kernel` (CUDA cores, one token): each kept value is multiplied by the entry
  of x its position selects, x read from L1 as int64 words of a group's four inputs and the
  entry taken by a shift of 16 x its position, so a group costs two multiply-adds rather than
  the dense four.
* :func:`_quad_multi_kernel` (CUDA cores, up to 8 tokens; a candidate from 2): each quad's eight
  weight entries placed once (zero where not kept) and multiplied with every token's inputs,
  one (rows, quads) accumulator a token; x read as 16-byte vectors of a token's inputs for the
  step's quads.
* :func:`_quad_mma_kernel` (tensor cores, tokens padded to 16): each group's four weight entries
  placed in four (rows, quads) planes, each multiplied by ``tl.dot`` with the matching (quads,
  tokens) tile of x, which comes permuted by position in the quad (:func:`_permute_x_kernel`)
  so that Triton streams it into shared memory by ``cp.async``; the weight tiles stream there
  too, are decoded in the tensor cores' register layout and feed ``wgmma`` from registers (as the
  SASS counts of ``benchmarks/inference/gemv_sass.py``, since removed, showed). The work per weight
  byte does not grow with the tokens.

Each splits the inputs over several programs per band of rows where asked (float32 partials,
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
def _placed(w, p, S: tl.constexpr):
    """Group S (0: low, 1: high) of each quad as its four dense 16-bit entries, (entry 1 | entry 0,
    entry 3 | entry 2) as two int32 words: each kept value shifted to its position (two 64-bit
    shifts and an or a group, where selecting each entry takes two compares and two selects)."""
    word = (w >> (32 * S)) & 0xFFFFFFFF
    code = (p >> (4 * S)) & 15
    dense = ((word & 0xFFFF) << (16 * (code & 3)).to(tl.int64)) | ((word >> 16) << (16 * (code >> 2)).to(tl.int64))
    return dense.to(tl.int32), (dense >> 32).to(tl.int32)


@jit
def _entry16(pair, HIGH: tl.constexpr, IS_BF16: tl.constexpr):
    """The low or high 16-bit entry of int32 words, as bf16/fp16 (bit casts)."""
    bits = ((pair >> 16) if HIGH else pair).to(tl.int16)
    return bits.to(tl.bfloat16 if IS_BF16 else tl.float16, bitcast=True)


@jit
def _x_quads(x_ptr, sxt, k, q0, Q, T, BQ: tl.constexpr, IS_BF16: tl.constexpr):
    """Token ``k``'s eight inputs of each of the quads q0 .. q0 + BQ: eight (BQ,) float32 tensors,
    from one contiguous load of 2 BQ int64 words (zero past the inputs); bf16 by one shift or
    mask an entry."""
    j = 2 * q0 + tl.arange(0, 2 * BQ)
    xw = tl.load(x_ptr + k * sxt + j, mask=j < tl.where(k < T, 2 * Q, 0), other=0)
    lo, hi = tl.split(tl.reshape(xw, (BQ, 2)))
    x0, x1 = _pair_f32(lo.to(tl.int32), IS_BF16)
    x2, x3 = _pair_f32((lo >> 32).to(tl.int32), IS_BF16)
    x4, x5 = _pair_f32(hi.to(tl.int32), IS_BF16)
    x6, x7 = _pair_f32((hi >> 32).to(tl.int32), IS_BF16)
    return x0, x1, x2, x3, x4, x5, x6, x7


@jit
def _token_dot(acc, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, k, q0, Q, T, BQ: tl.constexpr,
               IS_BF16: tl.constexpr):
    """acc (BO, BQ) + token ``k``'s products with the quads q0 .. q0 + BQ, whose eight weight
    entries (``e`` the low group's, ``f`` the high one's; (BO, BQ) float32) are placed already:
    eight multiply-adds an element, summed over the quads only at the end."""
    x0, x1, x2, x3, z0, z1, z2, z3 = _x_quads(x_ptr, sxt, k, q0, Q, T, BQ, IS_BF16)
    acc += e0 * x0[None, :] + e1 * x1[None, :] + e2 * x2[None, :] + e3 * x3[None, :]
    return acc + f0 * z0[None, :] + f1 * z1[None, :] + f2 * z2[None, :] + f3 * z3[None, :]


@jit
def _store_token(acc, k, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Token ``k``'s row of y from its (BO, BQ) partial sums, or its split's float32 partial."""
    y = tl.sum(acc, axis=1)
    m = o < tl.where(k < T, N, 0)  # om, for a token that exists
    if PARTIAL:
        tl.store(y_ptr + tl.program_id(1) * T * N + k * N + o, y, mask=m)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + o, mask=om, other=0.0).to(tl.float32)
        tl.store(y_ptr + k * N + o, y.to(y_ptr.dtype.element_ty), mask=m)


@jit
def _quad_multi_kernel(x_ptr, sxt, sxk, q_ptr, p_ptr, bias_ptr, y_ptr, T, N, Q, q_per, HAS_BIAS: tl.constexpr,
                       BT: tl.constexpr, BO: tl.constexpr, BQ: tl.constexpr, PARTIAL: tl.constexpr,
                       EVEN: tl.constexpr, IS_BF16: tl.constexpr):
    """Rows ``BO`` of y over quads [s q_per, (s + 1) q_per) for split s, up to 8 tokens (BT <= 8)
    on CUDA cores: each quad's eight weight entries placed once (float32, zero where not kept)
    and multiplied with every token's inputs; one (rows, quads) accumulator a token, in the
    weights' layout (no layout conversion in the loop); x given as int64 words of 4 inputs."""
    o, q_lo, t, om, tm = _program(T, N, q_per, BT, BO)
    a0 = tl.zeros((BO, BQ), dtype=tl.float32)
    a1 = tl.zeros((BO, BQ), dtype=tl.float32)
    a2 = tl.zeros((BO, BQ), dtype=tl.float32)
    a3 = tl.zeros((BO, BQ), dtype=tl.float32)
    a4 = tl.zeros((BO, BQ), dtype=tl.float32)
    a5 = tl.zeros((BO, BQ), dtype=tl.float32)
    a6 = tl.zeros((BO, BQ), dtype=tl.float32)
    a7 = tl.zeros((BO, BQ), dtype=tl.float32)
    for q0 in range(q_lo, tl.minimum(Q, q_lo + q_per), BQ):
        q = q0 + tl.arange(0, BQ)
        w, p = _load_quads(q_ptr, p_ptr, o, om, q, Q, EVEN)
        lo, hi = _placed(w, p, 0)
        e0, e1 = _pair_f32(lo, IS_BF16)
        e2, e3 = _pair_f32(hi, IS_BF16)
        lo, hi = _placed(w, p, 1)
        f0, f1 = _pair_f32(lo, IS_BF16)
        f2, f3 = _pair_f32(hi, IS_BF16)
        a0 = _token_dot(a0, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 0, q0, Q, T, BQ, IS_BF16)
        a1 = _token_dot(a1, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 1, q0, Q, T, BQ, IS_BF16)
        if BT > 2:
            a2 = _token_dot(a2, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 2, q0, Q, T, BQ, IS_BF16)
            a3 = _token_dot(a3, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 3, q0, Q, T, BQ, IS_BF16)
        if BT > 4:
            a4 = _token_dot(a4, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 4, q0, Q, T, BQ, IS_BF16)
            a5 = _token_dot(a5, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 5, q0, Q, T, BQ, IS_BF16)
            a6 = _token_dot(a6, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 6, q0, Q, T, BQ, IS_BF16)
            a7 = _token_dot(a7, e0, e1, e2, e3, f0, f1, f2, f3, x_ptr, sxt, 7, q0, Q, T, BQ, IS_BF16)
    _store_token(a0, 0, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
    _store_token(a1, 1, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
    if BT > 2:
        _store_token(a2, 2, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
        _store_token(a3, 3, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
    if BT > 4:
        _store_token(a4, 4, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
        _store_token(a5, 5, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
        _store_token(a6, 6, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)
        _store_token(a7, 7, y_ptr, bias_ptr, o, om, T, N, HAS_BIAS, PARTIAL)


@jit
def _quad_mma_kernel(x_ptr, sxt, sxk, q_ptr, p_ptr, bias_ptr, y_ptr, T, N, Q, q_per, HAS_BIAS: tl.constexpr,
                     BT: tl.constexpr, BO: tl.constexpr, BQ: tl.constexpr, PARTIAL: tl.constexpr,
                     EVEN: tl.constexpr, IS_BF16: tl.constexpr):
    """Rows ``BO`` of y over quads [s q_per, (s + 1) q_per) for split s, on tensor cores (BT = 16):
    each group's four weight entries placed in four (rows, quads) planes, one per position in the
    group, each multiplied by ``tl.dot`` with the matching (quads, tokens) tile of x. x comes
    permuted (:func:`_permute_x_kernel`: (8, Q, BT), entry (e, q, t) = x[t, 8 q + e], tokens
    zero-padded), so each of a step's eight products reads its operand as one plain tile, which
    Triton streams into shared memory ahead of the loop (cp.async) for wgmma to read there."""
    o, q_lo, t, om, tm = _program(T, N, q_per, BT, BO)
    acc = tl.zeros((BO, BT), dtype=tl.float32)
    for q0 in range(q_lo, tl.minimum(Q, q_lo + q_per), BQ):
        q = q0 + tl.arange(0, BQ)
        w, p = _load_quads(q_ptr, p_ptr, o, om, q, Q, EVEN)
        for s in tl.static_range(2):
            lo, hi = _placed(w, p, s)
            for e in tl.static_range(4):
                xp = x_ptr + (4 * s + e) * Q * BT + q[:, None] * BT + t[None, :]
                if EVEN:
                    xs = tl.load(xp)
                else:
                    xs = tl.load(xp, mask=(q < Q)[:, None], other=0.0)
                acc = tl.dot(_entry16(lo if e < 2 else hi, e % 2 == 1, IS_BF16), xs, acc)
    _store_rows(tl.trans(acc), y_ptr, bias_ptr, t, o, tm, om, T, N, HAS_BIAS, PARTIAL)


@jit
def _permute_x_kernel(x_ptr, sxt, sxk, out_ptr, T, Q, BT: tl.constexpr, BLOCK: tl.constexpr):
    """out (8, Q, BT) = x's entries (e, q, t) = x[t, 8 q + e], zero for tokens t >= T: the operand
    :func:`_quad_mma_kernel` reads."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < 8 * Q * BT
    t = i % BT
    q = (i // BT) % Q
    e = i // (BT * Q)
    tl.store(out_ptr + i, tl.load(x_ptr + t * sxt + (8 * q + e) * sxk, mask=m & (t < T), other=0.0), mask=m)


def quad_kernels() -> dict[str, object]:
    """The GEMV kernels by variant name (empty without Triton)."""
    return ({"quad": _quad_fma_kernel, "quad_multi": _quad_multi_kernel, "quad_mma": _quad_mma_kernel}
            if HAS_TRITON else {})
