"""What keeping paused sequences' pages in host memory costs (``rollout.partial.keep_caches``):
``blocks.pages_to_host`` over every layer's keys and values of both models, as a pause does, three
times in a row, then the copy back (``pages_from_host``) as a resume does. The first pause allocates
its pinned host memory; the later ones get it back from PyTorch's host allocator once the previous
pause's copies were freed (a restored sequence gives its caches up), which is the steady state.

    python dev/benchmarks/pinned_pages.py --positions 110000            # the 4B pair, 48 groups in flight
    python dev/benchmarks/pinned_pages.py --device cpu --positions 2000 --layers 2   # a dry run
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem_lit.rollout.static.blocks import pages_from_host, pages_to_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--positions", type=int, default=110_000, help="paused token positions kept")
    parser.add_argument("--layers", type=int, default=36, help="layers of each model (Qwen3-4B: 36)")
    parser.add_argument("--models", type=int, default=2, help="models kept (2: keep_caches both)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    pages = -(-args.positions // args.page_size)
    shape = (pages + 1, args.kv_heads, args.page_size, args.head_dim)
    pools = [torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(2 * args.layers * args.models)]
    index = torch.randperm(pages, device=device) + 1  # a paused sequence's pages are scattered over the pool
    gib = len(pools) * pages * pools[0][0].numel() * 2 / 1024**3
    print(f"# {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: {args.positions:,} positions, "
          f"{args.models} model(s) x {args.layers} layers x keys and values = {gib:.1f} GiB a pause")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for round_ in range(1, args.rounds + 1):
        kept = None  # the previous pause's copies were restored and given up before this pause
        sync()
        started = time.perf_counter()
        kept = [pages_to_host(pool, index) for pool in pools]
        sync()
        pause = time.perf_counter() - started
        print(f"pause {round_}: {pause:.2f} s ({gib / pause:.1f} GiB/s)")
    sync()
    started = time.perf_counter()
    for pool, host in zip(pools, kept):
        pages_from_host(pool, index, host)
    sync()
    back = time.perf_counter() - started
    print(f"resume (copy back): {back:.2f} s ({gib / back:.1f} GiB/s)")
    ok = all(torch.equal(pool[index].cpu(), host) for pool, host in zip(pools[:2], kept[:2]))
    print(f"pages round-trip equal: {ok}")


if __name__ == "__main__":
    main()
