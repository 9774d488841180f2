"""Train a tiny GPT with S-STE on a slice of Python's own standard library, on the CPU (about a minute on 2 cores).

    python examples/quickstart.py
"""

import sysconfig
from pathlib import Path

import torch

import twofour
from twofour.models import FFN_PATTERNS, from_preset

torch.manual_seed(0)
# a few hundred kB of real text that every Python install has, read as bytes (vocabulary 256)
files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
data = torch.tensor(list(b"".join(f.read_bytes() for f in files)), dtype=torch.long)

model = from_preset("tiny", block_size=128)
twofour.sparsify(model, "s-ste", include=FFN_PATTERNS)  # FFN linears 2:4, as in the papers
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
twofour.attach(model, opt)  # masks and counters advance once per optimizer step

for step in range(1, 201):
    i = torch.randint(0, len(data) - 129, (16,))
    x = torch.stack([data[j : j + 128] for j in i])
    y = torch.stack([data[j + 1 : j + 129] for j in i])
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step % 20 == 0:
        print(f"step {step:4d}  loss {loss.item():.3f}  flip rate {twofour.flip_rate(model)['total']:.2e}")
