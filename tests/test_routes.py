"""SparseLinear's forward routes (twofour.sparse.routes): which route a call takes, and that the
route computes what it promises (the fast-path routes on a GPU only)."""

import pytest
import torch
import torch.nn.functional as F

from twofour import dispatch
from twofour.activations import GELU_TANH
from twofour.fp8 import fp8_linear
from twofour.kernels import ops
from twofour.sparse import SparseLinear, routes
from twofour.sparse.routes import ROUTES, Route, route_for


def case(recipe, device, dtype=torch.float32, **opts):
    """A 64 -> 32 layer and 64 tokens that require grad, seed 0."""
    torch.manual_seed(0)
    lin = SparseLinear(64, 32, recipe=recipe, device=device, **opts)
    x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
    return lin, x


def grads(lin, x, y):
    """(dX, dW, db) of ``(y * g).sum()`` for a fixed g."""
    x.grad = lin.weight.grad = lin.bias.grad = None
    y.backward(_g(y))
    return x.grad, lin.weight.grad, lin.bias.grad


def grads_of(y, *leaves):
    """The gradients of ``(y * g).sum()`` for ``leaves``, with :func:`grads`' g."""
    return torch.autograd.grad(y, leaves, _g(y))


def _g(y):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)


@pytest.mark.parametrize("recipe", ["ste", "s-ste", "t-sr-ste"])
def test_without_the_fast_path_a_sparse_layer_runs_the_reference(device, recipe):
    """The fast path off: the reference route, y = x W_eff^T + b and dW passed straight through."""
    lin, x = case(recipe, device, mvue=False)
    with dispatch.override(fast=False):
        assert route_for(lin, x).name == "reference"
        y = lin(x)
    dx, dw, db = grads(lin, x, y)
    x2 = x.detach().clone().requires_grad_()
    w_eff = lin.effective_weight().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    want = F.linear(x2, w_eff, b)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close((dx, dw, db), grads_of(want, x2, w_eff, b))


def test_dense_recipe_is_nn_linear(device):
    lin, x = case("dense", device)
    assert route_for(lin, x).name == "dense"
    plain = torch.nn.Linear(64, 32, device=device)
    plain.load_state_dict(lin.state_dict())
    x2 = x.detach().clone().requires_grad_()
    y, want = lin(x), plain(x2)
    assert torch.equal(y, want)
    for got, ref in zip(grads(lin, x, y), grads_of(want, x2, plain.weight, plain.bias)):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("recipe", ["dense", "s-ste"])
@pytest.mark.parametrize("precision", ["fp8", "fp8-forward", "fp8-backward-rowwise-e5m2"])
def test_an_fp8_precision_runs_the_fp8_linear(device, recipe, precision):
    """Any FP8 precision, dense recipe included: the FP8 route, the FP8 linear on W_eff."""
    lin, x = case(recipe, device, precision=precision, **({} if recipe == "dense" else {"mvue": False}))
    assert route_for(lin, x).name == "fp8"
    y = lin(x)
    x2, w2 = x.detach().clone().requires_grad_(), lin.weight.detach().clone().requires_grad_()
    b2 = lin.bias.detach().clone().requires_grad_()
    want = fp8_linear(x2, w2, b2, lin.effective_weight(), precision=precision, sparse=recipe != "dense")
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads(lin, x, y), grads_of(want, x2, w2, b2), rtol=1e-5, atol=1e-5)


def test_a_dense_phase_runs_the_reference_on_the_dense_weight(device):
    """STEP before its switch (MVUE on): the reference route on W itself, dW exact."""
    lin, x = case("step", device, mvue=True)
    assert lin.is_dense_phase and route_for(lin, x).name == "reference"
    y = lin(x)
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = lin.weight.detach().clone().requires_grad_(), lin.bias.detach().clone().requires_grad_()
    want = F.linear(x2, w2, b2)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(grads(lin, x, y), grads_of(want, x2, w2, b2))


def test_bf16_finetune_moves_from_the_fp8_route_to_the_reference():
    lin, x = case("s-ste", "cpu", precision="fp8", bf16_finetune=0.5, total_steps=2)
    assert route_for(lin, x).name == "fp8" and lin.is_fp8_phase
    lin.advance()
    assert route_for(lin, x).name == "reference" and not lin.is_fp8_phase
    torch.testing.assert_close(lin(x), F.linear(x, lin.effective_weight(), lin.bias))


@pytest.mark.parametrize("recipe,opts", [("s-ste", {}), ("dense", {}), ("s-ste", {"precision": "fp8"})])
def test_an_activation_follows_a_route_that_does_not_fuse_it(recipe, opts):
    """Off the GPU fast path, ``layer(x, act=act)`` is ``act(layer(x))`` by the same route."""
    lin, x = case(recipe, "cpu", **opts)
    assert route_for(lin, x, GELU_TANH) is route_for(lin, x)
    torch.testing.assert_close(lin(x, act=GELU_TANH), GELU_TANH(lin(x)))


@pytest.mark.parametrize("recipe,opts", [("dense", {}), ("s-ste", {}), ("s-ste", {"mvue": False}),
                                         ("t-sr-ste", {}), ("step", {}), ("dense", {"precision": "fp8"}),
                                         ("s-ste", {"precision": "fp8-rowwise"})])
@pytest.mark.parametrize("act", [None, GELU_TANH], ids=["plain", "act"])
def test_at_most_one_route_but_the_reference_applies(device, recipe, opts, act):
    """The routes' conditions do not overlap: the table's order only makes the reference the
    fallback (bf16 tokens in multiples of 32, so that on a GPU the fast path can take them)."""
    lin, x = case(recipe, device, dtype=torch.bfloat16, **opts)
    lin.to(torch.bfloat16)
    taken = [r.name for r in ROUTES[:-1] if r.applies(lin, x, act)]
    assert len(taken) <= 1 and route_for(lin, x, act).name == (taken or ["reference"])[0]


def test_a_route_added_to_the_table_is_taken(monkeypatch):
    """The table is the one place the forward looks: a route put first takes the calls it applies to."""
    lin, x = case("s-ste", "cpu")
    halved = Route("halved", lambda layer, x, act: x.shape[0] == 64, lambda layer, x, act: x[:, :32] / 2)
    monkeypatch.setattr(routes, "ROUTES", (halved, *ROUTES))
    assert torch.equal(lin(x), x[:, :32] / 2)
    assert route_for(lin, x[:32]).name == "reference"


@pytest.mark.gpu
def test_gpu_fast_path_routes():
    """On a GPU with the fast path: a sparse layer in bf16 runs the fast path eagerly, with an
    activation and MVUE the fused linear+activation route, each close to the reference; the fast
    path off, the reference."""
    if not ops.fast_available():
        pytest.skip("needs the fast path (Triton and cuSPARSELt)")
    lin, x = case("s-ste", "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert route_for(lin, x).name == "fast path eager"
        assert route_for(lin, x, GELU_TANH).name == "fused linear+activation"
        y, h = lin(x), lin(x, act=GELU_TANH)
        with dispatch.override(fast=False):
            assert route_for(lin, x).name == "reference"
            ref = lin(x)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.float(), GELU_TANH(ref).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.triton
@pytest.mark.parametrize("recipe", ["ste", "s-ste"])
def test_the_compiled_fp8_route_takes_the_fused_kernels_effective_weight(recipe, monkeypatch):
    """Where the fast path takes the call, a compiled FP8 layer's graph builds W_eff with the fused
    kernel (the op ``twofour::compress``, one pass over the weight), not plain-torch pruning, and
    gives the eager fast path's output. The fast path's shape check is forced here, so the route
    runs on the CPU under Triton's interpreter."""
    monkeypatch.setattr(routes, "applies", lambda *args: True)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    torch.manual_seed(0)
    lin = SparseLinear(64, 32, recipe=recipe, precision="fp8", bias=False)
    x = torch.randn(4, 16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.compile(lin, backend=backend, fullgraph=True)(x)
        want = lin(x)
    ops_in_graph = {n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert torch.ops.twofour.compress.default in ops_in_graph
    torch.testing.assert_close(y, want)
