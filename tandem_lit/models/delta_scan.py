"""Qwen3.5's chunked gated delta rule with the inter-chunk scan as two Triton kernels (issue 26).

transformers' torch path (``modeling_qwen3_5.torch_chunk_gated_delta_rule``, what the update runs
without flash-linear-attention) works in two phases. The first is parallel over 64-token chunks:
l2-normalised queries and keys, cumulative decays, a triangular solve per chunk. The second is a
Python loop over the chunks carrying the [K, V] state, a few small matmuls each: ~47 iterations
for 3,000 tokens, forward and backward, per layer and micro-batch, thousands of tiny kernel
launches. ``chunk_gated_delta_rule`` here keeps the first phase in torch (autograd as usual) and
runs the loop as one forward and one backward Triton kernel (``delta_scan_kernels``) on CUDA, or as
the same loop in torch (``scan_reference``) elsewhere. Per (batch, head), chunks i = 0..N-1:

    v_i     = u_i - w_i @ S_i              (the part of the chunk's values the state does not predict)
    o_i     = q_i @ S_i + A_i @ v_i        (inter-chunk read + intra-chunk attention)
    S_i+1   = g_i * S_i + k_i^T @ v_i

with q, k, u, w, A, g the first phase's decayed queries and keys, new values, decayed keys of the
solve, masked intra-chunk attention and chunk decay (transformers' names: ``query``, ``key``,
``new_values``, ``k_cumdecay``, ``intra_chunk_attn``, ``chunk_decay``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def scan_reference(q: Tensor, k: Tensor, u: Tensor, w: Tensor, attn: Tensor, decay: Tensor,
                   initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """The inter-chunk scan as transformers' loop runs it (float32, autograd through the loop).

    q, k, w: [B, H, N, C, K]; u: [B, H, N, C, V]; attn: [B, H, N, C, C]; decay: [B, H, N];
    initial_state: [B, H, K, V] or None (zeros). Returns o [B, H, N, C, V] and the final state."""
    batch, heads, chunks, _, k_dim = q.shape
    state = q.new_zeros(batch, heads, k_dim, u.shape[-1]) if initial_state is None else initial_state
    out = []
    for i in range(chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * decay[:, :, i, None, None] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2), state


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """As transformers (and flash-linear-attention) normalise queries and keys: eps inside the root."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


# How the first phase solves each chunk's unit lower-triangular system: ``triangular`` solves it for
# the values and for the decayed keys (two solves of V and K right-hand sides, as transformers),
# ``inverse`` solves it once against the identity (C right-hand sides) and multiplies the two by
# that inverse, as flash-linear-attention's kernels do. Same result to float32 rounding
# (tests/test_delta_scan.py); ``inverse`` is the default, the faster of the two for a 9B layer's
# forward + backward (dev/benchmarks/delta_rule_cost.py, dev/log.md).
SOLVES = ("triangular", "inverse")
SOLVE = "inverse"


def chunk_terms(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int,
                solve: str | None = None):
    """The first phase: what the scan reads, from float32 [B, H, L, *] inputs already padded to a
    multiple of ``chunk_size``. Returns q, k, u, w [B, H, N, C, *], attn [B, H, N, C, C], decay [B, H, N].
    ``solve``: one of ``SOLVES`` (None: ``SOLVE``)."""
    batch, heads, length, _ = key.shape
    chunked = [x.reshape(batch, heads, length // chunk_size, chunk_size, -1) for x in (query, key, value)]
    query, key, value = chunked
    beta = beta.reshape(batch, heads, -1, chunk_size, 1)
    cum_decay = g.reshape(batch, heads, -1, chunk_size).cumsum(-1)  # log of the decay since the chunk's start
    # exp(cum_i - cum_j) for j <= i; -inf above the diagonal before exp, so no overflow
    above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=key.device).triu(1)
    pairwise = (cum_decay[..., :, None] - cum_decay[..., None, :]).masked_fill(above, float("-inf")).exp()
    k_beta = key * beta
    system = (k_beta @ key.transpose(-1, -2)) * pairwise  # unit lower-triangular once the identity is added
    attn = (query @ key.transpose(-1, -2)) * pairwise
    decayed_keys = k_beta * cum_decay.exp()[..., None]
    if (solve or SOLVE) == "inverse":
        identity = torch.eye(chunk_size, dtype=system.dtype, device=system.device).expand_as(system)
        inverse = torch.linalg.solve_triangular(system, identity, upper=False, unitriangular=True)
        u, w = inverse @ (value * beta), inverse @ decayed_keys
    else:
        u = torch.linalg.solve_triangular(system, value * beta, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, decayed_keys, upper=False, unitriangular=True)
    q = query * cum_decay.exp()[..., None]
    k = key * (cum_decay[..., -1:] - cum_decay).exp()[..., None]
    return q, k, u, w, attn, cum_decay[..., -1].exp()


def chunk_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, solve: str | None = None,
                           **kwargs) -> tuple[Tensor, Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` (same arguments, outputs and gradients to
    float32 rounding), the scan in Triton when the inputs are on CUDA.

    query, key: [B, L, HK, K]; value: [B, L, H, V] (H a multiple of HK: each key head serves
    H // HK consecutive value heads); g (log decay, <= 0), beta: [B, L, H]; initial_state
    [B, H, K, V] or None. Returns the output [B, L, H, V] in query's dtype and, if asked, the final
    state [B, H, K, V] in float32. ``solve``: how the first phase solves its chunks (``SOLVES``)."""
    if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
        raise ValueError("chunk_gated_delta_rule cannot keep packed sequences apart (as transformers' torch path)")
    dtype, length = query.dtype, query.shape[1]
    heads = value.shape[2]
    query, key = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (query, key))
    query, key, value, g, beta = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = -length % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    terms = chunk_terms(query, key, value, g, beta, chunk_size, solve)
    state = None if initial_state is None else initial_state.float()
    if query.is_cuda:
        from tandem_lit.models.delta_scan_kernels import scan_triton

        out, final = scan_triton(*terms, state)
    else:
        out, final = scan_reference(*terms, state)
    out = out.flatten(2, 3)[:, :, :length].transpose(1, 2).to(dtype).contiguous()
    return out, final if output_final_state else None
