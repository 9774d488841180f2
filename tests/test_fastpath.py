"""The GPU fast path (cuSPARSELt GEMMs + fused kernels) against the reference path."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from twofour import dispatch
from twofour.functional import prune_transpose_24
from twofour.kernels import ops
from twofour.models import GatedMLP
from twofour.models.common import MLP, GPTConfig
from twofour.sparse import SparseLinear, sparsify

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def need_fast_path():
    if not torch.cuda.is_available() or not ops.fast_available():
        pytest.skip("needs a GPU with cuSPARSELt bindings (nvmath-python) and Triton")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run(layer, x, g, fast):
    with dispatch.override(fast=fast):
        layer.weight.grad = None
        xx = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(xx)
        y.backward(g)
        return y.detach(), xx.grad, layer.weight.grad.clone()


@pytest.mark.parametrize("recipe", ["ste", "sr-ste", "s-ste", "t-sr-ste"])
@pytest.mark.parametrize("gemm", ["sparse", "dense", "auto"])
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("transposed_output", [False, True])
def test_fast_matches_reference(recipe, gemm, layout, transposed_output):
    """bf16 tolerances: forward (bias in cuSPARSELt's epilogue when sparse) and dX within 1e-2
    relative; dW (mvue off) within 1e-2. The output is row-major unless ``transposed_output``
    allows y^T; dX comes back in x's order."""
    torch.manual_seed(0)
    layer = SparseLinear(256, 512, device="cuda", recipe=recipe, mvue=False, transposed_output=transposed_output)
    with torch.no_grad():
        layer.bias.normal_()  # a bias that shows: GPT-style zero init would hide a missing epilogue
    x = torch.randn(4, 256, 256, device="cuda")
    if layout == "col":  # activations stored transposed, as a sparse fc1 may leave them
        x = x.reshape(-1, 256).t().contiguous().t().reshape(4, 256, 256)
    g = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    with dispatch.override(gemm=gemm):
        yf, dxf, dwf = run(layer, x, g, True)
        yr, dxr, dwr = run(layer, x, g, False)
    assert rel(yf, yr) < 1e-2 and rel(dxf, dxr) < 1e-2 and rel(dwf, dwr) < 1e-2
    if not transposed_output:
        assert yf.is_contiguous()
    assert ops.order(dxf.reshape(-1, 256)) == layout


@pytest.mark.parametrize("recipe", ["s-ste", "t-sr-ste"])
def test_fast_mvue_is_unbiased(recipe):
    """On the sparse dW route (forced) the MVUE estimate is random and its mean is the exact dW."""
    torch.manual_seed(0)
    layer = SparseLinear(128, 128, device="cuda", recipe=recipe, decay=0.0) if recipe == "t-sr-ste" \
        else SparseLinear(128, 128, device="cuda", recipe=recipe)
    x = torch.randn(256, 128, device="cuda")
    g = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    exact = (g.float().t() @ x.bfloat16().float())
    mean = torch.zeros_like(exact)
    errs = []
    for i in range(1, 257):
        with dispatch.override(gemm="sparse"):
            mean += (run(layer, x, g, True)[2] - mean) / i
        if i in (16, 256):
            errs.append(rel(mean, exact))
    assert errs[1] < errs[0] / 2.5  # error falls like 1/sqrt(n): 4x at 16x the draws
    assert errs[1] < 0.1


def test_dense_dw_route_is_exact():
    """Where the dense dW GEMM wins (forced here), MVUE is skipped: dW is the exact dY^T X."""
    torch.manual_seed(0)
    layer = SparseLinear(128, 128, device="cuda", recipe="s-ste")
    x = torch.randn(256, 128, device="cuda")
    g = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    with dispatch.override(gemm="dense"):
        dw1, dw2 = run(layer, x, g, True)[2], run(layer, x, g, True)[2]
    assert torch.equal(dw1, dw2) and rel(dw1, g.float().t() @ x.bfloat16().float()) < 1e-2


def test_weight_compressed_once_per_step(monkeypatch):
    """Micro-batches reuse the compressed weight; an optimizer step (an in-place update) makes
    the next forward compress again, and the result follows the new weight."""
    layer = SparseLinear(256, 256, device="cuda", recipe="s-ste")
    x = torch.randn(64, 256, device="cuda")
    calls = []
    compress = type(layer.pruner).compress
    monkeypatch.setattr(type(layer.pruner), "compress", lambda self, *a: calls.append(1) or compress(self, *a))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y1 = layer(x)
        layer(x)
        assert len(calls) == 1  # micro-batches reuse it
        with torch.no_grad():
            layer.weight.mul_(-1)  # an optimizer step
        y2 = layer(x)
        assert len(calls) == 2
    bias = layer.bias.to(torch.bfloat16)
    assert rel(y2 - bias, -(y1 - bias)) < 1e-2  # S(-W) = -S(W): the new weight was used


def test_checkpointed_layers_keep_no_compressed_weight(monkeypatch):
    """Under activation checkpointing the forward and its recomputation compress each and keep
    nothing afterwards (the memory checkpointing saves), with the same results as without."""
    from torch.utils.checkpoint import checkpoint

    layer = SparseLinear(256, 512, device="cuda", recipe="s-ste")
    x, g = torch.randn(64, 256, device="cuda"), torch.randn(64, 512, device="cuda")
    calls = []
    compress = type(layer.pruner).compress
    monkeypatch.setattr(type(layer.pruner), "compress", lambda self, *a: calls.append(1) or compress(self, *a))
    plain = run(layer, x, g, fast=True)  # kept, as after an evaluation: the checkpointed call drops it
    assert len(calls) == 1
    with dispatch.override(fast=True), torch.autocast("cuda", dtype=torch.bfloat16):
        layer.weight.grad = None
        xx = x.detach().clone().requires_grad_()
        y = checkpoint(layer, xx, use_reentrant=False)
        y.backward(g)
        assert len(calls) == 3  # the forward's and the recomputation's
        layer(x)
    assert len(calls) == 4  # neither was kept for a later call
    for a, b in zip(plain, (y.detach(), xx.grad, layer.weight.grad), strict=True):
        assert rel(b, a) < 1e-2


@pytest.mark.parametrize("recipe", ["s-ste", "t-sr-ste"])
def test_compile_runs_the_fast_path(recipe, monkeypatch):
    """Under torch.compile (inductor, whole graph) the 2:4 GEMMs run as custom ops: forced
    sparse, cuSPARSELt is called, and output and gradients match the eager reference (MVUE off,
    so dW is a dense GEMM)."""
    torch.manual_seed(0)
    layer = SparseLinear(256, 256, device="cuda", recipe=recipe, mvue=False)
    x = torch.randn(64, 256, device="cuda")
    g = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    spmm, calls = ops.spmm, []
    monkeypatch.setattr(ops, "spmm", lambda *a: calls.append(1) or spmm(*a))
    f = torch.compile(layer, fullgraph=True)
    with dispatch.override(gemm="sparse"):
        layer.weight.grad = None
        xx = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = f(xx)
        y.backward(g)
    assert len(calls) == (2 if recipe == "t-sr-ste" else 1)  # forward (and dX, W^T being 2:4 too)
    yr, dxr, dwr = run(layer, x, g, False)
    assert rel(y, yr) < 1e-2 and rel(xx.grad, dxr) < 1e-2 and rel(layer.weight.grad, dwr) < 1e-2


def test_choices_can_be_inspected_and_forced(monkeypatch):
    """A measured choice is listed with its timings; a forced choice is the one that runs."""
    dispatch.clear_choices()
    layer = SparseLinear(256, 256, device="cuda", recipe="ste")
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x)
    table = dispatch.choices()
    key = next(k for k in table if k.startswith("fwd"))
    assert table[key]["choice"] in table[key]["ms"] and len(table[key]["ms"]) >= 2
    spmm, calls = ops.spmm, []
    monkeypatch.setattr(ops, "spmm", lambda *a: calls.append(1) or spmm(*a))
    for forced, sparse_calls in (("dense", 0), ("sparse_dc", 1)):
        dispatch.set_choice(key, forced)
        calls.clear()
        with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
            layer(x)
        assert dispatch.choices()[key]["choice"] == forced and len(calls) == sparse_calls


def test_cuda_graph_replay_follows_weight_updates():
    """A captured forward + backward (warmed up first, as CUDA graphs need) recompresses the
    weight on every replay: after an in-place update, the replay matches the reference path."""
    layer = SparseLinear(256, 512, device="cuda", recipe="s-ste", mvue=False)
    x = torch.randn(128, 256, device="cuda")
    g = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        layer.weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(g)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.weight.grad = None
    with torch.cuda.graph(graph):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_static = layer(x)
        y_static.backward(g)
    with torch.no_grad():
        layer.weight.mul_(-1.5).add_(0.01)  # what an optimizer step does: in place
    graph.replay()
    y_graph, dw_graph = y_static.clone(), layer.weight.grad.clone()
    y_ref, _, dw_ref = run(layer, x, g, fast=False)
    assert rel(y_graph, y_ref) < 1e-2
    assert rel(dw_graph, dw_ref) < 1e-2


@pytest.mark.parametrize("recipe", ["s-ste", "t-sr-ste"])
def test_compile_reduce_overhead_trains_like_eager(recipe):
    """torch.compile(mode="reduce-overhead") replays the step as CUDA graphs, with the plans built
    and measured while it warms up (shapes no other test uses): over optimizer steps that update
    the weights in place, outputs and weight gradients match the eager fast path's (forced 2:4,
    MVUE off so that dW is exact)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(SparseLinear(352, 608, recipe=recipe, mvue=False), torch.nn.GELU(),
                                SparseLinear(608, 352, recipe=recipe, mvue=False)).cuda()
    ref = copy.deepcopy(model)
    runs = [(model, torch.compile(model, mode="reduce-overhead")), (ref, ref)]  # compiled first: it builds the plans
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m, _ in runs]
    x = torch.randn(4, 64, 352, device="cuda")
    counters["inductor"].clear()
    with dispatch.override(gemm="sparse"):
        for _ in range(4):
            outs = []
            for (m, fn), opt in zip(runs, opts):
                torch.compiler.cudagraph_mark_step_begin()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = fn(x)
                y.float().pow(2).mean().backward()
                outs.append((y.detach().float().clone(), m[0].weight.grad.clone(), m[2].weight.grad.clone()))
                opt.step()
                opt.zero_grad(set_to_none=True)
            for got, want in zip(*outs, strict=True):
                assert rel(got, want) < 2e-2
    assert counters["inductor"]["cudagraph_skips"] == 0  # the step did run as CUDA graphs


@pytest.mark.parametrize("recipe", ["ste", "s-ste"])
def test_advance_refreshes_mask_on_device(recipe):
    """advance() on the GPU (one fused kernel) gives the reference's mask and flip count."""
    from twofour.functional import mask_24

    torch.manual_seed(0)
    layer = SparseLinear(256, 512, device="cuda", recipe=recipe)
    with torch.no_grad():
        layer.weight.add_(torch.randn_like(layer.weight) * 0.02)
    want = mask_24(layer.weight)
    want_flips = (want != layer.mask).sum().item()
    layer.advance()
    assert torch.equal(layer.mask, want) and layer.flips.item() == want_flips > 0


@pytest.mark.parametrize("recipe", ["s-ste", "t-sr-ste"])
@pytest.mark.parametrize("route", ["sparse_dr", "sparse_dc", "dense"])
def test_gated_ffn_fast_matches_reference(recipe, route):
    """The SwiGLU FFN in its layout plan: the fused gate|up linear (transposed_output) leaves
    z^T where its forward GEMM route ``route`` does (``sparse_dr``: a column-major z), the fused
    activation reads it in that order and hands the down projection h in the same order; output
    and every gradient match the reference path, eager and compiled (mvue off: dW is exact)."""
    torch.manual_seed(0)
    mlp = GatedMLP(256, 512).cuda()
    sparsify(mlp, recipe, include=["gate_up", "down"], transposed_output=["gate_up"], mvue=False)
    x = torch.randn(4, 128, 256, device="cuda")
    g = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    seen = {}
    # gate_up is called with the activation (twofour.activations.linear_act): its output is h, in z's order
    hooks = [mlp.gate_up.register_forward_hook(lambda m, a, out: seen.update(z=ops.order(out.reshape(-1, 512)))),
             mlp.down.register_forward_pre_hook(lambda m, a: seen.update(h=ops.order(a[0].reshape(-1, 512))))]

    ffn_run(mlp, x, g, True)  # measure the dispatch, then force the gate|up forward route
    for key in [k for k in dispatch.choices() if k.startswith("fwd:1024x256x512:")]:
        dispatch.set_choice(key, route)
    fast = ffn_run(mlp, x, g, True)
    assert seen["z"] == ("col" if route == "sparse_dr" else "row") and seen["h"] == seen["z"]
    for hook in hooks:
        hook.remove()
    ref = ffn_run(mlp, x, g, False)
    assert all(rel(a, b) < 2e-2 for a, b in zip(fast, ref))
    compiled = ffn_run(mlp, x, g, True, fn=torch.compile(mlp))
    assert all(rel(a, b) < 2e-2 for a, b in zip(compiled, ref))


def ffn(kind, mvue):
    """A GPT (GELU) or Llama (SwiGLU) FFN block made sparse with s-ste in its layout plan (its first
    parameter is the first linear's weight)."""
    torch.manual_seed(0)
    mlp = (MLP(GPTConfig(n_embd=256)) if kind == "gelu" else GatedMLP(256, 512)).cuda()
    names = ["fc", "proj"] if kind == "gelu" else ["gate_up", "down"]
    sparsify(mlp, "s-ste", include=names, transposed_output=names[:1], mvue=mvue)
    return mlp


def ffn_run(mlp, x, g, fast, fn=None):
    """One forward + backward of the FFN ``mlp`` (through ``fn``, e.g. its compiled twin) under bf16
    autocast: [y, dX, then every parameter's gradient in ``mlp.parameters()``' order]."""
    with dispatch.override(fast=fast):
        mlp.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = (mlp if fn is None else fn)(xx)
        y.backward(g)
    return [y.detach(), xx.grad, *(p.grad.clone() for p in mlp.parameters())]


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
@pytest.mark.parametrize("gemm", ["dense", "auto"])
def test_ffn_fused_activation_matches_reference(kind, gemm):
    """The FFN's first linear with its activation as one op (MVUE on): with the dense dW route
    (forced, or where it measures faster) output and every gradient match the reference path
    without MVUE; the fused route's dispatch is recorded under ``dw-mvue+ACT``."""
    mlp, ref_mlp = ffn(kind, mvue=True), ffn(kind, mvue=False)
    x = torch.randn(4, 128, 256, device="cuda")
    g = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    dispatch.clear_choices()
    with dispatch.override(gemm=gemm):
        ffn_run(mlp, x, g, True)  # measure the dispatch, then keep z column-major (z^T stored)
        for key in [k for k in dispatch.choices() if k.startswith("fwd") and ":1024x256x512:" in k]:
            dispatch.set_choice(key, "sparse_dr")
        fast = ffn_run(mlp, x, g, True)
    ref = ffn_run(ref_mlp, x, g, False)
    act = "gelu_tanh" if kind == "gelu" else "swiglu"
    keys = [k for k in dispatch.choices() if k.startswith(f"dw-mvue+{act}:")]
    assert rel(fast[0], ref[0]) < 2e-2 and rel(fast[1], ref[1]) < 2e-2
    if gemm == "dense" or dispatch.choices()[keys[0]]["choice"] == "dense":
        assert all(rel(a, b) < 2e-2 for a, b in zip(fast[2:], ref[2:]))
    if gemm == "auto":  # the three routes timed: the fused kernel, the standalone MVUE kernel, dense
        assert set(dispatch.choices()[keys[0]]["ms"]) == {"sparse_fused", "sparse", "dense"}
    assert len(keys) == (1 if gemm == "auto" else 0)


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_ffn_fused_activation_mvue_is_unbiased(kind):
    """On the fused route (forced sparse) the first linear's dW is the MVUE estimate drawn by the
    activation's backward kernel: random, with the exact dW as its mean; dX stays exact."""
    mlp, ref_mlp = ffn(kind, mvue=True), ffn(kind, mvue=False)
    x = torch.randn(2, 128, 256, device="cuda")
    g = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    _, dx_ref, exact = ffn_run(ref_mlp, x, g, False)[:3]
    mean, errs = torch.zeros_like(exact, dtype=torch.float32), []
    with dispatch.override(gemm="sparse"):  # the first sparse candidates: sparse_dr (z^T), sparse_fused
        for i in range(1, 257):
            _, dx, dw = ffn_run(mlp, x, g, True)[:3]
            mean += (dw.float() - mean) / i
            if i in (16, 256):
                errs.append(rel(mean, exact))
    assert rel(dx, dx_ref) < 2e-2
    assert errs[1] < errs[0] / 2.5 and errs[1] < 0.1


@pytest.mark.parametrize("recipe", ["ste", "s-ste"])
@pytest.mark.parametrize("gemm", ["sparse", "dense"])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_pruned_t_dx_matches_reference(recipe, gemm, layout, monkeypatch):
    """dx='pruned-t': the 2:4 dX GEMM (forced sparse: cuSPARSELt runs for the forward and dX) and
    its dense twin both give the reference's dY W_pt, in x's order."""
    torch.manual_seed(0)
    layer = SparseLinear(256, 512, device="cuda", recipe=recipe, mvue=False, dx="pruned-t")
    x = torch.randn(4, 256, 256, device="cuda")
    if layout == "col":
        x = x.reshape(-1, 256).t().contiguous().t().reshape(4, 256, 256)
    g = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    spmm, calls = ops.spmm, []
    monkeypatch.setattr(ops, "spmm", lambda *a: calls.append(1) or spmm(*a))
    both, passes = ops.compress_both, []
    monkeypatch.setattr(ops, "compress_both", lambda *a, **k: passes.append(1) or both(*a, **k))
    with dispatch.override(gemm=gemm):
        yf, dxf, dwf = run(layer, x, g, True)
    assert len(calls) == (2 if gemm == "sparse" else 0)
    assert len(passes) == 1  # W_eff and W_pt^T from one pass over the weight
    yr, dxr, dwr = run(layer, x, g, False)
    assert rel(yf, yr) < 1e-2 and rel(dxf, dxr) < 1e-2 and rel(dwf, dwr) < 1e-2
    w_eff = layer.effective_weight().bfloat16().float()
    assert rel(dxf, g.float() @ prune_transpose_24(w_eff)) < 1e-2 and rel(dxf, g.float() @ w_eff) > 0.1
    assert ops.order(dxf.reshape(-1, 256)) == layout


@pytest.mark.parametrize("compiled", [False, True])
def test_mvue_dx_is_unbiased_on_the_sparse_route(compiled, monkeypatch):
    """dx='mvue' with the 2:4 dX GEMM forced: each dX is a random draw (cuSPARSELt runs for it),
    and the mean of the draws is the exact dY W_eff; eagerly and under torch.compile."""
    torch.manual_seed(0)
    layer = SparseLinear(128, 128, device="cuda", recipe="ste", dx="mvue")
    x = torch.randn(256, 128, device="cuda")
    g = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    exact = g.float() @ layer.effective_weight().bfloat16().float()
    f = torch.compile(layer, fullgraph=True) if compiled else layer
    mean, errs = torch.zeros_like(exact), []
    spmm, calls = ops.spmm, []
    monkeypatch.setattr(ops, "spmm", lambda *a: calls.append(1) or spmm(*a))
    for i in range(1, 257):
        xx = x.detach().clone().requires_grad_()
        with dispatch.override(gemm="sparse"), torch.autocast("cuda", dtype=torch.bfloat16):
            f(xx).backward(g)
        mean += (xx.grad.float() - mean) / i
        if i in (16, 256):
            errs.append(rel(mean, exact))
    assert len(calls) == 2 * 256  # the forward's and dX's 2:4 GEMMs, every call
    assert errs[1] < errs[0] / 2.5 and errs[1] < 0.1
