#!/usr/bin/env bash
# The gpt-10m quality runs of docs/RESULTS.md: ~196.6M tokens per run (about 20 tokens per weight)
# on a deduplicated corpus of the machine's Python sources, in either regime, through `twofour
# compare` (finished runs in the folder are reused, an interrupted one resumes).
#
#   bash benchmarks/quality_gpt10m.sh REGIME RECIPES SEEDS [more twofour compare options]
#   bash benchmarks/quality_gpt10m.sh ours dense,ste,sr-ste,s-ste 1,2,3
#   bash benchmarks/quality_gpt10m.sh ours s-ste 1,2,3 --opt mvue=false
#   bash benchmarks/quality_gpt10m.sh authors dense,ste,s-ste 1,2,3
#
# Runs go to runs/q10m-REGIME/ (CORPUS, default /tmp/corpus, is built first if missing). Both
# regimes see the same tokens: `ours` 3000 steps of 64 x 1024; `authors` 375 steps of 8
# accumulated micro-batches of 64 x 1024 (~0.5M tokens per step).
set -euo pipefail
[ $# -ge 3 ] || { sed -n 2,9p "$0"; exit 2; }
regime=$1 recipes=$2 seeds=$3
shift 3
corpus=${CORPUS:-/tmp/corpus}
case $regime in
  ours) steps=3000 every=500 ;;
  authors) steps=375 every=75 ;;
  *) echo "quality_gpt10m.sh: REGIME is ours or authors, got '$regime'" >&2; exit 2 ;;
esac
[ -d "$corpus" ] || python "$(dirname "$0")/make_corpus.py" "$corpus" --min-bytes 2e8
exec "${PYTHON:-python3}" -m twofour compare --recipes "$recipes" --seeds "$seeds" --regime "$regime" --model gpt-10m --steps $steps \
  --batch-size 64 --seq-len 1024 --data "$corpus" --eval-interval $every --eval-iters 20 --ckpt-interval $steps \
  --no-progress --out "runs/q10m-$regime" "$@"
