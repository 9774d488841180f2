#!/usr/bin/env bash
# torchtitan 0.2.2 Llama 3 on NPROC GPUs (2; FSDP2): dense against twofour s-ste on the FFN linears,
# eager and compiled, at the 1B shape and the 8B shape with 4 layers (30 steps each), then a save +
# resume of an s-ste run. Prints tokens/s per GPU (torchtitan's tps, median of the steps after the
# 5th), its ratio to dense, memory and the last loss side by side (scripts/torchtitan_curves.py),
# and writes $OUT/torchtitan_run.md and each run's log. Runs
# past BUDGET seconds (420) are skipped, each stops after RUN_S (200), so it ends within about 8
# minutes; set RUNS to choose (see below), e.g. on 4 GPUs:
#   NPROC=4 RUNS="1B:compiled:300 8B:eager:40" RESUME=0 bash benchmarks/step/torchtitan_run.sh
#   needs torchtitan's wheels (torchtitan-0.2.2 and the packages the image lacks) in .whl/: see
#   docs/torchtitan.md "On a machine without network".
#   bash benchmarks/step/torchtitan_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/torchtitan_run}; mkdir -p "$OUT"
SITE=/tmp/titan-site
if ! python3 -c "import torchtitan" 2>/dev/null; then
  ls .whl/torchtitan-0.2.2-*.whl >/dev/null 2>&1 || { echo "no torchtitan: carry its wheels in .whl/ (docs/torchtitan.md)"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
fi
export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, torchtitan, datasets; print('torch', torch.__version__, '| datasets', datasets.__version__, '| gpus', torch.cuda.device_count())"
DATA=/tmp/titan-data; [ -f $DATA/data.json ] || python3 examples/torchtitan/make_data.py $DATA --records 4000
NPROC=${NPROC:-2}; STEPS=${STEPS:-30}; SEQ=${SEQ:-2048}; LBS=${LBS:-4}; BUDGET=${BUDGET:-420}  # seconds; later runs are skipped
# RUNS: flavor:mode[:steps] entries, each trained dense (torchtitan's own model) and with twofour
# s-ste FFNs (steps: STEPS unless given); flavors named in FULL_AC run with full activation
# checkpointing (the example's selective one keeps too much of the 8B's 32 layers on 4 GPUs)
RUNS=${RUNS:-1B:eager 1B:compiled 8B_4layers:eager 8B_4layers:compiled}; RESUME_FLAVOR=${RESUME_FLAVOR:-debugmodel}
FULL_AC=${FULL_AC:-8B}
ENTRY=${ENTRY:--m torchtitan.train}   # what torchrun starts: torchtitan's launcher
SPARSE=examples/torchtitan/llama3_1b.toml
DENSE=/tmp/titan-dense.toml  # the same job, torchtitan's plain model: no converter
sed 's/^converters = .*$/converters = []/' $SPARSE > $DENSE
run() {  # name flavor recipe(none: torchtitan's dense model) eager|compiled [extra args, --training.steps among them]
  local name=$1 flavor=$2 recipe=$3 tag=$4; shift 4
  if [ "$SECONDS" -gt "$BUDGET" ]; then echo "skipped: $name (past the ${BUDGET}s budget)"; return 0; fi
  local cfg=$SPARSE; [ "$recipe" = none ] && cfg=$DENSE
  local compile=--compile.no-enable; [ "$tag" = compiled ] && compile=--compile.enable
  # shellcheck disable=SC2086
  timeout "${RUN_S:-200}" python3 -m torch.distributed.run --nproc-per-node "$NPROC" --rdzv-endpoint=localhost:29511 $ENTRY \
    --job.config_file $cfg --job.dump_folder "/tmp/tt-$name" --model.flavor "$flavor" \
    --twofour.recipe "${recipe/none/s-ste}" $compile --checkpoint.no-enable \
    --training.dataset_path $DATA --training.local_batch_size "$LBS" --training.seq_len "$SEQ" \
    --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "FAILED: $name (tail of $OUT/$name.log)"; tail -25 "$OUT/$name.log"; return 0; }
  echo "done: $name"
}
for entry in $RUNS; do
  IFS=: read -r flavor tag steps rest <<< "$entry"
  if [[ -n "$rest" || ! "$tag" =~ ^(eager|compiled)$ || ! "${steps:-1}" =~ ^[0-9]+$ ]]; then
    echo "bad RUNS entry '$entry': flavor:eager|compiled[:steps]"; continue
  fi
  extra=(--training.steps "${steps:-$STEPS}")
  [[ " $FULL_AC " == *" $flavor "* ]] && extra+=(--activation_checkpoint.mode full)
  run "dense-$flavor-$tag" "$flavor" none "$tag" "${extra[@]}"
  run "sste-$flavor-$tag" "$flavor" s-ste "$tag" "${extra[@]}"
done
# save + resume (the debug model: its checkpoints are small): a 20-step s-ste run saving at steps 10
# and 20; its step-20 checkpoint removed, the same job again resumes from step 10 (weights, masks,
# scales, step counters, optimizer, data) to 20 (RESUME=0 skips it). MVUE off: its random draws come from torch's RNG,
# which torchtitan does not save. The two step-20 losses should agree (bit for bit on the CPU).
if [ "${RESUME:-1}" = 1 ]; then
rm -rf /tmp/tt-resume
CK="--job.dump_folder /tmp/tt-resume --training.steps 20 --checkpoint.enable --checkpoint.interval 10 --twofour.mvue False"
BUDGET=$((BUDGET + 90))  # the resume check runs even when the timing runs used the budget
run "resume-1-straight" "$RESUME_FLAVOR" s-ste eager $CK
rm -rf /tmp/tt-resume/checkpoint/step-20
run "resume-2-from-step10" "$RESUME_FLAVOR" s-ste eager $CK
grep -h "Loading the checkpoint" "$OUT/resume-2-from-step10.log" | head -1 || echo "resume-2 loaded no checkpoint"
fi
python3 scripts/torchtitan_curves.py "$OUT" | tee "$OUT/torchtitan_run.md"
