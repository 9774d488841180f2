#!/usr/bin/env bash
# The one-GPU measurements behind docs/ that each fit one device call (under 10 minutes), by PART:
#   tests        every GPU test file (those with a `gpu` mark), one pytest each, side by side
#   attn-speed   benchmarks/fp8/peer.py at the Llama-3-8B shape, 4 blocks: dense, s-ste dx=pruned-t,
#                the same with the attention projections 2:4 (+attn)
#   fp8-rows     peer.py, 4 blocks: torchao float8 beside the FP8 2:4 recipes, dX routes included
#   llama-1b     the user's command at llama-1b, dense against s-ste dx=pruned-t, 3 interleaved pairs
#   prose-sweep  scripts/dx_sweep.py on the prose corpus (carry .corpora/dxprose), seed by seed,
#                finished runs of docs/results/dx-prose reused
#   attn-quality gpt-10m, code corpus, ste / s-ste / s-ste dx=pruned-t with --sparse-attention at
#                their best rates of docs/results/dx-code, 3 seeds
#   torchtitan3  benchmarks/step/torchtitan3_run.sh (torchtitan 0.3's wheels in .whl/titan/)
# Everything it keeps goes under $OUT. Packages the GPU machine lacks (nvmath-python, torchao) travel
# as wheels in .whl/ (scripts/README.md says how to fetch them), installed first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:src bash scripts/one_gpu.sh PART
# The prose sweep's corpus: python scripts/make_corpus.py /tmp/dx_corpus_prose --kind prose --roots
# CORPORA/prose --max-bytes 18e6 --min-bytes 0 (CORPORA/prose from scripts/debian_corpus.sh), packed as
# .corpora/dxprose/dx_corpus_prose.tar.xz (4 MB).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/one_gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:?usage: one_gpu.sh tests|attn-speed|fp8-rows|llama-1b|prose-sweep|attn-quality|torchtitan3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuSPARSELt", torch.backends.cusparselt.version())'

peer() {  # name rows: peer.py at 4 blocks, its table and JSON under $OUT
  timeout "${PEER_S:-280}" python3 benchmarks/fp8/peer.py --layers 4 --rows "$2" --json "$OUT/$1.json" \
    > "$OUT/$1.txt" 2>&1; echo "peer.py rc $?"; tail -40 "$OUT/$1.txt"
}

case $part in
  tests)
    for f in $(grep -l 'mark.gpu' tests/test_*.py); do
      name=$(basename "$f" .py)
      timeout "${TEST_S:-270}" python3 -m pytest -q -p no:cacheprovider "$f" -m gpu > "$OUT/$name.log" 2>&1 &
    done
    wait
    for f in "$OUT"/test_*.log; do echo "== $(basename "$f")"; tail -3 "$f"; done ;;
  attn-speed) peer attn-4blocks dense,s-ste+dx=pruned-t,s-ste+dx=pruned-t+attn ;;
  fp8-rows) peer fp8-4blocks ao-float8,dense,s-ste-fp8,s-ste-fp8+dx=pruned-t,t-sr-ste-fp8 ;;
  llama-1b)
    common="--model llama-1b --batch-size 8 --seq-len 1024 --compile --steps 40 --eval-interval 40 --eval-iters 2"
    for i in 1 2 3; do
      for r in dense sparse; do
        # the first sparse run compiles and autotunes (over 140 s); later ones find the caches warm
        [ "$SECONDS" -gt "${LAST_START_S:-360}" ] && { echo "stopped at ${SECONDS} s: no time for $r $i"; break 2; }
        if [ $r = dense ]; then opts=(--recipe dense); else opts=(--recipe s-ste --opt dx=pruned-t); fi
        timeout 200 python3 -m twofour train $common --ckpt-interval 0 "${opts[@]}" --out "/tmp/l1-$r-$i" \
          > "$OUT/l1-$r-$i.log" 2>&1; echo "$r $i rc $?"
        cp "/tmp/l1-$r-$i/summary.json" "$OUT/llama-1b-$r-$i-summary.json" 2>/dev/null
        python3 -c "import json; d = json.load(open('/tmp/l1-$r-$i/summary.json')); \
print('$r', $i, round(d['tokens_per_s']), d['final_val_loss'], d['gemm_choices'])" 2>/dev/null \
          || tail -3 "$OUT/l1-$r-$i.log"
      done
    done ;;
  prose-sweep)
    tar -xJf .corpora/dxprose/dx_corpus_prose.tar.xz -C /tmp || exit 1
    reuse=(); [ -d docs/results/dx-prose ] && reuse=(--reuse docs/results/dx-prose)
    # no run starts after 300 s, so that the last ones (about 190 s with 12 sharing) end in the call
    timeout 575 python3 scripts/dx_sweep.py /tmp/dxruns --kind prose --corpus /tmp/dx_corpus_prose \
      --seeds 1,2,3 --lrs 0.5x,1x,1.5x,2x --workers 12 --deadline 300 "${reuse[@]}" 2>&1 | tail -60 ;;
  attn-quality)
    timeout 560 python3 scripts/dx_sweep.py /tmp/attnruns --kind code --sparse-attention \
      --best-from docs/results/dx-code --variants ste,s-ste,s-ste+dx=pruned-t --seeds 1,2,3 --workers 9 \
      --deadline 200 2>&1 | tail -40 ;;
  torchtitan3) OUT=$OUT bash benchmarks/step/torchtitan3_run.sh ;;
  *) echo "one_gpu.sh: unknown part $part" >&2; exit 2 ;;
esac
