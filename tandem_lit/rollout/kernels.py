"""Triton kernels for FastEngine's decode step on GPU.

A decode step of a Llama-family block is a few matrix-vector products (cuBLAS, bandwidth bound)
and a swarm of small elementwise ops that cost more in kernel gaps than in bytes. These kernels
fuse that swarm, so one layer runs 12 kernels instead of about 60:

- ``add_rms_norm``: residual add + RMSNorm (the residual stream is updated in place);
- ``qk_rope_cache``: per-head Q/K RMSNorm (Qwen3), rotary embedding, and the K/V cache write;
- ``decode_attention``: grouped-query attention of one new token over the cache, online softmax,
  reading only the slots written so far (the bound is read on the device, so one CUDA graph
  serves every step);
- ``silu_mul``: the gated MLP's activation.

Numerics follow transformers' eager Llama/Qwen3 code (fp32 norms and softmax, rounding to the
model dtype where it rounds); results agree to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
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
    normed = (x32 * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """``x += delta`` (in place, if given), then RMSNorm(x) * weight.  # [M, N] -> [M, N]"""
    rows, n = x.shape
    out = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, out, n, eps,
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n),
    )
    return out


@triton.jit
def _load_head(ptr, w_ptr, offs, mask, half, d, eps, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """One head's two halves in fp32, RMS-normalised (Qwen3 q/k norm) when HAS_NORM."""
    x1 = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / d + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    return x1, x2


@triton.jit
def _qk_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    heads, kv_heads, d, eps, cache_sb, cache_sh, cache_ss, q_sb, k_sb, v_sb,
    HAS_NORM: tl.constexpr, HALF: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)  # query heads first, then key/value heads
    half = d // 2
    offs = tl.arange(0, HALF)
    mask = offs < half
    pos = tl.load(pos_ptr + b)
    c1 = tl.load(cos_ptr + pos * d + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * d + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * d + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * d + half + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    if h < heads:
        x1, x2 = _load_head(q_ptr + b * q_sb + h * d, q_norm_ptr, offs, mask, half, d, eps, HAS_NORM, dtype)
        out = q_out_ptr + b * heads * d + h * d
    else:
        g = h - heads
        x1, x2 = _load_head(k_ptr + b * k_sb + g * d, k_norm_ptr, offs, mask, half, d, eps, HAS_NORM, dtype)
        cache = b * cache_sb + g * cache_sh + tl.load(slot_ptr) * cache_ss
        out = k_cache_ptr + cache
        vbase = v_ptr + b * v_sb + g * d
        tl.store(v_cache_ptr + cache + offs, tl.load(vbase + offs, mask=mask, other=0.0), mask=mask)
        tl.store(v_cache_ptr + cache + half + offs, tl.load(vbase + half + offs, mask=mask, other=0.0), mask=mask)
    tl.store(out + offs, (x1 * c1 - x2 * s1).to(dtype), mask=mask)  # rotary: rotate_half(x) * sin + x * cos
    tl.store(out + half + offs, (x2 * c2 + x1 * s2).to(dtype), mask=mask)


def qk_rope_cache(
    q: Tensor, k: Tensor, v: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
    cos: Tensor, sin: Tensor, position: Tensor, slot: Tensor, k_cache: Tensor, v_cache: Tensor,
    heads: int, kv_heads: int, head_dim: int,
) -> Tensor:
    """Rotary (and Qwen3 per-head norm) on q and k; k and v written at ``slot``.

    q [B, H*D], k/v [B, KV*D] (rows may be strided views of one fused projection), cos/sin
    [S, D], position [B], slot [1] -> rotated q [B, H*D] (contiguous)
    """
    batch = q.shape[0]
    q_out = torch.empty((batch, heads * head_dim), dtype=q.dtype, device=q.device)
    has_norm = q_norm is not None
    _qk_rope_cache_kernel[(batch, heads + kv_heads)](
        q, k, v, q_out, k_cache, v_cache,
        q_norm if has_norm else q, k_norm if has_norm else k, cos, sin, position, slot,
        heads, kv_heads, head_dim, eps, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q.stride(0), k.stride(0), v.stride(0),
        HAS_NORM=has_norm, HALF=triton.next_power_of_2(head_dim // 2),
    )
    return q_out


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, valid_ptr, out_ptr, slot_ptr,
    heads, group, d, scale, cache_sb, cache_sh, cache_ss, valid_sb,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = dd < d
    q = tl.load(q_ptr + b * heads * d + (kvh * group + g)[:, None] * d + dd[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    end = tl.load(slot_ptr) + 1  # slots [0, end) hold keys
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cache = k_cache_ptr + b * cache_sb + kvh * cache_sh
    vcache = v_cache_ptr + b * cache_sb + kvh * cache_sh
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < end
        ok = in_range & (tl.load(valid_ptr + b * valid_sb + n, mask=in_range, other=0) != 0)
        k = tl.load(cache + n[:, None] * cache_ss + dd[None, :], mask=in_range[:, None] & d_mask[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(vcache + n[:, None] * cache_ss + dd[None, :], mask=in_range[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + b * heads * d + (kvh * group + g)[:, None] * d + dd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, valid: Tensor, slot: Tensor, scale: float,
                     heads: int, kv_heads: int, head_dim: int, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 2) -> Tensor:
    """One query token per sequence over cache slots [0, slot]; invalid (padding) slots masked.

    q [B, H*D], caches [Bcap, KV, S, D], valid [Bcap, S] bool -> [B, H*D]
    """
    batch = q.shape[0]
    out = torch.empty_like(q)
    group = heads // kv_heads
    _decode_attention_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, valid.view(torch.uint8), out, slot,
        heads, group, head_dim, scale, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), valid.stride(0),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
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
