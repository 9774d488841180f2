#!/usr/bin/env bash
# The scale-out measurements on 2 GPUs of one host, in one command (about 9 minutes on 2 H100s):
#   1. the sharded FSDP2 checkpoint's GPU test (save on 2 GPUs, resume bit-exact);
#   2. FSDP2 policies against DDP at gpt2-124m, 16 x 1024 per GPU, dense and s-ste;
#   3. llama-1b and the Llama-3-8B shape (8 blocks) under FSDP2, dense and s-ste;
#   4. torchtitan's Llama 3 1B, dense and with twofour's converter, and its save + resume.
# Each part has its own time limit; results go to $OUT (default /tmp/scale_out).
#   bash benchmarks/step/scale_out.sh          (needs nvmath-python; torchtitan's wheels for part 4)
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TMPDIR=/dev/shm PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/scale_out}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step/dist_loop.py"

echo "== 1. sharded checkpoint on 2 GPUs"
timeout 110 python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_sharded_checkpoint.py > "$OUT/pytest.txt" 2>&1
tail -3 "$OUT/pytest.txt"

echo "== 2. FSDP2 policies against DDP, gpt2-124m"
M=model=gpt2-124m
timeout 150 $RUN --case "ddp16 $M batch_size=16" --case "fsdp16-bf16 $M batch_size=16 fsdp=bf16" \
  --case "fsdp16-flat $M batch_size=16 fsdp=bf16-flat" --deadline 105 --out "$OUT/fsdp.md" > "$OUT/fsdp.log" 2>&1
grep -E "^rep|failed" "$OUT/fsdp.log" | tail -4; cat "$OUT/fsdp.md" 2>/dev/null

echo "== 3. llama-1b and the 8B shape under FSDP2"
timeout 160 $RUN --case "llama-1b model=llama-1b batch_size=8 fsdp=bf16" \
  --case "llama-8b-8blocks model=llama-8b n_layer=8 batch_size=4 fsdp=bf16" --steps 20 --deadline 100 \
  --out "$OUT/big.md" > "$OUT/big.log" 2>&1
grep -E "^rep|failed|Error" "$OUT/big.log" | tail -4; cat "$OUT/big.md" 2>/dev/null

echo "== 4. torchtitan"
RUNS=${RUNS:-1B:eager} STEPS=${STEPS:-20} BUDGET=${BUDGET:-70} timeout 170 bash benchmarks/step/torchtitan_run.sh \
  > "$OUT/torchtitan.txt" 2>&1
tail -25 "$OUT/torchtitan.txt"
