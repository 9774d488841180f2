"""FP8 scaling, the FP8 GEMM and the FP8 linear against their plain-torch references (CPU; the
same tests run on the GPU where there is one)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from twofour import dispatch
from twofour.fp8 import (
    E4M3,
    E5M2,
    FP8,
    PRECISIONS,
    ROWWISE,
    SCALINGS,
    TENSORWISE,
    FP8LinearFn,
    Precision,
    dequantize,
    fake_fp8,
    fp8_linear,
    quantize,
    quantize_t,
    scaled_mm,
)
from twofour.functional import mask_24, mvue_24_padded
from twofour.kernels import fp8cast, ops
from twofour.kernels.mvue_fp8 import mvue_e4m3
from twofour.sparse import SparseLinear

FORMATS = [E4M3, E5M2]
SCALING = list(SCALINGS.values())


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_quantize_round_trip_and_scale(device, fmt, scaling):
    t = torch.randn(24, 40, device=device) * torch.logspace(-3, 3, 24, device=device)[:, None]
    q, s = quantize(t, fmt, scaling)
    assert q.dtype == fmt and s.dtype == torch.float32
    assert s.shape == ((24, 1) if scaling.rowwise else ())
    fmax = torch.finfo(fmt).max
    # the largest magnitude (of the tensor, or of each row) lands on the format's largest value
    peak = q.float().abs().amax(dim=-1) if scaling.rowwise else q.float().abs().amax()
    assert torch.equal(peak, torch.full_like(peak, fmax))
    back = dequantize(q, s)
    bits = 3 if fmt == E4M3 else 2  # mantissa bits: relative rounding error at most 2^-(bits+1)
    big = t.abs() > (t.abs().amax(-1, keepdim=True) if scaling.rowwise else t.abs().amax()) / 2 ** 6
    assert ((back - t).abs()[big] <= t.abs()[big] * 2.0 ** -(bits + 1) * 1.001).all()


@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_rowwise_scales_rows_apart(scaling):
    t = torch.randn(8, 32) * torch.logspace(-6, 0, 8)[:, None]
    err = rel(dequantize(*quantize(t, E4M3, scaling))[0], t[0])  # the smallest row
    assert err < 0.07 if scaling.rowwise else err > 0.07  # tensorwise flushes it toward zero


@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_zero_input_gets_scale_one(scaling):
    t = torch.zeros(4, 16)
    t[1] = torch.randn(16)
    q, s = quantize(t, E4M3, scaling)
    assert torch.isfinite(s).all() and (q.float()[t == 0] == 0).all()
    if scaling.rowwise:
        assert s[0].item() == 1.0 and s[1].item() != 1.0
    assert torch.equal(dequantize(*quantize(torch.zeros(3, 8), E5M2, scaling)), torch.zeros(3, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_non_finite_input_never_looks_finite(bad, scaling):
    a = torch.randn(32, 32)
    b = torch.randn(32, 32)
    a[3, 5] = bad
    qa, sa = quantize(a, E4M3, scaling)
    qb, sb = quantize(b, E4M3, scaling)
    assert not torch.isfinite(dequantize(qa, sa)[3]).any()
    y = scaled_mm(qa, sa, qb, sb, torch.float32)
    assert not torch.isfinite(y[3]).any()  # the row the bad value touches
    if not scaling.rowwise:
        assert not torch.isfinite(y).any()  # its scale touches every output


def test_fake_fp8_is_quantize_then_dequantize(dtype):
    t = torch.randn(16, 32).to(dtype)
    out = fake_fp8(t, E5M2)
    assert out.dtype == dtype
    assert torch.equal(out, dequantize(*quantize(t, E5M2), dtype))
    with pytest.raises(TypeError, match="float8"):
        quantize(t, torch.float16)


@pytest.mark.parametrize("shape", [(32, 64, 48), (30, 20, 12)])  # the second: dims not multiples of 16
@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_scaled_mm_matches_reference(device, shape, scaling):
    m, k, n = shape
    qa, sa = quantize(torch.randn(m, k, device=device), E5M2, scaling)
    qb, sb = quantize(torch.randn(n, k, device=device), E4M3, scaling)
    y = scaled_mm(qa, sa, qb, sb, torch.bfloat16)
    ref = dequantize(qa, sa) @ dequantize(qb, sb).t()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel(y, ref) < 1e-2  # the same products, rounded once to bf16


@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_scaled_mm_adds_the_bias(device, scaling):
    """The bias goes into the GEMM's epilogue (or the reference's float32 sum): added once, to
    every row."""
    qa, sa = quantize(torch.randn(48, 64, device=device), E4M3, scaling)
    qb, sb = quantize(torch.randn(32, 64, device=device), E4M3, scaling)
    b = (torch.randn(32, device=device) * 10).to(torch.bfloat16)
    y = scaled_mm(qa, sa, qb, sb, torch.bfloat16, bias=b)
    ref = dequantize(qa, sa) @ dequantize(qb, sb).t() + b.float()
    assert y.dtype == torch.bfloat16 and rel(y, ref) < 1e-2
    assert rel(y - scaled_mm(qa, sa, qb, sb, torch.bfloat16), b.float().expand(48, 32)) < 2e-2


@pytest.mark.skipif(not fp8cast.HAS_TRITON, reason="needs triton")
@pytest.mark.triton
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(64, 256), (37, 100)], ids=str)  # the second: partial tiles
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_rescale_matches_plain_torch(device, out, shape, with_bias):
    """The pass that scales an FP8 2:4 GEMM's output: the float32 product and sum rounded once,
    the same bits as plain torch; a non-finite scale reaches every element."""
    y = (torch.randn(shape, device=device) * 300).to(out)
    sa, sb = torch.tensor(0.0173, device=device), torch.tensor(2.9, device=device)
    bias = torch.randn(shape[1], device=device).to(out) if with_bias else None
    want = y.float() * (sa * sb)
    want = (want if bias is None else want + bias.float()).to(out)
    got = fp8cast.rescale_(y.clone(), sa, sb, bias)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.isnan(fp8cast.rescale_(y.clone(), torch.tensor(float("nan"), device=device), sb, bias)).all()
    with pytest.raises(ValueError, match="contiguous 2-D"):
        fp8cast.rescale_(y.t(), sa, sb)


def reference_linear(x, w, b, scaling, mvue=False, grad_fmt=E4M3):
    """y, dX, dW of the FP8 linear, from operands dequantized in plain torch."""
    def fq(t, fmt):
        return dequantize(*quantize(t, fmt, scaling))

    dy = torch.randn(x.shape[0], w.shape[0], generator=torch.Generator().manual_seed(7)).to(x.device)
    y = fq(x, E4M3) @ fq(w, E4M3).t() + b
    dx = fq(dy, grad_fmt) @ fq(w.t().contiguous(), E4M3).t()
    dyt = dy.t().contiguous()
    dw = fq(mvue_24_padded(dyt) if mvue else dyt, grad_fmt) @ fq(x.t().contiguous(), E4M3).t()
    return y, dx, dw, dy


@pytest.mark.parametrize("grad_fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_fp8_linear_matches_reference_and_dense(device, scaling, grad_fmt):
    torch.manual_seed(0)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 48, device=device) / 7)
    b = torch.randn(32, device=device, requires_grad=True)
    ry, rdx, rdw, dy = reference_linear(x.detach(), w.detach(), b.detach(), scaling, grad_fmt=grad_fmt)
    y = fp8_linear(x, w, b, precision=Precision(True, grad_fmt, scaling))
    y.backward(dy)
    # Hopper's FP8 tensor cores accumulate with fewer bits than float32 (4.6e-5 seen on an H100)
    tol = 1e-5 if device.type == "cpu" else 2e-4
    for got, want in ((y, ry), (x.grad, rdx), (w.grad, rdw)):
        assert got.dtype == torch.float32 and rel(got, want) < tol
    assert torch.allclose(b.grad, dy.sum(0))
    # and FP8 is close to the dense product
    xd, wd = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(xd, wd, b.detach()).backward(dy)
    assert rel(y, F.linear(x, w, b)) < 0.05 and rel(x.grad, xd.grad) < 0.1 and rel(w.grad, wd.grad) < 0.1


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_each_precision_rounds_the_gemms_it_names(device, name):
    """A layer with each preset: the GEMMs the precision puts in FP8 are the FP8 reference's (operands
    quantized in plain torch with its scaling, dY in its format), the others the exact products."""
    p = PRECISIONS[name]
    torch.manual_seed(0)
    lin = SparseLinear(48, 32, recipe="dense", precision=name, device=device)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    dy = torch.randn(64, 32, device=device)
    y = lin(x)
    y.backward(dy)
    w, xd, b = lin.weight.detach(), x.detach(), lin.bias.detach()

    def fq(t, fmt):
        return dequantize(*quantize(t.contiguous(), fmt, p.scaling))

    exact = (xd @ w.t() + b, dy @ w, dy.t() @ xd)
    fp8 = (fq(xd, E4M3) @ fq(w, E4M3).t() + b,
           fq(dy, p.grad or E4M3) @ fq(w.t(), E4M3).t(), fq(dy.t(), p.grad or E4M3) @ fq(xd.t(), E4M3).t())
    tol = 1e-5 if device.type == "cpu" else 2e-4
    backward = p.grad is not None
    for got, in_fp8, want_exact, want_fp8 in zip((y, x.grad, lin.weight.grad), (p.forward, backward, backward),
                                                 exact, fp8):
        assert rel(got, want_fp8 if in_fp8 else want_exact) < tol
        assert (rel(got, want_exact) > 1e-3) is in_fp8  # FP8's rounding shows exactly where it runs


def test_fp8_linear_bf16_autocast_and_effective_weight(device):
    x = torch.randn(2, 16, 64, device=device)
    w = torch.nn.Parameter(torch.randn(48, 64, device=device))
    w_eff = w.detach() * (torch.rand_like(w) > 0.5)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = fp8_linear(x, w, None, w_eff)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 16, 48)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
    assert rel(y, F.linear(x, w_eff)) < 0.05


def linear_case(device):
    """x (64 x 48, requiring grad), a weight W (32 x 48), a bias, W_eff (W with about half its entries
    zeroed) and dY (64 x 32): a linear's operands with seed 0."""
    torch.manual_seed(0)
    x = torch.randn(64, 48, device=device, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 48, device=device) / 7)
    b = torch.randn(32, device=device, requires_grad=True)
    return x, w, b, w.detach() * (torch.rand_like(w) > 0.5), torch.randn(64, 32, device=device)


@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_fp8_linear_forward_only(device, scaling):
    """``fp8-forward`` (``grad=None``): the forward GEMM in FP8 as with ``fp8``, dX and dW the exact
    products of dY with the unquantized W_eff and x."""
    x, w, b, w_eff, dy = linear_case(device)
    forward_only = Precision(True, None, scaling)
    y = fp8_linear(x, w, b, w_eff, precision=forward_only)
    y.backward(dy)
    assert torch.equal(y, fp8_linear(x.detach(), w.detach(), b.detach(), w_eff, precision=Precision(True, E4M3,
                                                                                                    scaling)))
    assert rel(x.grad, dy @ w_eff) < 1e-6 and rel(w.grad, dy.t() @ x.detach()) < 1e-6
    assert torch.allclose(b.grad, dy.sum(0))
    x.grad = w.grad = None  # with MVUE, the reference: an unbiased 2:4 estimate of dY^T, then the exact product
    torch.manual_seed(1)
    with dispatch.override(fast=False):
        fp8_linear(x, w, b, w_eff, precision=forward_only, mvue=True).backward(dy)
    torch.manual_seed(1)
    assert rel(w.grad, mvue_24_padded(dy.t().contiguous()) @ x.detach()) < 1e-6
    assert rel(x.grad, dy @ w_eff) < 1e-6


@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_fp8_linear_backward_only(device, scaling):
    """``fp8-backward`` (``forward=False``): the forward is the exact product in the compute dtype,
    and dX and dW are the FP8 backward's, the same as with the forward in FP8."""
    x, w, b, w_eff, dy = linear_case(device)
    y = fp8_linear(x, w, b, w_eff, precision=Precision(False, E4M3, scaling))
    y.backward(dy)
    assert rel(y, F.linear(x.detach(), w_eff, b.detach())) < 1e-6
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fp8_linear(x2, w2, b.detach(), w_eff, precision=Precision(True, E4M3, scaling)).backward(dy)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    with pytest.raises(ValueError, match="precision 'bf16' puts no GEMM in FP8"):
        fp8_linear(x, w, b, precision="bf16")


def test_layer_fp8_forward_trains_forward_only_in_fp8(device):
    """A layer with precision ``fp8-forward`` runs its forward in FP8 (same output as the FP8 layer)
    and its dX in the compute dtype (the dense product with the effective weight)."""
    torch.manual_seed(0)
    a = SparseLinear(64, 32, recipe="s-ste", precision="fp8").to(device)
    b = SparseLinear(64, 32, recipe="s-ste", precision="fp8-forward").to(device)
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 64, device=device, requires_grad=True)
    ya, yb = a(x), b(x)
    assert torch.equal(ya, yb)
    yb.sum().backward()
    assert rel(x.grad, torch.ones_like(yb) @ b.effective_weight().detach()) < 1e-6
    assert b.weight.grad is not None and torch.isfinite(b.weight.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_linear_mvue_is_unbiased(device, dtype):
    """The plain-torch reference (here on a GPU too: the fast path off) draws MVUE's estimate for
    dW: a noisy estimate whose average converges to dY^T X."""
    torch.manual_seed(1)
    x = torch.randn(64, 32, device=device, dtype=dtype)
    w = torch.nn.Parameter(torch.randn(16, 32, device=device, dtype=dtype))
    dy = torch.randn(64, 16, device=device, dtype=dtype)
    exact = dy.float().t() @ x.float()
    grads = []
    with dispatch.override(fast=False):
        for _ in range(64):
            w.grad = None
            FP8LinearFn.apply(x, w, None, w.detach(), FP8, True, dtype).backward(dy)
            grads.append(w.grad.float())
    one, mean = rel(grads[0], exact), rel(torch.stack(grads).mean(0), exact)
    assert one > 0.2 and mean < one / 3  # a noisy estimate whose average converges


@pytest.mark.parametrize("recipe", ["dense", "s-ste", "t-sr-ste"])
def test_layer_fp8_every_recipe(device, recipe):
    torch.manual_seed(0)
    lin = SparseLinear(32, 16, recipe=recipe, precision="fp8").to(device)
    x = torch.randn(64, 32, device=device)
    y = lin(x)
    ref = F.linear(x, lin.effective_weight(), lin.bias)
    assert 0 < rel(y, ref) < 0.1  # FP8 rounding is visible but small
    y.pow(2).sum().backward()
    assert torch.isfinite(lin.weight.grad).all() and lin.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("recipe", ["dense", "s-ste"])
def test_layer_fp8_rowwise_runs_the_rowwise_gemms(device, recipe):
    """``fp8-rowwise``: the layer's output and gradients are the FP8 linear's with row scales."""
    torch.manual_seed(0)
    opts = {} if recipe == "dense" else {"mvue": False}
    lin = SparseLinear(32, 16, recipe=recipe, precision="fp8-rowwise", **opts).to(device)
    x = torch.randn(4, 16, 32, device=device, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = lin.weight.detach().clone().requires_grad_()
    y = lin(x)
    y_ref = fp8_linear(x_ref, w_ref, lin.bias, lin.effective_weight(), precision=Precision(True, E4M3, ROWWISE))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rowwise scaling needs a GEMM in FP8"):
        SparseLinear(32, 16, recipe=recipe, precision=Precision(scaling=ROWWISE))


@pytest.mark.parametrize("recipe", ["dense", "s-ste"])
def test_layer_bf16_finetune_leaves_fp8_on_schedule(device, recipe):
    """``bf16_finetune=f``: FP8 GEMMs until ``(1 - f) * total_steps`` optimizer steps, then the
    reference math on the same effective weight; the phase comes back from the state dict."""
    torch.manual_seed(0)
    opts = dict(recipe=recipe, precision="fp8", bf16_finetune=0.5, total_steps=4)
    lin = SparseLinear(32, 16, **opts).to(device)
    x = torch.randn(64, 32, device=device)
    phases = []
    for _ in range(4):
        y = lin(x)
        gap = rel(y, F.linear(x, lin.effective_weight(), lin.bias))
        phases.append(lin.is_fp8_phase)
        assert gap > 0 if lin.is_fp8_phase else gap < 1e-6
        y.pow(2).sum().backward()
        lin.advance()
    assert phases == [True, True, False, False]  # steps 3 and 4 of 4 without FP8
    for step, fp8 in ((1, True), (2, False)):
        state = {**lin.state_dict(), "step": torch.tensor(step)}
        fresh = SparseLinear(32, 16, **opts).to(device)
        fresh.load_state_dict(state)
        assert fresh.is_fp8_phase is fp8


def test_dense_layer_keeps_a_step_counter_only_for_bf16_finetune():
    """A dense layer's state dict is nn.Linear's unless its FP8 phase ends (it then counts steps),
    and nn.Linear's loads into it as a run at step 0."""
    plain = torch.nn.Linear(32, 16)
    assert set(SparseLinear(32, 16, recipe="dense", precision="fp8").state_dict()) == set(plain.state_dict())
    lin = SparseLinear(32, 16, recipe="dense", precision="fp8", bf16_finetune=0.5, total_steps=4)
    assert set(lin.state_dict()) == {*plain.state_dict(), "step"}
    lin.load_state_dict(plain.state_dict())
    assert int(lin.step) == 0 and lin.is_fp8_phase and torch.equal(lin.weight, plain.weight)


def test_layer_bf16_finetune_recompiles_at_the_switch():
    """A compiled layer follows the switch, compiling twice in all: once per phase."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    lin = SparseLinear(32, 16, recipe="s-ste", precision="fp8", bf16_finetune=0.5, total_steps=2)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lin, backend=counter)
    x = torch.randn(64, 32)
    assert rel(compiled(x), F.linear(x, lin.effective_weight(), lin.bias)) > 0
    lin.advance()
    torch.testing.assert_close(compiled(x), F.linear(x, lin.effective_weight(), lin.bias))
    compiled(x)
    assert counter.frame_count == 2


@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_layer_fp8_grad_e4m3_quantizes_the_gradient_in_e4m3(device, scaling):
    """``grad=E4M3`` (the ``fp8`` presets): the layer's gradients are the FP8 linear's with an e4m3
    dY, closer to the exact gradients than with e5m2 (``-e5m2`` presets; one more mantissa bit)."""
    torch.manual_seed(0)
    x = torch.randn(256, 64, device=device)
    g = torch.randn(256, 32, device=device)
    grads = {}
    for e4m3 in (False, True):
        precision = Precision(True, E4M3 if e4m3 else E5M2, scaling)
        lin = SparseLinear(64, 32, recipe="s-ste", mvue=False, precision=precision.name).to(device)
        torch.manual_seed(1)
        lin.reset_parameters()
        xg = x.clone().requires_grad_()
        lin(xg).backward(g)
        grads[e4m3] = xg.grad, lin.weight.grad
        w_ref = lin.weight.detach().clone().requires_grad_()
        x_ref = x.clone().requires_grad_()
        fp8_linear(x_ref, w_ref, lin.bias, lin.effective_weight(), precision=precision).backward(g)
        torch.testing.assert_close(xg.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.weight.grad, w_ref.grad, rtol=1e-5, atol=1e-5)
    exact_dx = g @ lin.effective_weight()
    exact_dw = g.t() @ x
    assert rel(grads[True][0], exact_dx) < 0.8 * rel(grads[False][0], exact_dx)
    assert rel(grads[True][1], exact_dw) < 0.8 * rel(grads[False][1], exact_dw)
    with pytest.raises(ValueError, match="no option fp8_grad_e4m3; .*FP8 is the recipe's precision"):
        SparseLinear(32, 16, recipe="s-ste", fp8_grad_e4m3=False)
    with pytest.raises(ValueError, match="grad must be"):
        fp8_linear(x, lin.weight, None, precision=Precision(True, torch.bfloat16))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_transposed_copy_is_the_transpose_quantized(device, fmt):
    t = torch.randn(48, 80, device=device, dtype=torch.bfloat16) * 5
    q, s, qt = quantize_t(t, fmt, TENSORWISE, transposed=True)
    q2, s2 = quantize(t.t().contiguous(), fmt, TENSORWISE)
    assert qt.is_contiguous() and torch.equal(s, s2)
    assert torch.equal(qt.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(q.t().contiguous().view(torch.uint8), qt.view(torch.uint8))
    with pytest.raises(ValueError, match="tensorwise"):
        quantize_t(t, fmt, ROWWISE, transposed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("scaling", SCALING, ids=lambda s: s.name)
def test_gpu_quantization_matches_plain_torch(fmt, scaling):
    """The compiled quantization the GPU runs gives the CPU's plain-torch scales (to rounding) and
    bytes (a code off by one at most, where the GPU's division rounds the other way)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for shape in [(256, 320), (100, 48)]:  # the second shape recompiles nothing: dynamic shapes
        t = torch.randn(*shape, dtype=torch.bfloat16) * torch.logspace(-2, 2, shape[0])[:, None]
        t[3, 5] = 0
        q, s, qt = quantize_t(t.cuda(), fmt, scaling, transposed=not scaling.rowwise)
        rq, rs, rqt = quantize_t(t, fmt, scaling, transposed=not scaling.rowwise)
        torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
        pairs = [(q, rq)] + ([(qt, rqt)] if qt is not None else [])
        for got, want in pairs:
            diff = (got.cpu().view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


VARIANTS = [(TENSORWISE, False), (TENSORWISE, True), (ROWWISE, False)]


@pytest.mark.skipif(not fp8cast.HAS_TRITON, reason="needs triton")
@pytest.mark.triton
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize(("scaling", "transposed"), VARIANTS, ids=["tensorwise", "tensorwise+T", "rowwise"])
def test_triton_quantization_matches_plain_torch(device, dtype, fmt, scaling, transposed):
    """The Triton kernels give plain torch's scales and bytes, zero rows and tensors and an amax
    too small to scale included, for shapes that fill no tile."""
    g = torch.Generator().manual_seed(0)
    for shape in [(70, 130), (3, 1000), (1, 5)]:
        t = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[0])[:, None]
        t[0, : shape[1] // 2] = 0
        if shape[0] > 2:
            t[2] = 0  # an all-zero row: scale 1 rowwise
        t = t.to(dtype)
        if not fp8cast.supported(t.to(device), scaling.rowwise, transposed):  # a float32 copy to transpose, GPU
            assert device.type == "cuda" and transposed and dtype == torch.float32
            with pytest.raises(ValueError, match="contiguous float tensor"):
                fp8cast.quantize(t.to(device), fmt, scaling.rowwise, transposed)
            continue
        for x in [t, torch.zeros_like(t), torch.full_like(t, 1e-44)]:  # 1e-44 / fmax is 0 in float32
            q, s, qt = fp8cast.quantize(x.to(device), fmt, scaling.rowwise, transposed)
            rq, rs, rqt = quantize_t(x, fmt, scaling, transposed=transposed)
            assert torch.equal(s.cpu(), rs) and rs.isfinite().all()
            assert (qt is None) == (not transposed)
            for got, want in [(q, rq)] + ([(qt, rqt)] if transposed else []):
                assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(not fp8cast.HAS_TRITON, reason="needs triton")
@pytest.mark.triton
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on inf / inf
def test_triton_quantization_propagates_nan_and_inf(device, rowwise):
    """A NaN or inf makes its scale (the tensor's, or its row's) non-finite, as in plain torch;
    other rows keep finite scales."""
    t = torch.randn(4, 300)
    t[1, 7], t[2, 9] = float("nan"), float("inf")
    _, s, _ = fp8cast.quantize(t.to(device), E4M3, rowwise)
    _, rs, _ = quantize_t(t, E4M3, ROWWISE if rowwise else TENSORWISE)
    s = s.cpu()
    assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.isinf(), rs.isinf())
    if rowwise:
        assert s[0].isfinite() and s[3].isfinite() and s[1].isnan() and s[2].isinf()


def test_triton_quantization_refuses_what_it_cannot_take():
    """A non-contiguous tensor, or rowwise scales of a 1-D one: a clear error, nothing written."""
    t = torch.randn(64, 32)
    assert not fp8cast.supported(t.t(), False, False) and not fp8cast.supported(t[0], True, False)
    with pytest.raises(ValueError, match="contiguous float tensor"):
        fp8cast.quantize(t.t(), E4M3)


@pytest.mark.skipif(not fp8cast.HAS_TRITON, reason="needs triton")
@pytest.mark.triton
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("shape", [(64, 96), (37, 100), (1, 33), (130, 5), (300, 260)], ids=str)  # partial tiles
@pytest.mark.parametrize("tile", [None, (64, 128, 4)], ids=["default-tile", "64x128"])
def test_triton_transpose_is_the_transpose(device, fmt, shape, tile):
    """The FP8 transpose writes exactly q^T, row-major, with every byte pattern (NaN included),
    over several tiles along both axes and partial ones."""
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(sum(shape)))
    q = bits.view(fmt).to(device)
    got = fp8cast.transpose(q, tile)
    assert got.dtype == fmt and got.shape == shape[::-1] and got.is_contiguous()
    assert torch.equal(got.cpu().view(torch.uint8), bits.t())


def test_transpose_refuses_what_it_cannot_take():
    """A strided, 1-D or wider-than-a-byte tensor: a one-line error."""
    q = torch.zeros(8, 16, dtype=E4M3)
    for bad in (q.t(), q[0], torch.zeros(8, 16)):
        with pytest.raises(ValueError, match="contiguous 2-D tensor of 1-byte elements"):
            fp8cast.transpose(bad)


@pytest.mark.gpu
def test_gpu_quantization_compiles_every_variant(caplog):
    """Every input dtype x format x scaling x transposed copy, at two shapes each, runs compiled
    (the dispatch times both routes on first use): more variants than Dynamo recompiles one
    function for, and none falls back."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if dispatch.gemm != "auto":
        pytest.skip("TWOFOUR_GEMM forces a route: the dispatch times nothing")
    dispatch.clear_choices()
    with caplog.at_level(logging.WARNING, logger="twofour"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for fmt in (E4M3, E5M2):
                for scaling, transposed in VARIANTS:
                    for shape in [(64, 96), (96, 160)]:
                        t = torch.randn(*shape, device="cuda", dtype=dtype)
                        q, s, _ = quantize_t(t.requires_grad_(), fmt, scaling, transposed=transposed)
                        assert rel(dequantize(q, s), t.detach().float()) < 0.1
    timed = [v["ms"] for k, v in dispatch.choices().items() if k.startswith("fp8-quantize")]
    assert len(timed) == 3 * 2 * 3 * 2 and all("compiled" in ms for ms in timed)
    assert "FP8 quantization failed" not in caplog.text  # no compiled or Triton variant fell back


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["s-ste", "ste", "t-sr-ste"])
def test_gpu_layer_fp8_on_the_fused_effective_weight(recipe):
    """Under bf16 autocast on a GPU the FP8 layer quantizes the fused kernel's effective weight."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    lin = SparseLinear(64, 96, recipe=recipe, precision="fp8").cuda()
    x = torch.randn(128, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    assert 0 < rel(y, F.linear(x, lin.effective_weight(), lin.bias)) < 0.1
    y.float().pow(2).sum().backward()
    assert torch.isfinite(lin.weight.grad).all() and lin.weight.grad.abs().sum() > 0


def _fp8_sparse_gpu() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
            and ops.fast_available())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(96, 128), (320, 1024)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3], ids=str)
def test_gpu_plan_free_compression_writes_the_plans_bytes(shape, dtype):
    """cuSPARSELt's plan-free compression (what the FP8 2:4 route uses) writes the bytes a plan's
    own compression writes, and the reference layout's bytes."""
    if not _fp8_sparse_gpu():
        pytest.skip("needs an sm89+ GPU with the fast path")
    from twofour.kernels import cusparselt as cs
    from twofour.kernels.layout import compress_reference

    torch.manual_seed(0)
    m, k = shape
    mask = mask_24(torch.randn(m, k, device="cuda"))
    v = torch.randn(m, k, device="cuda")
    a = ((v.abs() + 0.5) * v.sign() * mask).to(dtype)  # kept values well away from 0 (none rounds to it)
    plan = cs.get_plan(m, k, 64, cs.COL, cs.COL, dtype, out_dtype=torch.bfloat16)
    assert torch.equal(cs.compress(a), plan.compress(a))
    assert torch.equal(cs.compress(a).cpu(), compress_reference(a.cpu(), mask.cpu()))
    if dtype == E4M3:  # and the Triton kernel the FP8 2:4 route runs writes the same bytes
        from twofour.kernels.compress import compress_e4m3

        assert torch.equal(compress_e4m3(a), cs.compress(a))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 128, 96), (64, 512, 320)])
def test_gpu_fp8_sparse_forward_matches_reference(shape):
    """The FP8 2:4 route of the forward GEMM (the weight compressed by the Triton kernel, the
    operands' scales and the bias in one pass over the output) computes the reference product, as
    the dense FP8 route does; the dispatch times both once and records them."""
    if not _fp8_sparse_gpu():
        pytest.skip("needs an sm89+ GPU with the fast path")
    torch.manual_seed(0)
    t, k, n = shape
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(n, k, device="cuda") * mask_24(torch.randn(n, k, device="cuda"))
    qx, sx = quantize(x, E4M3)
    qw, sw = quantize(w.to(torch.bfloat16), E4M3)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    ref = dequantize(qx, sx) @ dequantize(qw, sw).t()
    for mode in ("sparse", "dense"):
        with dispatch.override(gemm=mode):
            y = scaled_mm(qx, sx, qw, sw, torch.bfloat16, sparse_b=True)
            yb = scaled_mm(qx, sx, qw, sw, torch.bfloat16, sparse_b=True, bias=b)
        for got, want in ((y, ref), (yb, ref + b.float())):
            assert got.shape == (t, n) and got.is_contiguous() and got.dtype == torch.bfloat16
            assert rel(got, want) < 1e-2, mode
    if dispatch.gemm == "auto":
        dispatch.clear_choices()
        scaled_mm(qx, sx, qw, sw, torch.bfloat16, sparse_b=True)
        hit = [v for key, v in dispatch.choices().items() if key.startswith(f"fp8-fwd:{n}x{k}x{t}:")]
        assert len(hit) == 1 and set(hit[0]["ms"]) == {"sparse", "dense"}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 128, 96), (1024, 96, 64)])  # (tokens, in, out)
def test_gpu_fp8_mvue_dw_routes(shape, caplog):
    """e4m3 gradients, one scale, MVUE: dW through the FP8 2:4 route (the estimate written
    compressed in e4m3 at the bound scale, the FP8 2:4 GEMM, one scaling pass) is a noisy estimate
    of dY^T X whose average over draws converges; through the dense route it is exact (the FP8
    product of dY^T and X, the same every call, and for dY stored column-major); the dispatch times
    both routes once."""
    if not _fp8_sparse_gpu():
        pytest.skip("needs an sm89+ GPU with the fast path")
    torch.manual_seed(0)
    t, k, n = shape
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    exact = dy.float().t() @ x.float()
    x_grad = {"with dX": x.clone().requires_grad_(), "without dX": x}  # dY's scale from dX's quantization or its own

    def draw(xs=x_grad["with dX"], g=dy):
        w.grad = None
        fp8_linear(xs, w, None, precision="fp8", mvue=True).backward(g)
        return w.grad.float()

    for name, xs in x_grad.items():
        with dispatch.override(gemm="sparse"), caplog.at_level("WARNING", logger="twofour"):
            grads = torch.stack([draw(xs) for _ in range(128)])
        assert "dW GEMM failed" not in caplog.text  # the forced 2:4 route ran, not its fallback
        one, mean = rel(grads[0], exact), rel(grads.mean(0), exact)
        assert torch.isfinite(grads).all() and one > 0.2 and mean < min(one / 4, 0.1), name
        with dispatch.override(gemm="dense"):
            grads = torch.stack([draw(xs) for _ in range(3)])
            column_major = draw(xs, dy.t().contiguous().t())  # the same dY, stored column-major
        assert (grads == grads[0]).all() and rel(grads[0], exact) < 0.1, name
        assert torch.equal(column_major, grads[0]), name
    if dispatch.gemm == "auto":
        for xs in x_grad.values():
            dispatch.clear_choices()
            draw(xs)
            hit = [v for key, v in dispatch.choices().items() if key.startswith(f"fp8-dw-mvue:{n}x{t}x{k}:")]
            assert len(hit) == 1 and set(hit[0]["ms"]) == {"sparse", "dense"}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_fp8_mvue_dw_routes_run_compiled(mode, caplog, monkeypatch):
    """Compiled (CUDA graphs included), dW on the MVUE estimate with e4m3 gradients still has both
    routes, picked at run time: the forced 2:4 route runs (its kernel is called, no fallback) and
    its draws change from call to call (their average converges to dY^T X), with dY's scale from
    the dX GEMM or its own; the dispatch times both routes."""
    if not _fp8_sparse_gpu():
        pytest.skip("needs an sm89+ GPU with the fast path")
    import twofour.fp8.linear as fp8_module  # noqa: PLC0415 - the module whose dW route calls it

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return mvue_e4m3(*args, **kwargs)

    monkeypatch.setattr(fp8_module, "mvue_e4m3", counted)
    torch.manual_seed(0)
    t, k, n = 256, 128, 96
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    exact = dy.float().t() @ x.float()

    def draw(f, xs):
        torch.compiler.cudagraph_mark_step_begin()
        w.grad = xs.grad = None  # no accumulation into a replayed graph's output
        f(xs).backward(dy)
        return w.grad.float()  # a copy: a replayed graph's outputs are overwritten by the next replay

    for xs in (x.clone().requires_grad_(), x):  # with dX (dY's scale from its quantization), without
        for forced in ("sparse", "auto"):
            torch.compiler.reset()  # a fresh graph per dispatch setting (a recorded graph replays its route)
            dispatch.clear_choices()
            calls.clear()
            f = torch.compile(lambda a: fp8_linear(a, w, None, precision="fp8", mvue=True), mode=mode,
                              fullgraph=True)
            with dispatch.override(gemm=forced), caplog.at_level("WARNING", logger="twofour"):
                grads = torch.stack([draw(f, xs) for _ in range(128 if forced == "sparse" else 3)])
            assert "dW GEMM failed" not in caplog.text and calls, (forced, xs.requires_grad)
            if forced == "sparse":
                one, mean = rel(grads[0], exact), rel(grads.mean(0), exact)
                assert torch.isfinite(grads).all() and one > 0.2 and mean < min(one / 4, 0.1), xs.requires_grad
            else:
                hit = [v for key, v in dispatch.choices().items() if key.startswith(f"fp8-dw-mvue:{n}x{t}x{k}:")]
                assert len(hit) == 1 and set(hit[0]["ms"]) == {"sparse", "dense"}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["ste", "s-ste", "t-sr-ste"])
def test_gpu_fp8_sparse_layer_compiles_and_matches_dense_route(recipe):
    """An FP8 2:4 layer with its forward on the FP8 2:4 route gives the dense FP8 route's output,
    eager and compiled (where the effective weight comes from the fused kernel as a custom op),
    and the compiled weight gradient is the eager one."""
    if not _fp8_sparse_gpu():
        pytest.skip("needs an sm89+ GPU with the fast path")
    torch.manual_seed(0)
    lin = SparseLinear(256, 512, recipe=recipe, precision="fp8", bias=False).cuda()
    x = torch.randn(4, 64, 256, device="cuda")
    out, grads = {}, {}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for mode in ("sparse", "dense"):
            with dispatch.override(gemm=mode):
                out[mode] = lin(x)
                out[mode + "-compiled"] = torch.compile(lin, fullgraph=True)(x)
        with dispatch.override(gemm="dense"):  # the exact dW (no MVUE draw) on both sides
            for name, f in (("eager", lin), ("compiled", torch.compile(lin, fullgraph=True))):
                lin.weight.grad = None
                f(x).float().square().mean().backward()
                grads[name] = lin.weight.grad.clone()
    for name, y in out.items():
        assert rel(y, out["dense"]) < 1e-2, name
    assert rel(grads["compiled"], grads["eager"]) < 1e-2


def test_rowwise_needs_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 3, 4), E4M3, ROWWISE)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,dx", [("t-sr-ste", "transposable"), ("s-ste", "pruned-t")])
def test_gpu_fp8_sparse_dx_matches_the_dense_route(recipe, dx, monkeypatch):
    """FP8 with a dX route that makes W^T 2:4 along the output features: dX through the FP8 2:4
    GEMM (forced) equals dX through the dense FP8 GEMM; forced, cuSPARSELt ran the forward and dX."""
    if not _fp8_sparse_gpu():
        pytest.skip("needs an sm89+ GPU with the fast path")
    torch.manual_seed(0)
    layer = SparseLinear(256, 512, device="cuda", recipe=recipe, precision="fp8", mvue=False,
                         **({"dx": dx} if recipe == "s-ste" else {}))
    assert layer.recipe.dx == dx
    x = torch.randn(512, 256, device="cuda")
    g = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    spmm, calls = ops.spmm, []
    monkeypatch.setattr(ops, "spmm", lambda *a, **k: calls.append(1) or spmm(*a, **k))
    grads = {}
    for mode in ("sparse", "dense"):
        xx = x.clone().requires_grad_()
        calls.clear()
        with dispatch.override(gemm=mode), torch.autocast("cuda", dtype=torch.bfloat16):
            layer(xx).backward(g)
        grads[mode] = xx.grad.float()
        assert len(calls) == (2 if mode == "sparse" else 0), mode
    assert rel(grads["sparse"], grads["dense"]) < 2e-2
