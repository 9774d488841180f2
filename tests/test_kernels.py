"""The fused prune-and-compress kernel against the plain-torch reference (Triton's interpreter on
the CPU, the real kernel on the GPU), and byte for byte against cuSPARSELt where it is available."""

import pytest
import torch

from twofour import dispatch
from twofour.functional import (
    _fixed_scale,
    _mvue_24,
    _soft_threshold_24,
    mask_24,
    mvue_inclusion_probability,
    prune_transpose_24,
    transposable_mask_24,
)
from twofour.kernels import compress as ck
from twofour.kernels import ops
from twofour.kernels.layout import compress_reference, decompress_reference
from twofour.kernels.triton_common import HAS_TRITON

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton"), pytest.mark.triton]
SHAPES = [(64, 64), (100, 96), (128, 256), (32, 160)]
OUT = [torch.bfloat16, torch.float16]


def ids(x):
    return str(x).split(".")[-1] if isinstance(x, torch.dtype) else None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", OUT, ids=ids)
def test_hard(shape, out_dtype, device):
    w = torch.randn(shape, device=device)
    buf, dense = ck.compress(w, "hard", out_dtype=out_dtype, dense_out=True)
    eff = (w * mask_24(w)).to(out_dtype)
    assert torch.equal(buf, compress_reference(eff, mask_24(w)))
    assert torch.equal(dense, eff)


@pytest.mark.parametrize("tile", [(32, 2), (64, 4), (256, 8)])
def test_any_tile_gives_the_same_bytes(tile, device):
    w = torch.randn(128, 256, device=device)
    assert torch.equal(ck.compress_tiled(w, "hard", tile=tile)[0], ck.compress(w, "hard")[0])


@pytest.mark.parametrize("shape", SHAPES)
def test_soft_with_scale(shape, device):
    w = torch.randn(shape, device=device)
    beta = _fixed_scale(w).reshape(1)
    buf, dense = ck.compress(w, "soft", scale=beta, dense_out=True)
    eff = (beta * _soft_threshold_24(w)).bfloat16()
    assert torch.equal(buf, compress_reference(eff, mask_24(w)))
    assert torch.equal(dense, eff)


@pytest.mark.parametrize("shape", [(64, 64), (128, 96)])
def test_given_mask_through_a_transposed_view(shape, device):
    """Transposable masks: W^T's compressed copy, read from W's memory."""
    w = torch.randn(shape, device=device)
    m = transposable_mask_24(w)
    buf, _ = ck.compress(w.t(), "mask", mask=m.t())
    assert torch.equal(buf, compress_reference((w * m).t().contiguous().bfloat16(), m.t().contiguous()))


@pytest.mark.parametrize("shape", SHAPES)
def test_mvue_from_transposed_source(shape, device):
    """MVUE of dY^T straight from the row-major dY, with the reference's uniforms."""
    n, t = shape
    dy = torch.randn(t, n, device=device)
    dy[:4, :3] = 0.0  # zeros inside groups
    x = dy.t()
    u = torch.rand(n, t // 2, device=device)  # two uniforms per group
    buf, dense = ck.compress(x, "mvue", u=u, dense_out=True)
    ref = _mvue_24(x.contiguous(), u=u)
    dec = decompress_reference(buf, n, t).float()
    assert torch.equal(dec != 0, ref != 0)
    assert torch.equal(dense.float(), dec)  # the dense copy (for a dense dW GEMM) is the same estimate
    torch.testing.assert_close(dec, ref.bfloat16().float(), rtol=1e-2, atol=1e-6)


def test_mvue_with_philox_seed_is_unbiased(device):
    x = torch.randn(32, 64, device=device)
    n = 200
    acc = torch.zeros_like(x, dtype=torch.float64)
    for i in range(n):
        buf, _ = ck.compress(x, "mvue", seed=torch.tensor([1000 + i], device=device), out_dtype=torch.float16)
        d = decompress_reference(buf, 32, 64, torch.float16).double()
        assert ((d.reshape(-1, 4) != 0).sum(1) <= 2).all()
        acc += d
    # the estimator's exact standard error: Var = x^2 (1 - p) / p per draw
    p = mvue_inclusion_probability(x).double()
    sem = (x.double() ** 2 * (1 - p) / p / n).sqrt()
    assert ((acc / n - x.double()).abs() <= 5 * sem + 1e-2).all()


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "row_major"])
def test_mvue_on_both_load_paths(in_place, device):
    """dY^T read in place (four loads, Philox counters of row pairs) or row-major (a tile load,
    counters of group pairs): with the reference's uniforms the kernel keeps the reference's
    entries; with Philox draws each kept value is x / p at its own place (metadata and values
    agree) and the dense copy is the same estimate."""
    n, t = 96, 256
    dy = torch.randn(t, n, device=device)
    x = dy.t() if in_place else dy.t().contiguous()
    u = torch.rand(n, t // 2, device=device)
    buf, dense = ck.compress(x, "mvue", u=u, dense_out=True)
    ref = _mvue_24(x.contiguous(), u=u)
    dec = decompress_reference(buf, n, t).float()
    assert torch.equal(dec != 0, ref != 0) and torch.equal(dense.float(), dec)
    buf, dense = ck.compress(x, "mvue", seed=torch.tensor([7], device=device), dense_out=True)
    dec = decompress_reference(buf, n, t).float()
    kept = dec != 0
    assert (kept.reshape(-1, 4).sum(1) == 2).all() and torch.equal(dense.float(), dec)
    want = x / mvue_inclusion_probability(x)
    torch.testing.assert_close(dec[kept], want[kept].bfloat16().float(), rtol=1e-2, atol=1e-6)
    hard, _ = ck.compress(x, "hard")  # the plain top-2 through the same layout
    assert torch.equal(hard, compress_reference((x * mask_24(x)).bfloat16(), mask_24(x)))


def test_nan_stays_nan(device):
    """A NaN the kernel keeps comes out as a NaN in both outputs (rounding to bf16 must not carry
    the GPU's NaN bits into the sign bit)."""
    w = torch.randn(64, 64, device=device)
    mask = mask_24(w)
    r, c = 3, int(mask[3].nonzero()[0])
    w[r, c] = float("nan")
    buf, dense = ck.compress(w, "mask", mask=mask, dense_out=True)
    assert torch.isnan(dense[r, c]) and torch.isnan(dense).sum() == 1
    assert torch.isnan(decompress_reference(buf.cpu(), 64, 64)[r, c])


def test_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        ck.compress(torch.randn(8, 16), "hard")
    with pytest.raises(ValueError, match="mode"):
        ck.compress(torch.randn(8, 32), "magic")
    with pytest.raises(TypeError, match="out_dtype"):
        ck.compress(torch.randn(8, 32), "hard", out_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 128), (96, 192), (256, 1024)])
def test_matches_cusparselt_byte_for_byte(shape):
    from twofour.kernels import cusparselt

    if not cusparselt.available():
        pytest.skip("cuSPARSELt bindings (nvmath-python) not available")
    w = torch.randn(shape, device="cuda")
    plan = cusparselt.get_plan(shape[0], shape[1], 64, cusparselt.ROW, cusparselt.ROW, torch.bfloat16)
    buf, dense = ck.compress(w, "hard", dense_out=True)
    assert torch.equal(buf, plan.compress(dense))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside torch.compile
def test_compress_op_traces_like_eager():
    """The registered op (what torch's tracers see) passes torch's op checks and gives, compiled
    whole, the same bytes as the eager call."""
    x = torch.randn(64, 64)
    torch.library.opcheck(ops._compress_op, (x, "hard", None, None, None, True, torch.bfloat16))
    eager = ops.compress(x, "hard", dense_out=True)
    traced = torch.compile(lambda t: ops.compress(t, "hard", dense_out=True), fullgraph=True)(x)
    assert all(torch.equal(a, b) for a, b in zip(eager, traced, strict=True))
    beta = torch.ones(1)
    torch.library.opcheck(torch.ops.twofour.compress_both.default, (x, "soft", beta, None, torch.bfloat16))
    eager = ops.compress_both(x, "soft", scale=beta)
    traced = torch.compile(lambda t: ops.compress_both(t, "soft", scale=beta), fullgraph=True)(x)
    assert all(torch.equal(a, b) for a, b in zip(eager, traced, strict=True))


@pytest.mark.parametrize("shape", [(64, 128), (37, 8), (3, 2, 1028)])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=ids)
def test_mask_refresh_matches_reference(shape, wdtype, device):
    w = torch.randn(shape, device=device).to(wdtype)
    w.view(-1, 4)[:3] = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, -0.0, 0.0, 0.0], [2.0, -2.0, 1.0, -2.0]])  # ties
    old = mask_24(torch.randn(shape, device=device))
    mask, flips = old.clone(), torch.full((), 99, dtype=torch.long, device=device)
    ops.refresh_mask_(w, mask, flips)
    want = mask_24(w)
    assert torch.equal(mask, want)
    assert flips.item() == (want != old).sum().item() > 0
    ops.refresh_mask_(w, mask, flips)  # unchanged weight: no flips the second time
    assert flips.item() == 0 and torch.equal(mask, want)


def test_every_refresh_tile_writes_the_same_masks_and_counts(device):
    """Each (groups per program, warps) the GPU may pick for the refresh (pinned through its
    dispatch key) writes the reference mask and flip count; on the GPU the fastest is recorded."""
    from twofour.kernels.mask import CONFIGS

    torch.manual_seed(2)
    w = torch.randn(96, 2048, device=device)
    old = mask_24(torch.randn(96, 2048, device=device))
    key = dispatch.choice_key("refresh", 96, 2048, 1, "row", w.dtype, [f"{bg}x{nw}" for bg, nw in CONFIGS])
    try:
        for bg, nw in CONFIGS:
            dispatch.set_choice(key, f"{bg}x{nw}")
            mask, flips = old.clone(), torch.zeros((), dtype=torch.long, device=device)
            ops.refresh_mask_(w, mask, flips)
            assert torch.equal(mask, mask_24(w)) and flips.item() == (mask_24(w) != old).sum().item(), (bg, nw)
        if device == "cuda":
            dispatch.clear_choices()
            ops.refresh_mask_(w, old.clone(), torch.zeros((), dtype=torch.long, device=device))
            assert set(dispatch.choices()[key]["ms"]) == {f"{bg}x{nw}" for bg, nw in CONFIGS}
    finally:
        dispatch.clear_choices()


def test_mask_refresh_of_many_layers_in_one_call(device):
    """Layers of several shapes and weight dtypes in one call: each gets its own reference mask
    and flip count; a second call over unchanged weights counts none."""
    torch.manual_seed(1)
    shapes = [(64, 128), (37, 8), (4, 2052), (16, 4)]
    ws = [torch.randn(s, device=device).to(d) for s, d in zip(shapes, [torch.float32, torch.bfloat16] * 2)]
    olds = [mask_24(torch.randn(s, device=device)) for s in shapes]
    masks = [m.clone() for m in olds]
    flips = [torch.full((), 7, dtype=torch.long, device=device) for _ in shapes]
    ops.refresh_masks_(ws, masks, flips)
    for w, old, mask, f in zip(ws, olds, masks, flips, strict=True):
        want = mask_24(w)
        assert torch.equal(mask, want) and f.item() == (want != old).sum().item() > 0
    ops.refresh_masks_(ws, masks, flips)
    assert [f.item() for f in flips] == [0] * len(shapes)


def test_mask_refresh_of_an_unaligned_mask(device):
    """A mask at an odd byte offset (a view into a larger buffer) is refreshed byte by byte: the old
    mask read back right (flips counted against it, none the second time), its neighbours
    untouched; an aligned mask in the same call takes the same path and agrees too."""
    torch.manual_seed(2)
    w, w2 = torch.randn(16, 32, device=device), torch.randn(8, 64, device=device)
    buf = torch.zeros(w.numel() + 2, dtype=torch.bool, device=device)
    mask = buf[1:-1].view(w.shape)
    old = mask_24(torch.randn(w.shape, device=device))
    mask.copy_(old)
    old2 = mask_24(torch.randn(w2.shape, device=device))
    mask2 = old2.clone()
    flips = [torch.zeros((), dtype=torch.long, device=device) for _ in range(2)]
    ops.refresh_masks_([w, w2], [mask, mask2], flips)
    assert torch.equal(mask, mask_24(w)) and flips[0].item() == (mask_24(w) != old).sum().item() > 0
    assert torch.equal(mask2, mask_24(w2)) and flips[1].item() == (mask_24(w2) != old2).sum().item() > 0
    assert not buf[0] and not buf[-1]
    ops.refresh_masks_([w, w2], [mask, mask2], flips)
    assert [f.item() for f in flips] == [0, 0] and not buf[0] and not buf[-1]


def test_mask_refresh_bad_input():
    w = torch.randn(8, 8)
    with pytest.raises(ValueError, match="bool mask"):
        ops.refresh_mask_(w, torch.zeros(8, 8, dtype=torch.uint8), torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        ops.refresh_mask_(w.t(), mask_24(w), torch.zeros((), dtype=torch.long))
    with pytest.raises(ValueError, match="1 weights, 2 masks"):
        ops.refresh_masks_([w], [mask_24(w)] * 2, [torch.zeros((), dtype=torch.long)])


def test_dense_only_output_skips_the_compressed_layout(device):
    dy = torch.randn(96, 64, device=device, dtype=torch.bfloat16)
    seed = torch.tensor([5], device=device)
    buf, dense = ck.compress(dy.t(), "mvue", seed=seed, dense_out=True)
    empty, dense_only = ck.compress(dy.t(), "mvue", seed=seed, dense_out=True, sparse_out=False)
    assert empty.numel() == 0 and torch.equal(dense_only, dense)
    with pytest.raises(ValueError, match="neither"):
        ck.compress(dy.t(), "mvue", seed=seed, sparse_out=False)


@pytest.mark.parametrize("pruner", ["hard", "soft", "transposable"])
def test_pruner_compress_dense_only(pruner, device):
    """``sparse=False``: the same dense effective weight, and no 2:4 operand written."""
    from twofour.sparse.pruners import PRUNERS

    p = PRUNERS[pruner]
    w = torch.randn(64, 96, device=device)
    state = p.initial_state(w)
    beta, mask = state.get("beta"), state.get("mask")
    wc, wd, wtc = p.compress(w, beta, mask, torch.bfloat16)
    wc0, wd0, wtc0 = p.compress(w, beta, mask, torch.bfloat16, sparse=False)
    assert torch.equal(wd0, wd) and wc.numel() > 0
    assert wc0.numel() == 0 and wtc0.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("d_col", [False, True])
@pytest.mark.parametrize("b_col", [False, True])
def test_every_cusparselt_configuration_computes_the_same_product(d_col, b_col):
    """Each of cuSPARSELt's algorithm configurations reads our compressed layout correctly, and the
    dispatch measures them once and lists its choice."""
    from twofour.kernels import cusparselt

    if not cusparselt.available():
        pytest.skip("cuSPARSELt bindings (nvmath-python) not available")
    m, k, n = 256, 512, 384
    buf, dense = ck.compress(torch.randn(m, k, device="cuda"), "hard", dense_out=True)
    b = torch.randn(n, k, device="cuda").to(torch.bfloat16).t() if b_col else torch.randn(
        k, n, device="cuda").to(torch.bfloat16)
    ref = dense.float() @ b.float()
    plan = cusparselt.get_plan(m, k, n, cusparselt.COL if b_col else cusparselt.ROW,
                               cusparselt.COL if d_col else cusparselt.ROW, torch.bfloat16)
    assert plan.num_configs >= 1
    ran = 0
    for config in range(plan.num_configs):
        p = cusparselt.get_plan(m, k, n, plan.key.b_order, plan.key.d_order, torch.bfloat16, config=config)
        assert p.config_id == config and p.compressed_size == plan.compressed_size
        out = torch.empty((n, m) if d_col else (m, n), dtype=torch.bfloat16, device="cuda")
        p.matmul(buf, b, out)
        torch.testing.assert_close((out.t() if d_col else out).float(), ref, rtol=2e-2, atol=2e-2)
        ran += 1
    assert ran == plan.num_configs
    dispatch.clear_choices()
    y = ops.spmm(buf, b, m, d_col)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    keys = [key for key in dispatch.choices() if key.startswith(f"spmm-d{'col' if d_col else 'row'}:{m}x{k}x{n}:")]
    assert len(keys) == 1 and dispatch.choices()[keys[0]]["choice"].startswith("sparse#")


# ---- e4m3: the FP8 2:4 GEMM's sparse operand --------------------------------------------------

E4M3 = torch.float8_e4m3fn


def test_e4m3_matches_bytes_written_by_cusparselt(device):
    """The e4m3 compression writes, byte for byte, what cuSPARSELt wrote for these matrices on an
    H100 (dumped by benchmarks/gemm/probe_layout_fp8.py, since removed, in the git history; padding rows included)."""
    from pathlib import Path

    for rec in torch.load(Path(__file__).parent / "data" / "cusparselt_compressed_e4m3_h100.pt"):
        for dense, comp in zip(rec["dense"], rec["comp"]):
            assert torch.equal(ck.compress_e4m3(dense.view(E4M3).to(device)).cpu(), comp), (rec["m"], rec["k"])


@pytest.mark.parametrize("shape", [(64, 64), (70, 128), (130, 192), (33, 320)])
def test_e4m3_random_2to4(shape, device):
    """Random 2:4 matrices, rows not a multiple of 64 and K not a multiple of the tile width: the
    reference layout's bytes."""
    w = torch.randn(shape, device=device)
    q = (w * mask_24(w)).to(E4M3)
    assert torch.equal(ck.compress_e4m3(q).cpu(), compress_reference(q.cpu()))


def test_e4m3_sparser_groups_and_signed_zeros_round_trip(device):
    """Groups with fewer than two non-zeros (underflow, pruned rows) and negative zeros: what is
    kept decompresses to the same bytes."""
    w = torch.randn(128, 128, device=device)
    q = (w * mask_24(w)).to(E4M3)
    q = q.view(torch.uint8).clone()
    q[::3, ::5] = 0  # some groups with one non-zero, or none
    q[5] = 0x80  # a row of negative zeros
    q[7, :4] = torch.tensor([0, 0x80, 0x7F, 0], dtype=torch.uint8)  # with a NaN, which is kept
    buf = ck.compress_e4m3(q.view(E4M3))
    back = decompress_reference(buf.cpu(), 128, 128, E4M3).view(torch.uint8)
    qc = q.cpu()
    assert torch.equal(back & 0x7F, qc & 0x7F)  # every magnitude (a dropped -0 comes back as +0)
    assert torch.equal(back[qc & 0x7F != 0], qc[qc & 0x7F != 0])  # signs of the non-zeros


def test_e4m3_bad_input():
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ck.compress_e4m3(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not contiguous"):
        ck.compress_e4m3(torch.zeros(64, 128).to(E4M3).t())
    with pytest.raises(ValueError, match="multiple of 64"):
        ck.compress_e4m3(torch.zeros(64, 32).to(E4M3))


def test_hard_pruning_of_a_transpose_is_prune_transpose(device):
    """The pruned-t route's W_pt from one kernel pass over W_eff^T (a column-major view) equals the
    plain-torch prune_transpose_24, and its compressed form holds W_pt^T."""
    torch.manual_seed(0)
    w = torch.randn(64, 96, device=device, dtype=torch.bfloat16)
    w_eff = w * mask_24(w)
    buf, dense = ck.compress(w_eff.t(), "hard", out_dtype=torch.bfloat16, dense_out=True)
    assert torch.equal(dense.t(), prune_transpose_24(w_eff))
    assert torch.equal(decompress_reference(buf, 96, 64), dense)


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("shape", [(96, 128), (160, 64)])
def test_one_pass_writes_the_pruned_t_operand(mode, shape, device):
    """compress_both: W_eff compressed and dense as compress() writes them, and W_pt^T (W_eff^T,
    as rounded, pruned 2:4 along the output features) compressed, from one pass; on random weights
    and on small integers (ties in both directions)."""
    torch.manual_seed(0)
    for w in (torch.randn(shape, device=device), torch.randint(-3, 4, shape, device=device).float()):
        beta = _fixed_scale(w).reshape(1) if mode == "soft" else None
        wc, wd, wtc = ck.compress_both(w, mode, scale=beta, dense_out=True)
        wc0, wd0 = ck.compress(w, mode, scale=beta, dense_out=True)
        assert torch.equal(wc, wc0) and torch.equal(wd, wd0)
        pt = prune_transpose_24(wd.float()).bfloat16()
        assert torch.equal(decompress_reference(wtc, shape[1], shape[0]), pt.t())
        assert torch.equal(wtc, ck.compress(wd.t(), "hard")[0])  # the two-pass bytes, metadata included
    with pytest.raises(ValueError, match="multiples of 32"):
        ck.compress_both(torch.randn(48, 64, device=device), "hard")
    with pytest.raises(ValueError, match="hard, soft or mask"):
        ck.compress_both(torch.randn(64, 64, device=device), "mvue")


def test_one_pass_writes_a_transposable_masks_two_operands(device):
    """compress_both in mask mode: W * m compressed (and dense) as compress() writes it, and
    W^T compressed by m^T as the second pass over W^T wrote it, byte for byte."""
    torch.manual_seed(0)
    w = torch.randn(96, 128, device=device)
    m = transposable_mask_24(w)
    wc, wd, wtc = ck.compress_both(w, "mask", mask=m, dense_out=True)
    wc0, wd0 = ck.compress(w, "mask", mask=m, dense_out=True)
    assert torch.equal(wc, wc0) and torch.equal(wd, wd0)
    assert torch.equal(wtc, ck.compress(w.t(), "mask", mask=m.t())[0])
