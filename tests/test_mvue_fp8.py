"""The fused MVUE -> e4m3 compressed kernel against plain torch (Triton's interpreter on the CPU,
the real kernel on the GPU)."""

import pytest
import torch

from twofour.functional import _mvue_24
from twofour.kernels import compress as ck
from twofour.kernels.layout import decompress_reference
from twofour.kernels.mvue_fp8 import SCALE_BOUND, mvue_e4m3
from twofour.kernels.triton_common import HAS_TRITON

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton"), pytest.mark.triton]
E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max


def bound_scale(dy: torch.Tensor) -> torch.Tensor:
    """The scale the FP8 linear passes: SCALE_BOUND times dY's own e4m3 scale."""
    return (SCALE_BOUND * dy.abs().max().float() / FMAX).reshape(())


@pytest.mark.parametrize("shape", [(96, 256), (100, 192), (32, 64)], ids=str)  # (100, .): partial bands
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "row_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_quantized_reference(shape, in_place, dtype, device):
    """With the reference's uniforms: the same kept entries as plain torch's estimate, and its
    values divided by the scale and rounded to e4m3 (the kernel's division by the inclusion
    probability is approximate, so a value may land one e4m3 step away, rarely)."""
    n, t = shape
    dy = torch.randn(t, n, device=device).to(dtype)
    dy[:4, :3] = 0.0  # zeros inside groups
    x = dy.t() if in_place else dy.t().contiguous()
    u = torch.rand(n, t // 2, device=device)
    s = bound_scale(dy)
    buf = mvue_e4m3(x, s, u=u)
    ref = _mvue_24(x.float().contiguous(), u=u)
    assert (ref.abs() <= SCALE_BOUND * dy.float().abs().max()).all()  # the bound: nothing saturates
    want = (ref / s).to(E4M3)
    got = decompress_reference(buf, n, t, E4M3)
    assert torch.equal(got.float() != 0, ref != 0)
    same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
    assert same > 0.999
    step = want.float().abs() / 8 + 2.0 ** -9  # one e4m3 step (3 mantissa bits; subnormals below 2^-6)
    assert ((got.float() - want.float()).abs() <= step).all()


def test_same_draws_as_the_standalone_kernel_and_unbiased(device):
    """With a Philox seed the kernel keeps what the bf16 MVUE kernel keeps for that seed; averaged
    over seeds, dequantized, it converges to x."""
    n, t = 64, 128
    x = torch.randn(t, n, device=device).t()  # dY^T in place
    s = bound_scale(x)
    acc = torch.zeros(n, t, dtype=torch.float64, device=device)
    runs = 64
    for i in range(runs):
        seed = torch.tensor([100 + i], device=device)
        got = decompress_reference(mvue_e4m3(x, s, seed=seed), n, t, E4M3).float()
        bf16, _ = ck.compress(x, "mvue", seed=seed)
        other = decompress_reference(bf16, n, t).float()
        assert torch.equal(got != 0, other != 0)
        acc += got.double() * s.double()
    err = (acc / runs - x.double()).norm() / x.double().norm()
    one = (got * s - x).norm() / x.norm()
    assert one > 0.5 and err < one / 4  # a noisy estimate whose average converges
    xr = x.contiguous()  # dY^T row-major: both kernels' tile-load path and its Philox counters
    got = decompress_reference(mvue_e4m3(xr, s, seed=seed), n, t, E4M3).float()
    assert torch.equal(got != 0, decompress_reference(ck.compress(xr, "mvue", seed=seed)[0], n, t).float() != 0)


def test_the_bound_never_saturates(device):
    """Groups of four equal magnitudes (each kept with p = 1/2, so 2 * amax) land exactly on e4m3's
    largest value and dequantize to 2 * amax; random groups stay within the bound."""
    x = torch.full((32, 64), 3.0, device=device)
    x[::2] *= -1
    s = bound_scale(x)
    got = decompress_reference(mvue_e4m3(x, s, seed=torch.tensor([1], device=device)), 32, 64, E4M3).float()
    assert got.abs().max() == FMAX and ((got != 0).reshape(-1, 4).sum(1) == 2).all()
    deq = got[got != 0].abs() * s  # 448 * (6 / 448): 6 up to float32's rounding of the scale
    assert torch.allclose(deq, torch.full_like(deq, 6.0), rtol=1e-6, atol=0)
    g = torch.rand(20000, 4, device=device) ** 4  # magnitudes spread over orders, some groups near-equal
    assert (_mvue_24(g).abs().amax(1) <= SCALE_BOUND * g.amax(1) * (1 + 1e-6)).all()


def test_rejects_bad_input(device):
    x = torch.randn(32, 96, device=device)
    s = torch.tensor(1.0, device=device)
    with pytest.raises(ValueError, match="multiple of 64"):
        mvue_e4m3(x, s)
    with pytest.raises(ValueError, match="one float32 value"):
        mvue_e4m3(x[:, :64], s.double())
    with pytest.raises(ValueError, match="2-D float32"):
        mvue_e4m3(x[:, :64].to(torch.int32), s)
