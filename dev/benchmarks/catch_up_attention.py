"""Does a catch-up read a row's cache in about the time one decode query does? The assumption
decoding only the author rests on (dev/author_only_decode.md), measured before the rest is built.

    python dev/benchmarks/catch_up_attention.py --batch 128 --used 1000 --json catch_up.json
    TRITON_INTERPRET=1 python dev/benchmarks/catch_up_attention.py --device cpu --batch 3 --used 40  # a CPU check

One layer of Qwen3-4B's heads over a bf16 paged pool, rows at the lognormal mix of rows in flight
(``benchmarks/attention_kernel.py``'s ``row_lengths``), times per layer call:

- ``decode``: the engine's kernel today (``kernels.rope_attention``, its launch settings), one query
  a row: what each model pays per layer and token in lockstep;
- ``catch-up xK``: ``catch_up_attention`` with K queries a row, all ending at the row's length (K=1:
  the decode's work through the new kernel);
- ``author-only``: one model's step under the plan. Each row is that model's with probability 1/2;
  of its rows, a share 1/``--span`` has just switched to it and takes in the span the other model
  wrote (length geometric with mean ``--span``; in spans of ``--queries`` tokens), the rest decode
  one token; the other rows are not read. Beside it, ``lockstep`` is the decode's time: the pair's
  ratio is the cache-reading time of a tandem step under the plan over today's.

The catch-ups' keys and values are taken as written (the caller writes them before the kernel;
not timed). The number of decode steps a phase takes rises by about 1/``--span`` under the plan
(one step more per switch): dev/author_only_decode.md carries that into the phase's time.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from attention_kernel import ENGINE_DEFAULT, HEAD_DIM, HEADS, KV_HEADS, inputs, row_lengths  # noqa: E402

from tandem_lit.rollout.static.catch_up import catch_up_attention, catch_up_attention_reference  # noqa: E402
from tandem_lit.rollout.static.kernels import rope_attention  # noqa: E402


def spans_of(length: torch.Tensor, queries: torch.Tensor, per_span: int) -> tuple[torch.Tensor, ...]:
    """Spans (row, first, count, start) for ``queries[i]`` tokens ending at each row's ``length``
    (0: the row is not read), cut into spans of at most ``per_span`` tokens."""
    rows, counts, starts = [], [], []
    for b, (n, q) in enumerate(zip(length.tolist(), queries.tolist())):
        for lo in range(0, q, per_span):
            rows.append(b)
            counts.append(min(per_span, q - lo))
            starts.append(n - q + lo)
    count = torch.tensor(counts)
    first = torch.cat([torch.zeros(1, dtype=torch.long), count.cumsum(0)[:-1]])
    return torch.tensor(rows), first, count, torch.tensor(starts)


def author_only_queries(length: torch.Tensor, span: float, prompt: int, gen: torch.Generator) -> torch.Tensor:
    """One model's queries per row in a step under the plan (module docstring)."""
    batch = length.numel()
    mine = torch.rand(batch, generator=gen) < 0.5
    switched = torch.rand(batch, generator=gen) < 1 / span
    caught = torch.distributions.Geometric(probs=torch.tensor(1 / span)).sample((batch,)).long() + 1
    caught = torch.minimum(caught, (length - prompt).clamp_min(1))
    return torch.where(mine, torch.where(switched, caught, 1), 0)


def time_case(records: list, batch: int, name: str, fn, queries: int) -> None:
    """``fn``'s time on the GPU, printed and added to ``records``."""
    import triton.testing

    us = triton.testing.do_bench(fn, warmup=10, rep=50) * 1000
    print(f"B={batch} {name}: {us:.0f} us ({queries} queries)", flush=True)
    records.append({"batch": batch, "case": name, "us": us, "queries": queries})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[128])
    parser.add_argument("--used", type=int, default=1000, help="the responses' median length (lognormal)")
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--span", type=float, default=4.0,
                        help="tokens a model writes before the other takes over: 4.0 for the word handoff on math "
                             "text (dev/benchmarks/handoff_spans.py), 5.6 in the H100 CLI run (random weights)")
    parser.add_argument("--queries", type=int, nargs="+", default=[4, 8], help="catch_up_attention's queries_per_span")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cpu = args.device == "cpu"
    records = []
    for batch in args.batch:
        length = row_lengths(batch, args.used, "lognormal")
        call_args, table = inputs(length, args.page, torch.bfloat16, args.device)
        q, k_pool, v_pool = call_args[0], call_args[10], call_args[11]
        scale = HEAD_DIM**-0.5
        print(f"B={batch} lognormal positions: mean {float(length.float().mean()):.0f}, longest {int(length.max())}", flush=True)
        timed = functools.partial(time_case, records, batch) if not cpu else lambda *_: None
        timed("decode", functools.partial(rope_attention, *call_args, *ENGINE_DEFAULT, table=table), batch)
        gen = torch.Generator().manual_seed(1)
        cases = {f"catch-up x{k}": (torch.full((batch,), k), max(4, k)) for k in (1, 2, 4, 8)}
        for model in ("senior", "junior"):  # each model its own draw, the same for every per_span
            drawn = author_only_queries(length, args.span, 150, gen)
            for per_span in args.queries:
                cases[f"author-only {model} q{per_span}"] = (drawn, per_span)
        for name, (queries, per_span) in cases.items():
            spans = [x.to(args.device) for x in spans_of(length, queries, per_span)]
            tokens = int(queries.sum())
            qs = torch.randn(max(tokens, 1), HEADS * HEAD_DIM, generator=gen).to(args.device, q.dtype)
            run = functools.partial(catch_up_attention, qs, k_pool, v_pool, table, *spans, scale, HEADS, KV_HEADS,
                                    queries_per_span=per_span)
            # the kernel against its torch reference at these shapes (compiled on a GPU, interpreted on the CPU)
            gap = (run().float() - catch_up_attention_reference(qs, k_pool, v_pool, table, *spans, scale, HEADS,
                                                                KV_HEADS).float()).abs().max().item()
            print(f"B={batch} {name}: {tokens} queries in {spans[0].numel()} spans, max abs difference from "
                  f"the reference {gap:.2e}", flush=True)
            timed(name, run, tokens)
        if not cpu:
            by = {r["case"]: r["us"] for r in records if r["batch"] == batch}
            for per_span in args.queries:
                pair = by[f"author-only senior q{per_span}"] + by[f"author-only junior q{per_span}"]
                print(f"B={batch} author-only pair, spans of {per_span}: {pair:.0f} us against lockstep's "
                      f"{2 * by['decode']:.0f} us: {pair / (2 * by['decode']):.2f} of it", flush=True)
    if args.json:
        device = torch.cuda.get_device_name() if not cpu else "cpu"
        Path(args.json).write_text(json.dumps({"device": device, "span": args.span, "cases": records}, indent=1))


if __name__ == "__main__":
    main()
