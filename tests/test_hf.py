"""sparsify() on Hugging Face GPT-2 (Conv1D layers) and Llama (nn.Linear), built from configs."""

import pytest
import torch

import twofour
from twofour.models import ATTN_PATTERNS, FFN_PATTERNS

transformers = pytest.importorskip("transformers")


def _train_steps(model, vocab, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    twofour.attach(model, opt)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 32), generator=g)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref_sd = {k: v.clone() for k, v in model.state_dict().items()}
    twofour.sparsify(model, "s-ste", include=["*.mlp.*"])
    names = {n for n, _ in twofour.sparse_layers(model)}
    assert names == {f"transformer.h.{i}.mlp.{m}" for i in range(2) for m in ("c_fc", "c_proj")}
    # the state dict keeps Conv1D's (in, out) layout and the original values
    sd = model.state_dict()
    for k, v in ref_sd.items():
        assert torch.equal(sd[k], v), k
    layer = model.transformer.h[0].mlp.c_fc
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.effective_weight().t() + layer.bias)
    losses = _train_steps(model, 128)
    assert losses[-1] < losses[0]
    # a Hugging Face checkpoint loads back into the sparsified model (strict)
    fresh = twofour.sparsify(transformers.GPT2LMHeadModel(cfg), "s-ste", include=["*.mlp.*"])
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh.transformer.h[0].mlp.c_fc.weight, layer.weight)


def test_llama():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    twofour.sparsify(model, "sr-ste")
    names = {n for n, _ in twofour.sparse_layers(model)}
    assert "lm_head" not in names and len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
    losses = _train_steps(model, 128)
    assert losses[-1] < losses[0]


def _tiny_llama_config():
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, bos_token_id=0,
                                    eos_token_id=0)


def test_llama_ffn_sparsified_trained_saved_and_loaded(tmp_path):
    """gate/up/down (twofour's FFN patterns) become 2:4, train, and survive save_pretrained and
    from_pretrained: with load_recipe_state the loaded model has the saved beta, masks and step
    counters and computes the same function (recomputed ones would not)."""
    from twofour.training.hf import load_recipe_state

    cfg = _tiny_llama_config()
    torch.manual_seed(0)
    model = twofour.sparsify(transformers.LlamaForCausalLM(cfg), "s-ste", include=FFN_PATTERNS)
    names = [n for n, _ in twofour.sparse_layers(model)]
    assert set(names) == {f"model.layers.{i}.mlp.{m}" for i in range(2) for m in ("gate_proj", "up_proj", "down_proj")}
    losses = _train_steps(model, 128)
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path)
    loaded = twofour.sparsify(transformers.LlamaForCausalLM.from_pretrained(tmp_path), "s-ste", include=FFN_PATTERNS)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert not torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)  # fresh beta and masks
        assert load_recipe_state(loaded, tmp_path) == names
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)
    for (_, a), (_, b) in zip(twofour.sparse_layers(model), twofour.sparse_layers(loaded)):
        assert torch.equal(a.mask, b.mask) and torch.equal(a.beta, b.beta) and int(a.step) == int(b.step) == 5
    assert _train_steps(loaded, 128, steps=2)  # and it trains on
    # the folder and the model must agree on which layers are sparse
    both = twofour.sparsify(transformers.LlamaForCausalLM.from_pretrained(tmp_path), "s-ste",
                            include=FFN_PATTERNS + ATTN_PATTERNS)
    assert len(list(twofour.sparse_layers(both))) == 2 * 7  # q, k, v, o too, on request
    with pytest.raises(ValueError, match="no twofour state for model.layers.0.self_attn.q_proj"):
        load_recipe_state(both, tmp_path)
    ffn_only = twofour.sparsify(transformers.LlamaForCausalLM.from_pretrained(tmp_path), "s-ste",
                                include=["*.gate_proj", "*.up_proj"])
    with pytest.raises(ValueError, match="not sparse in this model: model.layers.0.mlp.down_proj"):
        load_recipe_state(ffn_only, tmp_path)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    return transformers.LlamaForCausalLM(_tiny_llama_config())


def _greedy(model, ids):
    return model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("make,recipe", [(_gpt2, "s-ste"), (_llama, "sr-ste")], ids=["gpt2", "llama"])
def test_round_trip_through_save_pretrained(make, recipe, tmp_path):
    """Sparsify, train, to_inference, save_pretrained; from_pretrained + sparsify_for_inference
    gives the 2:4 layers back and the same greedy tokens."""
    torch.manual_seed(0)
    model = make()
    twofour.sparsify(model, recipe)
    _train_steps(model, 128, steps=3)
    model.eval()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
    names = twofour.to_inference(model)
    assert names and all(isinstance(model.get_submodule(n), twofour.SparseInferenceLinear) for n in names)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    tokens = _greedy(model, ids)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)  # any transformers loads it: dense layers, 2:4 weights
    assert loaded.config.twofour["sparse_layers"] == names
    twofour.sparsify_for_inference(loaded)
    assert {n for n, m in loaded.named_modules() if isinstance(m, twofour.SparseInferenceLinear)} == set(names)
    assert torch.equal(_greedy(loaded, ids), tokens)
    loaded.save_pretrained(tmp_path / "again")  # and it saves in the model's own layout again
    again = type(model).from_pretrained(tmp_path / "again")
    assert torch.equal(_greedy(again, ids), tokens)


def test_sparsify_for_inference_detects_and_refuses(tmp_path):
    torch.manual_seed(0)
    model = _gpt2()
    twofour.sparsify(model, "ste", include=["*.mlp.*"])
    names = twofour.to_inference(model)
    model.save_pretrained(tmp_path)
    plain = type(model).from_pretrained(tmp_path)
    del plain.config.twofour  # no record: the 2:4 weights are found by looking
    twofour.sparsify_for_inference(plain)
    assert {n for n, m in plain.named_modules() if isinstance(m, twofour.SparseInferenceLinear)} == set(names)
    broken = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        broken.transformer.h[1].mlp.c_proj.weight[:4] = 1.0  # no longer 2:4
    with pytest.raises(ValueError, match="transformer.h.1.mlp.c_proj: listed as a 2:4 layer, but its weight is not"):
        twofour.sparsify_for_inference(broken)
    assert not any(isinstance(m, twofour.SparseInferenceLinear) for m in broken.modules())  # nothing half-done
