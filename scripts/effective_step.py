"""How far one optimizer step moves each recipe's effective weight (the weight the forward
multiplies by), for the question of S-STE's rate sensitivity (docs/RESULTS.md).

    PYTHONPATH=src python scripts/effective_step.py --data CORPUS [--recipes ste,s-ste] [--lr 1e-3]
        [--steps 300] [--seeds 1,2,3] [--out docs/results/rate-shift/effective_step.json]

Trains the ``tiny`` preset with 2 blocks (16 x 128 tokens a step, AdamW with the ``ours`` regime's
betas and decay, constant rate after a 5% warmup) on the CPU and records at every step, over the
FFN linears, ``|W_eff(t+1) - W_eff(t)| / |W_eff(t)|`` (Frobenius norms) and the part of it on the
entries kept both before and after the step. For S-STE it also splits the kept entries' move into
beta times the move of ``|W|`` and beta times the move of the group's threshold (beta*S(W) =
beta*sign(W)(|W| - t), t the group's third-largest magnitude: t moves whenever that pruned entry
does, and shifts every kept entry of its group). Prints the medians over steps and seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from twofour.models import build_model
from twofour.sparse.convert import attach, sparse_layers
from twofour.training.config import TrainConfig
from twofour.training.data import load_data
from twofour.training.runs import source_digest


def _threshold(w: torch.Tensor) -> torch.Tensor:
    """Each group of 4's third-largest magnitude, broadcast back to ``w``'s shape."""
    g = w.detach().abs().reshape(-1, 4).sort(dim=1).values[:, 1:2]
    return g.expand(-1, 4).reshape(w.shape)


def run(recipe: str, lr: float, steps: int, seed: int, data) -> dict[str, list[float]]:
    """One training run of ``steps``; per step, the medians over layers of the moves above."""
    torch.manual_seed(seed)
    model = build_model("tiny", recipe, vocab_size=data.vocab_size, block_size=128, n_layer=2)
    cfg = TrainConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    attach(model, opt)
    layers = [layer for _, layer in sparse_layers(model)]
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    out: dict[str, list[float]] = {"move": [], "kept_move": [], "abs_move": [], "threshold_move": []}
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        before = [(layer.effective_weight().clone(), layer.weight.detach().clone()) for layer in layers]
        x, y = data.batch("train", 16, 128, gen)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        moves: dict[str, list[float]] = {k: [] for k in out}
        for layer, (eff0, w0) in zip(layers, before):
            eff1, w1 = layer.effective_weight(), layer.weight.detach()
            norm = eff0.norm()
            kept = (eff0 != 0) & (eff1 != 0)
            moves["move"].append(float((eff1 - eff0).norm() / norm))
            moves["kept_move"].append(float(((eff1 - eff0) * kept).norm() / norm))
            if layer.beta is not None:
                beta = float(layer.beta)
                moves["abs_move"].append(float(beta * ((w1.abs() - w0.abs()) * kept).norm() / norm))
                moves["threshold_move"].append(float(beta * ((_threshold(w1) - _threshold(w0)) * kept).norm() / norm))
        for k, v in moves.items():
            if v:
                out[k].append(statistics.median(v))
    return {k: v for k, v in out.items() if v}


COLUMNS = ("move", "kept_move", "abs_move", "threshold_move")


def table(record: dict) -> str:
    """The markdown table of a record (:func:`main`'s ``--out``): per recipe, the median over
    steps and seeds of each move, relative to the effective weight's norm."""
    lines = ["| recipe | \\|dW_eff\\| | on the entries kept before and after | beta * d\\|W\\| there | "
             "beta * dt there |", "|---|---|---|---|---|"]
    for recipe, by_seed in record["runs"].items():
        cells = [[v for r in by_seed.values() for v in r.get(k, [])] for k in COLUMNS]
        lines.append(f"| {recipe} | " + " | ".join(f"{statistics.median(c):.2e}" if c else "-" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--data", required=True)
    ap.add_argument("--recipes", default="ste,s-ste")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = load_data(args.data)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {r: {s: run(r, args.lr, args.steps, s, data) for s in seeds} for r in args.recipes.split(",")}
    record = {"lr": args.lr, "steps": args.steps, "seeds": seeds, "code": source_digest(), "runs": results}
    print(f"lr {args.lr:g}, {args.steps} steps, seeds {args.seeds}; median over steps and seeds, relative to |W_eff|:")
    print(table(record))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record))


if __name__ == "__main__":
    main()
