"""SparseLinear against plain autograd on its effective weight, and its recipe state."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twofour
from twofour.functional import fixed_scale, mask_24, soft_threshold_24, transposable_mask_24
from twofour.sparse import SparseLinear, make_recipe

SPARSE = ["ste", "sr-ste", "s-ste", "t-sr-ste"]


def layer_for(recipe, device, in_f=32, out_f=16, bias=True, seed=0, **opts):
    torch.manual_seed(seed)
    return SparseLinear(in_f, out_f, bias=bias, recipe=recipe, device=device, **opts)


@pytest.mark.parametrize("recipe", ["dense", *SPARSE])
def test_effective_weight(recipe, device):
    lin = layer_for(recipe, device)
    w, we = lin.weight.detach(), lin.effective_weight()
    expected = {
        "dense": w,
        "ste": w * mask_24(w),
        "sr-ste": w * mask_24(w),
        "s-ste": fixed_scale(w).to(device) * soft_threshold_24(w),
        "t-sr-ste": w * transposable_mask_24(w),
    }[recipe]
    torch.testing.assert_close(we, expected)
    if recipe != "dense":
        assert ((we.reshape(-1, 4) != 0).sum(1) <= 2).all()


@pytest.mark.parametrize("recipe", ["dense", *SPARSE])
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_autograd_on_effective_weight(recipe, bias, device):
    """Forward, dX, db and dW equal plain autograd on W_eff (dW passed straight through; SR-STE's
    masked decay is added once per optimizer step, see test_masked_decay_*)."""
    opts = {} if recipe == "dense" else {"mvue": False}
    lin = layer_for(recipe, device, bias=bias, **opts)
    x = torch.randn(3, 5, 32, device=device, requires_grad=True)
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)

    w_eff = lin.effective_weight().clone().requires_grad_()
    b = None if lin.bias is None else lin.bias.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, w_eff, b)
    y_ref.backward(g)

    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(lin.weight.grad, w_eff.grad)
    if bias:
        torch.testing.assert_close(lin.bias.grad, b.grad)


@pytest.mark.parametrize("recipe", ["s-ste", "t-sr-ste"])
def test_mvue_weight_gradient_is_unbiased(recipe, device):
    """With MVUE on, dW is random but its mean over many backward passes is the exact dW."""
    lin = layer_for(recipe, device, in_f=8, out_f=8, decay=0.0) if recipe == "t-sr-ste" \
        else layer_for(recipe, device, in_f=8, out_f=8)
    assert lin.recipe.mvue
    x = torch.randn(6, 8, device=device)  # 6 tokens: padded to 8 inside
    g = torch.randn(6, 8, device=device)
    exact = g.t() @ x
    n = 4000
    grads = []
    for _ in range(n):
        lin.weight.grad = None
        lin(x).backward(g)
        grads.append(lin.weight.grad.double())
    grads = torch.stack(grads)
    mean, sem = grads.mean(0), grads.std(0) / n**0.5
    assert ((mean - exact.double()).abs() <= 5 * sem + 1e-6).all()
    assert (grads.std(0) > 0).any()  # it really is random


def test_autocast_bf16(device):
    lin = layer_for("s-ste", device)
    x = torch.randn(4, 32, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and torch.isfinite(lin.weight.grad).all()
    ref = F.linear(x, lin.effective_weight(), lin.bias)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_fp8_simulation_stays_close(device):
    lin = layer_for("s-ste", device, precision="fp8", mvue=False)
    x = torch.randn(64, 32, device=device)
    y = lin(x)
    ref = F.linear(x, lin.effective_weight(), lin.bias)
    err = ((y - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.1  # FP8 rounding is visible but small


def test_state_dict_keys_and_round_trip(device):
    lin = layer_for("t-sr-ste", device, in_f=16, out_f=16, mask_interval=2)
    keys = set(lin.state_dict())
    assert {"weight", "bias"} <= keys and {"weight", "bias"} == set(nn.Linear(16, 16).state_dict())
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    for _ in range(5):
        lin(torch.randn(8, 16, device=device)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        lin.advance()
    sd = lin.state_dict()
    fresh = layer_for("t-sr-ste", device, in_f=16, out_f=16, mask_interval=2, seed=1)
    assert not torch.equal(fresh.mask, lin.mask)
    fresh.load_state_dict(sd)
    assert int(fresh.step) == 5
    torch.testing.assert_close(fresh.effective_weight(), lin.effective_weight())
    assert torch.equal(fresh.mask, lin.mask)
    # the next refresh happens at the same step in both
    for m in (lin, fresh):
        m.advance()
    assert torch.equal(fresh.mask, lin.mask) and int(fresh.flips) == int(lin.flips)


def test_beta_survives_round_trip_and_stays_frozen(device):
    lin = layer_for("s-ste", device)
    beta0 = lin.beta.clone()
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    for _ in range(3):
        lin(torch.randn(8, 32, device=device)).pow(2).sum().backward()
        opt.step()
        lin.advance()
    assert torch.equal(lin.beta, beta0)
    assert not torch.allclose(fixed_scale(lin.weight), beta0)  # recomputing would have moved it
    other = layer_for("s-ste", device, seed=3)
    other.load_state_dict(lin.state_dict())
    assert torch.equal(other.beta, beta0)


def test_beta_refit_every_interval(device):
    """beta_interval=2 refits beta to the current weight after every second optimizer step only."""
    lin = layer_for("s-ste", device, beta_interval=2)
    betas = [lin.beta.clone()]
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    for _ in range(4):
        lin(torch.randn(8, 32, device=device)).pow(2).sum().backward()
        opt.step()
        lin.advance()
        betas.append(lin.beta.clone())
        if int(lin.step) % 2 == 0:
            torch.testing.assert_close(lin.beta, fixed_scale(lin.weight))
    assert torch.equal(betas[1], betas[0]) and torch.equal(betas[3], betas[2])
    assert not torch.equal(betas[2], betas[0]) and not torch.equal(betas[4], betas[2])


@pytest.mark.parametrize("source", ["nn.Linear", "dense FP8 with bf16_finetune"])
def test_dense_checkpoint_loads_as_made_sparse(device, source):
    """A dense checkpoint, also one whose FP8 phase ends (it holds a step count), loads into a sparse
    layer as made sparse from its weights: fresh recipe state, step 0."""
    if source == "nn.Linear":
        dense = nn.Linear(32, 16, device=device)
    else:
        dense = SparseLinear(32, 16, recipe="dense", precision="fp8", bf16_finetune=0.5, total_steps=4, device=device)
        dense.advance()
        assert int(dense.step) == 1
    lin = layer_for("s-ste", device, seed=5)
    lin.load_state_dict(dense.state_dict())  # strict: recipe buffers are derived from the weight
    torch.testing.assert_close(lin.beta, fixed_scale(dense.weight))
    assert torch.equal(lin.mask, mask_24(dense.weight)) and int(lin.step) == 0


def test_to_moves_buffers():
    lin = layer_for("s-ste", "cpu").to(torch.float64)
    assert lin.weight.dtype == torch.float64 and lin.mask.dtype == torch.bool
    y = lin(torch.randn(2, 32, dtype=torch.float64))
    assert y.dtype == torch.float64


@pytest.mark.gpu
def test_to_cuda_moves_buffers():
    lin = layer_for("t-sr-ste", "cpu", in_f=16, out_f=16, mask_interval=1, mvue=False).cuda()
    assert lin.mask.is_cuda and lin.step.is_cuda and lin.beta is None
    x = torch.randn(4, 16, device="cuda")
    lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, torch.ones(16, 4, device="cuda") @ x)
    with torch.no_grad():
        lin.weight.mul_(-2).add_(torch.randn_like(lin.weight))
    lin.advance()  # the refresh runs on the GPU and counts flips there
    assert lin.flips.is_cuda and torch.equal(lin.mask, transposable_mask_24(lin.weight))


@pytest.mark.parametrize("mask_interval", [1, 2])
def test_model_advance_matches_each_layer_advance(mask_interval, device):
    """twofour.advance(model) (the grouped refresh) leaves every layer as its own advance() does:
    masks, flip counts, step counters, on steps with and without a refresh."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(layer_for("s-ste", device, in_f=64, out_f=32), layer_for("ste", device, in_f=32, out_f=64),
                             layer_for("t-sr-ste", device, in_f=32, out_f=32, mask_interval=mask_interval),
                             layer_for("dense", device))
    grouped, single = model(), model()
    for step in range(3):
        for m in (grouped, single):
            torch.manual_seed(step)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
        twofour.advance(grouped)
        for layer in single:
            layer.advance()
        for a, b in zip(grouped, single, strict=True):
            for name in ("mask", "flips", "step"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None and y is None) or torch.equal(x, y)
        assert sum(layer.flips.item() for layer in grouped[:2]) > 0


def test_bad_shape_raises():
    with pytest.raises(ValueError, match="in_features=30"):
        SparseLinear(30, 16, recipe="ste")
    with pytest.raises(ValueError, match="both dimensions"):
        SparseLinear(32, 18, recipe="t-sr-ste")
    SparseLinear(30, 18, recipe="dense")  # dense has no shape constraint


def test_transposable_refresh_and_dense_finetune():
    lin = layer_for("t-sr-ste", "cpu", in_f=16, out_f=16, mask_interval=3, total_steps=12)
    opt = torch.optim.SGD(lin.parameters(), lr=0.3)
    refreshed, dense_from = [], None
    for step in range(1, 13):
        before = lin.mask.clone()
        lin(torch.randn(8, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        lin.advance()
        if not torch.equal(before, lin.mask):
            refreshed.append(step)
        if lin.is_dense_phase and dense_from is None:
            dense_from = step
    assert all(s % 3 == 0 for s in refreshed)
    assert dense_from == 10  # last 1/6 of 12 steps: steps 10..12
    torch.testing.assert_close(lin.effective_weight(), lin.weight.detach())


def test_compile_has_no_graph_break():
    lin = layer_for("s-ste", "cpu")
    x = torch.randn(4, 32)
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, F.linear(x, lin.effective_weight(), lin.bias))
    y.sum().backward()
    assert lin.weight.grad is not None


def test_recipe_object_and_repr():
    lin = SparseLinear(8, 8, recipe=make_recipe("sr-ste", decay=1e-3))
    assert lin.recipe.decay == 1e-3 and "sr-ste" in repr(lin)
    assert isinstance(twofour.SparseLinear(8, 4), nn.Linear)


@pytest.mark.parametrize("recipe", ["sr-ste", "t-sr-ste"])
def test_masked_decay_counts_once_per_optimizer_step(recipe, device):
    """One batch, or the same batch in 4 micro-batches (loss divided by 4, as gradient
    accumulation does): the same update, the decay added once, after clipping."""
    results = []
    for micro in (1, 4):
        lin = layer_for(recipe, device, in_f=16, out_f=16, decay=0.05, mvue=False)
        opt = torch.optim.SGD(lin.parameters(), lr=1.0)
        twofour.attach(lin, opt)
        x = torch.randn(8, 16, device=device, generator=torch.Generator(device).manual_seed(1))
        for chunk in x.chunk(micro):
            (lin(chunk).pow(2).sum() / 8).backward()
        torch.nn.utils.clip_grad_norm_(lin.parameters(), 1e9)
        before = lin.weight.detach().clone()
        mask = lin.mask.clone()
        grad = lin.weight.grad.clone()
        opt.step()
        results.append(lin.weight.detach().clone())
        # SGD, lr 1: the step is exactly the clipped gradient plus the decay on the pruned positions
        torch.testing.assert_close(before - lin.weight.detach(), grad + 0.05 * (~mask) * before)
    torch.testing.assert_close(results[0], results[1])


def test_masked_decay_follows_clipping():
    """Clipping sees the gradient without the decay; the decay is added after it."""
    lin = layer_for("sr-ste", "cpu", decay=0.1)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    twofour.attach(lin, opt)
    lin(torch.randn(8, 32)).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(lin.parameters(), 1e-3)
    clipped, w0, mask = lin.weight.grad.clone(), lin.weight.detach().clone(), lin.mask.clone()
    opt.step()
    torch.testing.assert_close(w0 - lin.weight.detach(), clipped + 0.1 * (~mask) * w0)
    assert clipped.norm() < 1e-3 + 1e-6


def test_compressed_weight_kept_once_per_step_unless_memory_comes_first():
    """The fast path's compressed weight is built once and reused while the weight is unchanged;
    under saved-tensor hooks (activation checkpointing) or with ``keep`` off, every call builds
    its own and nothing stays, not even what an earlier call kept."""
    from twofour.sparse.fastpath import CompressedWeight

    calls = []

    class Counting:
        def compress(self, w, beta, mask, dtype, sparse=True):
            calls.append(1)
            return w.clone(), w.clone(), w.new_empty(0)

    w, cw = torch.randn(8, 8), CompressedWeight()

    def get():
        return cw.get(w, Counting(), None, None, 0, torch.float32)

    get(), get()
    assert len(calls) == 1  # kept
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        get(), get()
    assert len(calls) == 3  # each call its own, the kept one dropped
    get()
    assert len(calls) == 4  # nothing was kept under the hooks
    with torch.no_grad():
        w.add_(1)  # an optimizer step: a new version
    get(), get()
    assert len(calls) == 5
    cw.keep = False
    get(), get()
    assert len(calls) == 7 and torch.equal(get()[0], w)
