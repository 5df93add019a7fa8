"""``catch_up_attention`` in Triton's interpreter (run by tests/test_catch_up_attention.py in a fresh
process with ``TRITON_INTERPRET=1``). Prints each case, then ``ok``.

- Spans of 0 to 4 tokens, several of one row in one launch, rows of different depths, pages that a
  tile of keys straddles, group sizes 4 and 2: the kernel equals the torch reference.
- One span of ``n`` tokens equals ``n`` decode steps of the engine's kernel (``rope_attention``,
  rotary as the identity) that wrote the same keys one at a time: a catch-up reads what the
  lockstep decode would have read.
"""

from __future__ import annotations

import torch

import tests.triton_interpreter  # noqa: F401 (loop bounds read on the device)
from tandem_lit.rollout.static import kernels
from tandem_lit.rollout.static.catch_up import catch_up_attention, catch_up_attention_reference

D, PAGE = 16, 5


def pool_and_table(rows: int, pages_per_row: int, kv_heads: int, gen: torch.Generator):
    pages = rows * pages_per_row + 1  # page 0: scratch, as the engine's pools
    k_pool = torch.randn(pages, kv_heads, PAGE, D, generator=gen)
    v_pool = torch.randn(pages, kv_heads, PAGE, D, generator=gen)
    table = (torch.randperm(pages - 1, generator=gen) + 1).view(rows, pages_per_row).to(torch.int32)
    return k_pool, v_pool, table


def against_the_reference(heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(heads)
    k_pool, v_pool, table = pool_and_table(rows=3, pages_per_row=6, kv_heads=kv_heads, gen=gen)
    # (row, count, start): row 0 decodes one token deep in its cache; row 1 catches up 4 tokens, then
    # 3 more in a second span of the same launch; row 2 catches up 2 tokens from its first slots; a
    # padding span
    spans = [(0, 1, 23), (1, 4, 9), (1, 3, 13), (2, 2, 0), (0, 0, 0)]
    row, count, start = (torch.tensor(x) for x in zip(*spans))
    first = torch.cat([torch.zeros(1, dtype=torch.long), count.cumsum(0)[:-1]])
    q = torch.randn(int(count.sum()), heads * D, generator=gen)
    args = (q, k_pool, v_pool, table, row, first, count, start, D**-0.5, heads, kv_heads)
    got = catch_up_attention(*args, queries_per_span=4, block_n=8)
    torch.testing.assert_close(got, catch_up_attention_reference(*args), rtol=1e-5, atol=1e-5)
    print(f"reference-h{heads}-kv{kv_heads}")


def as_decode_steps() -> None:
    """A row at depth 11 takes 4 tokens in: one catch-up against 4 steps of the decode kernel."""
    heads, kv_heads, depth, n = 8, 2, 11, 4
    gen = torch.Generator().manual_seed(7)
    k_pool, v_pool, table = pool_and_table(rows=1, pages_per_row=4, kv_heads=kv_heads, gen=gen)
    q = torch.randn(n, heads * D, generator=gen)
    new_k, new_v = torch.randn(n, kv_heads * D, generator=gen), torch.randn(n, kv_heads * D, generator=gen)
    length = table.shape[1] * PAGE
    cos, sin = torch.ones(length, D), torch.zeros(length, D)  # rotary as the identity: keys as given
    valid = torch.ones(1, length, dtype=torch.bool)
    k_steps, v_steps = k_pool.clone(), v_pool.clone()
    stepped = []
    for i in range(n):  # the lockstep engine: one token a step, its K/V written by the kernel
        at = torch.tensor([depth + i])
        stepped.append(kernels.rope_attention(q[i : i + 1], new_k[i : i + 1], new_v[i : i + 1], None, None, 0.0, cos, sin,
                                              at, at, k_steps, v_steps, valid, D**-0.5, heads, kv_heads, D,
                                              block_n=8, table=table))
    slots = depth + torch.arange(n)
    pages = table[0, slots // PAGE].long()
    k_pool[pages, :, slots % PAGE] = new_k.view(n, kv_heads, D)  # a catch-up's keys are written first
    v_pool[pages, :, slots % PAGE] = new_v.view(n, kv_heads, D)
    torch.testing.assert_close(k_pool, k_steps)
    torch.testing.assert_close(v_pool, v_steps)
    spans = (torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), torch.tensor([depth]))
    caught_up = catch_up_attention(q, k_pool, v_pool, table, *spans, D**-0.5, heads, kv_heads, queries_per_span=n, block_n=8)
    torch.testing.assert_close(caught_up, torch.cat(stepped), rtol=1e-5, atol=1e-5)
    print("decode-steps")


against_the_reference(heads=8, kv_heads=2)
against_the_reference(heads=4, kv_heads=2)
as_decode_steps()
print("ok")
