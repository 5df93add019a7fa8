"""Qwen3.5's two decode kernels at the 9B shape, timed alone (GPU): the Gated DeltaNet step
(``kernels.delta_rule_step``) by warp count, and the gated full-attention step
(``kernels.gated_attention``) by tile size, with the attention checked against the torch step.

    python dev/benchmarks/hybrid_kernels.py --batch 64 --slots 384

The delta-rule step is bound by its float32 state (read + written once), so it is shown in GB/s
against a device-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse

import torch

from tandem_lit.rollout.static import kernels
from tandem_lit.rollout.static.hybrid import HybridDecoderModel, _DeltaLayer


def cuda_time_us(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def delta_rule(batch: int) -> None:
    key_heads, value_heads, d = 16, 32, 128  # Qwen3.5-9B's linear attention
    torch.manual_seed(0)
    mixed = torch.randn(batch, 2 * key_heads * d + value_heads * d, device="cuda", dtype=torch.bfloat16)
    a, b = torch.randn(2, batch, value_heads, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(batch, value_heads * d, device="cuda", dtype=torch.bfloat16)
    a_log, dt_bias = torch.randn(2, value_heads, device="cuda")
    norm_weight = torch.ones(d, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(batch, value_heads, d, d, device="cuda") * 0.01
    state_bytes = 2 * state.numel() * state.element_size()
    copy = torch.empty_like(state)
    us = cuda_time_us(lambda: copy.copy_(state))
    print(f"delta rule, batch {batch}: copying the state {us:.1f} us ({state_bytes / us / 1e3:.0f} GB/s)")
    for warps in (2, 4, 8):
        us = cuda_time_us(lambda w=warps: kernels.delta_rule_step(mixed, a, b, z, a_log, dt_bias, norm_weight, state,
                                                                  key_heads, 1e-6, num_warps=w))
        print(f"  delta_rule_step, {warps} warps: {us:.1f} us ({state_bytes / us / 1e3:.0f} GB/s)")


def gated_attention(batch: int, slots: int) -> None:
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    # one 9B-shaped full-attention layer (the rest of the model is small)
    config = Qwen3_5TextConfig(vocab_size=1024, hidden_size=4096, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.normal_(0, 0.3)
    decoder = HybridDecoderModel(model)
    decoder.allocate(batch, slots + 128)
    index, layer = next((i, m) for i, (_, m, _) in enumerate(decoder.blocks) if not isinstance(m, _DeltaLayer))
    h = torch.randn(batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    slot = torch.tensor([slots], device="cuda")
    position = torch.full((batch,), slots, device="cuda")
    position[::3] -= 84
    valid = torch.ones(batch, slots + 128, dtype=torch.bool, device="cuda")
    valid[::3, :84] = False  # left-padded rows
    valid[:, slots + 1 :] = False
    decoder.k_cache[index].normal_()
    decoder.v_cache[index].normal_()
    mask = torch.zeros(batch, slots + 1, device="cuda", dtype=torch.bfloat16)
    mask.masked_fill_(~valid[:, : slots + 1], torch.finfo(torch.bfloat16).min)
    mask = mask[:, None, None, :]
    cos, sin = decoder.cos[position].unsqueeze(1), decoder.sin[position].unsqueeze(1)
    torch_step = lambda: decoder._attend(index, layer, h, cos, sin, slot, mask, slots + 1)  # noqa: E731
    expected = torch_step()
    layer.fuse(share=False)
    module = layer.module

    def kernel(block_n: int = 64, num_warps: int = 4):
        return kernels.gated_attention(
            *layer.project(h), module.q_norm.weight, module.k_norm.weight, module.q_norm.eps, decoder.cos, decoder.sin,
            position, slot, decoder.k_cache[index], decoder.v_cache[index], valid, layer.scaling, decoder.heads,
            decoder.kv_heads, decoder.head_dim, block_n=block_n, num_warps=num_warps)

    got = layer.o(kernel())
    error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    print(f"gated attention, batch {batch}, {slots} cached slots: relative error against the torch step {error:.1e} (bf16)")
    print(f"  torch ops (eager, with the projections): {cuda_time_us(torch_step):.1f} us")
    print(f"  one kernel (eager, with the projections): {cuda_time_us(lambda: layer.o(kernel())):.1f} us")
    for block_n, warps in ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8)):
        us = cuda_time_us(lambda n=block_n, w=warps: kernel(n, w))
        print(f"  gated_attention alone, block_n={block_n}, {warps} warps: {us:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--slots", type=int, default=384, help="cached tokens the new one attends to")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with torch.no_grad():
        delta_rule(args.batch)
        gated_attention(args.batch, args.slots)


if __name__ == "__main__":
    main()
