"""Launch settings of the decode-attention kernel (rotary, cache write and attention in one): time each over cache lengths, pick the best.

    python dev/benchmarks/attention_tune.py
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton.testing

from tandem_lit.rollout.static.kernels import rope_attention


def main() -> None:
    heads, kv_heads, head_dim = 32, 8, 128  # Qwen3-4B
    for batch, capacity, used in ((64, 384, 256), (64, 1152, 640), (256, 1152, 640), (16, 1152, 640)):
        q = torch.randn(batch, heads * head_dim, device="cuda", dtype=torch.bfloat16)
        new_k = torch.randn(batch, kv_heads * head_dim, device="cuda", dtype=torch.bfloat16)
        new_v = torch.randn_like(new_k)
        norm = torch.ones(head_dim, device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(capacity, head_dim, device="cuda", dtype=torch.bfloat16)
        sin = torch.randn_like(cos)
        position = torch.full((batch,), used - 1, device="cuda")
        k = torch.randn(batch, kv_heads, capacity, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        valid = torch.ones(batch, capacity, dtype=torch.bool, device="cuda")
        slot = torch.tensor([used - 1], device="cuda")
        inputs = (q, new_k, new_v, norm, norm, 1e-6, cos, sin, position, slot, k, v, valid, 0.088, heads, kv_heads, head_dim)
        bytes_read = 2 * batch * kv_heads * used * head_dim * 2
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
            run = functools.partial(rope_attention, *inputs, block_n, warps, stages)
            try:
                ms = triton.testing.do_bench(run, warmup=5, rep=20)
            except Exception as err:  # out of shared memory etc.
                print(f"  skip {block_n}/{warps}/{stages}: {type(err).__name__}")
                continue
            results.append((ms, block_n, warps, stages))
        results.sort()
        print(f"B={batch} keys={used}: " + "; ".join(
            f"n{b}/w{w}/s{s} {ms * 1000:.1f}us {bytes_read / (ms / 1000) / 1e12:.2f}TB/s" for ms, b, w, s in results[:5]))


if __name__ == "__main__":
    main()
