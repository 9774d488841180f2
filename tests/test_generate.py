"""The models' static KV cache and twofour.generate: cached forwards give the uncached logits
(GPT and Llama), greedy cached generation gives the uncached argmax loop's tokens, sampling
options behave."""

import pytest
import torch

import twofour
from twofour.inference.sampling import BYTES, CharCodec, IdCodec, codec_from_dict, sample_next
from twofour.models import FFN_PATTERNS

from .helpers import tiny_gpt, tiny_llama


def tiny_llama_gqa(**kw):
    """A tiny Llama with grouped-query attention: 4 query heads share 2 heads of keys and values."""
    return tiny_llama(n_head=4, n_kv_head=2, **kw)


@torch.no_grad()
def test_grouped_query_attention_is_attention_with_shared_keys_and_values():
    """A grouped model's logits equal those of the same model without grouping whose key and value
    heads are the grouped ones repeated (each kv head serving its run of query heads)."""
    g = tiny_llama_gqa()
    full = tiny_llama(n_head=4)
    hd = 8  # n_embd 32 over 4 heads
    sd = g.state_dict()
    for i in range(len(g.h)):
        w = sd[f"h.{i}.attn.qkv.weight"]
        q, k, v = w.split((32, 2 * hd, 2 * hd))
        rep = [z.view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32) for z in (k, v)]
        sd[f"h.{i}.attn.qkv.weight"] = torch.cat([q, *rep])
    full.load_state_dict(sd)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    assert g.h[0].attn.qkv.out_features == 32 + 2 * 2 * hd
    torch.testing.assert_close(g(idx)[0], full(idx)[0])


def model(block_size=32, make=tiny_gpt):
    m = make(block_size=block_size)
    twofour.sparsify(m, "s-ste", include=FFN_PATTERNS)
    return m.eval()


MODELS = pytest.mark.parametrize("make", [tiny_gpt, tiny_llama, tiny_llama_gqa], ids=["gpt", "llama", "llama-gqa"])


@MODELS
@torch.no_grad()
def test_cached_forward_gives_the_uncached_logits(make):
    m = model(make=make)
    idx = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    full = m(idx)[0]
    cache = m.make_cache(3, 24)
    assert torch.allclose(m(idx[:, :12], cache=cache)[0][:, 0], full[:, 11], atol=1e-5)  # a prompt: last logits
    for p in range(12, 20):  # then one token a call
        assert torch.allclose(m(idx[:, p:p + 1], cache=cache)[0][:, 0], full[:, p], atol=1e-5)
    assert int(cache.pos) == 20
    cache.reset()  # a new prompt starts over
    assert torch.allclose(m(idx[:, 5:9], cache=cache)[0][:, 0], m(idx[:, 5:9])[0][:, -1], atol=1e-5)


@torch.no_grad()
def uncached_greedy(m, idx, n):
    """The plain loop: the whole context through the model for every token, restarting from the
    last half of the text whenever the context is full (as generate documents)."""
    out, start, block = idx, max(0, idx.shape[1] - m.cfg.block_size), m.cfg.block_size
    for _ in range(n):
        if out.shape[1] - start > block:
            start = out.shape[1] - block // 2
        nxt = m(out[:, start:])[0][:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], 1)
    return out


@MODELS
@pytest.mark.parametrize("prompt,new", [(5, 20), (30, 40)], ids=["in-context", "past-the-context"])
def test_greedy_generation_equals_the_uncached_loop(prompt, new, make):
    m = model(block_size=32, make=make)
    idx = torch.randint(0, 64, (2, prompt), generator=torch.Generator().manual_seed(1))
    got = twofour.generate(m, idx, new, temperature=0)
    assert got.shape == (2, prompt + new) and torch.equal(got[:, :prompt], idx)
    assert torch.equal(got, uncached_greedy(m, idx, new))


def test_sampling_options():
    m = model()
    idx = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(2))

    def run(seed, **kw):
        return twofour.generate(m, idx, 12, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(run(1, temperature=0.9), run(1, temperature=0.9))  # a seed reproduces
    assert not torch.equal(run(1, temperature=5.0), run(2, temperature=5.0))
    assert torch.equal(run(3, top_k=1), twofour.generate(m, idx, 12, temperature=0))  # top-1 is greedy
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    draws = {sample_next(logits, 1.0, 2, torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert draws == {1, 2}  # only the two most likely tokens
    for kw, says in [({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k")]:
        with pytest.raises(ValueError, match=says):
            twofour.generate(m, idx, 3, **kw)
    with pytest.raises(ValueError, match="at least one token"):
        twofour.generate(m, idx[:, :0], 3)
    with pytest.raises(ValueError, match="max_len"):
        m.make_cache(1, 33)


def test_codecs():
    assert BYTES.decode(BYTES.encode("déf x")) == "déf x"
    assert BYTES.decode([0x64, 0xFF]) == "d\ufffd"  # bytes that don't decode are replaced, not fatal
    chars = CharCodec(list("abc\n"))
    assert chars.encode("cab\n") == [2, 0, 1, 3] and chars.decode([2, 0]) == "ca"
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        chars.encode("abz")
    ids = IdCodec(100)
    assert ids.encode(" 3 17 ") == [3, 17] and ids.decode([3, 17]) == "3 17"
    with pytest.raises(ValueError, match="token ids"):
        ids.encode("hello")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ids.encode("100")
    assert codec_from_dict({"kind": "bytes"}, 256) is BYTES
    assert isinstance(codec_from_dict({"kind": "chars", "itos": list("ab")}, 2), CharCodec)
    assert isinstance(codec_from_dict({"kind": "bytes"}, 50304), IdCodec)  # inconsistent: no guessing
    assert isinstance(codec_from_dict(None, 10), IdCodec)
    assert BYTES.encode("\udcff\udcfe") == [0xFF, 0xFE]  # a command line's bytes that aren't UTF-8


def test_codecs_decode_text_that_comes_in_pieces():
    """What `twofour generate` prints as the tokens come adds up to the text of all of them; a
    character whose bytes come apart waits for its last byte."""
    for codec, ids in ((BYTES, list("déf ✓".encode()) + [0xFF, 0x64]), (IdCodec(300), [3, 17, 299, 0]),
                       (CharCodec(list("abc\n")), [2, 0, 3, 1])):
        piece = codec.pieces()
        parts = [piece(ids[:2]), *(piece([i]) for i in ids[2:]), piece([])]
        assert "".join(parts) == codec.decode(ids), codec
    piece = BYTES.pieces()
    assert piece([0xE2, 0x9C]) == "" and piece([0x93]) == "✓" and piece([0xE2]) == "" and piece([]) == "\ufffd"
