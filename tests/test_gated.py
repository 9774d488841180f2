"""The fused SwiGLU activation of the gated FFN: the Triton kernels against the plain-torch
reference (Triton's interpreter on the CPU, the real kernels on the GPU), the op's gradient, its
custom ops under torch.compile, and the interleaved gate|up layout."""

import pytest
import torch
import torch.nn.functional as F

from twofour.activations import interleave_gate_up, split_gate_up, swiglu, swiglu_backward_reference, swiglu_reference
from twofour.kernels.swiglu import swiglu_backward, swiglu_forward
from twofour.kernels.triton_common import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(64, 64), (37, 96), (130, 40), (1, 32)]  # (tokens, H): odd sizes leave partial tiles


def ids(x):
    return str(x).split(".")[-1] if isinstance(x, torch.dtype) else None


def matrix(rows, cols, layout, dtype, device, seed=0):
    """A (rows, cols) matrix stored row-major or column-major."""
    g = torch.Generator(device=device).manual_seed(seed)
    if layout == "row":
        return (2 * torch.randn(rows, cols, device=device, generator=g)).to(dtype)
    return (2 * torch.randn(cols, rows, device=device, generator=g)).to(dtype).t()


def gemm_output(t, h, layout, dtype, device, seed=0):
    """A (t, 2H) gate|up GEMM output, row-major or column-major (y^T stored row-major)."""
    return matrix(t, 2 * h, layout, dtype, device, seed)


def order(t):
    return "row" if t.stride(1) == 1 else "col"


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=ids)
def test_kernels_match_reference(shape, layout, dtype, device):
    """Forward and backward against the reference; outputs keep z's memory order (what the next
    GEMM reads in place); dh may come in either order."""
    t, h = shape
    z = gemm_output(t, h, layout, dtype, device)
    out = swiglu_forward(z)
    assert out.shape == (t, h) and out.dtype == dtype and (t == 1 or order(out) == layout)
    torch.testing.assert_close(out, swiglu_reference(z))
    for dh_layout in ("row", "col"):
        dh = matrix(t, h, dh_layout, dtype, device, seed=1)
        dz = swiglu_backward(z, dh)
        assert dz.shape == z.shape and dz.stride() == z.stride() and dz.dtype == dtype
        torch.testing.assert_close(dz, swiglu_backward_reference(z, dh))


@needs_triton
@pytest.mark.parametrize("tile", [(4, 32, 4), (32, 16, 4), (1, 128, 4)])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_any_tile_gives_the_same_values(tile, layout, device):
    z = gemm_output(70, 48, layout, torch.bfloat16, device)
    dh = torch.randn(70, 48, device=device, dtype=torch.bfloat16)
    assert torch.equal(swiglu_forward(z, tile=tile), swiglu_forward(z))
    assert torch.equal(swiglu_backward(z, dh, tile=tile), swiglu_backward(z, dh))


def test_reference_is_silu_gate_times_up():
    """The reference against the unfused formula and torch's own autograd of it."""
    torch.manual_seed(0)
    gate, up = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    z = torch.stack((gate, up), dim=-1).reshape(5, 16).requires_grad_()
    want = F.silu(z[:, 0::2]) * z[:, 1::2]
    torch.testing.assert_close(swiglu_reference(z), want)
    dh = torch.randn(5, 8, dtype=torch.float64)
    (dz,) = torch.autograd.grad(want, z, dh)
    torch.testing.assert_close(swiglu_backward_reference(z.detach(), dh), dz)


def test_gradient_of_the_op():
    z = torch.randn(3, 7, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (z,))
    z32 = z.detach().float().requires_grad_()
    y = swiglu(z32)
    assert y.shape == (3, 7, 6)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(z32.grad, swiglu_backward_reference(z32.detach(), torch.ones(3, 7, 6)))


def test_bad_input():
    with pytest.raises(ValueError, match="even size"):
        swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="of one shape"):
        interleave_gate_up(torch.randn(4, 8), torch.randn(5, 8))
    if HAS_TRITON:
        with pytest.raises(ValueError, match="row- or column-major"):
            swiglu_forward(torch.randn(8, 16)[::2])
        with pytest.raises(TypeError, match="bfloat16"):
            swiglu_forward(torch.randn(8, 16, dtype=torch.float64))
        with pytest.raises(ValueError, match="dh must have shape"):
            swiglu_backward(torch.randn(8, 16), torch.randn(8, 16))


def test_interleaved_weight_is_the_separate_gate_and_up():
    """One GEMM on the interleaved weight, then the op, is down(silu(x G^T) * (x U^T))'s input."""
    torch.manual_seed(0)
    gate, up, x = torch.randn(24, 16), torch.randn(24, 16), torch.randn(5, 16)
    fused = interleave_gate_up(gate, up)
    assert fused.shape == (48, 16)
    g2, u2 = split_gate_up(fused)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    torch.testing.assert_close(swiglu(x @ fused.t()), F.silu(x @ gate.t()) * (x @ up.t()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_custom_ops_pass_opcheck_and_compile():
    """The ops torch.compile sees pass torch's checks; compiled whole (their registered backward
    included) they give the reference's output and gradient. The public op compiles too."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        z, dh = torch.randn(16, 64, dtype=dtype), torch.randn(16, 32, dtype=dtype)
        torch.library.opcheck(torch.ops.twofour.swiglu.default, (z,))
        torch.library.opcheck(torch.ops.twofour.swiglu_backward.default, (z, dh))
    z = torch.randn(64, 8, 2).permute(2, 1, 0).requires_grad_()  # a non-contiguous input too
    dh = torch.randn(32, 8, 2).permute(2, 1, 0)
    for fn in (torch.ops.twofour.swiglu, swiglu):
        zz = z.detach().clone().requires_grad_()
        y = torch.compile(fn, backend="aot_eager", fullgraph=True)(zz)
        y.backward(dh)
        torch.testing.assert_close(y, swiglu_reference(z.detach()))
        torch.testing.assert_close(zz.grad, swiglu_backward_reference(z.detach(), dh))
