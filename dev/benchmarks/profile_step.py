"""Where one FastEngine decode step spends its time (GPU kernels, torch.profiler).

    python dev/benchmarks/profile_step.py --batch 64 --new-tokens 128
    python dev/benchmarks/profile_step.py --models qwen35-9b-2b --batch 64 --new-tokens 128
    python dev/benchmarks/profile_step.py --models qwen3-4b-4b --batch 128 --prompt 1500 --new-tokens 64 \
        --kv-cache paged --kv-cache-dtype auto fp8 --policies tandem   # issue 54: the 8-bit cache's step

Prints the kernels with the most CUDA time over one rollout (solo and tandem), with each
kernel's share, so the next optimisation targets the biggest row.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.rollout import (
    QWEN3_1_7B,
    QWEN3_4B,
    QWEN35_2B,
    QWEN35_9B,
    build_qwen3,
    build_qwen35,
    synthetic_tokenizer,
)
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--models", choices=["qwen3-4b-1.7b", "qwen3-4b-4b", "qwen35-9b-2b"], default="qwen3-4b-1.7b")
    parser.add_argument("--kv-cache", choices=["slots", "paged"], default="slots")
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=["auto"],
                        help="one profile per value (FastEngine's kv_cache_dtype; fp8: plain attention models only)")
    parser.add_argument("--policies", nargs="+", choices=["solo", "tandem"], default=["solo", "tandem"])
    args = parser.parse_args()
    if args.models == "qwen35-9b-2b":
        vocab, build, shapes = 248320, build_qwen35, (QWEN35_9B, QWEN35_2B)
    else:
        vocab, build, shapes = 151936, build_qwen3, (QWEN3_4B, QWEN3_4B if args.models == "qwen3-4b-4b" else QWEN3_1_7B)
    tokenizer = synthetic_tokenizer(vocab)
    senior = build(shapes[0], vocab, torch.bfloat16, "cuda", seed=0)
    junior = build(shapes[1], vocab, torch.bfloat16, "cuda", seed=1)
    ids = torch.randint(4, vocab, (args.batch, args.prompt))
    prompts = PromptBatch(ids, torch.ones_like(ids), sequence_seeds(0, 0, args.batch)).to("cuda")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    policies = {"solo": SoloHandoff(), "tandem": WordHandoff(0.5)}
    for kv_dtype in args.kv_cache_dtype:
        engine = FastEngine(kv_cache=args.kv_cache, kv_cache_dtype=kv_dtype)
        engine.setup(senior, junior, tokenizer)
        for policy in (policies[name] for name in args.policies):
            engine.generate(prompts, policy, sampling)  # capture
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.generate(prompts, policy, sampling)
                torch.cuda.synchronize()
            profiled(prof, f"{policy!r}, kv_cache {args.kv_cache} {kv_dtype}", args)
        engine.release()


def profiled(prof, label: str, args) -> None:
    """The kernels with the most CUDA time, each with its share and time per decode step."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    print(f"\n== {label}: {total / 1000 / args.new_tokens:.2f} ms of kernels per step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[: args.rows]:
        share = e.device_time_total / total
        per_step = e.device_time_total / 1000 / args.new_tokens
        print(f"{share:6.1%} {per_step:7.3f} ms/step {e.count // args.new_tokens:5d}/step  {e.key[:90]}")


if __name__ == "__main__":
    main()
