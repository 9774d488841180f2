"""The dX routes of a sparse recipe (dx='dense' | 'transposable' | 'pruned-t' | 'mvue') in the
reference math: the option's checks, the weight dX multiplies by, MVUE's unbiasedness, and FP8."""

import pytest
import torch

from twofour import SparseLinear, make_recipe
from twofour.functional import mask_24, prune_transpose_24
from twofour.sparse.reference import dx_reference


def grads(layer, x, g):
    layer.zero_grad()
    xx = x.clone().requires_grad_()
    layer(xx).backward(g)
    return xx.grad, layer.weight.grad.clone()


def test_options_checked_in_one_line():
    assert make_recipe("ste").dx == "dense" and make_recipe("t-sr-ste").dx == "transposable"
    assert make_recipe("s-ste", dx="pruned-t").dx == "pruned-t"
    with pytest.raises(ValueError, match="t-sr-ste's"):
        make_recipe("ste", dx="transposable")
    with pytest.raises(ValueError, match="already"):
        make_recipe("t-sr-ste", dx="pruned-t")
    with pytest.raises(ValueError, match="dense, pruned-t, mvue"):
        make_recipe("s-ste", dx="sparse")
    with pytest.raises(ValueError, match="takes no option dx"):
        make_recipe("dense", dx="mvue")
    with pytest.raises(ValueError, match="out_features=6 is not a multiple of 4"):
        SparseLinear(8, 6, recipe="ste", dx="pruned-t")
    SparseLinear(8, 6, recipe="ste", dx="mvue")  # MVUE pads the features


def test_prune_transpose_is_24_both_ways_within_the_weight():
    w = torch.randn(64, 32)
    w_eff = w * mask_24(w)
    w_pt = prune_transpose_24(w_eff)
    assert bool(((w_pt != 0) <= (w_eff != 0)).all())  # a subset of W_eff's entries, values kept
    assert torch.equal(w_pt[w_pt != 0], w_eff[w_pt != 0])
    assert bool(((w_pt.reshape(64, 8, 4) != 0).sum(-1) <= 2).all())  # 2:4 along the input features
    assert bool(((w_pt.t().reshape(32, 16, 4) != 0).sum(-1) <= 2).all())  # and along the output features
    with pytest.raises(ValueError, match="multiples of 4"):
        prune_transpose_24(torch.randn(6, 8))


@pytest.mark.parametrize("recipe", ["ste", "s-ste", "sr-ste", "step"])
def test_pruned_t_dx_and_unchanged_forward_and_dw(recipe):
    torch.manual_seed(0)
    base = SparseLinear(32, 64, recipe=recipe, mvue=False)
    layer = SparseLinear(32, 64, recipe=recipe, mvue=False, dx="pruned-t")
    layer.load_state_dict(base.state_dict())
    for m in (base, layer):
        m.advance(sparse_phase=True)  # STEP's switch to its sparse phase (the others: one more step)
    assert not layer.is_dense_phase
    x, g = torch.randn(16, 32), torch.randn(16, 64)
    dx_base, dw_base = grads(base, x, g)
    dx, dw = grads(layer, x, g)
    assert torch.allclose(dx, g @ prune_transpose_24(layer.effective_weight()), atol=1e-5)
    assert torch.allclose(dw, dw_base) and not torch.allclose(dx, dx_base, atol=1e-3)
    assert torch.equal(layer(x), base(x))


def test_mvue_dx_is_unbiased_and_each_draw_2_4():
    torch.manual_seed(0)
    layer = SparseLinear(32, 64, recipe="ste", dx="mvue")
    x, g = torch.randn(16, 32), torch.randn(16, 64)
    exact = g @ layer.effective_weight()
    draws = torch.stack([grads(layer, x, g)[0] for _ in range(512)])
    assert not torch.allclose(draws[0], exact, atol=1e-3)  # a draw is random...
    err = [((draws[:n].mean(0) - exact).norm() / exact.norm()).item() for n in (32, 512)]
    assert err[1] < err[0] / 2.5 and err[1] < 0.1  # ...and its mean the exact dX (error ~ 1/sqrt(n))
    est = torch.stack([dx_reference(g, torch.eye(64), "mvue") for _ in range(8)])  # the estimate of dY itself
    assert bool(((est.reshape(8, 16, 16, 4) != 0).sum(-1) <= 2).all())  # 2:4 along the output features


def test_dense_phase_ignores_the_route():
    """A dense phase (STEP's first, here) multiplies dY by the whole W."""
    layer = SparseLinear(32, 64, recipe="step", dx="pruned-t")
    assert layer.is_dense_phase
    x, g = torch.randn(16, 32), torch.randn(16, 64)
    assert torch.allclose(grads(layer, x, g)[0], g @ layer.weight.detach(), atol=1e-5)


def test_fp8_pruned_t_dx():
    """FP8 (the reference off the GPU): dX multiplies dY by W_pt, within e4m3's rounding."""
    torch.manual_seed(0)
    layer = SparseLinear(64, 128, recipe="ste", dx="pruned-t", precision="fp8")
    x, g = torch.randn(64, 64), torch.randn(64, 128)
    dx = grads(layer, x, g)[0]
    w_eff = layer.effective_weight()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(dx, g @ prune_transpose_24(w_eff)) < 0.1 < rel(dx, g @ w_eff)
