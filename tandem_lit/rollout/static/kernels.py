"""Triton kernels for FastEngine's decode step on GPU.

A decode step of a Llama-family block is a few matrix-vector products (cuBLAS, bandwidth bound)
and a swarm of small elementwise ops that cost more in kernel gaps than in bytes. These kernels
fuse that swarm, so one layer runs 8 kernels (with fused q/k/v and gate/up weights) instead of about 60:

- ``add_rms_norm``: residual add + RMSNorm (the residual stream is updated in place);
- ``rope_attention``: per-head Q/K RMSNorm (Qwen3), rotary embedding, the K/V cache write and
  grouped-query attention of the new token over the cache (online softmax), reading only the
  slots written so far (each row's bound is read on the device, so one CUDA graph serves every
  step, and rows admitted at different steps sit at different depths);
- ``silu_mul``: the gated MLP's activation;
- ``sample_rows`` / ``token_logprobs``: the decoder's inverse-CDF draw (rows from either model's
  logits, optionally restricted to allowed start tokens) and the senior's log-probs, each one
  pass over the logits instead of a dozen elementwise passes;
- ``conv_silu_step`` / ``delta_rule_step``: a Gated DeltaNet layer's step (Qwen3.5's linear
  attention, ``hybrid.py``) in two kernels: the short convolution, then q/k normalisation, gate,
  the recurrence (one read and one write of the float32 state) and the gated RMSNorm;
- ``gated_attention``: Qwen3.5's full-attention step: zero-centred q/k norms, rotary on part of
  each head, the cache write, attention and the output gate, one kernel per layer.

Numerics follow transformers' eager Llama/Qwen3 code (fp32 norms and softmax, rounding to the
model dtype where it rounds), and for Qwen3.5 its training forward under bf16 autocast (a float32
residual stream, float32 norm weights; ``hybrid.py``); results agree to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n, eps, HAS_DELTA: tl.constexpr, ONE_PLUS: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:  # Qwen3.5's zero-centred weight, applied in float32 before rounding
        out = x32 * tl.rsqrt(variance + eps) * (1.0 + w)
    else:  # Llama/Qwen3: round the normalised value, then scale
        out = w * (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, one_plus: bool = False,
                 out_dtype: torch.dtype | None = None) -> Tensor:
    """``x += delta`` (in place, if given), then RMSNorm(x) * weight (``one_plus``: * (1 + weight),
    Qwen3.5's zero-centred norm), in ``out_dtype`` (default: x's; a float32 residual stream
    ``x`` with bf16 deltas and a bf16 output is what bf16 autocast computes).  # [M, N] -> [M, N]"""
    rows, n = x.shape
    out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, out, n, eps,
        HAS_DELTA=delta is not None, ONE_PLUS=one_plus, BLOCK=triton.next_power_of_2(n),
    )
    return out


@triton.jit
def _norm_rope(x1, x2, w_ptr, offs, mask, half, d, eps, c1, c2, s1, s2, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """Heads as two fp32 halves [heads, HALF]: Qwen3's per-head RMSNorm (when HAS_NORM), then
    rotary (rotate_half(x) * sin + x * cos), rounded to the model dtype like transformers' code."""
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / d + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return (x1 * c1 - x2 * s1).to(DTYPE), (x2 * c2 + x1 * s2).to(DTYPE)


@triton.jit
def _to_cache(x, cache_ptr, FP8: tl.constexpr):
    """Keys or values into the dtype of the cache at ``cache_ptr``: an 8-bit (e4m3) cache clamps
    to its +-448 first (it has no infinity), as ``blocks.to_cache`` does on the torch path."""
    if FP8:  # rounded to nearest, ties to even, as torch's conversion rounds
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        return x.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rope_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, k_cache_ptr, v_cache_ptr, valid_ptr,
    q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr,
    heads, group, d, eps, scale, q_sb, k_sb, v_sb, cache_sb, cache_sh, cache_ss, valid_sb, table_sb,
    part_out_ptr, part_lse_ptr, chunk, splits, order_ptr,
    HAS_NORM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
    PRECISION: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
    F16_DOT: tl.constexpr, ORDERED: tl.constexpr,
):
    if ORDERED:  # rows in ``order``, each row's KV heads side by side (rope_attention's ``order``)
        kvh = tl.program_id(0)
        b = tl.load(order_ptr + tl.program_id(1))
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    part = tl.program_id(2)  # split: this program's share of the row's slots, [part * chunk, (part + 1) * chunk)
    dtype = out_ptr.dtype.element_ty
    dot = tl.float16 if F16_DOT else dtype  # the products' inputs (F16_DOT: an 8-bit cache widened to float16)
    half = d // 2
    offs = tl.arange(0, HALF)[None, :]  # [1, HALF]: every head below is 2-D, [heads, HALF]
    mask = offs < half
    g = tl.arange(0, BLOCK_G)[:, None]
    qmask = (g < group) & mask
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)  # this row's new-token cache slot; slots [0, slot) hold earlier keys
    c1 = tl.load(cos_ptr + pos * d + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * d + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * d + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * d + half + offs, mask=mask, other=0.0).to(tl.float32)
    # this KV head's query group [G, HALF] x 2 halves, and the new key/value [1, HALF] x 2
    q_rows = q_ptr + b * q_sb + (kvh * group + g) * d + offs
    q1, q2 = _norm_rope(tl.load(q_rows, mask=qmask, other=0.0).to(tl.float32),
                        tl.load(q_rows + half, mask=qmask, other=0.0).to(tl.float32),
                        q_norm_ptr, offs, mask, half, d, eps, c1, c2, s1, s2, HAS_NORM, dot)
    k_row = k_ptr + b * k_sb + kvh * d + offs
    k1, k2 = _norm_rope(tl.load(k_row, mask=mask, other=0.0).to(tl.float32),
                        tl.load(k_row + half, mask=mask, other=0.0).to(tl.float32),
                        k_norm_ptr, offs, mask, half, d, eps, c1, c2, s1, s2, HAS_NORM, dtype)
    v_row = v_ptr + b * v_sb + kvh * d + offs
    v1 = tl.load(v_row, mask=mask, other=0.0)
    v2 = tl.load(v_row + half, mask=mask, other=0.0)
    if PAGED:  # the pool [pages, KV, PAGE, D]: this row's slots through its block-table row
        cache = kvh * cache_sh
        new = tl.load(table_ptr + b * table_sb + slot // PAGE).to(tl.int64) * cache_sb + (slot % PAGE) * cache_ss + cache + offs
    else:
        cache = b * cache_sb + kvh * cache_sh
        new = cache + slot * cache_ss + offs
    # the new token's K/V as the cache holds them (an 8-bit cache: rounded, and attended to so, as
    # the torch path reads it back)
    k1, k2 = _to_cache(k1, k_cache_ptr, FP8), _to_cache(k2, k_cache_ptr, FP8)
    v1, v2 = _to_cache(v1, v_cache_ptr, FP8), _to_cache(v2, v_cache_ptr, FP8)
    first = part == 0  # the first split writes the new token's K/V and starts from it; no split reads that slot
    write = mask & (offs * 0 + part == 0)  # (`first` as a [1, HALF] mask: the interpreter takes no scalar in one)
    tl.store(k_cache_ptr + new, k1, mask=write)
    tl.store(k_cache_ptr + new + half, k2, mask=write)
    tl.store(v_cache_ptr + new, v1, mask=write)
    tl.store(v_cache_ptr + new + half, v2, mask=write)
    k1, k2, v1, v2 = k1.to(dot), k2.to(dot), v1.to(dot), v2.to(dot)
    # online softmax, seeded with the new token (always attendable) from registers; a later split
    # starts empty (its running maximum at -inf until a valid slot is seen)
    m = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1)
         + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)) * scale  # [G]
    m = tl.where(first, m, float("-inf"))
    l_sum = tl.where(first, tl.full([BLOCK_G], 1.0, tl.float32), 0.0)
    acc1 = tl.where(first, tl.zeros([BLOCK_G, HALF], tl.float32) + v1.to(tl.float32), 0.0)
    acc2 = tl.where(first, tl.zeros([BLOCK_G, HALF], tl.float32) + v2.to(tl.float32), 0.0)
    keys = k_cache_ptr + cache
    values = v_cache_ptr + cache
    if SPLIT:
        lo = part * chunk
        hi = tl.minimum(lo + chunk, slot)
    else:
        lo = 0
        hi = slot
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < hi
        ok = in_range & (tl.load(valid_ptr + b * valid_sb + n, mask=in_range, other=0) != 0)
        if PAGED:
            page = tl.load(table_ptr + b * table_sb + n // PAGE, mask=in_range, other=0).to(tl.int64)
            tile = (page * cache_sb + (n % PAGE) * cache_ss)[:, None] + offs
        else:
            tile = n[:, None] * cache_ss + offs
        tile_mask = in_range[:, None] & mask
        kt1 = tl.load(keys + tile, mask=tile_mask, other=0.0).to(dot)
        kt2 = tl.load(keys + tile + half, mask=tile_mask, other=0.0).to(dot)
        scores = (tl.dot(q1, tl.trans(kt1), input_precision=PRECISION)
                  + tl.dot(q2, tl.trans(kt2), input_precision=PRECISION)).to(tl.float32) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with nothing valid yet: no -inf - -inf
        p = tl.exp(scores - m_base[:, None])
        alpha = tl.exp(m - m_base)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vt1 = tl.load(values + tile, mask=tile_mask, other=0.0).to(dot)
        vt2 = tl.load(values + tile + half, mask=tile_mask, other=0.0).to(dot)
        acc1 = acc1 * alpha[:, None] + tl.dot(p.to(vt1.dtype), vt1, input_precision=PRECISION).to(tl.float32)
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(vt2.dtype), vt2, input_precision=PRECISION).to(tl.float32)
        m = m_new
    if SPLIT:  # this split's normalised output and log-sum-exp, merged by _merge_splits_kernel
        # a split past the row's slots stores nothing: the merge reads a row's first cdiv(slot, chunk)
        # splits only (at least the first), so short rows cost no traffic for the splits they lack
        # (as [1, HALF] and [G] masks: the interpreter takes no scalar in one)
        stored = (offs * 0 + part == 0) | (offs * 0 + lo < slot)
        lse_rows = tl.arange(0, BLOCK_G)
        lse_stored = (lse_rows < group) & ((lse_rows * 0 + part == 0) | (lse_rows * 0 + lo < slot))
        seen = l_sum > 0
        l_safe = tl.where(seen, l_sum, 1.0)
        at = ((b * (heads // group) + kvh) * splits + part) * group  # this split's [G] rows
        rows = part_out_ptr + (at + g) * (2 * HALF) + offs
        tl.store(rows, acc1 / l_safe[:, None], mask=qmask & stored)
        tl.store(rows + HALF, acc2 / l_safe[:, None], mask=qmask & stored)
        tl.store(part_lse_ptr + at + lse_rows, tl.where(seen, m + tl.log(l_safe), float("-inf")), mask=lse_stored)
    else:
        out = out_ptr + b * heads * d + (kvh * group + g) * d + offs
        tl.store(out, (acc1 / l_sum[:, None]).to(dtype), mask=qmask)
        tl.store(out + half, (acc2 / l_sum[:, None]).to(dtype), mask=qmask)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, slot_ptr, heads, group, d, splits, chunk,
                         BLOCK_G: tl.constexpr, HALF: tl.constexpr):
    """The splits of one row and KV head, merged by their log-sum-exps (flash-decoding's
    second pass): softmax over all the row's slots = the splits' outputs weighted by
    exp(lse_split - lse_row). Only the splits that hold some of the row's slots: the first
    cdiv(slot, chunk), at least one (the first holds the new token)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    used = tl.maximum(tl.minimum((tl.load(slot_ptr + b) + chunk - 1) // chunk, splits), 1)
    half = d // 2
    offs = tl.arange(0, HALF)[None, :]
    g = tl.arange(0, BLOCK_G)[:, None]
    qmask = (g < group) & (offs < half)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_G, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_G, HALF], tl.float32)
    for part in range(0, used):
        at = ((b * tl.num_programs(1) + kvh) * splits + part) * group
        lse = tl.load(part_lse_ptr + at + tl.arange(0, BLOCK_G), mask=tl.arange(0, BLOCK_G) < group,
                      other=float("-inf"))
        rows = part_out_ptr + (at + g) * (2 * HALF) + offs
        o1 = tl.load(rows, mask=qmask, other=0.0)
        o2 = tl.load(rows + HALF, mask=qmask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_base)
        w = tl.exp(lse - m_base)
        l_sum = l_sum * alpha + w
        acc1 = acc1 * alpha[:, None] + w[:, None] * o1
        acc2 = acc2 * alpha[:, None] + w[:, None] * o2
        m = m_new
    l_safe = tl.where(l_sum > 0, l_sum, 1.0)
    out = out_ptr + b * heads * d + (kvh * group + g) * d + offs
    dtype = out_ptr.dtype.element_ty
    tl.store(out, (acc1 / l_safe[:, None]).to(dtype), mask=qmask)
    tl.store(out + half, (acc2 / l_safe[:, None]).to(dtype), mask=qmask)


def rope_attention(
    q: Tensor, k: Tensor, v: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
    cos: Tensor, sin: Tensor, position: Tensor, slot: Tensor, k_cache: Tensor, v_cache: Tensor, valid: Tensor,
    scale: float, heads: int, kv_heads: int, head_dim: int, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int = 2, table: Tensor | None = None, split_positions: int | None = None, f16_dot: bool = False,
    order: Tensor | None = None,
) -> Tensor:
    """One new token per sequence: (Qwen3) q/k norm, rotary, K/V written at ``slot``, then
    grouped-query attention over the valid cache slots [0, slot] — one kernel per layer.

    q [B, H*D], k/v [B, KV*D] (rows may be strided views of one fused projection), cos/sin
    [S, D], position [B], slot [B] (each row's own), caches [Bcap, KV, S, D], valid [Bcap, S] bool -> [B, H*D].
    Paged: caches are pools [pages, KV, page_size, D] (the slot layout with positions cut into
    pages) and ``table`` [Bcap, S / page_size] int32 maps each row's slot ``s`` to position
    ``s % page_size`` of pool page ``table[row, s // page_size]``. The caches may be 8-bit
    (float8_e4m3fn, ``FastEngine(kv_cache_dtype="fp8")``): written clamped and rounded, read widened
    to q's dtype.

    ``split_positions`` (a multiple of ``block_n``): each row's slots in chunks of that many, one
    program per chunk, merged by a second kernel (flash-decoding), so a long row is read by several
    programs at once instead of one; ``None``: one program per row and KV head. ``f16_dot`` (an
    8-bit cache only): the products take float16 inputs, to which e4m3 widens in one instruction
    per pair on a GPU, instead of q's dtype (the engine's choice for a 16-bit model:
    ``StaticDecoderModel.f16_products``).

    ``order`` [B] (a permutation of the rows, e.g. ``plain.longest_first(slot)``): the
    programs start row by row in that order, each row's KV heads side by side, instead of row-major
    by KV head. Where fewer programs fit on the card at once than the grid holds (at 128 rows of
    Qwen3-4B's heads, by the registers tests/kernels_compiled.py reports), the rows that start last
    set the kernel's end; longest first, the longest rows are not among them. The engine's decode
    passes it (``StaticDecoderModel._decode_triton``); benchmarks/attention_kernel.py times both.
    """
    if f16_dot and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError("f16_dot reads an 8-bit cache only")
    batch = q.shape[0]
    # tuned with dev/benchmarks/attention_tune.py at Qwen3-4B's heads: from batch 64 up, many
    # programs are in flight and small ones win; below, each program must pull more bytes
    tuned_n, tuned_warps = (64, 2) if batch >= 64 else (128, 4)
    block_n, num_warps = block_n or tuned_n, num_warps or tuned_warps
    out = torch.empty((batch, heads * head_dim), dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    group = heads // kv_heads
    block_g, half = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim // 2))
    splits = 1
    if split_positions is not None:
        if split_positions % block_n:
            raise ValueError(f"split_positions ({split_positions}) must be a multiple of block_n ({block_n})")
        capacity = table.shape[1] * k_cache.shape[2] if table is not None else k_cache.shape[2]  # slots a row may hold
        splits = triton.cdiv(capacity, split_positions)
    # each split's output [B, KV, splits, G, 2 * HALF] and log-sum-exp [B, KV, splits, G], in float32
    part_out = torch.empty((batch, kv_heads, splits, group, 2 * half) if splits > 1 else (1,), dtype=torch.float32,
                           device=q.device)
    part_lse = torch.empty((batch, kv_heads, splits, group) if splits > 1 else (1,), dtype=torch.float32,
                           device=q.device)
    grid = (kv_heads, batch, splits) if order is not None else (batch, kv_heads, splits)
    _rope_attention_kernel[grid](
        q, k, v, out, k_cache, v_cache, valid.view(torch.uint8),
        q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, position, slot,
        table if table is not None else slot,
        heads, group, head_dim, eps, scale, q.stride(0), k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), valid.stride(0),
        table.stride(0) if table is not None else 0, part_out, part_lse, split_positions or 0, splits,
        order if order is not None else slot,
        HAS_NORM=has_norm, BLOCK_G=block_g, BLOCK_N=block_n, HALF=half,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
        PAGED=table is not None, PAGE=k_cache.shape[2] if table is not None else 1,
        FP8=k_cache.dtype == torch.float8_e4m3fn, SPLIT=splits > 1, F16_DOT=f16_dot, ORDERED=order is not None,
    )
    if splits > 1:
        _merge_splits_kernel[(batch, kv_heads)](part_out, part_lse, out, slot, heads, group, head_dim, splits,
                                                split_positions, BLOCK_G=block_g, HALF=half, num_warps=2)
    return out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, gate_sb, up_sb, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_ptr + row * gate_sb + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_sb + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (act * up).to(dtype), mask=mask)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up; inputs may be strided row views of one fused projection.  # [M, N] -> [M, N]"""
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=1024)
    return out


@triton.jit
def _sample_kernel(
    a_ptr, b_ptr, pick_b_ptr, u_ptr, allowed_ptr, out_ptr, scratch_ptr, a_sb, b_sb, allowed_sb, inv_t,
    V: tl.constexpr, HAS_B: tl.constexpr, HAS_ALLOWED: tl.constexpr, GREEDY: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr,
):
    row = tl.program_id(0)
    base = a_ptr + row * a_sb
    if HAS_B:  # this row samples from the other model's logits
        if tl.load(pick_b_ptr + row) != 0:
            base = b_ptr + row * b_sb
    allowed = allowed_ptr + row * allowed_sb
    cols = tl.arange(0, BLOCK)
    scratch = scratch_ptr + row * 2 * BLOCKS_P2
    # one pass: each block's max and its sum of exp((x - block max) / T), the row's max and argmax
    m = float("-inf")
    best = 0
    for i in range(0, BLOCKS):
        x = tl.load(base + i * BLOCK + cols, mask=i * BLOCK + cols < V, other=float("-inf"))
        if HAS_ALLOWED:
            ok = tl.load(allowed + i * BLOCK + cols, mask=i * BLOCK + cols < V, other=0) != 0
            x = tl.where(ok, x, float("-inf"))
        block_max, block_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(block_max > m, i * BLOCK + block_arg, best)  # strict: the first maximum wins
        m = tl.maximum(m, block_max)
        if not GREEDY:
            shift = tl.where(block_max == float("-inf"), 0.0, block_max)
            tl.store(scratch + i, tl.sum(tl.exp((x - shift) * inv_t), axis=0))
            tl.store(scratch + BLOCKS_P2 + i, block_max)
    if GREEDY:
        tl.store(out_ptr + row, best)
    else:
        tl.debug_barrier()  # the block sums above were stored by other threads of this program
        blocks = tl.arange(0, BLOCKS_P2)
        sums = tl.load(scratch + blocks, mask=blocks < BLOCKS, other=0.0)
        maxes = tl.load(scratch + BLOCKS_P2 + blocks, mask=blocks < BLOCKS, other=float("-inf"))
        weights = sums * tl.exp((maxes - m) * inv_t)  # every block against the row's max
        cdf = tl.cumsum(weights, axis=0)
        target = tl.load(u_ptr + row) * tl.sum(weights, axis=0)
        chosen = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), BLOCKS - 1)  # first block past target
        before = tl.sum(tl.where(blocks < chosen, weights, 0.0), axis=0)
        x = tl.load(base + chosen * BLOCK + cols, mask=chosen * BLOCK + cols < V, other=float("-inf"))
        if HAS_ALLOWED:
            ok = tl.load(allowed + chosen * BLOCK + cols, mask=chosen * BLOCK + cols < V, other=0) != 0
            x = tl.where(ok, x, float("-inf"))
        w = tl.exp((x - m) * inv_t)
        offset = tl.minimum(tl.sum((tl.cumsum(w, axis=0) <= target - before).to(tl.int32), axis=0), BLOCK - 1)
        w_at = tl.sum(tl.where(cols == offset, w, 0.0), axis=0)
        # rounding between the two levels can land on a zero-weight token: take the mode instead
        tl.store(out_ptr + row, tl.where(w_at > 0, chosen * BLOCK + offset, best))


def sample_rows(a: Tensor, u: Tensor, temperature: float, b: Tensor | None = None, pick_b: Tensor | None = None,
                allowed: Tensor | None = None, block: int = 2048) -> Tensor:
    """One token per row by inverse CDF with the uniforms ``u`` (argmax when temperature is 0):
    the fused GPU form of ``sampling.sample_tokens`` without top-k/top-p.

    a, b [B, V] float32 (row-strided), pick_b [B] bool: rows drawn from b instead of a;
    allowed [V] or [B, V] bool: tokens that may be drawn -> [B] long
    """
    batch, vocab = a.shape
    blocks = triton.cdiv(vocab, block)
    out = torch.empty(batch, dtype=torch.long, device=a.device)
    scratch = torch.empty((batch, 2 * triton.next_power_of_2(blocks)), dtype=torch.float32, device=a.device)
    if allowed is not None:
        if allowed.stride(-1) != 1:
            allowed = allowed.contiguous()
        allowed = allowed.view(torch.uint8)
    _sample_kernel[(batch,)](
        a, b if b is not None else a, pick_b if pick_b is not None else u, u,
        allowed if allowed is not None else a, out, scratch,
        a.stride(0), b.stride(0) if b is not None else 0,
        (allowed.stride(0) if allowed.dim() == 2 else 0) if allowed is not None else 0,
        1.0 / temperature if temperature > 0 else 1.0,
        V=vocab, HAS_B=b is not None, HAS_ALLOWED=allowed is not None, GREEDY=temperature == 0,
        BLOCK=block, BLOCKS=blocks, BLOCKS_P2=triton.next_power_of_2(blocks), num_warps=8,
    )
    return out


@triton.jit
def _set_lse_step(x, in_set, m, total):
    """One block of an online log-sum-exp over the entries of ``x`` in a set (which may hold none)."""
    x = tl.where(in_set, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)


@triton.jit
def _token_logprob_kernel(x_ptr, token_ptr, out_ptr, x_sb, inv_t, sets_ptr, start_ptr, end_ptr, end_out_ptr,
                          V: tl.constexpr, BLOCK: tl.constexpr, HAS_SETS: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    total = 0.0
    # the switch sets (rollout.switch): each row's start and end set, 1-based rows of sets [K, V]
    m_start, total_start, m_end, total_end = float("-inf"), 0.0, float("-inf"), 0.0
    if HAS_SETS:
        start_code = tl.load(start_ptr + row)
        end_code = tl.load(end_ptr + row)
        start_row = sets_ptr + tl.maximum(start_code - 1, 0) * V
        end_row = sets_ptr + tl.maximum(end_code - 1, 0) * V
    for first in range(0, V, BLOCK):  # online log-sum-exp of x / T (and of its entries in each set)
        inside = first + cols < V
        x = tl.load(x_ptr + row * x_sb + first + cols, mask=inside, other=float("-inf")) * inv_t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if HAS_SETS:
            m_start, total_start = _set_lse_step(x, tl.load(start_row + first + cols, mask=inside, other=0) != 0,
                                                 m_start, total_start)
            m_end, total_end = _set_lse_step(x, tl.load(end_row + first + cols, mask=inside, other=0) != 0,
                                             m_end, total_end)
    lse = m + tl.log(total)
    chosen = tl.load(x_ptr + row * x_sb + tl.load(token_ptr + row)) * inv_t
    logp = chosen - lse
    if HAS_SETS:
        logp = logp - tl.where(start_code > 0, m_start + tl.log(total_start) - lse, 0.0)
        tl.store(end_out_ptr + row, tl.where(end_code > 0, m_end + tl.log(total_end) - lse, 0.0))
    tl.store(out_ptr + row, logp)


def token_logprobs(logits: Tensor, token: Tensor, temperature: float, sets: Tensor | None = None,
                   start: Tensor | None = None, end: Tensor | None = None,
                   block: int = 4096) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / T)[token] per row, in one pass; with switch ``sets`` [K, V] bool and
    per-row ``start`` / ``end`` codes (``rollout.switch``): the log-prob under each row's start set
    and the log-mass of its end set, as ``switch.set_log_mass`` computes them.
    # [B, V] float32, [B] long -> ([B] float32, [B] float32 or None)"""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    has_sets = sets is not None and start is not None
    end_out = torch.empty(batch, dtype=torch.float32, device=logits.device) if has_sets else None
    table = sets.contiguous().view(torch.uint8) if has_sets else out
    _token_logprob_kernel[(batch,)](logits, token, out, logits.stride(0), 1.0 / temperature, table,
                                    start if has_sets else token, end if has_sets else token,
                                    end_out if has_sets else out,
                                    V=vocab, BLOCK=block, HAS_SETS=has_sets, num_warps=8)
    return out, end_out


@triton.jit
def _conv_silu_kernel(x_ptr, state_ptr, w_ptr, out_ptr, channels, x_sb, K: tl.constexpr, BLOCK: tl.constexpr):
    """The short causal convolution's decode step: shift each channel's window by the new input,
    out = silu(window . weight); one program per (sequence, block of channels)."""
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < channels
    base = state_ptr + row * channels * K + c * K
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K - 1):
        value = tl.load(base + j + 1, mask=mask, other=0.0)
        tl.store(base + j, value, mask=mask)
        acc += value.to(tl.float32) * tl.load(w_ptr + c * K + j, mask=mask, other=0.0).to(tl.float32)
    new = tl.load(x_ptr + row * x_sb + c, mask=mask, other=0.0)
    tl.store(base + K - 1, new, mask=mask)
    acc += new.to(tl.float32) * tl.load(w_ptr + c * K + K - 1, mask=mask, other=0.0).to(tl.float32)
    conv = acc.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * channels + c, (conv / (1.0 + tl.exp(-conv))).to(dtype), mask=mask)


def conv_silu_step(x: Tensor, state: Tensor, weight: Tensor) -> Tensor:
    """x [B, C] (a strided row view is fine), state [B, C, K] updated in place, weight [C, K]
    -> silu(causal conv over the last K inputs) [B, C]."""
    batch, channels, kernel = state.shape
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    _conv_silu_kernel[(batch, triton.cdiv(channels, 256))](x, state, weight, out, channels, x.stride(0), K=kernel, BLOCK=256)
    return out


@triton.jit
def _delta_rule_kernel(
    mixed_ptr, a_ptr, b_ptr, z_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, state_ptr, out_ptr,
    mixed_sb, a_sb, b_sb, z_sb, heads, group, key_size, eps,
    DK: tl.constexpr, DV: tl.constexpr,
):
    """A Gated DeltaNet layer's decode step after the convolution, for one (sequence, value head):
    L2-normalised q and k, the gate and beta, one read and one write of the [DK, DV] float32
    state, then the gated RMSNorm of the output (rounding where transformers' forward rounds under
    bf16 autocast)."""
    pid = tl.program_id(0)
    row, head = pid // heads, pid % heads
    key_head = head // group
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    dtype = out_ptr.dtype.element_ty
    q = tl.load(mixed_ptr + row * mixed_sb + key_head * DK + dk).to(tl.float32)
    k = tl.load(mixed_ptr + row * mixed_sb + key_size + key_head * DK + dk).to(tl.float32)
    v = tl.load(mixed_ptr + row * mixed_sb + 2 * key_size + head * DV + dv).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) / tl.sqrt(DK * 1.0)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(a_ptr + row * a_sb + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
    b = tl.load(b_ptr + row * b_sb + head).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-b))).to(dtype).to(tl.float32)
    offsets = pid * DK * DV + dk[:, None] * DV + dv[None, :]
    state = tl.load(state_ptr + offsets) * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(state_ptr + offsets, state)
    out = tl.sum(state * q[:, None], axis=0).to(dtype).to(tl.float32)
    normed = (out * tl.rsqrt(tl.sum(out * out, axis=0) / DV + eps)).to(dtype).to(tl.float32)
    scaled = tl.load(norm_w_ptr + dv).to(tl.float32) * normed  # float32, as autocast over float32 weights
    z = tl.load(z_ptr + row * z_sb + head * DV + dv).to(tl.float32)
    tl.store(out_ptr + row * heads * DV + head * DV + dv, (scaled * (z / (1.0 + tl.exp(-z)))).to(dtype))


def delta_rule_step(mixed: Tensor, a: Tensor, b: Tensor, z: Tensor, a_log: Tensor, dt_bias: Tensor, norm_weight: Tensor,
                    state: Tensor, key_heads: int, eps: float, num_warps: int = 4) -> Tensor:
    """mixed [B, 2 Hk Dk + Hv Dv] (activated q|k|v), a, b [B, Hv], z [B, Hv Dv] (strided row views
    allowed), state [B, Hv, Dk, Dv] float32 (updated in place) -> the gated, normed output [B, Hv Dv]."""
    batch, heads, dk, dv = state.shape
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"delta_rule_step needs power-of-two head sizes, got {dk} and {dv}")
    out = torch.empty((batch, heads * dv), dtype=mixed.dtype, device=mixed.device)
    _delta_rule_kernel[(batch * heads,)](
        mixed, a, b, z, a_log, dt_bias, norm_weight, state, out,
        mixed.stride(0), a.stride(0), b.stride(0), z.stride(0), heads, heads // key_heads, key_heads * dk, eps,
        # 4 warps: at 8 a program spills its 128 x 128 float32 state out of registers (dev/log.md)
        DK=dk, DV=dv, num_warps=num_warps,
    )
    return out


@triton.jit
def _norm_1p_partial_rope(rows, partner_rows, row_mask, w_ptr, offs, partner, d, rot, eps, cos, sin, sign,
                          DTYPE: tl.constexpr):
    """Qwen3.5's zero-centred per-head RMSNorm (x * (1 + w), fp32, rounded once), then rotary on
    the first ``rot`` dimensions only (rotate_half within them), rounding where torch does in bf16."""
    in_head = offs < d
    x = tl.load(rows, mask=row_mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / d + eps)[:, None]
    x = (x * inv * (1.0 + tl.load(w_ptr + offs, mask=in_head, other=0.0).to(tl.float32))).to(DTYPE)
    xp = tl.load(partner_rows, mask=row_mask, other=0.0).to(tl.float32)
    xp = (xp * inv * (1.0 + tl.load(w_ptr + partner, mask=in_head, other=0.0).to(tl.float32))).to(DTYPE)
    rotated = ((x * cos).to(DTYPE) + (sign * xp * sin).to(DTYPE)).to(DTYPE)
    return tl.where(offs < rot, rotated, x)


@triton.jit
def _gated_attention_kernel(
    qg_ptr, k_ptr, v_ptr, out_ptr, k_cache_ptr, v_cache_ptr, valid_ptr,
    q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr,
    heads, group, d, rot, eps, scale, qg_sb, k_sb, v_sb, cache_sb, cache_sh, cache_ss, valid_sb, table_sb,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr,
):
    """Qwen3.5's gated full attention for one (sequence, KV head) and its query group: q/k norms,
    partial rotary, the K/V cache write, attention over the valid slots (online softmax, seeded
    with the new token), and the output gate sigmoid(g) from q_proj's second half of each head."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]: heads below are [rows, BLOCK_D]
    in_head = offs < d
    half = rot // 2
    partner = tl.where(offs < half, offs + half, tl.where(offs < rot, offs - half, offs))
    sign = tl.where(offs < half, -1.0, 1.0)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b)  # this row's new-token cache slot; slots [0, slot) hold earlier keys
    in_rot = offs < rot
    cos = tl.load(cos_ptr + pos * rot + offs, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * rot + offs, mask=in_rot, other=0.0).to(tl.float32)
    g = tl.arange(0, BLOCK_G)[:, None]
    qmask = (g < group) & in_head
    head_rows = qg_ptr + b * qg_sb + (kvh * group + g) * (2 * d)  # q_proj: [q | gate] per head
    q = _norm_1p_partial_rope(head_rows + offs, head_rows + partner, qmask, q_norm_ptr, offs, partner, d, rot, eps,
                              cos, sin, sign, dtype)
    k_row = k_ptr + b * k_sb + kvh * d
    k = _norm_1p_partial_rope(k_row + offs, k_row + partner, in_head, k_norm_ptr, offs, partner, d, rot, eps,
                              cos, sin, sign, dtype)
    v = tl.load(v_ptr + b * v_sb + kvh * d + offs, mask=in_head, other=0.0)
    if PAGED:  # the pool [pages, KV, PAGE, D]: this row's slots through its block-table row
        cache = kvh * cache_sh
        new = tl.load(table_ptr + b * table_sb + slot // PAGE).to(tl.int64) * cache_sb + (slot % PAGE) * cache_ss + cache
    else:
        cache = b * cache_sb + kvh * cache_sh
        new = cache + slot * cache_ss
    tl.store(k_cache_ptr + new + offs, k, mask=in_head)
    tl.store(v_cache_ptr + new + offs, v, mask=in_head)
    m = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale  # [G]
    l_sum = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v.to(tl.float32)
    for start in range(0, slot, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < slot
        ok = in_range & (tl.load(valid_ptr + b * valid_sb + n, mask=in_range, other=0) != 0)
        if PAGED:
            page = tl.load(table_ptr + b * table_sb + n // PAGE, mask=in_range, other=0).to(tl.int64)
            tile = cache + (page * cache_sb + (n % PAGE) * cache_ss)[:, None] + offs
        else:
            tile = cache + n[:, None] * cache_ss + offs
        tile_mask = in_range[:, None] & in_head
        kt = tl.load(k_cache_ptr + tile, mask=tile_mask, other=0.0)
        scores = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_cache_ptr + tile, mask=tile_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m = m_new
    attended = (acc / l_sum[:, None]).to(dtype)
    gate = tl.load(head_rows + d + offs, mask=qmask, other=0.0).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + b * heads * d + (kvh * group + g) * d + offs, (attended * gate).to(dtype), mask=qmask)


def gated_attention(
    q_and_gate: Tensor, k: Tensor, v: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float, cos: Tensor, sin: Tensor,
    position: Tensor, slot: Tensor, k_cache: Tensor, v_cache: Tensor, valid: Tensor, scale: float, heads: int,
    kv_heads: int, head_dim: int, block_n: int = 64, num_warps: int = 4, table: Tensor | None = None,
) -> Tensor:
    """Qwen3.5's gated full-attention step (``hybrid.HybridDecoderModel``) in one kernel per layer.

    q_and_gate [B, H*2D] (q_proj's output: each head's query, then its gate), k/v [B, KV*D] (rows
    may be strided views of one fused projection), cos/sin [S, R] (rotary on the first R dims),
    position [B], slot [B] (each row's own), caches [Bcap, KV, S, D], valid [Bcap, S] bool -> [B, H*D], already gated.
    Paged: pools [pages, KV, page_size, D] read through ``table`` (as in ``rope_attention``).
    """
    # the tile size barely moves the whole decode step (dev/log.md); the kernel alone is timed by
    # dev/benchmarks/hybrid_kernels.py
    batch = q_and_gate.shape[0]
    out = torch.empty((batch, heads * head_dim), dtype=q_and_gate.dtype, device=q_and_gate.device)
    group = heads // kv_heads
    _gated_attention_kernel[(batch, kv_heads)](
        q_and_gate, k, v, out, k_cache, v_cache, valid.view(torch.uint8),
        q_norm, k_norm, cos, sin, position, slot, table if table is not None else slot,
        heads, group, head_dim, cos.shape[-1], eps, scale, q_and_gate.stride(0), k.stride(0), v.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), valid.stride(0),
        table.stride(0) if table is not None else 0, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q_and_gate.dtype == torch.float32 else "tf32", num_warps=num_warps,
        PAGED=table is not None, PAGE=k_cache.shape[2] if table is not None else 1,
    )
    return out
