"""Sampling from a GPT or Llama with a KV cache (``twofour generate``), and the text codecs an export
names: bytes (vocabulary 256: every text corpus twofour trains on), characters (nanoGPT's
``meta.pkl`` with ``itos``), or bare token ids where no tokenizer is known."""

from __future__ import annotations

import abc
import codecs
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ..models.gpt import GPT
from ..models.llama import Llama

__all__ = ["generate", "stream", "MAX_NEW_TOKENS", "sample_next", "Codec", "BYTES", "CharCodec", "IdCodec",
           "codec_from_dict"]


#: The most tokens ``twofour generate`` samples in one call (``--max-new-tokens``): far past any
#: preset's context (the model sees at most ``block_size`` tokens of what it wrote), about an hour
#: of output on a CPU; the output streams as it comes, and Ctrl-C stops it.
MAX_NEW_TOKENS = 1_000_000


def _check_sampling(temperature: float, top_k: int | None) -> None:
    if not temperature >= 0:  # also NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for all tokens), got {top_k}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of ``logits`` (B, vocab), as (B, 1): the argmax at temperature 0, else a
    draw from softmax(logits / temperature) over the ``top_k`` most likely tokens (all if None)."""
    _check_sampling(temperature, top_k)
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model: GPT | Llama, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``idx`` (B, T) followed by ``max_new_tokens`` sampled tokens (B, T + max_new_tokens): the
    tokens of :func:`stream`, joined."""
    return torch.cat([idx, *stream(model, idx, max_new_tokens, temperature=temperature, top_k=top_k,
                                   generator=generator)], 1)


def stream(model: GPT | Llama, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """The ``max_new_tokens`` tokens sampled after the prompt ``idx`` (B, T), one (B, 1) tensor at a
    time as each comes (``twofour generate`` prints them so), in memory that does not grow with them.

    The prompt runs once through the model, filling a KV cache of ``block_size`` positions;
    then each new token is one cached forward. A prompt longer than the context keeps its last
    ``block_size`` tokens; when the cache is full, the last half of the text is run again as a
    new prompt (the model never sees more than ``block_size`` tokens)."""
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"generate: expected a (batch, tokens) prompt with at least one token, got {tuple(idx.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    _check_sampling(temperature, top_k)
    return _stream(model, idx, max_new_tokens, temperature, top_k, generator)


@torch.no_grad()
def _stream(model: GPT | Llama, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """:func:`stream`'s tokens, its arguments checked."""
    block = model.cfg.block_size
    cache = model.make_cache(idx.shape[0])
    tail = idx[:, -block:]  # the last block_size tokens of the text: what a new prompt is cut from
    filled = 0

    def prompt(tokens: torch.Tensor) -> torch.Tensor:
        nonlocal filled
        cache.reset()
        filled = tokens.shape[1]
        return model(tokens, cache=cache)[0][:, -1]

    logits = prompt(tail) if max_new_tokens else None
    for i in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)
        yield nxt
        if i + 1 == max_new_tokens:
            break
        tail = torch.cat([tail, nxt], 1)[:, -block:]
        if filled == block:  # the context is full: start again from the last half
            logits = prompt(tail[:, -max(1, block // 2):])
        else:
            logits = model(nxt, cache=cache)[0][:, -1]
            filled += 1


class Codec(abc.ABC):
    """Text <-> token ids, and the ``tokenizer`` entry an export stores for it."""

    name: str = "codec"

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""

    def to_dict(self) -> dict[str, Any]:
        """The export config's ``tokenizer`` entry (:func:`codec_from_dict` reads it back)."""
        return {"kind": self.name}

    def pieces(self) -> Callable[[list[int]], str]:
        """A decoder for ids that come a few at a time: called with each piece's ids (an empty list
        at the end flushes what it holds back), its texts joined are the text of all the ids."""
        return self.decode


class _Bytes(Codec):
    """UTF-8 bytes, vocabulary 256; bytes that don't decode come out as U+FFFD. Text holding bytes
    that were not UTF-8 (a command line's, which Python keeps as lone surrogates) encodes to those bytes."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def pieces(self) -> Callable[[list[int]], str]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character's bytes may come apart
        return lambda ids: decoder.decode(bytes(ids), final=not ids)


BYTES = _Bytes()


@dataclass
class CharCodec(Codec):
    """nanoGPT's character vocabulary: ``itos[i]`` is token i's text."""

    itos: list[str]
    name = "chars"

    def encode(self, text: str) -> list[int]:
        stoi = {s: i for i, s in enumerate(self.itos)}
        missing = sorted({ch for ch in text if ch not in stoi})
        if missing:
            raise ValueError(f"the prompt has characters outside the model's vocabulary: {''.join(missing)!r}")
        return [stoi[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.name, "itos": list(self.itos)}


class IdCodec(Codec):
    """No tokenizer known (token shards without one): the prompt and output are token ids,
    separated by spaces."""

    name = "ids"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(tok) for tok in text.split()]
        except ValueError:
            raise ValueError("this model has no known tokenizer: give the prompt as token ids separated by spaces, "
                             f"each below {self.vocab_size}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    def pieces(self) -> Callable[[list[int]], str]:
        started = False

        def piece(ids: list[int]) -> str:
            nonlocal started
            text = (" " if started and ids else "") + self.decode(ids)
            started = started or bool(ids)
            return text
        return piece


def codec_from_dict(d: dict[str, Any] | None, vocab_size: int) -> Codec:
    """The codec an export's ``tokenizer`` entry names (ids when it names none)."""
    kind = (d or {}).get("kind")
    if kind == BYTES.name and vocab_size == 256:
        return BYTES
    if kind == CharCodec.name and isinstance(d.get("itos"), list) and len(d["itos"]) == vocab_size:
        return CharCodec([str(s) for s in d["itos"]])
    return IdCodec(vocab_size)
