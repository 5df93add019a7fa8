"""Per-sequence token budgets and continuous batching.

Every engine honours ``PromptBatch.max_new_tokens`` (a row that reaches its budget is truncated,
as at ``sampling.max_new_tokens``). FastEngine with ``max_batch`` below the number of rows decodes
them as a queue (freed slots refilled, live rows compacted into smaller batches): its rollouts
must equal the reference engine's and the all-at-once FastEngine's whatever the admission order,
so a sequence depends on its own seed only, never on its slot or its neighbours.
"""

from __future__ import annotations

import pytest
import torch

from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tandem_lit.rollout.text_handoff import TextHandoffEngine
from tests.test_fast_engine import build, prompt_batch

BUDGETS = torch.tensor([3, 17, 1, 9])


@pytest.fixture(scope="module")
def tokenizer():
    from tandem_lit.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def plain_pair(tokenizer):
    return build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)


def with_budgets(prompts: PromptBatch, budgets: torch.Tensor) -> PromptBatch:
    return PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts.partner, budgets)


@pytest.mark.parametrize("kind", ["hf", "fast", "text"])
def test_every_engine_stops_each_row_at_its_own_budget(tokenizer, plain_pair, kind):
    senior, junior = plain_pair
    engine = {"hf": HFEngine, "fast": FastEngine, "text": TextHandoffEngine}[kind](rollout_dtype="float32")
    engine.setup(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, "cpu")
    if kind == "text":  # text-level handoff reads the junior's own encoding of the prompts
        prompts = PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    policy = WordHandoff(p=0.5)
    full = engine.generate(prompts, policy, sampling)
    cut = engine.generate(with_budgets(prompts, BUDGETS), policy, sampling)
    assert cut.truncated.all() and not cut.finished.any()
    if kind == "text":  # the budget counts tokens either model wrote; re-encoded spans may differ in count
        assert (cut.lengths <= BUDGETS).all()
        assert all(f.startswith(c) for c, f in zip(cut.texts, full.texts))
        return
    assert cut.lengths.tolist() == BUDGETS.tolist()
    for row, budget in enumerate(BUDGETS.tolist()):  # a budget cuts the same rollout, nothing else
        assert cut.completion_ids[row, :budget].tolist() == full.completion_ids[row, :budget].tolist()
        assert cut.author[row, :budget].tolist() == full.author[row, :budget].tolist()


@pytest.mark.parametrize("budgets", [torch.tensor([0, 1, 1, 1]), torch.tensor([1, 1, 21, 1]), torch.tensor([1, 2])])
def test_a_budget_outside_one_to_max_new_tokens_is_refused(tokenizer, plain_pair, budgets):
    senior, junior = plain_pair
    engine = HFEngine(rollout_dtype="float32")
    engine.setup(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, "cpu")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(with_budgets(prompts, budgets), SoloHandoff(), SamplingConfig(max_new_tokens=20))


def test_select_keeps_budgets_partner_and_drops_shared_padding(tokenizer):
    prompts = prompt_batch(tokenizer, "cpu")
    prompts = PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts, BUDGETS)
    picked = prompts.select([1, 2])  # "Hi" and the longest prompt
    assert picked.max_new_tokens.tolist() == [17, 1]
    assert picked.seeds.tolist() == prompts.seeds[[1, 2]].tolist()
    assert picked.partner.input_ids.shape == picked.input_ids.shape
    short = prompts.select([1])
    assert short.input_ids.shape[1] == int(prompts.attention_mask[1].sum())
