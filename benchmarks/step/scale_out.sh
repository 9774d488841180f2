#!/usr/bin/env bash
# The scale-out measurements on NPROC GPUs of one host (2). PARTS chooses (default: all but big, more
# than the 10 minutes one device call allows; each part has its own time limit):
#   dcp    the sharded FSDP2 checkpoint's GPU test (save on 2 GPUs, a kill mid-save, resume bit-exact)
#   host   where an FSDP2 step's time goes against DDP's, gpt2-124m 16 x 1024 (fsdp_host.py)
#   loop   the real loop (dist_loop.py): DDP against FSDP2 at gpt2-124m 16 x 1024 and gpt2-774m 8 x 1024
#   llama  llama-1b and the Llama-3-8B shape (8 blocks) under FSDP2, eager and compiled
#   titan  torchtitan's Llama 3 1B, dense and with twofour's converter, eager and compiled
#   big    llama-1b (vocabulary 32000) and the whole Llama-3-8B shape (32 blocks, vocabulary 128256,
#          activation checkpointing) under FSDP2, eager and compiled: for 4 GPUs (NPROC=4); BIG
#          chooses among its cases (1b 1b-compiled 8b 8b-compiled), BIG_S its time limit (560;
#          runs stop starting 150 s before it, and the table holds the runs that finished)
# TITAN_S: the titan part's time limit (330); RUNS, STEPS, BUDGET pass on to torchtitan_run.sh
# Results go to $OUT (default /tmp/scale_out): pytest.txt, host.md, loop.md, llama.md, big.md,
# torchtitan.md, torchtitan_steps.txt and log.txt (everything else each part printed); a
# device call brings back 8 files, so one call runs a few parts.
#   PARTS="dcp host loop" bash benchmarks/step/scale_out.sh     (needs nvmath-python; torchtitan's wheels for titan)
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TMPDIR=/dev/shm PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/scale_out}; mkdir -p "$OUT"
PARTS=${PARTS:-dcp host loop llama titan}
NPROC=${NPROC:-2}
LLAMA_S=${LLAMA_S:-280}; BIG_S=${BIG_S:-560}  # the llama and big parts' time limits (s)
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC"
LOOP="$TORCHRUN benchmarks/step/dist_loop.py"
LOG=$OUT/log.txt
has() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi topo -m >> "$LOG" 2>&1

if has dcp; then
  echo "== dcp: sharded checkpoint on 2 GPUs"
  timeout 200 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_sharded_checkpoint.py > "$OUT/pytest.txt" 2>&1
  tail -3 "$OUT/pytest.txt"
fi

if has host; then
  echo "== host: FSDP2's step against DDP's, gpt2-124m"
  timeout 200 $TORCHRUN benchmarks/step/fsdp_host.py --model gpt2-124m --batch 16 \
    --variants "${HOST_VARIANTS:-ddp,fsdp:bf16,fsdp:bf16-flat,fsdp:bf16+compile,ddp+compile}" \
    --out "$OUT/host.md" >> "$LOG" 2>&1
  cat "$OUT/host.md" 2>/dev/null
fi

if has loop; then
  echo "== loop: DDP against FSDP2, gpt2-124m and gpt2-774m"
  M=model=gpt2-124m; L=model=gpt2-774m
  timeout 190 $LOOP --case "ddp16 $M batch_size=16" --case "fsdp16 $M batch_size=16 fsdp=${FSDP:-bf16}" \
    --case "ddp8-774m $L batch_size=8" --case "fsdp8-774m $L batch_size=8 fsdp=${FSDP:-bf16}" \
    --steps 20 --deadline 140 --out "$OUT/loop.md" >> "$LOG" 2>&1
  cat "$OUT/loop.md" 2>/dev/null
fi

if has llama; then
  echo "== llama: llama-1b and the 8B shape under FSDP2"
  timeout $LLAMA_S $LOOP --case "llama-1b model=llama-1b batch_size=8 fsdp=bf16" \
    --case "llama-1b-compiled model=llama-1b batch_size=8 fsdp=bf16 compile=true" \
    --case "llama-8b-8blocks model=llama-8b n_layer=8 batch_size=4 fsdp=bf16" \
    --case "llama-8b-8blocks-compiled model=llama-8b n_layer=8 batch_size=4 fsdp=bf16 compile=true" \
    --steps 20 --deadline $(($LLAMA_S - 60)) --out "$OUT/llama.md" >> "$LOG" 2>&1
  cat "$OUT/llama.md" 2>/dev/null
fi

if has big; then
  echo "== big: llama-1b and the Llama-3-8B shape (32 blocks) under FSDP2 on $NPROC GPUs"
  declare -A CASE=(
    [1b]="llama-1b model=llama-1b batch_size=8 fsdp=bf16 vocab=32000"
    [1b-compiled]="llama-1b-compiled model=llama-1b batch_size=8 fsdp=bf16 vocab=32000 compile=true"
    [8b]="llama-8b model=llama-8b batch_size=4 fsdp=bf16 vocab=128256 activation_checkpointing=true"
    [8b-compiled]="llama-8b-compiled model=llama-8b batch_size=4 fsdp=bf16 vocab=128256 activation_checkpointing=true compile=true"
  )
  args=(); for c in ${BIG:-1b 1b-compiled 8b 8b-compiled}; do
    [[ -v CASE[$c] ]] || { echo "unknown BIG case: $c (one of ${!CASE[*]})"; continue; }
    args+=(--case "${CASE[$c]}")
  done
  timeout $BIG_S $LOOP "${args[@]}" --steps 20 --deadline $(($BIG_S > 150 ? $BIG_S - 150 : 0)) \
    --out "$OUT/big.md" >> "$LOG" 2>&1
  cat "$OUT/big.md" 2>/dev/null
fi

if has titan; then
  echo "== titan: torchtitan Llama 3 1B"
  TT=/tmp/scale_out_titan; rm -rf "$TT"
  OUT=$TT RESUME=0 RUNS=${RUNS:-1B:eager 1B:compiled} STEPS=${STEPS:-30} BUDGET=${BUDGET:-240} \
    NPROC=$NPROC timeout ${TITAN_S:-330} bash benchmarks/step/torchtitan_run.sh >> "$LOG" 2>&1
  cp "$TT/torchtitan_run.md" "$OUT/torchtitan.md" 2>/dev/null && cat "$OUT/torchtitan.md"
  for f in "$TT"/*.log; do  # each run's logged steps, colours removed
    echo "## $(basename "$f" .log)"; sed 's/\x1b\[[0-9;]*m//g' "$f" | grep -E "step: |Error|error" | cut -c1-220
  done > "$OUT/torchtitan_steps.txt" 2>&1
fi
