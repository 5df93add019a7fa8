"""Every Triton kernel the engine launches on a GPU, compiled for sm_90 (H100, H200) on a machine
without one (tests/triton_compile_only.py), at the shipped configs' shapes: Qwen3-4B's attention
(bf16 and 8-bit pools, split or not, both launch settings, programs in a given row order), Qwen3.5-9B's gated attention and
Gated DeltaNet step, the norms, the MLP activation, the sampler and the log-prob kernel over
Qwen3's vocabulary, and the catch-up attention. Run by tests/test_kernels_compiled.py in a fresh
process (it stands in for the CUDA driver); prints one line per compiled kernel with its registers,
stack and local memory, then ``ok``.
"""

from __future__ import annotations

import torch

from tandem_lit.rollout.static import kernels
from tandem_lit.rollout.static.catch_up import catch_up_attention
from tests.triton_compile_only import compiling_for, resource_usage

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
VOCAB = 151_936  # Qwen3's


def pool(pages: int, kv_heads: int, page: int, dim: int, dtype=BF16) -> torch.Tensor:
    return torch.zeros(pages, kv_heads, page, dim, dtype=dtype)


def qwen3_attention(batch: int, **options) -> None:
    """Qwen3-4B: 32 query heads, 8 KV heads of 128, per-head q/k norms, pages of 64, 3,072 slots."""
    heads, kv_heads, dim, page, slots = 32, 8, 128, 64, 3072
    q, k, v = (torch.zeros(batch, n * dim, dtype=BF16) for n in (heads, kv_heads, kv_heads))
    norm = torch.ones(dim, dtype=BF16)
    cos = sin = torch.zeros(slots, dim, dtype=BF16)
    position = slot = torch.zeros(batch, dtype=torch.long)
    table = torch.zeros(batch, slots // page, dtype=torch.int32)
    cache_dtype = options.pop("cache_dtype", BF16)
    keys, values = (pool(batch * slots // page + 1, kv_heads, page, dim, cache_dtype) for _ in "kv")
    valid = torch.ones(batch, slots, dtype=torch.bool)
    kernels.rope_attention(q, k, v, norm, norm, 1e-6, cos, sin, position, slot, keys, values, valid, dim**-0.5,
                           heads, kv_heads, dim, table=table, **options)


def qwen35_steps(batch: int) -> None:
    """Qwen3.5-9B: gated attention (16 query heads, 4 KV heads of 256, rotary on 64 dims) and a
    Gated DeltaNet step (16 key heads, 32 value heads, 128 x 128 float32 states, a width-4 conv)."""
    heads, kv_heads, dim, page, slots = 16, 4, 256, 64, 3072
    q_and_gate = torch.zeros(batch, heads * 2 * dim, dtype=BF16)
    k, v = torch.zeros(batch, kv_heads * dim, dtype=BF16), torch.zeros(batch, kv_heads * dim, dtype=BF16)
    norm = torch.zeros(dim, dtype=F32)
    cos = sin = torch.zeros(slots, 64, dtype=F32)
    position = slot = torch.zeros(batch, dtype=torch.long)
    table = torch.zeros(batch, slots // page, dtype=torch.int32)
    pages = batch * slots // page + 1
    kernels.gated_attention(q_and_gate, k, v, norm, norm, 1e-6, cos, sin, position, slot, pool(pages, kv_heads, page, dim),
                            pool(pages, kv_heads, page, dim), torch.ones(batch, slots, dtype=torch.bool), dim**-0.5,
                            heads, kv_heads, dim, table=table)
    key_heads, value_heads, dk, dv = 16, 32, 128, 128
    channels = 2 * key_heads * dk + value_heads * dv
    mixed = kernels.conv_silu_step(torch.zeros(batch, channels, dtype=BF16), torch.zeros(batch, channels, 4, dtype=BF16),
                                   torch.zeros(channels, 4, dtype=BF16))
    kernels.delta_rule_step(mixed, torch.zeros(batch, value_heads, dtype=BF16), torch.zeros(batch, value_heads, dtype=BF16),
                            torch.zeros(batch, value_heads * dv, dtype=BF16), torch.zeros(value_heads, dtype=F32),
                            torch.zeros(value_heads, dtype=F32), torch.zeros(dv, dtype=F32),
                            torch.zeros(batch, value_heads, dk, dv, dtype=F32), key_heads, 1e-6)


def step_kernels(batch: int) -> None:
    """The norms and the MLP activation at Qwen3-4B's width, the sampler and the log-probs over the vocabulary."""
    x = torch.zeros(batch, 2560, dtype=BF16)
    kernels.add_rms_norm(x, x.clone(), torch.ones(2560, dtype=BF16), 1e-6)
    kernels.add_rms_norm(x.float(), x, torch.zeros(2560, dtype=F32), 1e-6, one_plus=True, out_dtype=BF16)  # Qwen3.5's
    kernels.silu_mul(torch.zeros(batch, 9728, dtype=BF16), torch.zeros(batch, 9728, dtype=BF16))
    logits, u = torch.zeros(batch, VOCAB, dtype=F32), torch.zeros(batch, dtype=F32)
    kernels.sample_rows(logits, u, 0.6)
    kernels.sample_rows(logits, u, 0.6, logits.clone(), torch.zeros(batch, dtype=torch.bool),
                        torch.ones(batch, VOCAB, dtype=torch.bool))
    token = torch.zeros(batch, dtype=torch.long)
    kernels.token_logprobs(logits, token, 0.6)
    codes = torch.zeros(batch, dtype=torch.long)  # (switch_codes: long)
    kernels.token_logprobs(logits, token, 0.6, torch.ones(3, VOCAB, dtype=torch.bool), codes, codes)


def catch_up(batch: int, per_span: int) -> None:
    heads, kv_heads, dim, page = 32, 8, 128, 64
    spans = torch.arange(batch)
    catch_up_attention(torch.zeros(batch * per_span, heads * dim, dtype=BF16), pool(batch * 48 + 1, kv_heads, page, dim),
                       pool(batch * 48 + 1, kv_heads, page, dim), torch.zeros(batch, 48, dtype=torch.int32), spans,
                       spans * per_span, torch.full((batch,), per_span), torch.zeros(batch, dtype=torch.long),
                       dim**-0.5, heads, kv_heads, queries_per_span=per_span)


with compiling_for(90) as compiled:
    for batch in (128, 16):  # the two launch settings rope_attention picks, programs in a given row order (the engine's)
        qwen3_attention(batch, order=torch.arange(batch))
    qwen3_attention(128, cache_dtype=FP8, f16_dot=True, order=torch.arange(128))
    qwen3_attention(128, split_positions=1024, order=torch.arange(128))
    qwen3_attention(128)  # row-major (FastEngine's attention_order: rows)
    qwen35_steps(32)
    step_kernels(128)
    for per_span in (4, 8):
        catch_up(128, per_span)
for name, kernel in compiled:
    usage = resource_usage(kernel)
    print(name, " ".join(f"{key}:{value}" for key, value in sorted(usage.items())))
print("ok")
