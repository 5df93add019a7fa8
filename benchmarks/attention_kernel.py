"""The decode-attention kernel alone (``rope_attention``, Qwen3-4B's heads, a paged pool): which
cache dtype, widening and split reads a step's keys and values fastest, beside the rate at which the
card copies as many bytes (reads and writes counted) and the time of the longest row alone.

    python benchmarks/attention_kernel.py --lengths lognormal --used 1000 --batch 128 64 --json k.json
    python benchmarks/attention_kernel.py --batch 128 --used 1024 2048 --grid   # + a launch-settings grid
    TRITON_INTERPRET=1 python benchmarks/attention_kernel.py --device cpu --batch 2 --used 40 --split-positions 64  # a CPU check

Variants: ``bf16`` (a bf16 pool); ``fp8`` (8-bit, widened to q's dtype for the products: the
engine until 2026-12-07); ``fp8+f16dot`` (8-bit, widened to float16: the engine's for a 16-bit
model since). Each unsplit and split into chunks of ``--split-positions`` slots
(``FastEngine(attention_split=...)``), and unsplit with its programs started longest row first
(``rope_attention``'s ``order``, as ``plain.longest_first`` gives it: the engine's since 2026-12-08;
the plain timings are its ``attention_order: rows``).

``--lengths uniform`` puts every row at ``--used`` positions; ``lognormal`` draws each row's
sequence as issue 54's step does (prompt of 150, response lognormal with median ``--used`` and
sigma 0.8, capped at 3,000) and puts the row at a uniformly drawn point of it, as rows in flight
are. One program per row and KV head walks the row's whole context alone, so the longest row can
set a floor that the total bytes do not (docs/performance.md has the measurements).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from tandem_lit.rollout.static.kernels import rope_attention
from tandem_lit.rollout.static.plain import longest_first

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-4B
ENGINE_DEFAULT = (64, 2, 2)  # rope_attention's block_n, num_warps, num_stages from batch 64 up


PROMPT, CAP, SIGMA = 150, 3000, 0.8  # the lognormal lengths (docs/partial_rollouts.md)


def row_lengths(batch: int, used: int, lengths: str, seed: int = 0) -> torch.Tensor:
    """Each row's cached positions (its new token included): ``used`` each, or rows at a uniform
    point of lognormal sequences (see the module docstring)."""
    if lengths == "uniform":
        return torch.full((batch,), used)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    response = (torch.randn(batch, generator=gen) * SIGMA).exp().mul(used).clamp(1, CAP).round()
    return (PROMPT + (torch.rand(batch, generator=gen) * response).floor()).long() + 1


def inputs(length: torch.Tensor, page: int, dtype: torch.dtype, device: str, seed: int = 0) -> tuple:
    """One decode step's arguments: row ``i`` at position ``length[i] - 1`` of its own pages,
    scattered over the pool in a random order (as a pool is after many refills)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    batch, used = length.numel(), int(length.max())
    pages_per_row = -(-used // page)
    pool_pages = batch * pages_per_row + 1
    bf16 = torch.bfloat16 if device != "cpu" else torch.float32  # (Triton's CPU interpreter: no bf16 arithmetic)
    q = torch.randn(batch, HEADS * HEAD_DIM, generator=gen).to(device, bf16)
    new_k = torch.randn(batch, KV_HEADS * HEAD_DIM, generator=gen).to(device, bf16)
    new_v = torch.randn(batch, KV_HEADS * HEAD_DIM, generator=gen).to(device, bf16)
    norm = torch.ones(HEAD_DIM, device=device, dtype=bf16)
    cos = torch.randn(used, HEAD_DIM, generator=gen).to(device, bf16)
    sin = torch.randn(used, HEAD_DIM, generator=gen).to(device, bf16)
    position = (length - 1).to(device)
    slot = (length - 1).to(device)
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
    parser.add_argument("--used", type=int, nargs="+", default=[1024, 2048],
                        help="cached positions per row (uniform), or the responses' median (lognormal)")
    parser.add_argument("--lengths", choices=("uniform", "lognormal"), default="uniform")
    parser.add_argument("--page", type=int, default=64, help="positions per page (FastEngine's kv_page_size)")
    parser.add_argument("--grid", action="store_true", help="also search block_n x num_warps x num_stages")
    parser.add_argument("--json", default=None, help="also write every timing here (docs/performance.md reads it)")
    parser.add_argument("--split-positions", type=int, nargs="*", default=[256, 512, 1024],
                        help="also time the engine's launch settings with each row split into chunks of this many "
                             "slots (flash-decoding: rope_attention's split_positions)")
    args = parser.parse_args()
    # (cache dtype, f16_dot): an 8-bit cache widened to q's dtype ("fp8", the engine's until
    # 2026-12-07), or to float16 ("fp8+f16dot", the engine's for a 16-bit model since)
    variants = {"bf16": (torch.bfloat16, False), "fp8": (torch.float8_e4m3fn, False), "fp8+f16dot": (torch.float8_e4m3fn, True)}
    cases, copies = [], []  # the --json file's records
    for batch, used in itertools.product(args.batch, args.used):
        length = row_lengths(batch, used, args.lengths)
        positions = int(length.sum())
        print(f"B={batch} {args.lengths} positions: mean {positions / batch:.0f}, longest {int(length.max())}", flush=True)
        outputs = {}
        for name, (dtype, f16_dot) in variants.items():
            call_args, table = inputs(length, args.page, dtype, args.device)
            call = functools.partial(rope_attention, f16_dot=f16_dot)
            run = functools.partial(call, *call_args, *ENGINE_DEFAULT, table=table)
            outputs[name] = run().float()
            for split in args.split_positions:  # the same output, split into chunks
                gap = (call(*call_args, *ENGINE_DEFAULT, table=table, split_positions=split).float()
                       - outputs[name]).abs().max().item()
                print(f"B={batch} positions={used} {name} split {split}: max abs difference from unsplit {gap:.2e}")
            # the same output, the programs started longest row first, as the engine orders them
            ordered = functools.partial(call, *call_args, *ENGINE_DEFAULT, table=table, order=longest_first(call_args[9]))
            gap = (ordered().float() - outputs[name]).abs().max().item()
            print(f"B={batch} positions={used} {name} longest first: max abs difference from row order {gap:.2e}")
            if args.device == "cpu":
                continue
            import triton.testing

            bytes_read = 2 * positions * KV_HEADS * HEAD_DIM * dtype.itemsize  # keys and values
            if name == "bf16":  # what the card copies: a clone of as many bytes reads and writes each once
                block = torch.empty(bytes_read, dtype=torch.uint8, device=args.device)
                copy_ms = triton.testing.do_bench(block.clone, warmup=10, rep=50)
                print(f"B={batch} positions={used}: copying {bytes_read / 1e9:.2f} GB moves "
                      f"{2 * bytes_read / copy_ms / 1e9:.2f} TB/s (reads and writes)", flush=True)
                copies.append({"batch": batch, "lengths": args.lengths, "used": used,
                               "copy_tb_s": 2 * bytes_read / copy_ms / 1e9})
                del block
            settings = [ENGINE_DEFAULT]
            if args.grid:
                settings += [s for s in itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 2, 3)) if s != ENGINE_DEFAULT]
            timed = []
            for block_n, warps, stages in settings:
                try:
                    ms = triton.testing.do_bench(functools.partial(call, *call_args, block_n, warps, stages,
                                                                   table=table), warmup=10, rep=50)
                except Exception as err:  # out of shared memory, registers
                    print(f"  {name} n{block_n}/w{warps}/s{stages}: {type(err).__name__}")
                    continue
                timed.append((ms, block_n, warps, stages))
            default_ms = timed[0][0]
            best = sorted(timed)[:3]
            longest = inputs(length[length.argmax()].view(1), args.page, dtype, args.device)
            for split in (None, *args.split_positions):  # (unsplit: the engine's launch settings, timed above)
                split_ms = default_ms if split is None else triton.testing.do_bench(
                    functools.partial(call, *call_args, *ENGINE_DEFAULT, table=table, split_positions=split), warmup=10, rep=50)
                # the floor the longest row sets: its programs alone
                alone_ms = triton.testing.do_bench(functools.partial(call, *longest[0], *ENGINE_DEFAULT,
                                                                     table=longest[1], split_positions=split), warmup=10, rep=50)
                print(f"B={batch} positions={used} {name} split {split or 'none'}: {split_ms * 1000:.0f} us "
                      f"({bytes_read / split_ms / 1e9:.2f} TB/s); the longest row alone {alone_ms * 1000:.0f} us", flush=True)
                cases.append({"batch": batch, "lengths": args.lengths, "used": used, "variant": name, "split": split or 0,
                              "us": split_ms * 1000, "tb_s": bytes_read / split_ms / 1e9,
                              "longest_alone_us": alone_ms * 1000})
            ordered_ms = triton.testing.do_bench(ordered, warmup=10, rep=50)
            print(f"B={batch} positions={used} {name} longest first: {ordered_ms * 1000:.0f} us "
                  f"({bytes_read / ordered_ms / 1e9:.2f} TB/s) against {default_ms * 1000:.0f} in row order", flush=True)
            cases.append({"batch": batch, "lengths": args.lengths, "used": used, "variant": f"{name} longest-first",
                          "split": 0, "us": ordered_ms * 1000, "tb_s": bytes_read / ordered_ms / 1e9})
            print(f"B={batch} positions={used} {name}: engine's n{ENGINE_DEFAULT[0]}/w{ENGINE_DEFAULT[1]}/s{ENGINE_DEFAULT[2]} "
                  f"{default_ms * 1000:.0f} us ({bytes_read / default_ms / 1e9:.2f} TB/s, "
                  f"{positions / default_ms / 1e6:.2f} G positions/s); best: " + "; ".join(
                      f"n{b}/w{w}/s{s} {ms * 1000:.0f} us ({bytes_read / ms / 1e9:.2f} TB/s)" for ms, b, w, s in best), flush=True)
        for name in ("fp8", "fp8+f16dot"):
            gap = (outputs[name] - outputs["bf16"]).abs().max().item()
            print(f"B={batch} positions={used}: {name} output vs bf16's, max abs difference {gap:.3f}", flush=True)
    if args.json:
        device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
        Path(args.json).write_text(json.dumps({"device": device, "cases": cases, "copies": copies}, indent=1))


if __name__ == "__main__":
    main()
