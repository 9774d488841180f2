"""SR-STE's masked decay kernel against its plain-torch reference (Triton's interpreter on the CPU,
the GPU where there is one), and the layer's decay taking it on the GPU."""

import pytest
import torch

import twofour
from twofour.kernels import decay
from twofour.kernels.triton_common import HAS_TRITON

from .conftest import seeded

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton"), pytest.mark.triton]


@pytest.mark.parametrize("shape", [(64, 96), (3, 5), (1, 70001)])
def test_kernel_matches_the_reference(device, dtype, shape):
    gen = seeded(0)
    w = torch.randn(shape, generator=gen).to(device, dtype)
    g = torch.randn(shape, generator=gen).to(device, dtype)
    mask = (torch.rand(shape, generator=gen) < 0.5).to(device)
    want = decay.masked_decay_reference_(g.clone(), w, mask, 0.25)
    got = decay.masked_decay_(g.clone(), w, mask, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert torch.equal(got[mask], g[mask])  # the kept positions' gradient is untouched


def test_kernel_refuses_what_it_cannot_read():
    g, w = torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="contiguous tensors of one shape"):
        decay.masked_decay_(g, w, torch.zeros(4, 4, dtype=torch.bool), 0.1)
    with pytest.raises(ValueError, match="bool mask"):
        decay.masked_decay_(g, w, torch.zeros(4, 8), 0.1)


@pytest.mark.gpu
def test_the_layers_decay_runs_the_kernel_on_the_gpu(monkeypatch):
    calls = []
    kernel = decay.masked_decay_
    monkeypatch.setattr(decay, "masked_decay_", lambda *a: calls.append(1) or kernel(*a))
    layer = twofour.SparseLinear(256, 128, recipe="t-sr-ste", device="cuda")
    w = layer.weight.detach().clone()
    layer.weight.grad = torch.zeros_like(layer.weight)
    layer.add_masked_decay_()
    assert calls == [1]
    want = decay.masked_decay_reference_(torch.zeros_like(w), w, layer.mask, layer.recipe.decay)
    torch.testing.assert_close(layer.weight.grad, want)
