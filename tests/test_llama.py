"""The Llama-style model: its presets' shapes, causality, and the same function as Hugging Face's
LlamaForCausalLM given the same weights (RMSNorm, rotary positions, the SwiGLU FFN whose fused
gate|up weight interleaves gate and up rows)."""

import pytest
import torch

from twofour.activations import split_gate_up
from twofour.models import GPT, PRESETS, Llama, LlamaConfig, from_preset

from .helpers import tiny_llama


def test_presets_shapes():
    """Widths the 2:4 kernels take (multiples of 64), Llama's FFN rule, and sizes ~125M to 7B."""
    llamas = {n: p for n, p in PRESETS.items() if p.model is Llama}
    assert set(llamas) >= {"llama-tiny", "llama-125m", "llama-350m", "llama-1b", "llama-7b"}
    assert PRESETS["llama-7b"].config.hidden == 11008 and PRESETS["llama-1b"].config.hidden == 5632
    blocks = {}
    for name, preset in llamas.items():
        cfg = preset.config
        assert cfg.n_embd % 64 == 0 and cfg.hidden % 64 == 0 and cfg.hidden >= 8 * cfg.n_embd / 3, name
        with torch.device("meta"):
            model = preset.build(vocab_size=32000, block_size=1024)
        blocks[name] = sum(p.numel() for p in model.h.parameters())
        assert isinstance(model, Llama) and not any(m.bias is not None for m in model.modules()
                                                    if isinstance(m, torch.nn.Linear))
    assert 80e6 < blocks["llama-125m"] < 130e6 and 250e6 < blocks["llama-350m"] < 400e6
    assert 1.0e9 < blocks["llama-1b"] < 1.2e9 and 6.0e9 < blocks["llama-7b"] < 6.8e9
    assert LlamaConfig(n_embd=4096, ffn_multiple=256).hidden == 11008 and LlamaConfig(ffn_hidden=100).hidden == 100


def test_from_preset_checks_the_family():
    with pytest.raises(ValueError, match="is a GPT, not a Llama"):
        from_preset("tiny", Llama)
    with pytest.raises(ValueError, match="is a Llama, not a GPT"):
        from_preset("llama-tiny", GPT)
    with pytest.raises(ValueError, match="valid presets"):
        from_preset("llama-3t", Llama)
    with pytest.raises(ValueError, match="even head size"):
        Llama(LlamaConfig(n_embd=24, n_head=8))


def test_causal_and_tied_head():
    model = tiny_llama()
    idx = torch.randint(0, 64, (2, 16))
    later = idx.clone()
    later[:, 10:] = (later[:, 10:] + 1) % 64
    a, b = model(idx)[0], model(later)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert model.tied_weights == {} and model.lm_head.weight is not model.wte.weight
    tied = tiny_llama(tie_embeddings=True)
    assert tied.lm_head.weight is tied.wte.weight and tied.tied_weights == {"lm_head.weight": "wte.weight"}
    assert not any(k.startswith("rope") for k in model.state_dict())  # positions are recomputed, not saved
    with pytest.raises(ValueError, match="longer than block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_same_function_as_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(n_head=4, rope_theta=500.0).eval()
    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig(
        hidden_size=cfg.n_embd, intermediate_size=cfg.hidden, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head, vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.block_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu")
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {"model.embed_tokens.weight": model.wte.weight, "model.norm.weight": model.ln_f.weight,
          "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.h):
        p = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.chunk(3)
        gate, up = split_gate_up(block.mlp.gate_up.weight)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": block.attn.proj.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": block.mlp.down.weight, p + "input_layernorm.weight": block.ln_1.weight,
                   p + "post_attention_layernorm.weight": block.ln_2.weight})
    with torch.no_grad():
        for t in (model.ln_f.weight, *(b.ln_1.weight for b in model.h), *(b.ln_2.weight for b in model.h)):
            t.uniform_(0.5, 1.5)  # norms that show
        missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    idx = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(input_ids=idx).logits, rtol=1e-4, atol=1e-4)
