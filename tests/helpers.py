"""Small shared pieces for the tests: a tiny GPT or Llama and a few optimizer steps on random tokens."""

import socket

import torch

import twofour
from twofour.cli import main
from twofour.models import GPT, Llama, from_preset


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    return from_preset("tiny", GPT, **{**cfg, **overrides})


def tiny_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64, ffn_multiple=32)  # FFN width 96
    return from_preset("llama-tiny", Llama, **{**cfg, **overrides})


def make_optimizer(model, recipe, total_steps, lr=3e-3):
    if recipe == "step":
        return twofour.STEPAdamW(model.parameters(), total_steps=total_steps, lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr)


def batches(n, batch=8, seq=32, vocab=64, seed=1, period=16):
    """A learnable stream: tokens repeat with a fixed period, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (period,), generator=g)
    for _ in range(n):
        start = torch.randint(0, period, (batch,), generator=g)
        idx = (start[:, None] + torch.arange(seq + 1)) % period
        toks = base[idx]
        noise = torch.rand(toks.shape, generator=g) < 0.05
        toks = torch.where(noise, torch.randint(0, vocab, toks.shape, generator=g), toks)
        yield toks[:, :-1], toks[:, 1:]


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def error_of(args, capsys):
    """The one line a ``twofour`` command that fails on bad input prints (its exit status is 2)."""
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err
