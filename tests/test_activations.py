"""FFN activations as objects (``twofour.activations``): their values and gradients without
autograd against autograd's, and ``linear_act`` computing ``act(linear(x))`` for any layer, a
SparseLinear included (which takes the activation into its own call)."""

import pytest
import torch
from torch import nn

from twofour.activations import GELU_TANH, SWIGLU, linear_act
from twofour.sparse import SparseLinear

ACTS = {"gelu": GELU_TANH, "swiglu": SWIGLU}


@pytest.mark.parametrize("name", list(ACTS))
def test_values_and_grad_match_autograd(name, device):
    act = ACTS[name]
    z = torch.randn(64, 96, device=device, dtype=torch.float32, requires_grad=True)
    h = act(z)
    dh = torch.randn_like(h)
    (dz,) = torch.autograd.grad(h, z, dh)
    with torch.no_grad():
        torch.testing.assert_close(act.values(z), h)
        torch.testing.assert_close(act.grad(z.detach(), dh), dz, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("recipe", ["s-ste", "ste", "dense"])
def test_linear_act_is_act_of_linear(name, recipe, device):
    """Output and every gradient equal act(layer(x)), for nn.Linear and for SparseLinear (MVUE off:
    its dW estimate is random)."""
    act = ACTS[name]
    torch.manual_seed(0)
    layer = SparseLinear(64, 128, recipe=recipe, device=device, **({"mvue": False} if recipe == "s-ste" else {}))
    twin = nn.Linear(64, 128, device=device)
    with torch.no_grad():
        twin.weight.copy_(layer.effective_weight())
        twin.bias.copy_(layer.bias)
    x = torch.randn(2, 32, 64, device=device)
    outs = []
    for fn, params in ((lambda t: linear_act(layer, t, act), layer.parameters()),
                       (lambda t: act(layer(t)), layer.parameters()),
                       (lambda t: linear_act(twin, t, act), twin.parameters())):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        params = list(params)
        grads = torch.autograd.grad(y.square().sum(), [xx, *params])
        outs.append((y.detach(), *grads))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert outs[0][0].shape[-1] == (64 if act is SWIGLU else 128)


def test_activation_names():
    assert repr(GELU_TANH) == "gelu_tanh" and repr(SWIGLU) == "swiglu"
