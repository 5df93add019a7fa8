"""Partial rollouts (``rollout.partial``): a rollout phase ends once a step's groups are complete,
pauses the sequences still running, and resumes them first in the next phase.

The engines' side: a sequence paused at a ``StopRule`` and resumed (``PromptBatch.resume``) with
unchanged weights writes exactly the tokens, authors and log-probs of an uninterrupted run with the
same seed (HFEngine, FastEngine's torch path with slot caches and with a paged pool)."""

from __future__ import annotations

import pytest
import torch

from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.record import PromptBatch, StopRule
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tests.test_continuous_batching import JUNIOR_PROMPTS, queue_batch
from tests.test_fast_engine import build

SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    from tandem_lit.models.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def plain_pair(tokenizer):
    return build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)


def make_engine(kind: str, senior, junior, tokenizer):
    if kind == "hf":
        engine, batch = HFEngine(rollout_dtype="float32", check_every=2), None
    elif kind == "fast":
        engine, batch = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2), 3
    else:
        engine, batch = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2, kv_cache="paged",
                                   kv_page_size=4, kv_cache_tokens=60), 3
    engine.setup(senior, junior, tokenizer, max_batch=batch)
    return engine


def resumed(prompts: PromptBatch, paused) -> PromptBatch:
    return PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts.partner,
                       prompts.max_new_tokens, resume=paused)


@pytest.mark.parametrize("policy", [WordHandoff(p=0.5), SoloHandoff()], ids=["word", "solo"])
@pytest.mark.parametrize("kind", ["hf", "fast", "paged"])
def test_a_paused_and_resumed_sequence_writes_what_an_uninterrupted_one_does(tokenizer, plain_pair, kind, policy):
    senior, junior = plain_pair
    engine = make_engine(kind, senior, junior, tokenizer)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS if kind == "paged" else None)
    want = engine.generate(prompts, policy, SAMPLED)
    rows = prompts.batch_size
    stop = StopRule(group=[i // 2 for i in range(rows)], groups=1)  # pairs of rows: end at the first whole pair
    first = engine.generate(prompts, policy, SAMPLED, stop)
    assert first.paused is not None, "the rule should end the call before every row ended"
    paused = [i for i, p in enumerate(first.paused) if p is not None]
    ended = [i for i in range(rows) if i not in paused]
    assert any(first.paused[i].written > 0 for i in paused)  # some were paused mid-sequence
    groups = [g for g in range(rows // 2) if {2 * g, 2 * g + 1} <= set(ended)]
    assert groups, "at least one whole group ended"
    for i in ended:  # rows that ended are the uninterrupted ones
        n = int(want.lengths[i])
        assert first.completion_ids[i, :n].tolist() == want.completion_ids[i, :n].tolist()
    for i in paused:  # what a paused row wrote is a prefix of the uninterrupted row
        p = first.paused[i]
        assert p.tokens.tolist() == want.completion_ids[i, : p.written].tolist()
        assert p.authors.tolist() == want.author[i, : p.written].tolist()
        assert not first.finished[i] and not first.truncated[i]
    again = engine.generate(resumed(prompts.select(paused), [first.paused[i] for i in paused]), policy, SAMPLED)
    assert again.paused is None
    for j, i in enumerate(paused):
        n = int(want.lengths[i])
        assert int(again.lengths[j]) == n
        assert again.completion_ids[j, :n].tolist() == want.completion_ids[i, :n].tolist()
        assert again.author[j, :n].tolist() == want.author[i, :n].tolist()
        assert bool(again.finished[j]) == bool(want.finished[i]) and bool(again.truncated[j]) == bool(want.truncated[i])
        assert again.texts[j] == want.texts[i]
        for name in ("handoffs", "decisions", "junior_draws"):
            assert int(getattr(again, name)[j]) == int(getattr(want, name)[i]), name
        torch.testing.assert_close(again.senior_logprobs[j, :n], want.senior_logprobs[i, :n], rtol=1e-4, atol=1e-4)
