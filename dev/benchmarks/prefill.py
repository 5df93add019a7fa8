"""Where FastEngine's prompt prefill spends its time, against its compute floor.

    python dev/benchmarks/prefill.py --batch 64 --prompt 128

FastEngine prefills with each model's own Hugging Face decoder stack (exact agreement with
HFEngine), then copies the keys/values into its static caches. At batch 64 x 128 prompt tokens
that is about 15% of a 256-token tandem rollout. This script times, for both Qwen3 shapes (random
bf16 weights): the whole HF forward with ``logits_to_keep=1`` (the engine's prefill before), the
engine's prefill now, the LM head on a strided vs a contiguous last-row input, and the compute
floor (FLOPs over the measured matmul rate); then lists the top CUDA kernels of the engine's
prefill. (A lean plain-torch prefill was measured too and was no faster; commit 18d0089.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile

from benchmarks.rollout import QWEN3_1_7B, QWEN3_4B, build_qwen3
from tandem_lit.rollout.static.plain import StaticDecoderModel


def flops(shape: dict, tokens: int) -> float:
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    return 2.0 * tokens * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of a large bf16 matrix product on random data (the compute ceiling)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / (triton.testing.do_bench(lambda: a @ a, rep=200, return_mode="median") / 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    vocab = 151936
    rate = matmul_rate()
    print(f"# bf16 matmul rate {rate / 1e12:.0f} TFLOP/s; batch {args.batch} x {args.prompt} prompt tokens")
    ids = torch.randint(4, vocab, (args.batch, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    mask[::4, : args.prompt // 4] = 0  # a quarter of the rows left-padded
    for name, shape, seed in (("Qwen3-4B", QWEN3_4B, 0), ("Qwen3-1.7B", QWEN3_1_7B, 1)):
        model = build_qwen3(shape, vocab, torch.bfloat16, "cuda", seed)
        m = StaticDecoderModel(model)
        m.allocate(args.batch, args.prompt + 256)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)

        def whole_forward(model=model, positions=positions):  # the engine's prefill before: the HF forward with logits_to_keep=1
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]

        t_whole = triton.testing.do_bench(whole_forward, rep=300, return_mode="median")
        t_engine = triton.testing.do_bench(lambda m=m: m.prefill(ids, mask), rep=300, return_mode="median")
        floor = flops(shape, ids.numel()) / rate * 1000
        hidden = torch.randn(args.batch, args.prompt, shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
        head = model.lm_head.weight
        t_strided = triton.testing.do_bench(lambda h=hidden, w=head: F.linear(h[:, -1:], w), rep=100, return_mode="median")
        t_contig = triton.testing.do_bench(lambda h=hidden, w=head: F.linear(h[:, -1].contiguous(), w), rep=100, return_mode="median")
        print(f"{name}: HF forward(logits_to_keep=1) {t_whole:.1f} ms; engine prefill (HF decoder stack + head on "
              f"contiguous last rows) {t_engine:.1f} ms; compute floor {floor:.1f} ms", flush=True)
        print(f"  LM head on the last rows: strided view [B, 1, H] {t_strided:.2f} ms, contiguous [B, H] {t_contig:.2f} ms")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m.prefill(ids, mask)
            torch.cuda.synchronize()
        events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        print(f"  engine prefill kernels {total / 1000:.1f} ms (GPU busy {total / 1000 / t_engine:.0%} of wall):")
        for e in events[:12]:
            print(f"  {e.device_time_total / total:6.1%} {e.device_time_total / 1000:7.2f} ms {e.count:5d}x  {e.key[:80]}")
        del model, m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
