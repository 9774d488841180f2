"""An exported 2:4 GPT against its dense twin, taken apart: bytes, correctness, the FFN and each of
its kernels at decoding sizes against the memory bound, and decoding against its bound (GPU).

    PYTHONPATH=src python benchmarks/inference/inference_bench.py                  # gpt2-774m
    PYTHONPATH=src python benchmarks/inference/inference_bench.py --model tiny --vocab-size 256 --context 256 \\
        --prompt-len 32 --decode-steps 32                              # a quick check that every row runs

First the rows of ``twofour bench --inference`` at the sizes chosen (whole-model prefill and
decoding tokens/s, both models through the static KV cache, one CUDA graph replay a step), then:
the weight bytes (stored, held on the GPU, whole file); 2:4 logits against the dense twin's and
each 2:4 kernel of one FFN linear against a float32 product; the FFN block alone from 1 token to
batch x context tokens; each kernel of one FFN linear at decoding sizes beside its memory bound
(weight bytes / copy bandwidth); at each decoding batch the bytes a step must read (weights and
KV cache), the ratio those bound, and whether graph replay decodes the tokens an eager run does;
and the kernel the dispatch chose per shape.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from twofour import dispatch
from twofour.bench import exported_pair, inference_report
from twofour.inference import SparseInferenceLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import copy_bandwidth, gpu_line, graph_ms, md_head, md_row, weight_bytes  # noqa: E402

CHECK = 8  # decoding steps compared between an eager run and graph replays


def decode_bytes(model: nn.Module, batch: int, max_len: int) -> int:
    """Bytes one decoding step reads at least: every linear's weight once (the output head
    included) and the whole cache of keys and values, which a static cache's masked attention
    reads up to ``max_len``."""
    weights = sum(weight_bytes(m) for m in model.modules() if isinstance(m, (nn.Linear, SparseInferenceLinear)))
    c = model.cfg
    return weights + 2 * c.n_layer * batch * max_len * c.n_embd * next(model.parameters()).element_size()


def graph_decodes_as_eager(model: nn.Module, prompt: torch.Tensor) -> bool:
    """Whether ``CHECK`` greedy steps replayed from one captured step give an eager run's tokens."""
    cache = model.make_cache(prompt.shape[0], -(-(prompt.shape[1] + CHECK + 2) // 16) * 16)
    tok = torch.zeros(prompt.shape[0], 1, dtype=torch.long, device="cuda")

    def prefill() -> None:
        cache.reset()
        tok.copy_(model(prompt, cache=cache)[0][:, -1:].argmax(-1))

    def step() -> None:
        tok.copy_(model(tok, cache=cache)[0][:, -1:].argmax(-1))

    prefill()
    eager = []
    for _ in range(CHECK):
        step()
        eager.append(tok.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    prefill()
    replayed = []
    for _ in range(CHECK):
        graph.replay()
        replayed.append(tok.clone())
    return all(torch.equal(a, b) for a, b in zip(eager, replayed))


@torch.no_grad()
def details(sparse: nn.Module, dense: nn.Module, cfg: dict, args: argparse.Namespace, bw: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fc, proj, dfc, dproj = sparse.h[0].mlp.fc, sparse.h[0].mlp.proj, dense.h[0].mlp.fc, dense.h[0].mlp.proj
    layers = [m for m in sparse.modules() if isinstance(m, SparseInferenceLinear)]
    stored, dense_eq, held = cfg["sparse_layer_bytes"], cfg["sparse_layer_dense_bytes"], sum(m.nbytes() for m in layers)
    twin = sum(p.numel() * p.element_size() for p in dense.parameters())
    print("\n### Weight bytes\n\n" + md_head("what", "2:4 model", "dense twin", "ratio"))
    print(md_row(f"2:4 layers as stored (values + positions, {len(layers)} layers)", f"{stored / 1e6:,.1f} MB",
                 f"{dense_eq / 1e6:,.1f} MB", f"{stored / dense_eq:.4f}x"))
    print(md_row("2:4 layers on the GPU (cuSPARSELt operand + positions)", f"{held / 1e6:,.1f} MB",
                 f"{dense_eq / 1e6:,.1f} MB", f"{held / dense_eq:.4f}x"))
    print(md_row("whole model file", f"{cfg['weights_bytes'] / 1e6:,.1f} MB", f"{twin / 1e6:,.1f} MB (parameters)",
                 f"{cfg['weights_bytes'] / twin:.4f}x"))

    print("\n### Correctness\n\n" + md_head("check", "result"))
    idx = torch.randint(0, args.vocab_size, (2, min(128, args.context)), device="cuda", generator=gen)
    ls, ld = sparse(idx)[0].float(), dense(idx)[0].float()
    print(md_row(f"logits, 2:4 vs dense twin (2 x {idx.shape[1]} tokens)",
                 f"max abs diff {(ls - ld).abs().max().item():.4f} (max abs logit {ld.abs().max().item():.2f}); "
                 f"argmax agrees at {(ls.argmax(-1) == ld.argmax(-1)).float().mean().item():.1%} of positions"))
    for t in (1, 5, 8, 64, 1024):
        x = torch.randn(t, fc.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x.float(), fc.dense_weight().float(), fc.bias.float())
        errs = {name: ((fn().float() - ref).abs().max() / ref.abs().max()).item() for name, fn in fc.routes(x).items()}
        print(md_row(f"h.0.mlp.fc, {t} tokens, each 2:4 kernel vs float32",
                     ", ".join(f"{n}: max rel err {e:.1e}" for n, e in errs.items())))

    print("\n### FFN block alone (fc -> GELU -> proj, block 0), CUDA graph replay\n\n"
          + md_head("tokens", "dense ms", "2:4 ms", "ratio"))
    for t in sorted({1, 8, 64, *(b * args.context for b in args.prefill_batches)}):
        x = torch.randn(t, fc.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
        inner = 20 if t <= 64 else 3
        td = graph_ms(lambda x=x: dense.h[0].mlp(x), inner=inner, reps=args.reps)
        ts = graph_ms(lambda x=x: sparse.h[0].mlp(x), inner=inner, reps=args.reps)
        print(md_row(t, f"{td:.4f}", f"{ts:.4f}", f"{td / ts:.2f}x"), flush=True)

    print("\n### One FFN linear at decoding sizes: each kernel, and the memory bound\n\n`bound` = weight bytes / "
          "copy bandwidth (no kernel reads its weight faster); cuSPARSELt pads the tokens to 8.\n\n"
          + md_head("layer", "tokens", "dense us (bound)", "cuSPARSELt us", "2:4 GEMV us", "2:4 bound us",
                    "best ratio"))
    for name, lin, twin_lin in (("fc", fc, dfc), ("proj", proj, dproj)):
        for t in (1, 8, 64):
            x = torch.randn(t, lin.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
            td = graph_ms(lambda x=x, m=twin_lin: m(x), inner=20, reps=args.reps) * 1e3
            routes = {n: graph_ms(fn, inner=20, reps=args.reps) * 1e3 for n, fn in lin.routes(x).items()}
            gemv = f"{routes['sparse_gemv']:.1f}" if "sparse_gemv" in routes else "-"
            cslt = min(v for n, v in routes.items() if n != "sparse_gemv")  # either output order
            print(md_row(f"{name} {lin.in_features}->{lin.out_features}", t,
                         f"{td:.1f} ({weight_bytes(twin_lin) / bw / 1e3:.1f})", f"{cslt:.1f}", gemv,
                         f"{weight_bytes(lin) / bw / 1e3:.1f}", f"{td / min(routes.values()):.2f}x"), flush=True)

    max_len = -(-(args.prompt_len + args.decode_steps + 2) // 16) * 16
    print(f"\n### Decoding: what bounds a step (static KV cache of {max_len})\n\n`bytes/step`: weights + KV cache "
          "read per step (a lower bound on the traffic); `bound`: the ratio if both ran at the same bandwidth.\n\n"
          + md_head("batch", "bytes/step dense / 2:4", "bound", "graph = eager (dense, 2:4)"))
    for b in args.decode_batches:
        prompt = torch.randint(0, args.vocab_size, (b, args.prompt_len), device="cuda", generator=gen)
        bd, bs = decode_bytes(dense, b, max_len), decode_bytes(sparse, b, max_len)
        same = [graph_decodes_as_eager(m, prompt) for m in (dense, sparse)]
        print(md_row(b, f"{bd / 1e6:,.0f} / {bs / 1e6:,.0f} MB", f"{bd / bs:.2f}x",
                     "yes" if all(same) else f"dense {same[0]}, 2:4 {same[1]}"), flush=True)
    print("\n2:4 kernel chosen per shape (`inf` keys: MxKxN = out x in x tokens):\n\n```")
    print("\n".join(dispatch.choice_lines("inf")) + "\n```")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-774m", help="GPT preset (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=50304, help="(default %(default)s)")
    p.add_argument("--context", type=int, default=1024, help="block size = prefill length (default %(default)s)")
    p.add_argument("--prefill-batches", type=ints, default=[1, 8], help="(default 1,8)")
    p.add_argument("--decode-batches", type=ints, default=[1, 8, 64], help="(default 1,8,64)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens before decoding (default %(default)s)")
    p.add_argument("--decode-steps", type=int, default=64, help="decoding steps timed (default %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="graph replays per timing (default %(default)s)")
    args = p.parse_args()
    if args.prompt_len + max(args.decode_steps, CHECK) + 2 > args.context:
        raise SystemExit("inference_bench.py: --prompt-len + --decode-steps (+ 2) must fit --context")
    bw = copy_bandwidth()
    print(f"{gpu_line()}; copy bandwidth {bw:.0f} GB/s\n")
    for line in inference_report(False, args.model, vocab_size=args.vocab_size, context=args.context,
                                 prefill_batches=args.prefill_batches, decode_batches=args.decode_batches,
                                 prompt_len=args.prompt_len, decode_steps=args.decode_steps):
        print(line, flush=True)
    with tempfile.TemporaryDirectory(prefix="twofour-inference-") as folder:
        sparse, dense, cfg = exported_pair(args.model, folder, vocab_size=args.vocab_size, context=args.context)
    details(sparse, dense, cfg, args, bw)


if __name__ == "__main__":
    main()
