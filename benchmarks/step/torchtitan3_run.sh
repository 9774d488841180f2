#!/usr/bin/env bash
# torchtitan 0.3 on one GPU, compiled: the Llama 3 8B cut to 4 blocks (twofour.integrations.titan3's
# llama3_8b_4layers), dense bf16, twofour's fastest bf16 recipe on the FFN (s-ste dx=pruned-t),
# torchtitan's float8 (rowwise) on every linear, then the FFN 2:4 with float8 on the rest, and FP8 2:4
# on the FFN with float8 on the rest; STEPS steps of LBS x SEQ tokens each. Prints tokens/s (torchtitan's
# tps, median after the 5th step), its ratio to dense and the last loss (scripts/torchtitan_curves.py).
#   needs torchtitan 0.3's wheels in .whl/titan/ where it is not installed (docs/torchtitan.md)
#   bash benchmarks/step/torchtitan3_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/torchtitan3_run}; mkdir -p "$OUT"
SITE=/tmp/titan3-site
if ! python3 -c "import torchtitan.models.common" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/titan/*.whl
fi
export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, torchtitan; print('torch', torch.__version__, '| torchtitan', torchtitan.__version__)"
DATA=/tmp/titan-data; [ -f $DATA/data.json ] || python3 examples/torchtitan/make_data.py $DATA --records 4000
STEPS=${STEPS:-30}; SEQ=${SEQ:-1024}; LBS=${LBS:-8}
FAST='twofour.integrations.titan3.sparse_ffn={"recipe": "s-ste", "dx": "pruned-t", "total_steps": '$STEPS'}'
FP8='twofour.integrations.titan3.sparse_ffn={"recipe": "s-ste", "precision": "fp8", "total_steps": '$STEPS'}'
run() {  # name config [extra args]
  local name=$1 config=$2; shift 2
  timeout "${RUN_S:-150}" python3 -m torch.distributed.run --nproc-per-node 1 --rdzv-endpoint=localhost:29511 \
    -m torchtitan.train --module twofour.integrations.torchtitan --config "$config" --compile.enable \
    --hf_assets_path examples/torchtitan/assets/tokenizer --dataloader.dataset c4_test --dataloader.dataset_path $DATA \
    --dump_folder "/tmp/tt3-$name" --training.steps "$STEPS" --training.local_batch_size "$LBS" \
    --training.seq_len "$SEQ" --checkpoint.no-enable --metrics.log_freq 1 "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "FAILED: $name (tail of $OUT/$name.log)"; tail -25 "$OUT/$name.log"; return 0; }
  echo "done: $name"
}
run dense llama3_8b_4layers
run s-ste-pt llama3_8b_4layers --override.imports "$FAST"
run float8 llama3_8b_4layers_float8
run s-ste-pt+float8 llama3_8b_4layers_float8 --override.imports "$FAST"
run fp8-s-ste+float8 llama3_8b_4layers_float8 --override.imports "$FP8"
python3 scripts/torchtitan_curves.py "$OUT" | tee "$OUT/torchtitan3_run.md"
