#!/usr/bin/env bash
# The quality runs of docs/RESULTS.md: about 200M tokens per run on a deduplicated corpus of the
# machine's Python sources, through `twofour compare` (finished runs in the folder are reused, an
# interrupted one resumes: from the step it stopped at after Ctrl-C or SIGTERM, from its last
# evaluation's checkpoint if it was killed).
#
#   bash scripts/quality.sh MODEL REGIME RECIPES SEEDS [more twofour compare options]
#   bash scripts/quality.sh gpt-10m ours dense,ste,sr-ste,s-ste 1,2,3
#   bash scripts/quality.sh gpt-10m ours s-ste 1,2,3 --opt mvue=false
#   bash scripts/quality.sh gpt-10m authors dense,ste,s-ste 1,2,3
#   bash scripts/quality.sh gpt2-124m ours dense,ste,s-ste 1
#
# Runs go to runs/q10m-REGIME/ or runs/q124m-REGIME/ (CORPUS, default /tmp/corpus, is built first
# if missing). gpt-10m: 196.6M tokens, `ours` 3000 steps of 64 x 1024, `authors` 375 steps of 8
# accumulated micro-batches of 64 x 1024 (~0.5M tokens per step). gpt2-124m: 200.0M tokens,
# `ours` 6104 steps of 32 x 1024, `authors` 381 steps of 16 accumulated micro-batches of 32 x 1024.
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,10p "$0"; exit 2; }
model=$1 regime=$2 recipes=$3 seeds=$4
shift 4
corpus=${CORPUS:-/tmp/corpus}
case $model/$regime in
  gpt-10m/ours) name=q10m steps=3000 every=500 batch=64 ;;
  gpt-10m/authors) name=q10m steps=375 every=75 batch=64 ;;
  gpt2-124m/ours) name=q124m steps=6104 every=1000 batch=32 ;;
  gpt2-124m/authors) name=q124m steps=381 every=75 batch=32 ;;
  *) echo "quality.sh: MODEL is gpt-10m or gpt2-124m and REGIME ours or authors, got '$model $regime'" >&2; exit 2 ;;
esac
[ -d "$corpus" ] || python3 "$(dirname "$0")/make_corpus.py" "$corpus" --min-bytes 2e8
exec "${PYTHON:-python3}" -m twofour compare --recipes "$recipes" --seeds "$seeds" --regime "$regime" --model "$model" \
  --steps $steps --batch-size $batch --seq-len 1024 --data "$corpus" --eval-interval $every --eval-iters 20 \
  --ckpt-interval $every --no-progress --out "runs/$name-$regime" "$@"
