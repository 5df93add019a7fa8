#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md's open numbers, by name, so that a lent machine's minutes
# go to measuring. Each stage writes its log (and JSON where the script has one) under $OUT.
#
#     OUT=/tmp/out TOKENIZER=<qwen3 tokenizer> PROBLEMS=<deepscaler_subset_803.json> bash benchmarks/h200.sh STAGE...
#
# TOKENIZER and PROBLEMS default to ../shared (the developers' checkout), WHEELS to .whl: wheels
# installed first into /tmp/site where the machine lacks them (jsonargparse, liger-kernel, ...).
# Minutes are wall time on one H200 at 2026-12-03, model builds and warm-up steps included. The
# full-weight 4B stages run two warm-up steps: the first offload of the optimizer state pins ~30 GB
# of host buffers (~25 s) and belongs to no steady-state step.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the logs}
TOKENIZER=${TOKENIZER:-../shared/models/qwen3-tokenizer}
PROBLEMS=${PROBLEMS:-../shared/data/deepscaler/train/deepscaler_subset_803.json}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "installing $WHEELS failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD  # the scripts import tandem_lit from this checkout, installed or not
fi
LOGNORMAL="lognormal:median=1000,sigma=0.8,cap=3000"
DATA=(--tokenizer "$TOKENIZER" --problems "$PROBLEMS")

stage() {  # name, seconds allowed, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name $(date +%T): $*"
  timeout -s KILL "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "=== $name rc=$? $(date +%T)"
}

for name in "$@"; do
  case $name in
    # issue 26: where a 9B linear-attention layer's rule spends its time, each solve (~1 min)
    delta-cost) stage "$name" 120 python3 benchmarks/delta_rule_cost.py --device cuda --tokens 4096 --rows 2;;
    # issue 26: the scan kernel over its dot precision, value block and warps (~2 min)
    scan-tune) stage "$name" 240 python3 benchmarks/delta_scan_tune.py --tokens 4096 --rows 2;;
    # issue 26: the issue's own 9B LoRA step, with its update profiled in one more step (~10 min)
    lora9) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen35_9b_2b_tandem.yaml "${DATA[@]}" \
      --arms tandem --lora 16 --gradient-checkpointing --warmup-steps 1 --json "$OUT/$name.json";;
    lora9-profile) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen35_9b_2b_tandem.yaml "${DATA[@]}" \
      --arms tandem --lora 16 --gradient-checkpointing --warmup-steps 1 --max-new-tokens 1000 \
      --profile-update "$OUT/update_profile_lora9" --json "$OUT/$name.json";;
    # issue 24: the Qwen3.5 pair with both refill rules, one policy a call (~6 min each)
    q35-solo|q35-tandem) stage "$name" 590 python3 benchmarks/rollout.py --device cuda --models qwen35-9b-2b --batches 64 \
      --queue 2 --lengths "$LOGNORMAL" --refill amortized eager --policies "${name#q35-}" --json "$OUT/$name.json";;
    # issue 24: the paper config as written, both arms at lognormal lengths (~9.5 min), the tandem arm at fixed lengths (~6 min)
    both-lognormal) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms tandem grpo --lengths "$LOGNORMAL" --warmup-steps 2 --json "$OUT/$name.json";;
    tandem-fixed) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms tandem --warmup-steps 2 --json "$OUT/$name.json";;
    # issue 27: the GRPO arm at lognormal lengths, its update profiled in one more step (~5 min)
    grpo-profile) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms grpo --lengths "$LOGNORMAL" --warmup-steps 2 --profile-update "$OUT/update_profile_grpo" --json "$OUT/$name.json";;
    # issue 27: the GRPO arm at lognormal lengths, unprofiled (~3.5 min): the update against tokens trained on
    grpo-lognormal) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms grpo --lengths "$LOGNORMAL" --warmup-steps 2 --json "$OUT/$name.json";;
    # issue 27: the same with packed passes through PyTorch's variable-length flash kernel (~3.5 min)
    grpo-lognormal-packed) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms grpo --lengths "$LOGNORMAL" --warmup-steps 2 --pack-sequences --json "$OUT/$name.json";;
    # issue 27: LoRA (rank 16) and QLoRA (4-bit base: carry the bitsandbytes wheel in $WHEELS) at fixed lengths (~6 and ~9 min)
    lora-fixed) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms tandem --lora 16 --warmup-steps 2 --json "$OUT/$name.json";;
    qlora-fixed) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms tandem --lora 16 --qlora --warmup-steps 1 --json "$OUT/$name.json";;
    # issue 27: the GRPO arm at fixed lengths (the update's target), its update profiled in one more step (~5 min)
    grpo-fixed-profile) stage "$name" 590 python3 benchmarks/train_step.py --config configs/rlvr/qwen3_4b_tandem.yaml "${DATA[@]}" \
      --arms grpo --warmup-steps 1 --profile-update "$OUT/update_profile_grpo_fixed" --json "$OUT/$name.json";;
    # issue 27: one update pass with the linear weights cast once per update against autocast's cast per forward (~2 min)
    cast-once) stage "$name" 300 python3 benchmarks/update_kernels.py --variants off off+once liger liger+once \
      --profile-rows 14 --json "$OUT/$name.json";;
    # issue 27: one RMSNorm's forward + backward per call, Liger against torch's fused op (~20 s)
    rms-norm) stage "$name" 120 python3 benchmarks/rms_norm_call.py --dtype float32;;
    # issue 27: the update's GPU tests: cast once, no per-pass syncs, Liger against PyTorch, varlen packing, the tiny GPU steps (~3 min)
    update-tests) stage "$name" 400 python3 -m pytest -q -p no:cacheprovider tests/test_compute_weights.py \
      tests/test_gpu_training.py tests/test_liger_gpu.py tests/test_packing.py;;
    # issue 27: Liger's kernels and fused head against PyTorch's on the GPU (~1 min)
    liger-tests) stage "$name" 200 python3 -m pytest -q -p no:cacheprovider tests/test_liger_gpu.py tests/test_liger.py;;
    # issue 24: FastEngine's GPU tests (CUDA graphs, Triton kernels, paged pool with preemption and resumption) (~2 min)
    gpu-tests) stage "$name" 300 python3 -m pytest -q -p no:cacheprovider tests/test_continuous_batching.py tests/test_fast_engine.py \
      tests/test_hybrid_engine.py -k "cuda or gpu or triton or graph or stream";;
    # issue 24: Qwen3.5 9B/2B solo, a step's 128 lognormal rollouts at 64 at once: refills prefilled
    # beside the next decode chunk vs waited for, and the static engine, same run (~7 min)
    q35-overlap-solo) stage "$name" 560 python3 benchmarks/rollout.py --device cuda --models qwen35-9b-2b --batches 64 \
      --queue 2 --lengths "$LOGNORMAL" --policies solo --overlap-prefill on off --json "$OUT/$name.json";;
    # the same for tandem (9B + 2B, word p=0.5) (~8 min)
    q35-overlap-tandem) stage "$name" 560 python3 benchmarks/rollout.py --device cuda --models qwen35-9b-2b --batches 64 \
      --queue 2 --lengths "$LOGNORMAL" --policies tandem --overlap-prefill on off --json "$OUT/$name.json";;
    # the 9B config as written: rollout.batch_size 32, the step's 128 rollouts a queue of 4 (~9 min)
    q35-config-solo) stage "$name" 560 python3 benchmarks/rollout.py --device cuda --models qwen35-9b-2b --batches 32 \
      --queue 4 --lengths "$LOGNORMAL" --policies solo --json "$OUT/$name.json";;
    # the 9B config's tandem arm as written (batch 32, queue 4) (~6 min)
    q35-config-tandem) stage "$name" 560 python3 benchmarks/rollout.py --device cuda --models qwen35-9b-2b --batches 32 \
      --queue 4 --lengths "$LOGNORMAL" --policies tandem --json "$OUT/$name.json";;
    # issue 24's Qwen3.5 command with the engine's defaults, one policy a call: static and continuous (~4-5 min each)
    q35-issue-solo|q35-issue-tandem) stage "$name" 560 python3 benchmarks/rollout.py --device cuda --models qwen35-9b-2b \
      --batches 64 --queue 2 --lengths "$LOGNORMAL" --policies "${name#q35-issue-}" --json "$OUT/$name.json";;
    # issue 24's anchor: Qwen3-4B solo, 64 and 128 lognormal sequences at once, FastEngine static and
    # continuous against vLLM 0.24 (its KV cache as large as the 128 rows' slot caches), each in its own
    # process of the same run; vLLM unpacked into /tmp/site first (../shared/vllm/README.md) (~6 min)
    vllm-anchor) stage "$name" 560 env PYTHONPATH="/tmp/site:$PYTHONPATH" VLLM_USE_FLASHINFER_SAMPLER=0 python3 \
      benchmarks/rollout.py --device cuda --batches 64 128 --queue 1 --lengths "$LOGNORMAL" --policies solo --vllm \
      --vllm-kwargs '{"kv_cache_gib": 60}' --json "$OUT/$name.json";;
    *) echo "unknown stage $name (see the case list in $0)"; exit 2;;
  esac
done
