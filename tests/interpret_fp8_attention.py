"""Run by tests/test_fp8_kv_cache.py under TRITON_INTERPRET=1 (Triton's CPU interpreter): the decode
attention kernel over an 8-bit cache, slots and paged, against attention written out in torch.

The interpreter's float32 -> float8 conversion mis-rounds where the mantissa carries into the
exponent (-1.97 becomes -1.0; a GPU's conversion does not), so the keys and values are made exactly
representable first and the rotary table is the identity: every rounding is then exact, and what is
checked is where the kernel writes, what it reads and how it widens it (to q's dtype, and to
float16 with ``f16_dot``). Prints the largest error of each.
"""

from __future__ import annotations

import torch

from tandem_lit.rollout.static import kernels
from tandem_lit.rollout.static.blocks import FP8_CACHE

B, H, KV, D, S, PAGE = 2, 4, 2, 16, 32, 8


def reference(q, k_cache, v_cache, slot):  # -> [B, H * D]: the new token's attention over slots [0, slot]
    rows = []
    for b in range(B):
        keys = k_cache[b, :, : slot[b] + 1].float().repeat_interleave(H // KV, 0)  # [H, n, D]
        values = v_cache[b, :, : slot[b] + 1].float().repeat_interleave(H // KV, 0)
        scores = (q.view(B, H, 1, D)[b] @ keys.transpose(-1, -2)).squeeze(1) * D**-0.5
        rows.append((scores.softmax(-1).unsqueeze(1) @ values).reshape(-1))
    return torch.stack(rows)


def main() -> None:
    torch.manual_seed(0)
    q = torch.randn(B, H * D)
    k, v = (torch.randn(B, KV * D).to(FP8_CACHE).float() for _ in range(2))  # exactly representable
    cos, sin = torch.ones(S, D), torch.zeros(S, D)
    position = slot = torch.tensor([5, 19])
    valid = torch.ones(B, S, dtype=torch.bool)
    worst = worst_f16 = 0.0
    for paged in (False, True):
        slots = torch.randn(B, KV, S, D).to(FP8_CACHE)  # the earlier tokens' keys/values, as a slot cache
        values = torch.randn(B, KV, S, D).to(FP8_CACHE)
        if paged:  # the same positions cut into pages, row b's pages reversed and after the scratch page
            per_row = S // PAGE
            table = torch.tensor([[1 + b * per_row + (per_row - 1 - j) for j in range(per_row)] for b in range(B)],
                                 dtype=torch.int32)
            k_cache = torch.zeros(1 + B * per_row, KV, PAGE, D, dtype=FP8_CACHE)
            v_cache = torch.zeros_like(k_cache)
            for b in range(B):
                for j in range(per_row):
                    k_cache.view(torch.uint8)[table[b, j]] = slots[b, :, j * PAGE : (j + 1) * PAGE].view(torch.uint8)
                    v_cache.view(torch.uint8)[table[b, j]] = values[b, :, j * PAGE : (j + 1) * PAGE].view(torch.uint8)
        else:
            table, k_cache, v_cache = None, slots.clone(), values.clone()
        f16_in = k_cache.clone(), v_cache.clone()
        out = kernels.rope_attention(q, k, v, None, None, 0.0, cos, sin, position, slot, k_cache, v_cache, valid,
                                     D**-0.5, H, KV, D, block_n=8, num_warps=1, table=table)
        # the same, the products' inputs widened to float16 (q rounded there too)
        out_f16 = kernels.rope_attention(q, k, v, None, None, 0.0, cos, sin, position, slot, *f16_in, valid,
                                         D**-0.5, H, KV, D, block_n=8, num_warps=1, table=table, f16_dot=True)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(f16_in, (k_cache, v_cache)))
        for b in range(B):  # what the kernel should have stored: the new token at its slot
            slots.view(torch.uint8)[b, :, slot[b]] = k[b].view(KV, D).to(FP8_CACHE).view(torch.uint8)
            values.view(torch.uint8)[b, :, slot[b]] = v[b].view(KV, D).to(FP8_CACHE).view(torch.uint8)
            if paged:
                page, offset = table[b, slot[b] // PAGE], slot[b] % PAGE
                stored_k, stored_v = k_cache[page, :, offset], v_cache[page, :, offset]
            else:
                stored_k, stored_v = k_cache[b, :, slot[b]], v_cache[b, :, slot[b]]
            assert torch.equal(stored_k.view(torch.uint8), slots[b, :, slot[b]].view(torch.uint8)), "new key stored wrong"
            assert torch.equal(stored_v.view(torch.uint8), values[b, :, slot[b]].view(torch.uint8)), "new value stored wrong"
        worst = max(worst, (out - reference(q, slots, values, slot)).abs().max().item())
        worst_f16 = max(worst_f16, (out_f16 - reference(q.half().float(), slots, values, slot)).abs().max().item())
    print(f"largest error {worst:.3g}")
    print(f"float16 products: largest error {worst_f16:.3g}")


if __name__ == "__main__":
    main()
