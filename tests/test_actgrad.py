"""The activation backward fused with the MVUE compression of its output (``kernels/actgrad.py``):
its dense gradient against the plain-torch references, and its compressed estimate byte for byte
against the standalone MVUE kernel run on that gradient (Triton's interpreter on the CPU, the
real kernels on the GPU)."""

import pytest
import torch

from twofour.kernels import actgrad
from twofour.kernels import compress as ck
from twofour.kernels.layout import decompress_reference
from twofour.kernels.swiglu import swiglu_backward_reference
from twofour.kernels.triton_common import HAS_TRITON

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton"), pytest.mark.triton]
#: (tokens, features of z): partial bands of 64 features and partial token tiles
SHAPES = [(64, 128), (96, 160), (160, 64)]
ACTS = {"gelu": actgrad.GELU_TANH, "swiglu": actgrad.SWIGLU}


def operand(rows, cols, layout, dtype, device, gen):
    """A (rows, cols) matrix stored row-major or column-major (its transpose row-major)."""
    if layout == "row":
        return (2 * torch.randn(rows, cols, device=device, generator=gen)).to(dtype)
    return (2 * torch.randn(cols, rows, device=device, generator=gen)).to(dtype).t()


def reference_grad(z, dh, act):
    """dz in float32 math, rounded to z's dtype."""
    if act == actgrad.SWIGLU:
        return swiglu_backward_reference(z, dh)
    return torch.ops.aten.gelu_backward(dh.float(), z.float(), approximate="tanh").to(z.dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dh_layout", ["row", "col"])
@pytest.mark.parametrize("act", list(ACTS), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
def test_gradient_and_estimate(shape, dh_layout, act, dtype, device):
    """z column-major (z^T stored, as a 2:4 GEMM with transposed_output leaves it); dh in either order."""
    t, n = shape
    code = ACTS[act]
    gen = torch.Generator(device=device).manual_seed(t * n + len(dh_layout))
    z = operand(t, n, "col", dtype, device, gen)
    dh = operand(t, n // 2 if code == actgrad.SWIGLU else n, dh_layout, dtype, device, gen)
    seed = torch.tensor([1234], device=device)
    dz, buf = actgrad.act_backward_mvue(z, dh, code, seed)
    assert dz.stride() == z.stride(), "dz comes back in z's order"
    ref = reference_grad(z, dh, code)
    torch.testing.assert_close(dz.float(), ref.float(), rtol=1e-2, atol=1e-2)
    # the estimate is what the standalone MVUE kernel draws from this dz on its tile-load path
    # (a row-major dz^T: the same Philox counters and layout)
    assert torch.equal(buf, ck.compress(dz.t().contiguous(), "mvue", seed=seed, out_dtype=dtype)[0])
    est = decompress_reference(buf.cpu(), n, t).float()  # dz^T's estimate: 2:4 along tokens
    assert ((est.reshape(n, t // 4, 4) != 0).sum(-1) <= 2).all()
    kept = est != 0
    assert torch.equal(torch.sign(est[kept]), torch.sign(dz.t().float().cpu()[kept]))


def test_any_tile_gives_the_same_bytes(device):
    gen = torch.Generator(device=device).manual_seed(0)
    z = operand(128, 128, "col", torch.bfloat16, device, gen)
    dh = operand(128, 64, "col", torch.bfloat16, device, gen)
    seed = torch.tensor([7], device=device)
    outs = [actgrad.act_backward_mvue(z, dh, actgrad.SWIGLU, seed, tile=tile) for tile in ((32, 4), (64, 4), (128, 8))]
    for dz, buf in outs[1:]:
        assert torch.equal(dz, outs[0][0]) and torch.equal(buf, outs[0][1])


def test_estimate_is_unbiased():
    """The mean of many estimates approaches dz^T (each a different seed)."""
    gen = torch.Generator().manual_seed(3)
    z = operand(32, 64, "col", torch.bfloat16, "cpu", gen)
    dh = operand(32, 64, "col", torch.bfloat16, "cpu", gen)
    dz, _ = actgrad.act_backward_mvue(z, dh, actgrad.GELU_TANH, torch.tensor([0]))
    draws = 200
    mean = sum(decompress_reference(actgrad.act_backward_mvue(z, dh, actgrad.GELU_TANH, torch.tensor([s]))[1],
                                    64, 32).float() for s in range(draws)) / draws
    target = dz.t().float()
    assert (mean - target).norm() / target.norm() < 0.15


def test_bad_input():
    z = torch.randn(64, 64).bfloat16().t()
    with pytest.raises(ValueError, match="multiple of 32"):
        actgrad.act_backward_mvue(z[:40], z[:40], actgrad.GELU_TANH, torch.tensor([0]))
    with pytest.raises(ValueError, match="dh must have shape"):
        actgrad.act_backward_mvue(z, z, actgrad.SWIGLU, torch.tensor([0]))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        actgrad.act_backward_mvue(z.float(), z.float(), actgrad.GELU_TANH, torch.tensor([0]))
    with pytest.raises(ValueError, match="act must be"):
        actgrad.act_backward_mvue(z, z, 5, torch.tensor([0]))
    with pytest.raises(ValueError, match="column-major"):
        actgrad.act_backward_mvue(z.t(), z.t(), actgrad.GELU_TANH, torch.tensor([0]))
