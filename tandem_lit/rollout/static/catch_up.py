"""Attention of several new tokens of a row over its paged cache in one read: a catch-up.

The first piece of decoding only the author (dev/author_only_decode.md; not used by the engine yet).
Under that plan a model that did not write a span takes the span in when it takes over, as a chunk
of queries over its cache, so that it reads its cache once per span instead of once per token. Its
cost rests on one assumption this kernel lets a GPU measure (dev/benchmarks/catch_up_attention.py):
that a few queries of a row read the row's cache in about the time one does. The decode kernel's
tile already holds 16 query rows and uses ``group`` of them (4 at Qwen3-4B's heads), so up to four
tokens of a row fill the same tile.

A *span* is ``count`` consecutive tokens of one row at cache slots ``[start, start + count)``, its
queries rows ``[first, first + count)`` of ``q``. Their keys and values are in the pool already (the
caller writes them first, so that spans of one row may run in one launch), and query ``i`` attends
to slots ``[0, start + i]``. A decode step is the case ``count = 1``. One program per span and KV
head walks the span's cache once, its ``count x group`` query rows together in one tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _catch_up_kernel(
    q_ptr, out_ptr, k_pool_ptr, v_pool_ptr, table_ptr, row_ptr, first_ptr, count_ptr, start_ptr,
    group, scale, q_sb, out_sb, pool_sb, pool_sh, pool_ss, table_sb,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, F16_DOT: tl.constexpr,
):
    span = tl.program_id(0)
    kvh = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    dot = tl.float16 if F16_DOT else dtype
    b = tl.load(row_ptr + span)
    first = tl.load(first_ptr + span)
    count = tl.load(count_ptr + span)
    start = tl.load(start_ptr + span)
    m = tl.arange(0, BLOCK_M)  # tile row m: query token m // group, head m % group of this KV head's group
    token = m // group
    live = token < count
    d = tl.arange(0, D)[None, :]
    q_rows = q_ptr + (first + token)[:, None] * q_sb + (kvh * group + m % group)[:, None] * D + d
    q = tl.load(q_rows, mask=live[:, None], other=0.0).to(dot)
    last = start + token  # the last slot each query row attends to (its own)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    keys = k_pool_ptr + kvh * pool_sh
    values = v_pool_ptr + kvh * pool_sh
    for lo in range(0, start + count, BLOCK_N):
        n = lo + tl.arange(0, BLOCK_N)
        in_range = n < start + count
        page = tl.load(table_ptr + b * table_sb + n // PAGE, mask=in_range, other=0).to(tl.int64)
        tile = (page * pool_sb + (n % PAGE) * pool_ss)[:, None] + d
        kt = tl.load(keys + tile, mask=in_range[:, None], other=0.0).to(dot)
        scores = tl.dot(q, tl.trans(kt), input_precision=PRECISION).to(tl.float32) * scale
        seen = in_range[None, :] & (n[None, :] <= last[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        best_new = tl.maximum(best, tl.max(scores, axis=1))
        base = tl.where(best_new == float("-inf"), 0.0, best_new)  # a padded row sees nothing: no -inf - -inf
        p = tl.exp(scores - base[:, None])
        alpha = tl.exp(best - base)
        total = total * alpha + tl.sum(p, axis=1)
        vt = tl.load(values + tile, mask=in_range[:, None], other=0.0).to(dot)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot), vt, input_precision=PRECISION).to(tl.float32)
        best = best_new
    total = tl.where(total > 0, total, 1.0)
    out_rows = out_ptr + (first + token)[:, None] * out_sb + (kvh * group + m % group)[:, None] * D + d
    tl.store(out_rows, (acc / total[:, None]).to(dtype), mask=live[:, None])


def catch_up_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, row: Tensor, first: Tensor, count: Tensor, start: Tensor,
    scale: float, heads: int, kv_heads: int, queries_per_span: int = 4, block_n: int = 64, num_warps: int = 4,
    num_stages: int = 2, f16_dot: bool = False,
) -> Tensor:
    """Grouped-query attention of the spans' query tokens over their rows' paged caches (module
    docstring).  # q [T, H*D]; pools [pages, KV, page_size, D]; table [R, P] int32; spans [S] -> [T, H*D]

    ``row``, ``first``, ``count``, ``start``: per span (int32 or int64, on q's device), with
    ``count <= queries_per_span`` (0: a padding span, which writes nothing). Query rows no span
    names are left as they were (uninitialised). Keys and values as the pool holds them (an 8-bit
    pool widened to q's dtype, or to float16 with ``f16_dot``, as ``kernels.rope_attention``)."""
    if f16_dot and k_pool.dtype != torch.float8_e4m3fn:
        raise ValueError("f16_dot reads an 8-bit cache only")
    head_dim = k_pool.shape[-1]
    group = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(queries_per_span * group))
    out = torch.empty((q.shape[0], heads * head_dim), dtype=q.dtype, device=q.device)
    if row.numel() == 0:
        return out
    _catch_up_kernel[(row.numel(), kv_heads)](
        q, out, k_pool, v_pool, table, row, first, count, start,
        group, scale, q.stride(0), out.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), table.stride(0),
        D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=k_pool.shape[2],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", F16_DOT=f16_dot,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def catch_up_attention_reference(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, row: Tensor, first: Tensor, count: Tensor, start: Tensor,
    scale: float, heads: int, kv_heads: int,
) -> Tensor:
    """``catch_up_attention`` in torch, one span at a time (the check the kernel is held to)."""
    head_dim = k_pool.shape[-1]
    group = heads // kv_heads
    out = torch.zeros((q.shape[0], heads * head_dim), dtype=q.dtype, device=q.device)
    page_size = k_pool.shape[2]
    for b, f, n, s in zip(row.tolist(), first.tolist(), count.tolist(), start.tolist()):
        if n == 0:
            continue
        slots = torch.arange(s + n, device=q.device)
        pages = table[b, slots // page_size].long()
        keys = k_pool[pages, :, slots % page_size].to(q.dtype)  # [s + n, KV, D]
        values = v_pool[pages, :, slots % page_size].to(q.dtype)
        queries = q[f : f + n].view(n, kv_heads, group, head_dim)
        scores = torch.einsum("nkgd,skd->nkgs", queries.float(), keys.float()) * scale
        causal = slots[None, :] <= (s + torch.arange(n, device=q.device))[:, None]  # [n, s + n]
        scores = scores.masked_fill(~causal[:, None, None, :], float("-inf"))
        attended = torch.einsum("nkgs,skd->nkgd", scores.softmax(-1), values.float())
        out[f : f + n] = attended.reshape(n, heads * head_dim).to(q.dtype)
    return out
