"""The gated delta rule's inter-chunk scan (``delta_scan``) as one Triton kernel per direction.

Every step of the scan is column-wise in the value dimension, so a program owns one (batch, head)
and BV value columns, keeps its [K, BV] slice of the state in registers and walks the chunks: the
forward stores each chunk's incoming state S_i and corrected values v_i (as flash-linear-attention
keeps its ``h``), the backward walks the chunks in reverse from them. Gradients of the inputs
shared by all columns (q, k, w, attn, decay) are sums over V: each program writes its block's part
and torch adds the parts (no atomics, so the result does not depend on the order programs finish).

Imports Triton at the top: import this module only where Triton is installed (``delta_scan``
imports it when the inputs are on CUDA). Matmuls are IEEE float32 (``DOT_PRECISION``), not TF32:
the point of running the rule in float32 is to compute what the engine's float32 recurrence does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

DOT_PRECISION = "ieee"
BLOCK_V = 16  # value columns per program: 8 blocks x 32 heads x 2 rows = 512 programs at the 9B's shape
# Triton's default of 3 pipeline stages asks 256 KiB of shared memory for the forward (320 KiB for
# the backward) at K = 128, over Hopper's 227 KiB (the first compile failed there); one stage needs 48 / 72
# KiB, which also fits an A100 (compiled for sm_90 on the CPU: metadata.shared)
NUM_STAGES = 1
NUM_WARPS = 8  # with BLOCK_V 16 the fastest IEEE float32 setting tried (dev/benchmarks/delta_scan_tune.py, dev/log.md)


@triton.jit
def _scan_forward_kernel(q_ptr, k_ptr, u_ptr, w_ptr, attn_ptr, decay_ptr, s0_ptr, o_ptr, v_ptr, h_ptr, final_ptr, N,
                         K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         HAS_INITIAL: tl.constexpr, DOT: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rows, ks, vs = tl.arange(0, C), tl.arange(0, BK), block * BV + tl.arange(0, BV)
    k_in, v_in = ks < K, vs < V
    state_at = ks[:, None] * V + vs[None, :]
    state_in = k_in[:, None] & v_in[None, :]
    if HAS_INITIAL:
        state = tl.load(s0_ptr + bh * K * V + state_at, mask=state_in, other=0.0)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(N):
        token = bh * N * C + i * C + rows  # [C] rows of the flattened [B*H*N*C, *] inputs
        by_k, by_v = token[:, None] * K + ks[None, :], token[:, None] * V + vs[None, :]
        tl.store(h_ptr + (bh * N + i) * K * V + state_at, state, mask=state_in)
        w = tl.load(w_ptr + by_k, mask=k_in[None, :], other=0.0)
        v = tl.load(u_ptr + by_v, mask=v_in[None, :], other=0.0) - tl.dot(w, state, input_precision=DOT)
        tl.store(v_ptr + by_v, v, mask=v_in[None, :])
        q = tl.load(q_ptr + by_k, mask=k_in[None, :], other=0.0)
        attn = tl.load(attn_ptr + (bh * N + i) * C * C + rows[:, None] * C + rows[None, :])
        o = tl.dot(q, state, input_precision=DOT) + tl.dot(attn, v, input_precision=DOT)
        tl.store(o_ptr + by_v, o, mask=v_in[None, :])
        k = tl.load(k_ptr + by_k, mask=k_in[None, :], other=0.0)
        state = state * tl.load(decay_ptr + bh * N + i) + tl.dot(tl.trans(k), v, input_precision=DOT)
    tl.store(final_ptr + bh * K * V + state_at, state, mask=state_in)


@triton.jit
def _scan_backward_kernel(q_ptr, k_ptr, w_ptr, attn_ptr, decay_ptr, h_ptr, v_ptr, do_ptr, dfinal_ptr,
                          du_ptr, dq_ptr, dk_ptr, dw_ptr, dattn_ptr, ddecay_ptr, ds0_ptr, BH, N,
                          K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          HAS_FINAL_GRAD: tl.constexpr, DOT: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    part = block * BH + bh  # this block's slice of the per-block partial sums [blocks, B*H, ...]
    rows, ks, vs = tl.arange(0, C), tl.arange(0, BK), block * BV + tl.arange(0, BV)
    k_in, v_in = ks < K, vs < V
    state_at = ks[:, None] * V + vs[None, :]
    state_in = k_in[:, None] & v_in[None, :]
    if HAS_FINAL_GRAD:
        d_state = tl.load(dfinal_ptr + bh * K * V + state_at, mask=state_in, other=0.0)  # dS_N
    else:
        d_state = tl.zeros([BK, BV], dtype=tl.float32)
    for j in range(N):
        i = N - 1 - j
        token = bh * N * C + i * C + rows
        by_k, by_v = token[:, None] * K + ks[None, :], token[:, None] * V + vs[None, :]
        part_by_k = (part * N * C + i * C + rows)[:, None] * K + ks[None, :]
        state = tl.load(h_ptr + (bh * N + i) * K * V + state_at, mask=state_in, other=0.0)  # S_i
        v = tl.load(v_ptr + by_v, mask=v_in[None, :], other=0.0)
        do = tl.load(do_ptr + by_v, mask=v_in[None, :], other=0.0)
        attn = tl.load(attn_ptr + (bh * N + i) * C * C + rows[:, None] * C + rows[None, :])
        k = tl.load(k_ptr + by_k, mask=k_in[None, :], other=0.0)
        # d_state is dS_{i+1} here: v_i reaches the output through attn and the next state through k
        dv = tl.dot(tl.trans(attn), do, input_precision=DOT) + tl.dot(k, d_state, input_precision=DOT)
        tl.store(du_ptr + by_v, dv, mask=v_in[None, :])
        tl.store(dk_ptr + part_by_k, tl.dot(v, tl.trans(d_state), input_precision=DOT), mask=k_in[None, :])
        tl.store(dq_ptr + part_by_k, tl.dot(do, tl.trans(state), input_precision=DOT), mask=k_in[None, :])
        tl.store(dw_ptr + part_by_k, -tl.dot(dv, tl.trans(state), input_precision=DOT), mask=k_in[None, :])
        tl.store(dattn_ptr + (part * N + i) * C * C + rows[:, None] * C + rows[None, :],
                 tl.dot(do, tl.trans(v), input_precision=DOT))
        tl.store(ddecay_ptr + part * N + i, tl.sum(state * d_state))
        q = tl.load(q_ptr + by_k, mask=k_in[None, :], other=0.0)
        w = tl.load(w_ptr + by_k, mask=k_in[None, :], other=0.0)
        d_state = (d_state * tl.load(decay_ptr + bh * N + i) + tl.dot(tl.trans(q), do, input_precision=DOT)
                   - tl.dot(tl.trans(w), dv, input_precision=DOT))
    tl.store(ds0_ptr + bh * K * V + state_at, d_state, mask=state_in)


def _blocks(k_dim: int, v_dim: int, block_v: int) -> tuple[int, int]:
    # tl.dot needs every dimension >= 16; all of K in one tile (Qwen3.5: 128)
    return max(16, triton.next_power_of_2(k_dim)), max(16, min(block_v, triton.next_power_of_2(v_dim)))


class DeltaScan(torch.autograd.Function):
    """The scan over [B*H, N, C, *] float32 inputs (contiguous): o and the final state."""

    @staticmethod
    def forward(ctx, q, k, u, w, attn, decay, initial_state, block_v, dot, num_warps):
        bh, chunks, chunk, k_dim = q.shape
        v_dim = u.shape[-1]
        bk, bv = _blocks(k_dim, v_dim, block_v)
        o, v = torch.empty_like(u), torch.empty_like(u)
        states = q.new_empty(bh, chunks, k_dim, v_dim)  # S_i, the state each chunk reads
        final = q.new_empty(bh, k_dim, v_dim)
        _scan_forward_kernel[(triton.cdiv(v_dim, bv), bh)](
            q, k, u, w, attn, decay, initial_state if initial_state is not None else final, o, v, states, final,
            chunks, K=k_dim, V=v_dim, C=chunk, BK=bk, BV=bv, HAS_INITIAL=initial_state is not None, DOT=dot,
            num_stages=NUM_STAGES, num_warps=num_warps,
        )
        ctx.save_for_backward(q, k, w, attn, decay, states, v)
        ctx.has_initial, ctx.block_v, ctx.dot, ctx.num_warps = initial_state is not None, block_v, dot, num_warps
        ctx.set_materialize_grads(False)  # an unused final state's gradient stays None: nothing to load
        return o, final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, w, attn, decay, states, v = ctx.saved_tensors
        bh, chunks, chunk, k_dim = q.shape
        v_dim = v.shape[-1]
        bk, bv = _blocks(k_dim, v_dim, ctx.block_v)
        blocks = triton.cdiv(v_dim, bv)
        d_out = torch.zeros_like(v) if d_out is None else d_out.contiguous()
        du = torch.empty_like(v)
        dq, dk, dw = (q.new_empty(blocks, *q.shape) for _ in range(3))
        dattn, ddecay = attn.new_empty(blocks, *attn.shape), decay.new_empty(blocks, *decay.shape)
        ds0 = q.new_empty(bh, k_dim, v_dim)
        _scan_backward_kernel[(blocks, bh)](
            q, k, w, attn, decay, states, v, d_out, d_final.contiguous() if d_final is not None else ds0,
            du, dq, dk, dw, dattn, ddecay, ds0, bh, chunks,
            K=k_dim, V=v_dim, C=chunk, BK=bk, BV=bv, HAS_FINAL_GRAD=d_final is not None, DOT=ctx.dot,
            num_stages=NUM_STAGES, num_warps=ctx.num_warps,
        )
        return (dq.sum(0), dk.sum(0), du, dw.sum(0), dattn.sum(0), ddecay.sum(0),
                ds0 if ctx.has_initial else None, None, None, None)


def scan_triton(q: Tensor, k: Tensor, u: Tensor, w: Tensor, attn: Tensor, decay: Tensor,
                initial_state: Tensor | None, block_v: int = BLOCK_V, dot: str = DOT_PRECISION,
                num_warps: int = NUM_WARPS) -> tuple[Tensor, Tensor]:
    """``delta_scan.scan_reference``'s contract ([B, H, N, C, *] in, o and final state out) on the kernels.
    ``block_v``, ``dot`` (Triton's ``input_precision``) and ``num_warps``: dev/benchmarks/delta_scan_tune.py."""
    batch, heads, chunks, chunk, k_dim = q.shape
    flat = [x.flatten(0, 1).contiguous() for x in (q, k, u, w, attn, decay)]
    state = None if initial_state is None else initial_state.flatten(0, 1).contiguous()
    o, final = DeltaScan.apply(*flat, state, block_v, dot, num_warps)
    return o.view(batch, heads, chunks, chunk, -1), final.view(batch, heads, k_dim, -1)
