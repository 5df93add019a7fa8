"""Where FastEngine's prompt prefill spends its time, and what a lean prefill would save.

    python benchmarks/prefill.py --batch 64 --prompt 128

FastEngine prefills with each model's own Hugging Face decoder stack (exact agreement with
HFEngine), then copies the keys/values into its static caches. At batch 64 x 128 prompt tokens
that is about 15% of a 256-token tandem rollout. This script times, for both Qwen3 shapes (random
bf16 weights): the whole HF forward with ``logits_to_keep=1`` (the engine's prefill before), the
engine's prefill now; a lean torch prefill over the engine's own
(fused) weights that writes the caches in place (SDPA with grouped-query attention, no mask
building beyond one boolean tensor); the compute floor (FLOPs over the measured matmul rate);
and the top CUDA kernels of the engine's prefill. The lean prefill is a prototype measured here, not
used by the engine; its last-token logits are compared with HF's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile

from benchmarks.rollout import QWEN3_1_7B, QWEN3_4B, build_qwen3
from tandem_lit.rollout.fast import StaticDecoderModel, _norm, _rotate_half


@torch.no_grad()
def lean_prefill(m: StaticDecoderModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded prompts -> last-token logits; keys/values written into m's static caches."""
    batch, width = input_ids.shape
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    cos, sin = m.cos[positions].unsqueeze(1), m.sin[positions].unsqueeze(1)  # [B, 1, P, D]
    causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
    # a padding query attends to itself, so no row is fully masked (no NaN in the residual stream)
    mask = (causal & attention_mask.bool()[:, None, None, :]) | torch.eye(width, dtype=torch.bool, device=input_ids.device)
    x = m.embed.weight[input_ids]
    for i, layer in enumerate(m.layers):
        h = _norm(layer.input_norm, x)
        q, k, v = layer.project_qkv(h)
        q = q.view(batch, width, m.heads, m.head_dim).transpose(1, 2)
        k = k.view(batch, width, m.kv_heads, m.head_dim).transpose(1, 2)
        v = v.view(batch, width, m.kv_heads, m.head_dim).transpose(1, 2)
        if layer.q_norm is not None:
            q, k = _norm(layer.q_norm, q), _norm(layer.k_norm, k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        m.k_cache[i][:batch, :, :width].copy_(k)
        m.v_cache[i][:batch, :, :width].copy_(v)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=m.scaling, enable_gqa=True)
        x = x + layer.o(attended.transpose(1, 2).reshape(batch, width, -1))
        h = _norm(layer.post_norm, x)
        gate, up = layer.mlp_inputs(h)
        x = x + layer.down(F.silu(gate) * up)
    return m.lm_head(_norm(m.final_norm, x[:, -1]))


def flops(shape: dict, tokens: int) -> float:
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    return 2.0 * tokens * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of a large bf16 matrix product on random data (the compute ceiling)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / (triton.testing.do_bench(lambda: a @ a, rep=200, return_mode="median") / 1000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    vocab = 151936
    rate = matmul_rate()
    print(f"# bf16 matmul rate {rate / 1e12:.0f} TFLOP/s; batch {args.batch} x {args.prompt} prompt tokens")
    ids = torch.randint(4, vocab, (args.batch, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    mask[::4, : args.prompt // 4] = 0  # a quarter of the rows left-padded
    for name, shape, seed in (("Qwen3-4B", QWEN3_4B, 0), ("Qwen3-1.7B", QWEN3_1_7B, 1)):
        model = build_qwen3(shape, vocab, torch.bfloat16, "cuda", seed)
        m = StaticDecoderModel(model)
        m.fuse_projections()
        m.allocate(args.batch, args.prompt + 256)
        hf = m.prefill(ids, mask).float()
        lean = lean_prefill(m, ids, mask).float()
        err = float((lean - hf).norm() / hf.norm())
        positions = (mask.cumsum(-1) - 1).clamp_min(0)

        def whole_forward(model=model, positions=positions):  # the engine's prefill before: the HF forward with logits_to_keep=1
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]

        t_whole = triton.testing.do_bench(whole_forward, rep=300, return_mode="median")
        t_hf = triton.testing.do_bench(lambda m=m: m.prefill(ids, mask), rep=300, return_mode="median")
        t_lean = triton.testing.do_bench(lambda m=m: lean_prefill(m, ids, mask), rep=300, return_mode="median")
        floor = flops(shape, ids.numel()) / rate * 1000
        hidden = torch.randn(args.batch, args.prompt, shape["hidden_size"], device="cuda", dtype=torch.bfloat16)
        head = model.lm_head.weight
        t_strided = triton.testing.do_bench(lambda h=hidden, w=head: F.linear(h[:, -1:], w), rep=100, return_mode="median")
        t_contig = triton.testing.do_bench(lambda h=hidden, w=head: F.linear(h[:, -1].contiguous(), w), rep=100, return_mode="median")
        print(f"{name}: HF forward(logits_to_keep=1) {t_whole:.1f} ms; engine prefill (HF decoder stack + head on "
              f"contiguous last rows) {t_hf:.1f} ms; lean {t_lean:.1f} ms; compute floor {floor:.1f} ms; "
              f"lean vs engine last-token logits rel. err {err:.1e}", flush=True)
        print(f"  LM head on the last rows: strided view [B, 1, H] {t_strided:.2f} ms, contiguous [B, H] {t_contig:.2f} ms")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m.prefill(ids, mask)
            torch.cuda.synchronize()
        events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        print(f"  engine prefill kernels {total / 1000:.1f} ms (GPU busy {total / 1000 / t_hf:.0%} of wall):")
        for e in events[:12]:
            print(f"  {e.device_time_total / total:6.1%} {e.device_time_total / 1000:7.2f} ms {e.count:5d}x  {e.key[:80]}")
        del model, m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
