"""Launch settings of the decode-attention kernel: time each over cache lengths, pick the best.

    python benchmarks/attention_tune.py
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

from tandem_lit.rollout.kernels import decode_attention


def main() -> None:
    heads, kv_heads, head_dim = 32, 8, 128  # Qwen3-4B
    for batch, capacity, used in ((64, 384, 256), (64, 1152, 640), (256, 1152, 640), (16, 1152, 640)):
        q = torch.randn(batch, heads * head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, capacity, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        valid = torch.ones(batch, capacity, dtype=torch.bool, device="cuda")
        slot = torch.tensor([used - 1], device="cuda")
        bytes_read = 2 * batch * kv_heads * used * head_dim * 2
        results = []
        for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
            def run(q=q, k=k, v=v, valid=valid, slot=slot, block_n=block_n, warps=warps, stages=stages):
                return decode_attention(q, k, v, valid, slot, 0.088, heads, kv_heads, head_dim, block_n, warps, stages)

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
