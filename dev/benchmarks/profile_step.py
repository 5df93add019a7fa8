"""Where one FastEngine decode step spends its time (GPU kernels, torch.profiler).

    python dev/benchmarks/profile_step.py --batch 64 --new-tokens 128
    python dev/benchmarks/profile_step.py --models qwen35-9b-2b --batch 64 --new-tokens 128

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
    parser.add_argument("--models", choices=["qwen3-4b-1.7b", "qwen35-9b-2b"], default="qwen3-4b-1.7b")
    args = parser.parse_args()
    if args.models == "qwen35-9b-2b":
        vocab, build, shapes = 248320, build_qwen35, (QWEN35_9B, QWEN35_2B)
    else:
        vocab, build, shapes = 151936, build_qwen3, (QWEN3_4B, QWEN3_1_7B)
    tokenizer = synthetic_tokenizer(vocab)
    senior = build(shapes[0], vocab, torch.bfloat16, "cuda", seed=0)
    junior = build(shapes[1], vocab, torch.bfloat16, "cuda", seed=1)
    engine = FastEngine()
    engine.setup(senior, junior, tokenizer)
    ids = torch.randint(4, vocab, (args.batch, args.prompt))
    prompts = PromptBatch(ids, torch.ones_like(ids), sequence_seeds(0, 0, args.batch)).to("cuda")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    for policy in (SoloHandoff(), WordHandoff(0.5)):
        engine.generate(prompts, policy, sampling)  # capture
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, policy, sampling)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events)
        print(f"\n== {policy!r}: {total / 1000 / args.new_tokens:.2f} ms of kernels per step")
        for e in sorted(events, key=lambda e: -e.device_time_total)[: args.rows]:
            share = e.device_time_total / total
            per_step = e.device_time_total / 1000 / args.new_tokens
            print(f"{share:6.1%} {per_step:7.3f} ms/step {e.count // args.new_tokens:5d}/step  {e.key[:90]}")


if __name__ == "__main__":
    main()
