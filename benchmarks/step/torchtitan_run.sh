#!/usr/bin/env bash
# torchtitan 0.2.2 Llama 3 on 2 GPUs (FSDP2): dense against twofour s-ste on the FFN linears, eager and
# compiled, at the 1B shape and the 8B shape with 4 layers; one save + resume of the s-ste run. Prints
# tokens/s (torchtitan's tps, median of the steps after the first 5) and the last loss side by side,
# and writes $OUT/torchtitan_run.md (+ the logs). About 6-8 minutes on 2 H100s.
#   needs torchtitan's wheels (torchtitan-0.2.2 and the packages the image lacks) in .whl/: see
#   docs/torchtitan.md "On a machine without network".
#   bash benchmarks/step/torchtitan_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/torchtitan_run}; mkdir -p "$OUT"
SITE=/tmp/titan-site
if ! python3 -c "import torchtitan" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
fi
export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, torchtitan, datasets; print('torch', torch.__version__, '| datasets', datasets.__version__, '| gpus', torch.cuda.device_count())"
DATA=/tmp/titan-data; [ -f $DATA/data.json ] || python3 examples/torchtitan/make_data.py $DATA --records 4000
NPROC=${NPROC:-2}; STEPS=${STEPS:-30}
SPARSE=examples/torchtitan/llama3_1b.toml
DENSE=/tmp/titan-dense.toml  # the same job, torchtitan's plain model: no converter
sed 's/^converters = .*$/converters = []/' $SPARSE > $DENSE
run() {  # name flavor recipe(none: dense torchtitan) compile [extra args...]
  local name=$1 flavor=$2 recipe=$3 comp=$4; shift 4
  local cfg=$SPARSE; [ "$recipe" = none ] && cfg=$DENSE
  timeout 300 torchrun --nproc-per-node "$NPROC" --rdzv-endpoint=localhost:29511 -m torchtitan.train \
    --job.config_file $cfg --job.dump_folder "/tmp/tt-$name" --model.flavor "$flavor" \
    --twofour.recipe "${recipe/none/s-ste}" --compile.enable="$comp" \
    --training.dataset_path $DATA --training.steps "$STEPS" --training.local_batch_size 2 --training.seq_len 2048 \
    --lr_scheduler.warmup_steps 5 --checkpoint.enable=false --metrics.log_freq 1 "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "FAILED: $name (tail of $OUT/$name.log)"; tail -25 "$OUT/$name.log"; return 0; }
  echo "done: $name"
}
for flavor in 1B 8B_4layers; do
  for comp in false true; do
    run "dense-$flavor-c$comp" "$flavor" none "$comp"
    run "sste-$flavor-c$comp" "$flavor" s-ste "$comp"
  done
done
# save + resume: a 20-step s-ste run saving at steps 10 and 20; its step-20 checkpoint removed, the
# same job again resumes from step 10 (weights, masks, scales, step counters, optimizer, data) to 20.
# The two step-20 losses should agree to a few 1e-3 (GPU kernels are not bitwise).
rm -rf /tmp/tt-resume
CK="--job.dump_folder /tmp/tt-resume --training.steps 20 --checkpoint.enable=true --checkpoint.interval 10"
run "resume-1-straight" 1B s-ste false $CK
rm -rf /tmp/tt-resume/checkpoint/step-20
run "resume-2-from-step10" 1B s-ste false $CK
grep -h "Loading the checkpoint\|Finished loading" "$OUT/resume-2-from-step10.log" | head -2 || true
python3 - "$OUT" <<'PY'
import re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1]); rows = []
pat = re.compile(r"step:\s*(\d+).*?loss:\s*([\d.]+).*?tps:\s*([\d,]+)")
for log in sorted(out.glob("*.log")):
    steps = [(int(s), float(l), int(t.replace(",", ""))) for s, l, t in pat.findall(re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()))]
    if not steps:
        rows.append((log.stem, "-", "-", "no steps logged")); continue
    tps = statistics.median(t for s, _, t in steps if s > 5) if len(steps) > 6 else steps[-1][2]
    rows.append((log.stem, f"{tps:,.0f}", f"{steps[-1][1]:.4f}", f"steps {steps[0][0]}-{steps[-1][0]}"))
dense = {r[0].replace("dense-", ""): r[1] for r in rows if r[0].startswith("dense-")}
lines = ["| run | tokens/s per GPU (median) | s-ste / dense | last loss | steps |", "|---|---|---|---|---|"]
for name, tps, loss, steps in rows:
    d = dense.get(name.replace("sste-", "")) if name.startswith("sste-") else None
    ratio = f"{float(tps.replace(',', '')) / float(d.replace(',', '')):.2f}x" if d and "-" not in (tps, d) else ""
    lines.append(f"| {name} | {tps} | {ratio} | {loss} | {steps} |")
text = "\n".join(lines); print(text); (out / "torchtitan_run.md").write_text(text + "\n")
PY
