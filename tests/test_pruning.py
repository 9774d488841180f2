"""Properties of the 2:4 math on random inputs, any leading shape, every float dtype, CPU and GPU."""

import itertools

import pytest
import torch

from twofour.functional import (
    fixed_scale,
    hard_threshold_24,
    mask_24,
    mvue_24,
    mvue_inclusion_probability,
    soft_threshold_24,
    transposable_mask_24,
    transposable_patterns,
)

SHAPES = [(8,), (16, 32), (3, 4, 12), (2, 3, 8, 16)]


def rand(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_mask_keeps_exactly_two_largest(shape, dtype, device):
    w = rand(shape, dtype, device)
    m = mask_24(w)
    assert m.dtype == torch.bool and m.shape == w.shape and m.device.type == device.type
    groups, mg = w.reshape(-1, 4).abs().float(), m.reshape(-1, 4)
    assert (mg.sum(1) == 2).all()
    kept_min = torch.where(mg, groups, torch.inf).amin(1)
    dropped_max = torch.where(mg, -torch.inf, groups).amax(1)
    assert (kept_min >= dropped_max).all()
    assert torch.equal(hard_threshold_24(w), w * m)


def test_mask_ties_go_to_lower_index(device):
    # small integers make ties frequent
    w = torch.randint(-2, 3, (4096, 4), generator=torch.Generator().manual_seed(1)).float().to(device)
    m = mask_24(w)
    assert (m.sum(1) == 2).all()
    a = w.abs()
    for k, j in itertools.permutations(range(4), 2):
        # a dropped k never beats a kept j; on a tie, the kept one has the lower index
        bad = ~m[:, k] & m[:, j] & ((a[:, k] > a[:, j]) | ((a[:, k] == a[:, j]) & (k < j)))
        assert not bad.any()
    assert mask_24(torch.zeros(1, 4, device=device)).tolist() == [[True, True, False, False]]


def soft_reference(w):
    out = []
    for grp in w.double().reshape(-1, 4).tolist():
        t = sorted(abs(v) for v in grp)[1]
        out.append([(1 if v > 0 else -1) * max(abs(v) - t, 0.0) for v in grp])
    return torch.tensor(out, dtype=torch.float64).reshape(w.shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_soft_threshold_formula(shape, dtype, device):
    w = rand(shape, dtype, device, seed=2)
    s = soft_threshold_24(w)
    assert s.dtype == dtype and s.shape == w.shape
    ref = soft_reference(w.cpu())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(s.cpu().double(), ref, atol=tol, rtol=tol)
    assert ((s.reshape(-1, 4) != 0).sum(1) <= 2).all()
    # the survivors are the two largest and keep their sign
    nz = s != 0
    assert (mask_24(w) | ~nz).all() and (torch.sign(s[nz]) == torch.sign(w[nz])).all()


def test_soft_threshold_is_continuous(device):
    """|S(a) - S(b)| <= 2 |a - b|_inf per group, also where the kept pair changes."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(20000, 4, generator=g, dtype=torch.float64)
    # near-ties between the 2nd and 3rd largest, so small moves change the hard mask
    a[:, 2] = a[:, 1] + 1e-4 * torch.randn(20000, generator=g, dtype=torch.float64)
    for scale in (1e-1, 1e-3, 1e-6):
        d = scale * torch.randn(20000, 4, generator=g, dtype=torch.float64)
        a_d, b_d = a.to(device), (a + d).to(device)
        diff = (soft_threshold_24(a_d) - soft_threshold_24(b_d)).abs().amax(1).cpu()
        assert (diff <= 2 * d.abs().amax(1) + 1e-12).all()
        assert (mask_24(a_d) != mask_24(b_d)).any() or scale < 1e-3


@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_scale_is_least_squares_fit(shape, dtype, device):
    w = rand(shape, dtype, device, seed=4)
    beta = fixed_scale(w)
    assert beta.dim() == 0 and beta.dtype == torch.float32
    s = soft_threshold_24(w.float()).double().reshape(-1, 1).cpu()
    lstsq = torch.linalg.lstsq(s, w.double().reshape(-1, 1).cpu()).solution.item()
    assert beta.item() == pytest.approx(lstsq, rel=1e-4)
    assert beta.item() > 1  # S shrinks magnitudes, so the fit scales them back up


def test_fixed_scale_of_zero_is_finite(device):
    for w in (torch.zeros(4, 8, device=device), torch.ones(4, 8, device=device)):  # S(W) == 0 for both
        beta = fixed_scale(w)
        assert torch.isfinite(beta) and beta.item() == 1.0


def brute_force_best(block):
    """Largest kept sum over all 4x4 0/1 patterns with two ones per row and column."""
    rows = [r for r in itertools.product((0, 1), repeat=4) if sum(r) == 2]
    best = -1.0
    for p in itertools.product(rows, repeat=4):
        if all(sum(p[i][j] for i in range(4)) == 2 for j in range(4)):
            best = max(best, sum(block[i][j] for i in range(4) for j in range(4) if p[i][j]))
    return best


def test_transposable_patterns():
    p = transposable_patterns().reshape(-1, 4, 4)
    assert p.shape[0] == 90 and len({tuple(x.flatten().tolist()) for x in p}) == 90
    assert (p.sum(1) == 2).all() and (p.sum(2) == 2).all()


@pytest.mark.parametrize("shape", [(8, 12), (3, 4, 8)])
def test_transposable_mask_is_24_both_ways_and_optimal(shape, device):
    w = rand(shape, torch.float32, device, seed=5)
    m = transposable_mask_24(w)
    assert m.dtype == torch.bool and m.shape == w.shape
    assert (m.reshape(-1, 4).sum(1) == 2).all()
    assert (m.transpose(-1, -2).reshape(-1, 4).sum(1) == 2).all()
    a, mc = w.abs().cpu().reshape(-1, *shape[-2:]), m.cpu().reshape(-1, *shape[-2:])
    for b in range(a.shape[0]):
        for i in range(0, shape[-2], 4):
            for j in range(0, shape[-1], 4):
                blk, mb = a[b, i:i + 4, j:j + 4], mc[b, i:i + 4, j:j + 4]
                assert (blk * mb).sum().item() == pytest.approx(brute_force_best(blk.tolist()), rel=1e-5)


def test_transposable_mask_dtypes(dtype, device):
    m = transposable_mask_24(rand((16, 16), dtype, device))
    assert (m.reshape(-1, 4).sum(1) == 2).all() and (m.t().reshape(-1, 4).sum(1) == 2).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_mvue_keeps_at_most_two(shape, dtype, device):
    x = rand(shape, dtype, device, seed=6)
    out = mvue_24(x, torch.Generator(device=device).manual_seed(0))
    assert out.shape == x.shape and out.dtype == dtype
    assert ((out.reshape(-1, 4) != 0).sum(1) <= 2).all()
    kept = out != 0
    assert (torch.sign(out[kept]) == torch.sign(x[kept])).all()
    assert (mvue_24(torch.zeros(3, 8, dtype=dtype, device=device)) == 0).all()


def test_mvue_is_reproducible_with_a_generator(device):
    x = rand((64, 32), torch.float32, device)
    a = mvue_24(x, torch.Generator(device=device).manual_seed(7))
    b = mvue_24(x, torch.Generator(device=device).manual_seed(7))
    c = mvue_24(x, torch.Generator(device=device).manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_mvue_draws_with_given_uniforms(device):
    """``u`` fixes the draw: uniforms of 0 keep each group's first two entries (the first two
    running sums lie above 0), scaled by 1 / their inclusion probability; a wrong count is refused."""
    x = rand((8, 16), torch.float32, device) + 3  # no zeros
    out = mvue_24(x, u=torch.zeros(x.numel() // 2, device=device))
    kept = (out != 0).reshape(-1, 4)
    assert kept[:, :2].all() and not kept[:, 2:].any()
    torch.testing.assert_close(out[out != 0], (x / mvue_inclusion_probability(x))[out != 0])
    u = torch.rand(x.numel() // 2, device=device)
    assert torch.equal(mvue_24(x, u=u), mvue_24(x, u=u))
    with pytest.raises(ValueError, match="2 uniforms per group"):
        mvue_24(x, u=u[1:])


def test_mvue_is_unbiased(device):
    """The sample mean over N draws is within 5 standard errors of x, element by element.

    Each output is x_k/p_k with probability p_k, else 0, so its variance is x_k^2 (1-p_k)/p_k;
    the tolerance comes from that variance. The observed inclusion rates match p_k too.
    """
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 8, generator=g)
    x[0, :4] = torch.tensor([5.0, 0.1, -0.01, 2.0])  # very unequal magnitudes
    x[1, :4] = 0.0  # an all-zero group stays zero
    n = 40000
    draws = mvue_24(x.to(device).repeat(n, 1), torch.Generator(device=device).manual_seed(10))
    draws = draws.reshape(n, *x.shape).double().cpu()
    p = mvue_inclusion_probability(x).double()
    sem = (x.double() ** 2 * (1 - p) / p / n).sqrt()
    assert ((draws.mean(0) - x.double()).abs() <= 5 * sem + 1e-9).all()
    nz = x != 0  # inclusion rates, where a kept entry is visible
    assert torch.allclose(draws.ne(0).double().mean(0)[nz], p[nz], atol=5 * (0.25 / n) ** 0.5)
    assert (draws[:, 1, :4] == 0).all()


def test_mvue_generator_device_mismatch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.raises(ValueError, match="generator"):
        mvue_24(torch.randn(4, 8, device="cuda"), torch.Generator().manual_seed(0))


ALL = [mask_24, hard_threshold_24, soft_threshold_24, transposable_mask_24, mvue_24, fixed_scale]


@pytest.mark.parametrize("fn", ALL, ids=lambda f: f.__name__)
class TestBadInput:
    def test_last_dim_not_multiple_of_4(self, fn):
        with pytest.raises(ValueError, match=r"multiple of 4.*\(8, 6\)"):
            fn(torch.randn(8, 6))

    @pytest.mark.parametrize("dt", [torch.int64, torch.int8, torch.bool, torch.complex64])
    def test_non_float_dtype(self, fn, dt):
        with pytest.raises(TypeError, match="floating-point"):
            fn(torch.zeros(8, 8, dtype=dt))

    def test_empty(self, fn):
        with pytest.raises(ValueError, match="empty"):
            fn(torch.empty(0, 8))

    def test_zero_dim(self, fn):
        with pytest.raises(ValueError, match="0-dim"):
            fn(torch.tensor(1.0))

    @pytest.mark.parametrize("bad", [float("nan"), float("inf")])
    def test_non_finite(self, fn, bad):
        w = torch.randn(8, 8)
        w[3, 5] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            fn(w)

    def test_not_a_tensor(self, fn):
        with pytest.raises(TypeError, match="torch.Tensor"):
            fn([[1.0, 2.0, 3.0, 4.0]])


def test_transposable_needs_both_dims():
    with pytest.raises(ValueError, match=r"both.*\(6, 8\)"):
        transposable_mask_24(torch.randn(6, 8))
    with pytest.raises(ValueError, match="both"):
        transposable_mask_24(torch.randn(8))
