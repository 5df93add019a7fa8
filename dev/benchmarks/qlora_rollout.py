"""QLoRA rollouts: FastEngine on the bf16 rollout copy vs HFEngine on the same QLoRA senior.

A Qwen3-4B-shape senior with random weights is saved and loaded back 4-bit NF4 through
``from_pretrained(quantization_config=...)`` (the path a hub checkpoint takes), gets LoRA adapters
(rank 16, all linear layers: the Tandem Training setting), and co-writes with a bf16
Qwen3-1.7B-shape junior (word handoff, p = 0.5, EOS ignored so every row runs the full budget).

Rows, measured in the same run:
- ``fast (bf16 copy)``: the default engine for this senior: FastEngine decoding its own bf16
  copy (4-bit base dequantised, adapters merged), CUDA graphs and Triton kernels;
- ``hf (bf16 copy)``: HFEngine on the same copy (the per-token reference loop);
- ``hf (live QLoRA)``: HFEngine on the live 4-bit + LoRA model, what decoding QLoRA weights in
  place costs (bitsandbytes dequantises every weight at every step).
Plus the time to build the copy (dequantise + merge), paid once after each optimiser update.

    python dev/benchmarks/qlora_rollout.py --tokenizer .bench/qwen3-tokenizer --batch 64 --new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from benchmarks.rollout import QWEN3_1_7B, QWEN3_4B, Row, build_qwen3, sync, time_engine
from tandem_lit.models import LoraSettings, ModelSource, apply_lora, load_causal_lm, quantization_config
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import WordHandoff
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine


def qlora_senior(vocab: int, lora: LoraSettings):
    """The 4-bit senior with LoRA adapters, loaded the way tandem-lit loads a hub checkpoint."""
    with tempfile.TemporaryDirectory(prefix="qlora-bench-") as folder:
        build_qwen3(QWEN3_4B, vocab, torch.bfloat16, "cuda", seed=0).save_pretrained(folder)
        torch.cuda.empty_cache()
        model = load_causal_lm(ModelSource(folder, dtype="bfloat16"), quantization_config(lora))
    model = apply_lora(model, lora)
    with torch.no_grad():  # trained adapters are not zero: make the merge do real work
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (its vocabulary size is used)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--baseline-tokens", type=int, default=64, help="new tokens of the slow HFEngine rows")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        args.vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
    lora = LoraSettings(r=16, alpha=32, dropout=0.0, load_in_4bit=True)
    senior = qlora_senior(args.vocab, lora)
    junior = build_qwen3(QWEN3_1_7B, args.vocab, torch.bfloat16, "cuda", seed=1)
    from benchmarks.rollout import synthetic_tokenizer

    tokenizer = synthetic_tokenizer(args.vocab)
    ids = torch.randint(4, args.vocab, (args.batch, args.prompt), device="cuda")
    prompts = PromptBatch(ids, torch.ones_like(ids), sequence_seeds(0, 0, args.batch, "cuda"))
    policy = WordHandoff(p=0.5)
    rows = []

    def measure(name: str, engine, new_tokens: int) -> None:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
        seconds, phases = time_engine(engine, prompts, policy, sampling, "cuda", args.repeats)
        rows.append(Row(name, args.batch, new_tokens, new_tokens, seconds, phases))
        print(f"{name:22s} batch {args.batch} x {new_tokens} tokens: {rows[-1].tokens_per_second:9.0f} tok/s "
              f"({rows[-1].step_ms:.1f} ms/step)", flush=True)

    from tandem_lit.rollout.choice import default_engine

    fast = default_engine(senior, junior)
    assert isinstance(fast, FastEngine), f"a QLoRA senior fell back to {type(fast).__name__}"
    sync("cuda")
    start = time.perf_counter()
    fast.setup(senior, junior, tokenizer)  # builds the bf16 copy: dequantise + merge
    sync("cuda")
    copy_seconds = time.perf_counter() - start
    print(f"rollout copy (dequantise 4-bit base, merge LoRA, bf16): {copy_seconds:.2f} s", flush=True)
    measure("fast (bf16 copy)", fast, args.new_tokens)
    fast.release()
    reload_start = time.perf_counter()
    from tandem_lit.rollout.weights import rollout_named_tensors

    fast.load_weights(rollout_named_tensors(senior))  # what each step after an update pays
    sync("cuda")
    reload_seconds = time.perf_counter() - reload_start
    print(f"copy refresh after an update (load_weights): {reload_seconds:.2f} s", flush=True)
    del fast
    torch.cuda.empty_cache()
    hf_copy = HFEngine()
    hf_copy.setup(senior, junior, tokenizer)
    measure("hf (bf16 copy)", hf_copy, args.baseline_tokens)
    del hf_copy
    torch.cuda.empty_cache()
    hf_live = HFEngine(rollout_dtype="live")
    hf_live.setup(senior, junior, tokenizer)
    measure("hf (live QLoRA)", hf_live, args.baseline_tokens)
    fast_row = rows[0]
    for row in rows[1:]:
        print(f"fast / {row.name}: {fast_row.tokens_per_second / row.tokens_per_second:.1f}x")
    print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_seconds": copy_seconds, "reload_seconds": reload_seconds,
                       "rows": [dict(name=r.name, batch=r.batch, new_tokens=r.new_tokens, seconds=r.seconds,
                                     tokens_per_second=r.tokens_per_second) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
