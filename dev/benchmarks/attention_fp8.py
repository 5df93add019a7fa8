"""Does the decode-attention kernel read an 8-bit paged cache faster than a bf16 one? Times
``rope_attention`` over a paged pool of each dtype at Qwen3-4B's heads, the engine's launch
settings and the best of a grid, with the bytes each call must read.

    python dev/benchmarks/attention_fp8.py                      # a GPU: times both dtypes
    TRITON_INTERPRET=1 python dev/benchmarks/attention_fp8.py --device cpu --batch 2 --used 40   # a CPU check

Issue 54: in a training step with partial rollouts (123 of 128 rows live) the 8-bit cache left the
decode step as long as bf16's (docs/partial_rollouts.md). If the kernel alone reads fp8 at about
twice bf16's positions per second, the step's time is elsewhere; if not, the kernel is the limit.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from tandem_lit.rollout.static.kernels import rope_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-4B
ENGINE_DEFAULT = (64, 2, 2)  # rope_attention's block_n, num_warps, num_stages from batch 64 up


def inputs(batch: int, used: int, page: int, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """One decode step's arguments: every row at position ``used - 1`` of its own pages, scattered
    over the pool in a random order (as a pool is after many refills)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_row = -(-used // page)
    pool_pages = batch * pages_per_row + 1
    bf16 = torch.bfloat16 if device != "cpu" else torch.float32  # (Triton's CPU interpreter: no bf16 arithmetic)
    q = torch.randn(batch, HEADS * HEAD_DIM, generator=gen).to(device, bf16)
    new_k = torch.randn(batch, KV_HEADS * HEAD_DIM, generator=gen).to(device, bf16)
    new_v = torch.randn(batch, KV_HEADS * HEAD_DIM, generator=gen).to(device, bf16)
    norm = torch.ones(HEAD_DIM, device=device, dtype=bf16)
    cos = torch.randn(used, HEAD_DIM, generator=gen).to(device, bf16)
    sin = torch.randn(used, HEAD_DIM, generator=gen).to(device, bf16)
    position = torch.full((batch,), used - 1, device=device)
    slot = torch.full((batch,), used - 1, device=device)
    cache_dtype = bf16 if dtype == torch.bfloat16 else dtype  # (bf16 stands for the model's dtype)
    k, v = (torch.randn(pool_pages, KV_HEADS, page, HEAD_DIM, generator=gen).to(device, bf16).to(cache_dtype) for _ in "kv")
    table = torch.randperm(pool_pages - 1, generator=gen)[: batch * pages_per_row].view(batch, pages_per_row) + 1
    valid = torch.ones(batch, pages_per_row * page, dtype=torch.bool, device=device)
    return (q, new_k, new_v, norm, norm, 1e-6, cos, sin, position, slot, k, v, valid, HEAD_DIM**-0.5,
            HEADS, KV_HEADS, HEAD_DIM), table.to(device, torch.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[128])
    parser.add_argument("--used", type=int, nargs="+", default=[1024, 2048], help="cached positions per row")
    parser.add_argument("--page", type=int, default=64, help="positions per page (FastEngine's kv_page_size)")
    parser.add_argument("--grid", action="store_true", help="also search block_n x num_warps x num_stages")
    args = parser.parse_args()
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    for batch, used in itertools.product(args.batch, args.used):
        outputs = {}
        for name, dtype in dtypes.items():
            call_args, table = inputs(batch, used, args.page, dtype, args.device)
            run = functools.partial(rope_attention, *call_args, *ENGINE_DEFAULT, table=table)
            outputs[name] = run().float()
            if args.device == "cpu":
                continue
            import triton.testing

            bytes_read = 2 * batch * KV_HEADS * used * HEAD_DIM * dtype.itemsize  # keys and values
            settings = [ENGINE_DEFAULT]
            if args.grid:
                settings += [s for s in itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 2, 3, 4)) if s != ENGINE_DEFAULT]
            timed = []
            for block_n, warps, stages in settings:
                try:
                    ms = triton.testing.do_bench(functools.partial(rope_attention, *call_args, block_n, warps, stages,
                                                                   table=table), warmup=10, rep=50)
                except Exception as err:  # out of shared memory, registers
                    print(f"  {name} n{block_n}/w{warps}/s{stages}: {type(err).__name__}")
                    continue
                timed.append((ms, block_n, warps, stages))
            default_ms = timed[0][0]
            best = sorted(timed)[:3]
            print(f"B={batch} positions={used} {name}: engine's n{ENGINE_DEFAULT[0]}/w{ENGINE_DEFAULT[1]}/s{ENGINE_DEFAULT[2]} "
                  f"{default_ms * 1000:.0f} us ({bytes_read / default_ms / 1e9:.2f} TB/s, "
                  f"{batch * used / default_ms / 1e6:.2f} G positions/s); best: " + "; ".join(
                      f"n{b}/w{w}/s{s} {ms * 1000:.0f} us ({bytes_read / ms / 1e9:.2f} TB/s)" for ms, b, w, s in best), flush=True)
        gap = (outputs["fp8"] - outputs["bf16"]).abs().max().item()
        print(f"B={batch} positions={used}: fp8 output vs bf16's, max abs difference {gap:.3f}", flush=True)


if __name__ == "__main__":
    main()
