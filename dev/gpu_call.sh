# One lent-GPU call of a developer's session (dev/gpu_session.md): $PLAN, a shell line of
# `job STAGE...` (scripts/gpu_mainjob.sh), `stages NAME...` (benchmarks/gpu.sh) and
# `gpu_tests [PATH...]` (`-m gpu`, all or those named, in the seconds left of BUDGET). Logs go to
# /tmp/logs/$CALL; the calling command packs them into $OUT. Reads .gpu/ (data, tokenizer) and .whl/.
#
#     CALL=c1 BUDGET=560 PLAN='gpu_tests tests/test_fast_engine.py; STEPS=1 job models fit' \
#         timeout -s KILL 575 bash dev/gpu_call.sh; tar czf $OUT/logs_c1.tgz -C /tmp/logs c1
set -o pipefail
cd "$(dirname "$0")/.."
L=/tmp/logs/$CALL; mkdir -p $L
xz -dkf .gpu/qwen3-tokenizer/tokenizer.json.xz
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > $L/nvidia-smi.txt 2>&1
if [ -z "$CARD" ]; then CARD=h100; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 100000 ] && CARD=h200; fi
export CARD; echo CARD=$CARD
# the 4B run's last.ckpt is 48 GB with full weights: where the checkout's disk lacks room, the run goes to /dev/shm
avail_gb() { df --output=avail -BG "$1" 2>/dev/null | tail -1 | tr -dc 0-9; }
df -h . /tmp /dev/shm >> $L/nvidia-smi.txt 2>&1; free -g >> $L/nvidia-smi.txt
WORK=runs/mainjob; [ "$(avail_gb .)" -lt 75 ] && [ "$(avail_gb /dev/shm)" -gt 75 ] && WORK=/dev/shm/mainjob
export WORK; echo WORK=$WORK | tee -a $L/stages.txt
job() { OUT=$L DATA=.gpu/data TOKENIZER=.gpu/qwen3-tokenizer bash scripts/gpu_mainjob.sh "$@" >> $L/driver.txt 2>&1; }
stages() { OUT=$L TOKENIZER=.gpu/qwen3-tokenizer PROBLEMS=.gpu/data/deepscaler/train/deepscaler_subset_803.json \
  bash benchmarks/gpu.sh "$@" 2>&1 | tee -a $L/stages.txt; }  # benchmarks/gpu.sh's stages by name
END=$((SECONDS + ${BUDGET:-560}))
left() { echo $((END - SECONDS)); }
gpu_tests() {  # [PATH...]: the GPU tests, all or those named, in the seconds left (less a margin for packing the logs)
  local limit=$(( $(left) - 10 ))
  [ $limit -lt 20 ] && { echo "=== gpu-tests skipped: ${limit}s left" | tee -a $L/stages.txt; return; }
  echo "=== gpu-tests $(date +%T) limit ${limit}s $*" | tee -a $L/stages.txt
  timeout -s KILL $limit python3 -m pytest -q -p no:cacheprovider -m gpu -v --durations=20 "$@" >> $L/gpu_tests.txt 2>&1
  echo "=== gpu-tests rc=$? $(date +%T)" | tee -a $L/stages.txt; tail -30 $L/gpu_tests.txt
}
eval "$PLAN"
cat $L/stages.txt
