import pytest
import torch
from torch import nn

import twofour
from twofour.models import FFN_IN_PATTERNS, FFN_PATTERNS
from twofour.sparse import SparseLinear, sparsify

from .helpers import tiny_gpt


def test_default_converts_every_linear_but_the_head():
    model = tiny_gpt()
    params = {n: p for n, p in model.named_parameters()}
    sparsify(model)
    names = {n for n, _ in twofour.sparse_layers(model)}
    assert names == {f"h.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight
    # the same parameter objects: an optimizer made before sparsify stays valid
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(m.recipe.name == twofour.DEFAULT_RECIPE for _, m in twofour.sparse_layers(model))


def test_include_exclude_patterns():
    model = sparsify(tiny_gpt(), "ste", include=FFN_PATTERNS)
    assert {n for n, _ in twofour.sparse_layers(model)} == {"h.0.mlp.fc", "h.0.mlp.proj", "h.1.mlp.fc", "h.1.mlp.proj"}
    model = sparsify(tiny_gpt(), "ste", exclude=["*.attn.*", "lm_head"])
    assert {n for n, _ in twofour.sparse_layers(model)} == {"h.0.mlp.fc", "h.0.mlp.proj", "h.1.mlp.fc", "h.1.mlp.proj"}


def test_transposed_output_is_set_on_the_named_layers_only():
    model = sparsify(tiny_gpt(), "s-ste", include=FFN_PATTERNS, transposed_output=FFN_IN_PATTERNS)
    flags = {n: m.transposed_output for n, m in twofour.sparse_layers(model)}
    assert flags == {"h.0.mlp.fc": True, "h.0.mlp.proj": False, "h.1.mlp.fc": True, "h.1.mlp.proj": False}
    assert "transposed_output=True" in repr(model.h[0].mlp.fc)


def test_untied_head_is_excluded_by_name_and_can_be_included():
    model = nn.Sequential()
    model.add_module("body", nn.Linear(16, 16))
    model.add_module("head", nn.Linear(16, 8))
    sparsify(model, "ste")
    assert isinstance(model.body, SparseLinear) and type(model.head) is nn.Linear
    sparsify(model, "ste", exclude=[])
    assert isinstance(model.head, SparseLinear)


def test_skips_bad_shapes_and_reports_them():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 6), nn.Linear(6, 8))
    with pytest.warns(UserWarning, match=r"2 \(in_features=6 is not a multiple of 4\)"):
        sparsify(model, "ste")
    assert [type(m) for m in model] == [SparseLinear, SparseLinear, nn.Linear]
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 6))
    with pytest.warns(UserWarning, match=r"1 \(out_features=6"):
        sparsify(model, "t-sr-ste")


def test_multihead_attention_is_left_alone():
    model = nn.Sequential(nn.MultiheadAttention(16, 2), nn.Linear(16, 16))
    with pytest.warns(UserWarning, match="MultiheadAttention"):
        sparsify(model, "ste")
    assert isinstance(model[1], SparseLinear)


def test_nothing_to_convert_warns():
    with pytest.warns(UserWarning, match="no eligible"):
        sparsify(nn.Sequential(nn.ReLU()), "ste")


def test_bad_recipe_and_options():
    with pytest.raises(ValueError, match="valid recipes"):
        sparsify(tiny_gpt(), "magic")
    with pytest.raises(ValueError, match="takes no option decay; valid options: mvue, dx, bf16_finetune"):
        sparsify(tiny_gpt(), "ste", decay=1e-4)


def test_sparsify_output_matches_effective_weights(device):
    model = sparsify(tiny_gpt().to(device), "sr-ste")
    x = torch.randint(0, 64, (2, 16), device=device)
    logits, _ = model(x)
    for _, layer in twofour.sparse_layers(model):  # swapping for plain Linears on W_eff gives the same output
        layer.weight.data.copy_(layer.effective_weight())
    ref, _ = model(x)
    torch.testing.assert_close(logits, ref)
