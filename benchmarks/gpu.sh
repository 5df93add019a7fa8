#!/usr/bin/env bash
# The GPU runs behind docs/performance.md, and the GPU tests, by name: a lent machine's minutes go to
# measuring. Each stage writes its log (and JSON where the script has one) under $OUT.
#
#     OUT=/tmp/out TOKENIZER=<qwen3 tokenizer> PROBLEMS=<deepscaler_subset_803.json> bash benchmarks/gpu.sh STAGE...
#     bash benchmarks/gpu.sh            # lists the stages
#
# TOKENIZER and PROBLEMS default to ../shared (the developers' checkout), WHEELS to .whl: wheels
# installed first into /tmp/site where the machine lacks them (jsonargparse, liger-kernel, vLLM, ...).
# The training-step stages run two warm-up steps: the first offload of the optimizer state pins its
# host buffers once, which belongs to no steady-state step. A new figure for the page: copy the
# stage's .json and .txt into docs/results/, add the run to docs/results/manifest.json, then run
# python benchmarks/performance_page.py.
set -o pipefail
cd "$(dirname "$0")/.."
STAGES="gpu-tests rollout-fixed rollout-fixed-1024 rollout-fixed-qwen35 rollout-lognormal-64 rollout-lognormal-128
rollout-lognormal-paged rollout-lognormal-fp8 rollout-lognormal-qwen35-solo rollout-lognormal-qwen35-tandem step-tandem-fixed step-lognormal
step-grpo-lognormal step-grpo-lognormal-packed step-qlora-fixed step-grpo-config step-grpo-vllm step-qwen35-lora
step-switch-unrestricted step-switch-scoring step-partial-lognormal attention-kernel-lognormal attention-kernel-uniform
catch-up-attention"
if [ $# -eq 0 ]; then echo "stages:" $STAGES; exit 0; fi
OUT=${OUT:?set OUT to a folder for the logs}
TOKENIZER=${TOKENIZER:-../shared/models/qwen3-tokenizer}
PROBLEMS=${PROBLEMS:-../shared/data/deepscaler/train/deepscaler_subset_803.json}
source benchmarks/gpu_env.sh  # wheels the machine lacks, PYTHONPATH
LOGNORMAL="lognormal:median=1000,sigma=0.8,cap=3000"
# the config of the stages that take one: the paper's on an H200 (CARD=h200, the default); on an 80 GB
# H100 (CARD=h100) its LoRA variant, since the paper's plans 121 GiB
case ${CARD:-h200} in
  h100) STEP_CONFIG=${STEP_CONFIG:-configs/rlvr/qwen3_4b_tandem_lora_h100.yaml};;
  *) STEP_CONFIG=${STEP_CONFIG:-configs/rlvr/qwen3_4b_tandem.yaml};;
esac
echo "STEP_CONFIG=$STEP_CONFIG"
STEP=(python3 benchmarks/train_step.py --tokenizer "$TOKENIZER" --problems "$PROBLEMS")
ROLLOUT=(python3 benchmarks/rollout.py --device cuda)
VLLM_ENV=(env VLLM_USE_FLASHINFER_SAMPLER=0)  # vLLM unpacked into /tmp/site first (../shared/vllm/README.md)

stage() {  # name, seconds allowed, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name $(date +%T): $*"
  timeout -s KILL "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "=== $name rc=$? $(date +%T)"
}

for name in "$@"; do
  case $name in
    # every test marked gpu: FastEngine's CUDA graphs and Triton kernels, the update on the GPU, Liger, vLLM
    gpu-tests) stage "$name" 590 python3 -m pytest -q -p no:cacheprovider -m gpu;;
    # rollout tokens/s at fixed lengths: Qwen3-4B / 1.7B, naive loop, HF generate, FastEngine solo and tandem
    rollout-fixed) stage "$name" 590 "${ROLLOUT[@]}" --batches 16 64 256 --new-tokens 256 --baseline-steps 256 \
      --compare-overlap --json "$OUT/$name.json";;
    rollout-fixed-1024) stage "$name" 590 "${ROLLOUT[@]}" --batches 16 64 256 --new-tokens 1024 --baseline-steps 128 \
      --json "$OUT/$name.json";;
    rollout-fixed-qwen35) stage "$name" 590 "${ROLLOUT[@]}" --models qwen35-9b-2b --batches 16 64 --new-tokens 256 \
      --json "$OUT/$name.json";;
    # rollout tokens/s at long-tailed lengths: FastEngine static and continuous against vLLM, 64 and 128 at once
    rollout-lognormal-64) stage "$name" 590 "${VLLM_ENV[@]}" "${ROLLOUT[@]}" --batches 64 --queue 1 --lengths "$LOGNORMAL" \
      --vllm --vllm-kwargs '{"kv_cache_gib": 40}' --json "$OUT/$name.json";;
    rollout-lognormal-128) stage "$name" 590 "${VLLM_ENV[@]}" "${ROLLOUT[@]}" --batches 128 --queue 1 --lengths "$LOGNORMAL" \
      --vllm --vllm-kwargs '{"kv_cache_gib": 60}' --json "$OUT/$name.json";;
    rollout-lognormal-paged) stage "$name" 590 "${ROLLOUT[@]}" --batches 128 --queue 1 --lengths "$LOGNORMAL" \
      --kv-cache slots paged --skip-static --json "$OUT/$name.json";;
    # FastEngine's 8-bit KV cache against the model's dtype: the 4B pair, 128 lognormal rollouts at once from one
    # 40 GiB pool (an H100's room; 8 bits hold twice the positions), same run
    rollout-lognormal-fp8) stage "$name" 590 "${ROLLOUT[@]}" --models qwen3-4b-4b --batches 128 --queue 1 --lengths "$LOGNORMAL" \
      --kv-cache paged --kv-cache-gib 40 --kv-cache-dtype auto fp8 --skip-static --json "$OUT/$name.json";;
    # the Qwen3.5 9B/2B pair: a step's 128 rollouts, 64 at once, static against continuous, one policy a call
    rollout-lognormal-qwen35-solo|rollout-lognormal-qwen35-tandem) stage "$name" 590 "${ROLLOUT[@]}" --models qwen35-9b-2b \
      --batches 64 --queue 2 --lengths "$LOGNORMAL" --policies "${name##*-}" --json "$OUT/$name.json";;
    # step time, peak memory and the update's MFU of the shipped configs
    step-tandem-fixed) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen3_4b_tandem.yaml --arms tandem \
      --warmup-steps 2 --json "$OUT/$name.json";;
    step-lognormal) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen3_4b_tandem.yaml --arms tandem grpo \
      --lengths "$LOGNORMAL" --warmup-steps 2 --json "$OUT/$name.json";;
    step-grpo-lognormal) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen3_4b_tandem.yaml --arms grpo \
      --lengths "$LOGNORMAL" --warmup-steps 2 --json "$OUT/$name.json";;
    step-grpo-lognormal-packed) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen3_4b_tandem.yaml --arms grpo \
      --lengths "$LOGNORMAL" --warmup-steps 2 --pack-sequences --json "$OUT/$name.json";;
    # QLoRA: carry the bitsandbytes wheel in $WHEELS
    step-qlora-fixed) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen3_4b_tandem.yaml --arms tandem --lora 16 \
      --qlora --warmup-steps 1 --json "$OUT/$name.json";;
    step-grpo-config) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen3_4b_grpo.yaml --arms grpo \
      --warmup-steps 2 --json "$OUT/$name.json";;
    step-grpo-vllm) stage "$name" 590 "${VLLM_ENV[@]}" "${STEP[@]}" --config configs/rlvr/qwen3_4b_grpo_vllm.yaml \
      --arms grpo grpo-vllm --lengths "$LOGNORMAL" --warmup-steps 2 --json "$OUT/$name.json";;
    step-qwen35-lora) stage "$name" 590 "${STEP[@]}" --config configs/rlvr/qwen35_9b_2b_tandem.yaml --arms tandem --lora 16 \
      --gradient-checkpointing --warmup-steps 1 --json "$OUT/$name.json";;
    # issue 51: the tandem step with switch tokens scored unrestricted, as before they were scored as drawn;
    # its mismatch_kl beside step-lognormal's (as drawn) is what that fix removed
    step-switch-unrestricted) stage "$name" 590 "${STEP[@]}" --config "$STEP_CONFIG" --arms tandem \
      --lengths "$LOGNORMAL" --warmup-steps 2 --switch-scoring unrestricted --json "$OUT/$name.json";;
    # issue 51 in one process: the tandem step scored as drawn, then unrestricted, its mismatch metrics side by side
    step-switch-scoring) stage "$name" 590 "${STEP[@]}" --config "$STEP_CONFIG" --arms tandem \
      --lengths "$LOGNORMAL" --warmup-steps 2 --switch-scoring as-drawn unrestricted --json "$OUT/$name.json";;
    # issue 54: each arm as today and with rollout.partial (IN_FLIGHT groups in flight over batches of 16,
    # default 24; MAX_STALENESS updates, default 2: a step makes 2), three measured steps each (the
    # carry fills in the first): rollout seconds, live rows, stale tokens. ARMS="tandem" or "grpo" runs
    # one arm's pair (a pair fills a call on an H100); PARTIAL_ONLY=1 only the partial arm; KV_DTYPE=fp8
    # FastEngine's 8-bit KV cache in both; COMPARE_FP8=1 each arm again with it (arm+fp8), in the same run;
    # KEEP_CACHES="none junior both": one partial arm per rollout.partial.keep_caches value;
    # ATTENTION_SPLIT=N FastEngine's decode attention in chunks of N slots (attention_split), every arm;
    # COMPARE_ORDER=1 each arm again with the decode attention's programs in row order (attention_order: rows)
    step-partial-lognormal) keep=${KEEP_CACHES:+-keep-${KEEP_CACHES// /-}}
      tag="${ARMS:+-${ARMS// /-}}${IN_FLIGHT:+-f$IN_FLIGHT}${MAX_STALENESS:+-s$MAX_STALENESS}${KV_DTYPE:+-$KV_DTYPE}${COMPARE_FP8:+-vs-fp8}${COMPARE_ORDER:+-vs-rows-order}${ATTENTION_SPLIT:+-split$ATTENTION_SPLIT}$keep"
      stage "$name$tag" 590 "${STEP[@]}" --config "$STEP_CONFIG" --arms ${ARMS:-tandem grpo} \
      --lengths "$LOGNORMAL" --warmup-steps 2 --steps "${MEASURED_STEPS:-3}" --partial "${IN_FLIGHT:-24}" \
      --max-staleness "${MAX_STALENESS:-2}" ${PARTIAL_ONLY:+--partial-only} ${KV_DTYPE:+--kv-cache-dtype $KV_DTYPE} ${COMPARE_FP8:+--compare-fp8} ${COMPARE_ORDER:+--compare-attention-order} \
      ${KEEP_CACHES:+--keep-caches $KEEP_CACHES} ${ATTENTION_SPLIT:+--attention-split $ATTENTION_SPLIT} --json "$OUT/$name$tag.json";;
    # the decode-attention kernel alone: bf16 and 8-bit pools (widened to bf16 or float16), unsplit and split, rows at
    # the partial step's lognormal mix (128 and 64 of them) or all at one length
    attention-kernel-lognormal) stage "$name" 300 python3 benchmarks/attention_kernel.py --lengths lognormal --used 1000 \
      --batch 128 64 --json "$OUT/$name.json";;
    attention-kernel-uniform) stage "$name" 300 python3 benchmarks/attention_kernel.py --batch 128 --used 1024 2048 \
      --json "$OUT/$name.json";;
    # the catch-up kernel decoding only the author would need (dev/author_only_decode.md), against the decode kernel
    catch-up-attention) stage "$name" 120 python3 dev/benchmarks/catch_up_attention.py --batch 128 64 --json "$OUT/$name.json";;
    *) echo "unknown stage $name; stages: $STAGES"; exit 2;;
  esac
done
