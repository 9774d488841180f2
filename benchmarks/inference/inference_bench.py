"""An exported 2:4 GPT against its dense twin on this GPU: what ``twofour bench --inference`` runs,
with the sizes to choose (twofour.bench_inference has the details).

    PYTHONPATH=src python benchmarks/inference/inference_bench.py                  # gpt2-774m, the issue's rows
    PYTHONPATH=src python benchmarks/inference/inference_bench.py --model tiny --vocab-size 256 --context 256 \\
        --prompt-len 32 --decode-steps 32                              # a quick check that all rows run

Prints, as markdown: the weight bytes (stored, held on the GPU, whole file), correctness (2:4
logits against the dense twin's, each 2:4 kernel against a float32 product), the FFN block alone
at 1 token to batch x context tokens, each kernel of one FFN linear at decoding sizes beside its
memory bound, whole-model prefill and decoding tokens/s (static KV cache, CUDA graphs for both
models, graph replay checked against eager decoding), and the kernel chosen per shape.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from twofour.bench import _write_section
from twofour.bench_inference import CONTEXT, PRESET, VOCAB, inference_bench


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=PRESET, help="GPT preset (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=VOCAB, help="(default %(default)s)")
    p.add_argument("--context", type=int, default=CONTEXT, help="block size = prefill length (default %(default)s)")
    p.add_argument("--recipe", default="s-ste", help="recipe that makes the FFN linears 2:4 (default %(default)s)")
    p.add_argument("--prefill-batches", type=_ints, default=[1, 8], help="(default 1,8)")
    p.add_argument("--decode-batches", type=_ints, default=[1, 8, 64], help="(default 1,8,64)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens before decoding (default %(default)s)")
    p.add_argument("--decode-steps", type=int, default=64, help="decoding steps timed (default %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="graph replays per timing (default %(default)s)")
    p.add_argument("--write", default=None, help="also write the report between the inference markers of this file")
    a = p.parse_args()
    start = time.perf_counter()
    report = inference_bench(a.model, vocab_size=a.vocab_size, context=a.context, recipe=a.recipe,
                             prefill_batches=a.prefill_batches, decode_batches=a.decode_batches,
                             prompt_len=a.prompt_len, decode_steps=a.decode_steps, reps=a.reps)
    print(f"\n(total {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if a.write:
        _write_section(Path(a.write), report, "inference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
