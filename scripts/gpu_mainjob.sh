#!/usr/bin/env bash
# Issue 53 on a GPU: the main job as users run it, `tandem-lit fit` and `tandem-lit test` on a shipped
# config through the CLI, on random-weight Hugging Face folders of the config's shape with the real
# tokenizer and local data. Each stage is bounded (timeout -s KILL) and tees its log under $OUT.
#
#     OUT=/tmp/out DATA=<folder in ../shared/data's layout> TOKENIZER=<qwen3 tokenizer folder> \
#         CARD=h200|h100 bash scripts/gpu_mainjob.sh STAGE...
#     TINY=1 OUT=/tmp/out bash scripts/gpu_mainjob.sh models fit resume ckpt-io harness test   # CPU dry run
#
# Stages (in this order; later ones read what earlier ones wrote under $WORK):
#   models   a random bf16 folder of each model CONFIG names (scripts/random_hf_folder.py --config: the 4B
#            configs pair Qwen3-4B-Instruct-2507 with itself, the GRPO ones have no junior, the Qwen3.5 one
#            pairs 9B with 2B); their paths are kept in $WORK/models-<config>.txt for the later stages
#   fit      tandem-lit fit on CONFIG (h200: configs/rlvr/qwen3_4b_tandem.yaml; h100: its LoRA variant
#            configs/rlvr/qwen3_4b_tandem_lora_h100.yaml), only paths and lengths overridden: STEPS
#            rollout steps, validation at the start and every VAL_EVERY steps on VAL_BATCHES batches,
#            last.ckpt every step; the run's history.jsonl (per-step seconds, peak memory) copied to $OUT
#   resume   the same run resumed from its last.ckpt for one more step (the start-up's time is the
#            resume's: wall time minus that step's seconds)
#   ckpt-io  the last checkpoint read and written once more, timed (size, load s, save s)
#   harness  benchmarks/train_step.py on CONFIG at the same lengths, back to back with fit (its step
#            next to the CLI's: the CLI's overhead): the arm CONFIG trains (tandem, grpo or grpo-vllm),
#            HARNESS_EXTRA for what FIT_EXTRA changed (e.g. --lora 16 --gradient-checkpointing)
#   test     tandem-lit test --config configs/eval/math_handoff.yaml on the run's last.ckpt, LIMIT
#            problems of each set (data.init_args.limit: the quick look), TEST_TOKENS tokens; the handoff's
#            partner is CONFIG's junior (a GRPO config's: the senior's base)
#
# CONFIG (default by CARD, below) may be any shipped GPU config; e.g. the vLLM one (vLLM unpacked
# into /tmp/site first: ../shared/vllm/README.md) or the Qwen3.5 pair with LoRA on one GPU:
#     CONFIG=configs/rlvr/qwen35_9b_2b_tandem.yaml LORA="{r: 16}" FIT_EXTRA='--model.init_args.lora {"r":16}
#         --model.init_args.memory.gradient_checkpointing true' HARNESS_EXTRA="--lora 16 --gradient-checkpointing" ...
#
# DATA holds deepscaler/train/*.json and the eval sets (aime24/, amc23/, ...) as ../shared/data does;
# ../shared does not travel to a GPU machine: copy what is needed into an ignored folder of the
# checkout (runs/ is ignored) and point DATA there.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the logs}
CARD=${CARD:-h200}
TINY=${TINY:-0}
DATA=${DATA:-../shared/data}
TOKENIZER=${TOKENIZER:-../shared/models/qwen3-tokenizer}
WORK=${WORK:-runs/mainjob}                   # models, run folders (ignored by git, kept on a warm machine)
STEPS=${STEPS:-3}                            # rollout steps of the fit stage (each is 2 optimiser updates)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-3000}       # the config's; lower it to fit a device call's minutes
VAL_EVERY=${VAL_EVERY:-2}                    # validation every this many steps (data batches)
VAL_BATCHES=${VAL_BATCHES:-1}                # of eval_batch_size (16) problems
LIMIT=${LIMIT:-4}                            # problems of each eval set in the test stage
TEST_TOKENS=${TEST_TOKENS:-$MAX_NEW_TOKENS}
mkdir -p "$OUT" "$WORK"
case $CARD in
  h200) CONFIG=${CONFIG:-configs/rlvr/qwen3_4b_tandem.yaml};;
  h100) CONFIG=${CONFIG:-configs/rlvr/qwen3_4b_tandem_lora_h100.yaml};;
  *) echo "CARD must be h200 or h100, got $CARD"; exit 2;;
esac
source benchmarks/gpu_env.sh  # wheels the machine lacks, PYTHONPATH
PY=${PY:-python3}
MODELS=$WORK/models
RUN=$WORK/fit-$CARD-$(basename "$CONFIG" .yaml)
MODEL_PATHS=$WORK/models-$(basename "$CONFIG" .yaml).txt  # senior=<folder>, junior=<folder> (the models stage)
export VLLM_USE_FLASHINFER_SAMPLER=0  # vLLM (a VLLMEngine config): its own sampler (flashinfer is not shipped)
EXTRA=(${FIT_EXTRA:-})  # more fit/test flags (e.g. to skip the evaluation at start) and what the CPU dry run changes
HARNESS=()
if [ "$TINY" = 1 ]; then
  STEPS=1; MAX_NEW_TOKENS=8; TEST_TOKENS=8; LIMIT=1
  EXTRA+=(--trainer.accelerator cpu --trainer.precision 32-true --data.init_args.batch_size 2
         --data.init_args.eval_batch_size 2 --data.init_args.val_size 2 --model.init_args.rollout.sampling.n 2
         --model.init_args.update.mini_batch_size 1)
  HARNESS=(--device cpu --prompts 2 --n 2)
  MODEL_SIZE=(--tiny)
else
  MODEL_SIZE=(--device cuda)
fi
# a LoRA config's checkpoint holds adapters: the test stage builds the same adapters over the base
# (LORA="{r: 16}" where FIT_EXTRA added them to a full-weight config)
LORA=${LORA:-$(sed -n 's/^ *lora: *\({.*}\) *$/\1/p' "$CONFIG" | head -1)}

stage() {  # name, seconds allowed, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name $(date +%T): $*" | tee -a "$OUT/stages.txt"
  local started=$SECONDS
  timeout -s KILL "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=$?
  echo "=== $name rc=$rc wall_s=$((SECONDS - started)) $(date +%T)" | tee -a "$OUT/stages.txt"
  return $rc
}

report_steps() {  # history.jsonl, stage: each step's seconds and each phase's peak against the memory plan (GiB)
  [ -f "$1" ] || { echo "no $1: the run ended before its report" | tee -a "$OUT/$2.txt"; return; }
  $PY - "$1" <<'EOF' | tee -a "$OUT/$2.txt"
import json, sys
for row in map(json.loads, open(sys.argv[1])):
    if "train/rollout_peak_memory_gb" in row:
        print("step {}: {:.1f} s (rollout {:.1f}, update {:.1f}); ".format(
            row.get("step"), row.get("train/step_seconds", float("nan")), row["train/rollout_seconds"], row["train/update_seconds"]) + "; ".join(
            "{} measured {:.1f} GiB, plan {:.1f}".format(phase, row[f"train/{phase}_peak_memory_gb"],
                                                          row.get(f"train/{phase}_memory_plan_gb", float("nan")))
            for phase in ("rollout", "update")))
EOF
}

model_args() {  # the models stage's folders, as --model.init_args.{senior,junior}.path (a GRPO config: no junior)
  local role folder
  while IFS='=' read -r role folder; do
    printf '%s\n' "--model.init_args.$role.path" "$folder"
  done < "$MODEL_PATHS"
}
partner() {  # the handoff partner of the test stage: CONFIG's junior, else the senior's base
  sed -n 's/^junior=//p' "$MODEL_PATHS"; sed -n 's/^senior=//p' "$MODEL_PATHS"
}
fit_args() {
  [ -f "$MODEL_PATHS" ] || { echo "no $MODEL_PATHS: run the models stage first"; return 1; }
  mapfile -t fit_args < <(model_args)
  fit_args=(--config "$CONFIG" "${fit_args[@]}"
            --data.init_args.source "$DATA/deepscaler/train" --data.init_args.eval_root "$DATA"
            --model.init_args.rollout.sampling.max_new_tokens "$MAX_NEW_TOKENS"
            --model.init_args.evaluation.sampling.max_new_tokens "$MAX_NEW_TOKENS"
            --trainer.val_check_interval "$VAL_EVERY" --trainer.limit_val_batches "$VAL_BATCHES"
            --checkpoint.every_n_train_steps 2 --trainer.default_root_dir "$RUN" "${EXTRA[@]}")
}
# the harness's arm: the one CONFIG trains
if grep -q "VLLMEngine" "$CONFIG"; then HARNESS_ARM=grpo-vllm
elif grep -q "class_path: SoloHandoff" "$CONFIG"; then HARNESS_ARM=grpo
else HARNESS_ARM=tandem; fi
HARNESS+=(${HARNESS_EXTRA:-})
updates_per_step=2  # 16 prompts a step, PPO mini-batches of 8

for name in "$@"; do
  case $name in
    models)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no GPU"; \
        $PY -c 'import torch, transformers, lightning; print(torch.__version__, transformers.__version__, lightning.__version__)'; } \
        > "$OUT/env.txt" 2>&1
      stage models 300 $PY scripts/random_hf_folder.py --config "$CONFIG" \
        --tokenizer "$TOKENIZER" --out "$MODELS" "${MODEL_SIZE[@]}" \
        && grep -E '^(senior|junior)=' "$OUT/models.txt" > "$MODEL_PATHS";;
    fit)
      rm -rf "$RUN"
      fit_args || exit 1
      stage fit 590 $PY -m tandem_lit fit "${fit_args[@]}" --trainer.max_steps $((STEPS * updates_per_step))
      cp "$RUN/history.jsonl" "$OUT/fit_history.jsonl" 2>/dev/null
      cp "$RUN/out_of_memory.txt" "$OUT/fit_out_of_memory.txt" 2>/dev/null  # a CUDA out-of-memory's traceback and allocator state
      report_steps "$RUN/history.jsonl" fit
      cp "$RUN/summary.json" "$OUT/fit_summary.json" 2>/dev/null
      ls -l "$RUN/checkpoints" > "$OUT/fit_checkpoints.txt" 2>&1;;
    resume)
      fit_args || exit 1
      stage resume 590 $PY -m tandem_lit fit "${fit_args[@]}" --trainer.max_steps $(((STEPS + 1) * updates_per_step)) \
        --ckpt_path "$RUN/checkpoints/last.ckpt"
      cp "$RUN/history.jsonl" "$OUT/resume_history.jsonl" 2>/dev/null
      cp "$RUN/out_of_memory.txt" "$OUT/resume_out_of_memory.txt" 2>/dev/null
      report_steps "$RUN/history.jsonl" resume;;
    ckpt-io)
      stage ckpt-io 300 $PY - "$RUN/checkpoints/last.ckpt" <<'EOF'
import json, os, sys, time, torch
path = sys.argv[1]
started = time.perf_counter()
checkpoint = torch.load(path, map_location="cpu", weights_only=False)
loaded = time.perf_counter()
copy = path + ".timing"
torch.save(checkpoint, copy)
with open(copy, "rb+") as f:
    os.fsync(f.fileno())  # as AtomicCheckpointIO writes: on the disk, not in the page cache
saved = time.perf_counter()
os.remove(copy)
print(json.dumps({"bytes": os.path.getsize(path), "load_s": round(loaded - started, 2), "save_s": round(saved - loaded, 2)}))
EOF
      ;;
    harness)
      if [ "$TINY" = 1 ]; then
        stage harness 590 $PY benchmarks/train_step.py --config "$CONFIG" --tiny --arms $HARNESS_ARM --steps 1 --warmup-steps 1 \
          "${HARNESS[@]}" --json "$OUT/harness.json"
      else
        stage harness 590 $PY benchmarks/train_step.py --config "$CONFIG" --tokenizer "$TOKENIZER" \
          --problems "$DATA/deepscaler/train/deepscaler_subset_803.json" --arms $HARNESS_ARM --steps 1 --warmup-steps 1 \
          --max-new-tokens "$MAX_NEW_TOKENS" "${HARNESS[@]}" --json "$OUT/harness.json"
      fi;;
    test)
      test_args=(--config configs/eval/math_handoff.yaml --ckpt_path "$RUN/checkpoints/last.ckpt"
                 --model.init_args.senior.path "$(sed -n 's/^senior=//p' "$MODEL_PATHS")"
                 --model.init_args.junior.path "$(partner | head -1)"
                 --data.init_args.root "$DATA" --data.init_args.limit "$LIMIT"
                 --model.init_args.evaluation.test_sampling.max_new_tokens "$TEST_TOKENS"
                 --trainer.default_root_dir "$WORK/test-$CARD")
      [ -n "$LORA" ] && test_args+=(--model.init_args.lora "$LORA")
      [ "$TINY" = 1 ] && test_args+=(--trainer.accelerator cpu --model.init_args.evaluation.test_sampling.n 2)
      rm -rf "$WORK/test-$CARD"
      stage test 590 $PY -m tandem_lit test "${test_args[@]}"
      cp "$WORK/test-$CARD/eval/results.json" "$OUT/test_results.json" 2>/dev/null;;
    *) echo "unknown stage $name"; exit 2;;
  esac
done
