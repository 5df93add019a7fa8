"""VLLMEngine on one GPU at the real size: Qwen3-4B shape, random bf16 weights (H200).

    PYTHONPATH=.:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python dev/benchmarks/vllm_smoke.py --tokenizer .tok/qwen3

What the engine costs where training feels it, one line per measure:
- build: vLLM built from the config with dummy weights (CUDA graphs, torch.compile) plus the first
  load of the senior's weights; then one load_weights alone (the per-update sync);
- generate: 64 rows with lognormal token budgets (median 1,000, sigma 0.8, cap 3,000; seed 0;
  EOS ignored, so each row writes exactly its budget: random weights never end), useful tokens/s;
- sleep level 1 vs 2: memory release() frees, then load_weights (waking the weights) and the KV
  cache's wake-up, and whether greedy decoding afterwards is what it was before the sleep.

The tokenizer only decodes texts (vLLM reads token ids); without --tokenizer a synthetic one of
Qwen3's vocabulary size stands in.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.rollout import QWEN3_4B, build_qwen3, draw_budgets, synthetic_tokenizer
from tandem_lit.rollout.handoff import SoloHandoff
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.vllm_engine import VLLMEngine
from tandem_lit.rollout.weights import rollout_named_tensors

VOCAB = 151936
GIB = 2**30


def random_prompts(rows: int, length: int, seed: int, budgets: torch.Tensor | None = None) -> PromptBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, VOCAB - 1000, (rows, length), generator=g)
    batch = PromptBatch(ids, torch.ones_like(ids), sequence_seeds(seed, 0, rows))
    if budgets is not None:
        batch.max_new_tokens = budgets  # (PromptBatch's per-row budget field)
    return batch


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def report(measures: list[dict], **row) -> None:
    measures.append(row)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (e.g. the Qwen3 tokenizer carried into the repo)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--median", type=int, default=1000)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--cap", type=int, default=3000)
    p.add_argument("--kv-gib", type=float, default=40.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json", default=None, help="append the measures here as one JSON object")
    args = p.parse_args()

    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = synthetic_tokenizer(VOCAB)
    rows: list[dict] = []
    senior = build_qwen3(QWEN3_4B, VOCAB, torch.bfloat16, "cuda", 0)
    engine = VLLMEngine(kv_cache_gib=args.kv_gib, max_model_len=args.prompt + args.cap + 16, enforce_eager=args.enforce_eager)
    free = free_bytes()
    started = time.perf_counter()
    engine.setup(senior, None, tokenizer)
    report(rows, measure="build", seconds=time.perf_counter() - started, gpu_gib_taken=(free - free_bytes()) / GIB)
    started = time.perf_counter()
    count = engine.load_weights(rollout_named_tensors(senior))
    torch.cuda.synchronize()
    report(rows, measure="load_weights", seconds=time.perf_counter() - started, tensors=count)

    probe, greedy = random_prompts(4, args.prompt, seed=1), SamplingConfig(temperature=0.0, max_new_tokens=32)
    reference = engine.generate(probe, SoloHandoff(), greedy)  # also the warm-up
    # the draw every benchmark shares (benchmarks/rollout.py), so rows compare across scripts
    budgets = draw_budgets({"median": args.median, "sigma": args.sigma, "cap": args.cap}, args.rows, seed=0)
    batch = random_prompts(args.rows, args.prompt, seed=0, budgets=budgets)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.cap, ignore_eos=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = engine.generate(batch, SoloHandoff(), sampling)
    seconds = time.perf_counter() - started
    assert torch.equal(out.lengths.cpu(), budgets), "every row should write exactly its budget"
    useful = int(budgets.sum())
    report(rows, measure="generate", rows=args.rows, useful_tokens=useful, longest=int(budgets.max()), seconds=seconds,
           useful_tok_s=useful / seconds)

    for level in (1, 2):
        engine.sleep_level = level
        free = free_bytes()
        started = time.perf_counter()
        engine.release()
        asleep = time.perf_counter() - started
        freed = free_bytes() - free
        started = time.perf_counter()
        engine.load_weights(rollout_named_tensors(senior))
        torch.cuda.synchronize()
        loaded = time.perf_counter() - started
        started = time.perf_counter()
        engine.wake_up()
        torch.cuda.synchronize()
        woken = time.perf_counter() - started
        again = engine.generate(probe, SoloHandoff(), greedy)
        same = bool(torch.equal(again.completion_ids, reference.completion_ids))
        report(rows, measure=f"sleep_level_{level}", freed_gib=freed / GIB, sleep_s=asleep, load_weights_s=loaded,
               wake_kv_s=woken, greedy_unchanged=same)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"vllm_smoke": rows}) + "\n")


if __name__ == "__main__":
    main()
