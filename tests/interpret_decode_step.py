"""Run by tests/test_kernels.py under TRITON_INTERPRET=1 (Triton's CPU interpreter): one decode step
of ``StaticDecoderModel`` through its Triton path (the one a GPU runs) against its torch path, over
rows at different depths, slot caches and a paged pool, recording the row order the attention
kernel's programs were given. Prints the largest logit difference and ``order ok``."""

from __future__ import annotations

import torch

import tests.triton_interpreter  # noqa: F401 (loop bounds read on the device, Triton < 3.9)
from tandem_lit.rollout.static import kernels
from tandem_lit.rollout.static.plain import StaticDecoderModel
from tests.test_fast_engine import build

B, S, PAGE, VOCAB = 4, 32, 8, 64


def main() -> None:
    model = StaticDecoderModel(build("qwen3", VOCAB, 32, 2, seed=0))
    given = []
    attention = kernels.rope_attention

    def recorded(*args, **kwargs):
        given.append(kwargs.get("order"))
        return attention(*args, **kwargs)

    kernels.rope_attention = recorded
    torch.manual_seed(1)
    slot = torch.tensor([5, 19, 2, 11])  # each row at its own depth
    token, position = torch.randint(3, VOCAB, (B,)), slot.clone()
    valid = torch.arange(S)[None, :] <= slot[:, None]
    worst = 0.0
    for pages in (0, B * S // PAGE + 1):
        model.allocate(B, S, pages=pages, page_size=PAGE if pages else 0)
        table = None
        if pages:  # row b's slots on pages in reverse order, after the scratch page 0
            per_row = S // PAGE
            table = torch.tensor([[1 + b * per_row + (per_row - 1 - j) for j in range(per_row)] for b in range(B)],
                                 dtype=torch.int32)
        for cache in (*model.k_cache, *model.v_cache):  # the earlier tokens' keys and values
            cache.normal_()
        saved = [c.clone() for c in (*model.k_cache, *model.v_cache)]
        torch_logits = model.decode(token, position, slot, valid, S, triton=False, table=table)  # (writes the new token's)
        for longest_first in (False, True):  # FastEngine's attention_order: rows, then the default
            model.programs_longest_first = longest_first
            for cache, copy in zip((*model.k_cache, *model.v_cache), saved):
                cache.copy_(copy)
            triton_logits = model.decode(token, position, slot, valid, S, triton=True, table=table)
            worst = max(worst, (triton_logits - torch_logits).abs().max().item())
    print(f"largest logit difference {worst:.2e}")
    layers = len(model.layers)
    assert len(given) == 4 * layers, given  # 2 layouts x 2 orders
    for start in (0, 2 * layers):  # each layout: row order (None), then longest row first
        assert all(o is None for o in given[start:start + layers]), given
        assert all(o is not None and o.tolist() == [1, 3, 0, 2] for o in given[start + layers:start + 2 * layers]), given
    print("order ok")


if __name__ == "__main__":
    main()
