"""The fast path as torch.compile sees it (custom ops with their backward), on the CPU: the ops
pass torch's checks and, compiled whole, give the reference's output and gradients. On the CPU
only the dense routes exist (no cuSPARSELt); tests/test_fastpath.py runs the 2:4 ones on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from twofour.sparse import fastpath
from twofour.sparse.pruners import HARD, SOFT, TRANSPOSABLE


def operands(pruner, n=64, k=96):
    w = torch.randn(n, k, requires_grad=True)
    beta, mask = torch.tensor(1.3), pruner.mask(w.detach())
    wc, wd, wtc = pruner.compress(w.detach(), beta, mask, torch.bfloat16)
    return w, pruner.effective(w.detach(), beta, mask), wc[:0], wd, wtc[:0]  # dense routes only


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.triton  # pruner.compress on CPU tensors
@pytest.mark.parametrize("pruner", [HARD, SOFT, TRANSPOSABLE], ids=lambda p: p.name)
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_linear_matches_reference(pruner, bias):
    torch.manual_seed(0)
    w, w_eff, wc, wd, wtc = operands(pruner)
    b = torch.randn(64, requires_grad=True) if bias else None
    x = torch.randn(96, 64).t().reshape(2, 32, 96).requires_grad_()  # a column-major input too
    g = torch.randn(2, 32, 64, dtype=torch.bfloat16)

    def f(x):
        return fastpath.compiled_linear(x.to(torch.bfloat16), w, b, wc, wd, wtc, mvue=True)

    y = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    y.backward(g)
    w_ref = w_eff.bfloat16().requires_grad_()
    b_ref = None if b is None else b.detach().bfloat16().requires_grad_()
    x_ref = x.detach().bfloat16().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref)
    y_ref.backward(g)
    assert y.is_contiguous() and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=2e-2)  # bf16: a fused bias rounds once less
    torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad, w_ref.grad.float(), rtol=1e-2, atol=1e-2)  # passed straight through
    if bias:
        torch.testing.assert_close(b.grad, b_ref.grad.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.triton
def test_custom_ops_pass_opcheck():
    torch.manual_seed(0)
    w, _, wc, wd, wtc = operands(SOFT)
    x2 = torch.randn(32, 96, dtype=torch.bfloat16)
    b = torch.randn(64, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.twofour.sparse_linear.default, (x2, w.detach(), wc, wd, wtc, b, True, "dense"))
    dy2 = torch.randn(32, 64, dtype=torch.bfloat16)
    for dx in ("dense", "pruned-t"):
        args = (dy2, x2, wd, wtc, True, dx, True, True)
        torch.library.opcheck(torch.ops.twofour.sparse_linear_backward.default, args)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("recipe", ["dense", "s-ste"])
def test_fp8_layer_compiles_whole(recipe):
    """An FP8 layer compiles into one graph (no break at its GEMMs) and, compiled, gives eager's
    output and gradients (s-ste without MVUE, whose draws differ between the two runs)."""
    from twofour.sparse import SparseLinear  # noqa: PLC0415

    torch.manual_seed(0)
    lin = SparseLinear(64, 96, recipe=recipe, precision="fp8", **({"mvue": False} if recipe != "dense" else {}))
    x = torch.randn(2, 16, 64)
    outs = []
    for run in (lin, torch.compile(lin, backend="aot_eager", fullgraph=True)):
        lin.zero_grad()
        xr = x.clone().requires_grad_()
        y = run(xr)
        y.pow(2).sum().backward()
        outs.append((y.detach(), xr.grad, lin.weight.grad.clone()))
    for eager, compiled in zip(*outs, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fp8_mvue_weight_gradient_op_passes_opcheck():
    """The op a compiled FP8 backward calls for dW with MVUE (e4m3 gradients, one scale: the 2:4
    route on the estimate or the exact GEMM), with and without dY's scale from the dX GEMM."""
    from twofour.fp8 import E4M3, quantize_t  # noqa: PLC0415

    dy = torch.randn(64, 48, dtype=torch.bfloat16)
    qd, sd, _ = quantize_t(dy, E4M3)
    _, sxt, qxt = quantize_t(torch.randn(64, 32, dtype=torch.bfloat16), E4M3, transposed=True)
    for q, scale in ((qd, sd), (None, None)):
        torch.library.opcheck(torch.ops.twofour.mvue_dw_e4m3.default, (dy, q, scale, qxt, sxt, torch.bfloat16),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fp8_scaled_mm_op_passes_opcheck():
    from twofour.fp8 import (
        E4M3,
        quantize,  # noqa: PLC0415
    )

    qa, sa = quantize(torch.randn(32, 64), E4M3)
    qb, sb = quantize(torch.randn(48, 64), E4M3)
    # test_schema left out: it compares the FP8 inputs arithmetically, which the CPU lacks for FP8
    torch.library.opcheck(torch.ops.twofour.scaled_mm.default, (qa, sa, qb, sb, torch.bfloat16),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("choice", ["dense", "sparse"])
def test_gpu_compiled_layers_take_the_planned_form(choice):
    """plan_compiled's record decides what compiled code runs: dense GEMMs on the effective weight
    (the 2:4 op never called: no GEMM of its recorded) or the 2:4 op; both give the reference's
    output and weight gradient."""
    from twofour import dispatch
    from twofour.sparse import SparseLinear
    from twofour.sparse.compiled import plan_compiled, plan_key

    torch.manual_seed(0)
    dispatch.clear_choices()
    torch._dynamo.reset()  # the plan is a constant of the compiled code
    layer = SparseLinear(256, 512, recipe="s-ste").cuda()
    planned = plan_compiled(layer, tokens=256)
    assert set(planned) == {plan_key(layer, 256, torch.bfloat16)} and set(planned.values()) <= {"dense", "sparse"}
    dispatch.clear_choices()
    for key in planned:
        dispatch.set_choice(key, choice)
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.compile(layer)(x)
    y.float().square().sum().backward()
    ran_op = any(k.startswith("fwd") for k in dispatch.choices())
    assert ran_op == (choice == "sparse")
    w_ref = layer.effective_weight().bfloat16().requires_grad_()
    y_ref = F.linear(x.detach().bfloat16(), w_ref, layer.bias.bfloat16())
    y_ref.float().square().sum().backward()
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    if choice == "dense":  # exact dW (MVUE's estimate differs by its draws)
        torch.testing.assert_close(layer.weight.grad, w_ref.grad.float(), rtol=3e-2, atol=3e-2)
    dispatch.clear_choices()
    torch._dynamo.reset()
