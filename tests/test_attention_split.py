"""FastEngine(attention_split=N): the Triton decode attention reads each row's cache in chunks of
N slots, one program per chunk, merged by a second kernel (flash-decoding). The arithmetic is
checked against the unsplit kernel in Triton's interpreter (tests/test_kernels.py); here whole
rollouts through the engine write the same tokens as unsplit ones, on both pool layouts, and what
it cannot do fails in one line.
"""

from __future__ import annotations

import pytest
import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tests.test_fast_engine import PROMPTS, assert_same_rollouts, build, prompt_batch
from tests.test_fast_engine import tokenizer as tokenizer  # noqa: F401 (the fixture)


@pytest.mark.parametrize("bad", [0, 64, 200, -128])
def test_a_split_that_is_not_a_multiple_of_128_fails_in_one_line(bad):
    with pytest.raises(ConfigError, match=f"attention_split must be a multiple of 128 .* got {bad}"):
        FastEngine(attention_split=bad)


def test_a_hybrid_model_refuses_the_split(tokenizer):
    from tests.test_hybrid_engine import hybrid

    engine = FastEngine(kernels="torch", rollout_dtype="float32", attention_split=256)
    with pytest.raises(ConfigError, match="splits plain attention layers only; the senior is qwen3_5"):
        engine.setup(hybrid(len(tokenizer), seed=0), None, tokenizer)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_split_attention_writes_the_tokens_unsplit_attention_writes(tokenizer, kv_cache):
    """fp32 tandem rollouts of 300 tokens (rows past 128 slots span three chunks and more): the same
    tokens, authors and handoffs, log-probs equal to float32 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    senior = build("qwen3", len(tokenizer), 128, 2, seed=0).cuda()
    junior = build("qwen3", len(tokenizer), 64, 1, seed=1).cuda()
    runs = []
    for split in (None, 128):
        engine = FastEngine(kernels="triton", rollout_dtype="float32", kv_cache=kv_cache, kv_page_size=16,
                            attention_split=split)
        engine.setup(senior, junior, tokenizer)
        runs.append([engine.generate(prompt_batch(tokenizer, "cuda", PROMPTS * 2), policy,
                                     SamplingConfig(temperature=1.0, max_new_tokens=300, ignore_eos=True))
                     for policy in (WordHandoff(0.5), SoloHandoff())])
    for unsplit, split in zip(*runs):
        assert split.completion_mask.sum(1).min() == 300  # (every row reaches its third chunk)
        assert_same_rollouts(unsplit, split)
        torch.testing.assert_close(unsplit.senior_logprobs, split.senior_logprobs, atol=1e-4, rtol=1e-4)


def test_the_attention_order_is_checked_and_reaches_the_decode_step(tokenizer):
    with pytest.raises(ConfigError, match="attention_order must be 'longest_first' or 'rows', got 'random'"):
        FastEngine(attention_order="random")
    for order, longest_first in (("longest_first", True), ("rows", False)):
        engine = FastEngine(kernels="torch", rollout_dtype="float32", attention_order=order)
        engine.setup(build("qwen3", len(tokenizer), 32, 1, seed=0), None, tokenizer)
        engine.generate(prompt_batch(tokenizer, "cpu"), SoloHandoff(), SamplingConfig(temperature=0.0, max_new_tokens=2))
        assert engine.models["senior"].programs_longest_first is longest_first
