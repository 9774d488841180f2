"""Export folders and load_for_inference: round trips per recipe, logits against the training
model, a run that ended dense, strict loading, and bad input; the GPU's 2:4 kernels (gpu)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

import twofour
from twofour.errors import TrainError
from twofour.inference import SparseInferenceLinear, load_for_inference, save_inference
from twofour.inference.packed import pack_24
from twofour.integrity import crc32_file
from twofour.models import FFN_PATTERNS

from .helpers import batches, make_optimizer, tiny_gpt, tiny_llama


def trained(recipe="s-ste", steps=3, make=tiny_gpt, **options):
    """A tiny GPT (or Llama) with ``recipe`` on its FFNs after a few optimizer steps (weights
    moved, masks refreshed, S-STE's beta in use)."""
    m = make(n_embd=64)
    twofour.sparsify(m, recipe, include=FFN_PATTERNS, **options)
    opt = make_optimizer(m, recipe, steps)
    twofour.attach(m, opt)
    for x, y in batches(steps, vocab=64):
        m(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return m.eval()


IDX = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("recipe", ["s-ste", "ste", "sr-ste", "t-sr-ste"])
def test_round_trip_gives_the_training_models_logits(recipe, tmp_path):
    m = trained(recipe)
    with torch.no_grad():
        want = m(IDX)[0]
    cfg = save_inference(m, tmp_path, dtype="float32")
    assert cfg["sparse_layers"] == [f"h.{i}.mlp.{n}" for i in range(2) for n in ("fc", "proj")] and not cfg["dense"]
    loaded = load_for_inference(tmp_path, "cpu")
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert isinstance(loaded.h[1].mlp.proj, SparseInferenceLinear) and isinstance(loaded.h[1].attn.qkv, nn.Linear)
    assert loaded.lm_head.weight is loaded.wte.weight  # the tie is one parameter again
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDX)[0], want, rtol=1e-5, atol=1e-5)  # float32: same weights, same math


def test_export_without_an_architecture_loads_as_gpt(tmp_path):
    """Exports written before Llama existed name no architecture; they hold a GPT and still load."""
    m = trained("s-ste")
    with torch.no_grad():
        want = m(IDX)[0]
    save_inference(m, tmp_path, dtype="float32")
    path = tmp_path / "model_config.json"
    cfg = json.loads(path.read_text())
    del cfg["architecture"]
    path.write_text(json.dumps(cfg))
    loaded = load_for_inference(tmp_path, "cpu")
    assert type(loaded) is type(m)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDX)[0], want, rtol=1e-5, atol=1e-5)


def test_llama_round_trip(tmp_path):
    """A Llama export loads as a Llama (its rotary tables recomputed) with the training model's
    logits, and generates with its KV cache."""
    m = trained("s-ste", make=tiny_llama)
    with torch.no_grad():
        want = m(IDX)[0]
    cfg = save_inference(m, tmp_path, dtype="float32")
    assert cfg["architecture"] == "Llama" and cfg["sparse_layers"] == [
        f"h.{i}.mlp.{n}" for i in range(2) for n in ("gate_up", "down")]
    loaded = load_for_inference(tmp_path, "cpu")
    assert type(loaded) is type(m) and isinstance(loaded.h[0].mlp.gate_up, SparseInferenceLinear)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDX)[0], want, rtol=1e-5, atol=1e-5)
    out = twofour.generate(loaded, IDX[:, :4], 8, temperature=0)
    assert out.shape == (2, 12)


def test_bf16_export_is_within_the_stated_tolerance(tmp_path):
    """The default bf16 export rounds every weight to bf16; on the CPU the model runs in float32,
    and its logits stay within 1% of the training model's largest logit (docs/export-format.md)."""
    m = trained("s-ste", steps=5)
    with torch.no_grad():
        want = m(IDX)[0]
    cfg = save_inference(m, tmp_path)
    assert cfg["dtype"] == "bfloat16" and cfg["sparse_layer_ratio"] == 0.5625
    loaded = load_for_inference(tmp_path, "cpu")
    assert loaded.wte.weight.dtype == torch.float32
    with torch.no_grad():
        got = loaded(IDX)[0]
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    bf16 = load_for_inference(tmp_path, "cpu", torch.bfloat16)  # or in the stored dtype
    assert bf16.h[0].mlp.fc.values.dtype == torch.bfloat16


def test_the_file_holds_exactly_the_models_keys(tmp_path):
    m = trained("s-ste", steps=1)
    save_inference(m, tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    loaded = load_for_inference(tmp_path, "cpu")
    assert set(stored) == set(loaded.state_dict()) - {"lm_head.weight"}  # the tied head is stored once
    assert {k for k in stored if k.startswith("h.0.mlp.fc.")} == {"h.0.mlp.fc.values", "h.0.mlp.fc.positions",
                                                                  "h.0.mlp.fc.bias"}
    fresh = load_for_inference(tmp_path, "cpu", dense=True)  # the dense twin: same weights in nn.Linear
    assert type(fresh.h[0].mlp.fc) is nn.Linear
    torch.testing.assert_close(fresh.h[0].mlp.fc.weight, loaded.h[0].mlp.fc.dense_weight())
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDX)[0], loaded(IDX)[0])


def test_a_run_that_ended_dense_exports_dense(tmp_path):
    m = trained("t-sr-ste", steps=6, total_steps=6, dense_finetune=0.5)  # steps 3.. train dense
    assert all(layer.is_dense_phase for _, layer in twofour.sparse_layers(m))
    with torch.no_grad():
        want = m(IDX)[0]
    cfg = save_inference(m, tmp_path, dtype="float32")
    assert cfg["dense"] and cfg["sparse_layers"] == [] and "dense" in cfg["dense_reason"]
    assert not any(k.endswith(".positions") for k in load_file(str(tmp_path / "model.safetensors")))
    loaded = load_for_inference(tmp_path, "cpu")
    assert not any(isinstance(mod, SparseInferenceLinear) for mod in loaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDX)[0], want, rtol=1e-5, atol=1e-5)


def edit_config(folder, **changes):
    path = folder / "model_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def resave(folder, tensors):
    """Other weights in an export folder, its config's size and CRC-32 made to match them."""
    save_file(tensors, str(folder / "model.safetensors"))
    edit_config(folder, weights_bytes=(folder / "model.safetensors").stat().st_size,
                weights_crc32=crc32_file(folder / "model.safetensors"))


def test_bad_input_is_one_clear_error(tmp_path):
    good = tmp_path / "good"
    save_inference(trained("ste", steps=1), good)
    tensors = load_file(str(good / "model.safetensors"))

    def error(folder):
        with pytest.raises(TrainError) as info:
            load_for_inference(folder, "cpu")
        msg = str(info.value)
        assert "\n" not in msg
        return msg

    assert "no such export folder" in error(tmp_path / "missing")
    assert "is a file" in error(good / "model_config.json")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"x")
    assert "twofour export" in error(tmp_path / "run")  # a run folder not exported yet
    assert "not a twofour export" in error(tmp_path)

    def copy(name):
        folder = tmp_path / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        return folder

    trunc = copy("truncated")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated or from another export" in error(trunc)
    torn = copy("torn")  # a damaged file of the right size
    (torn / "model.safetensors").write_bytes(b"\xff" * len(data))
    assert "is damaged (its bytes fail the CRC-32" in error(torn)
    edit_config(torn, weights_crc32=None)  # an export written before the CRC-32: the reader still refuses it
    assert "unreadable or corrupt" in error(torn)
    other = copy("other")  # weights of another model, config of this one
    save_inference(twofour.sparsify(tiny_gpt(n_embd=32), "ste", include=FFN_PATTERNS), tmp_path / "small")
    resave(other, load_file(str(tmp_path / "small" / "model.safetensors")))
    assert "has shape" in error(other)
    dense = copy("dense-weight")  # a dense weight where the config says 2:4
    t = dict(tensors)
    del t["h.0.mlp.fc.values"], t["h.0.mlp.fc.positions"]
    t["h.0.mlp.fc.weight"] = torch.randn(256, 64)
    resave(dense, t)
    assert "h.0.mlp.fc is listed as 2:4" in error(dense)
    bad = copy("positions")  # positions that name no 2:4 pattern
    t = dict(tensors)
    t["h.1.mlp.proj.positions"] = t["h.1.mlp.proj.positions"].clone()
    t["h.1.mlp.proj.positions"][3, 0] = 0x00
    resave(bad, t)
    assert "h.1.mlp.proj.positions is not a 2:4 pattern" in error(bad)
    missing = copy("missing-key")
    t = dict(tensors)
    del t["h.0.ln_1.weight"]
    resave(missing, t)
    assert "missing h.0.ln_1.weight" in error(missing)
    listed = copy("listed")
    edit_config(listed, sparse_layers=["h.0.mlp.nope"])
    assert "no linear layer" in error(listed)
    old = copy("old")
    (old / "model_config.json").write_text(json.dumps({"sparse_layers": 8, "vocab_size": 64}))
    assert "earlier twofour export" in error(old)
    newer = copy("newer")
    edit_config(newer, format_version=99)
    assert "upgrade twofour" in error(newer)
    (copy("broken") / "model_config.json").write_text("{")
    assert "not JSON" in error(tmp_path / "broken")


def test_dense_layout_state_dict_round_trip():
    """to_inference's default keeps nn.Linear's state-dict layout; loading a weight that isn't
    2:4 fails by name."""
    w = torch.randn(32, 64)
    w = w * twofour.functional.mask_24(w)
    layer = SparseInferenceLinear.from_weight(w, torch.zeros(32), packed_state=False)
    sd = layer.state_dict()
    assert set(sd) == {"weight", "bias"} and torch.equal(sd["weight"], w)
    other = SparseInferenceLinear(64, 32, packed_state=False)
    other.load_state_dict(sd)
    x = torch.randn(3, 64)
    torch.testing.assert_close(other(x), F.linear(x, w))
    with pytest.raises(ValueError, match="weight: not 2:4"):
        other.load_state_dict({"weight": torch.ones(32, 64), "bias": torch.zeros(32)})


def test_to_inference_keeps_the_output():
    m = trained("sr-ste", steps=2)
    with torch.no_grad():
        want = m(IDX)[0]
    names = twofour.to_inference(m)
    assert len(names) == 4 and not list(twofour.sparse_layers(m))
    with torch.no_grad():
        torch.testing.assert_close(m(IDX)[0], want, rtol=1e-5, atol=1e-5)
    values, _ = pack_24(m.h[0].mlp.fc.dense_weight())
    assert values.shape == (256, 32)


# -- on the GPU ---------------------------------------------------------------------------------


def _gpu_fast():
    from twofour.kernels import ops

    if not ops.fast_available():
        pytest.skip("needs Triton and nvmath-python's cuSPARSELt bindings")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 8, 13, 64, 1000])
def test_gpu_kernels_match_the_dense_product(tokens):
    _gpu_fast()
    w = torch.randn(256, 512, device="cuda")
    w = (w * twofour.functional.mask_24(w)).bfloat16()
    b = torch.randn(256, device="cuda").bfloat16()
    layer = SparseInferenceLinear.from_weight(w, b).cuda()
    layer.prepare()
    assert layer.runs_sparse() and layer.nbytes() == 256 * 512 // 2 * 2 + 256 * 512 // 8 * 2  # operand + positions
    layer.transposed_output = True  # may also write a column-major output
    x = torch.randn(tokens, 512, device="cuda").bfloat16()
    want = F.linear(x.float(), w.float(), b.float())
    for xin in (x, x.t().contiguous().t()):  # row- and column-major inputs, read in place
        routes = layer.routes(xin)
        # a column-major output only where no padding rows are sliced off; the GEMV up to 16 tokens
        want_routes = {"sparse"} | ({"sparse_dr"} if tokens % 8 == 0 else set())
        want_routes |= {"sparse_gemv"} if tokens <= 16 else set()
        assert set(routes) == want_routes
        for name, fn in routes.items():
            got = fn().float()
            assert got.shape == want.shape and ((got - want).abs().max() / want.abs().max()).item() < 1e-2, name
        got = layer(xin.view(1, tokens, 512)).float().view(tokens, 256)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_model_and_graph_decoding(tmp_path):
    _gpu_fast()
    m = trained("s-ste", steps=2)
    save_inference(m, tmp_path)
    sparse, dense = load_for_inference(tmp_path, "cuda"), load_for_inference(tmp_path, "cuda", dense=True)
    assert sparse.h[0].mlp.fc.runs_sparse()
    with torch.no_grad():
        ls, ld = sparse(IDX.cuda())[0].float(), dense(IDX.cuda())[0].float()
    assert (ls - ld).abs().max() <= 0.02 * ld.abs().max()
