"""HFEngine with tiny real Llama models: tandem equals solo for identical models, authorship at
p=0/p=1, batching with left padding, stopping, seeding, and the tokenizer check."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem_lit.models.tiny import char_tokenizer
from tandem_lit.rollout import (
    Author,
    HFEngine,
    ParagraphHandoff,
    PromptBatch,
    SamplingConfig,
    SentenceHandoff,
    SoloHandoff,
    TokenHandoff,
    TokenizerMismatchError,
    WordHandoff,
)
from tandem_lit.rollout.sampling import sequence_seeds

PROMPTS = ["ab cd. e", "a", "bad cab.\n\ndeed a", "cc", "e. a b c d e. ", "dd\nab"]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24)
SENIOR, JUNIOR = int(Author.SENIOR), int(Author.JUNIOR)


def encode(tokenizer, prompts: list[str], seed: int = 0, key: int = 0) -> PromptBatch:
    batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    return PromptBatch(batch["input_ids"], batch["attention_mask"], sequence_seeds(seed, key, len(prompts)))


def engine(senior, junior, tokenizer, junior_tokenizer=None) -> HFEngine:
    e = HFEngine()
    e.setup(senior, junior, tokenizer, junior_tokenizer or tokenizer)
    return e


def completions(rollout) -> list[list[int]]:
    return [row[: int(n)] for row, n in zip(rollout.completion_ids.tolist(), rollout.lengths.tolist())]


@pytest.fixture(scope="module")
def solo(small_model, small_tok):
    """Greedy single-model completions (the senior alone) of PROMPTS."""
    return engine(small_model, None, small_tok).generate(encode(small_tok, PROMPTS), SoloHandoff("senior"), GREEDY)


def test_solo_reference_is_varied(solo):
    """The fixture model writes spaces, stops and end tokens, so the tandem tests below have
    boundaries to hand off at and rows that finish early."""
    assert any(" " in t for t in solo.texts)
    assert bool(solo.finished.any()) and bool(solo.truncated.any())


@pytest.mark.parametrize("policy", [
    TokenHandoff(p=0.5), WordHandoff(p=0.5), SentenceHandoff(p=0.5), ParagraphHandoff(p=0.5),
    TokenHandoff(p=0.5, max_span=2),
], ids=repr)
@pytest.mark.parametrize("junior_kind", ["same_object", "identical_copy"])
def test_identical_models_greedy_tandem_equals_solo(policy, junior_kind, small_model, small_tok, solo):
    junior = small_model if junior_kind == "same_object" else copy.deepcopy(small_model)
    tandem = engine(small_model, junior, small_tok).generate(encode(small_tok, PROMPTS), policy, GREEDY)
    assert completions(tandem) == completions(solo)
    assert tandem.texts == solo.texts
    assert torch.equal(tandem.finished, solo.finished) and torch.equal(tandem.truncated, solo.truncated)
    if policy.unit in ("token", "word"):  # the junior really wrote part of it
        assert int(tandem.handoffs.sum()) > 0
        assert 0.0 < tandem.junior_token_share() < 1.0


@pytest.mark.parametrize("policy,author", [
    (WordHandoff(p=0.0), SENIOR), (SoloHandoff("senior"), SENIOR),
    (WordHandoff(p=1.0), JUNIOR), (SoloHandoff("junior"), JUNIOR), (TokenHandoff(p=1.0), JUNIOR),
], ids=repr)
def test_p0_all_senior_p1_all_junior(policy, author, small_model, other_small_model, small_tok):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    rollout = engine(small_model, other_small_model, small_tok).generate(encode(small_tok, PROMPTS), policy, sampling)
    written = rollout.author[rollout.completion_mask]
    assert written.numel() > len(PROMPTS)
    assert set(written.tolist()) == {author}
    assert int(rollout.handoffs.sum()) == 0


def test_junior_solo_writes_what_the_junior_writes_alone(small_model, other_small_model, small_tok):
    """p=1 is the junior's own greedy text: the same as the junior as the only model."""
    prompts = encode(small_tok, PROMPTS)
    tandem = engine(small_model, other_small_model, small_tok).generate(prompts, WordHandoff(p=1.0), GREEDY)
    alone = engine(other_small_model, None, small_tok).generate(prompts, SoloHandoff("senior"), GREEDY)
    assert completions(tandem) == completions(alone)


@pytest.mark.parametrize("policy", [SoloHandoff("senior"), WordHandoff(p=0.5), TokenHandoff(p=0.5)], ids=repr)
def test_batched_left_padded_prompts_match_one_at_a_time(policy, small_model, other_small_model, small_tok):
    """Left padding and per-row positions: each prompt completes the same in a batch as alone
    (same per-row seed), with sampling and two different models."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20)
    e = engine(small_model, other_small_model, small_tok)
    batch = encode(small_tok, PROMPTS)
    together = e.generate(batch, policy, sampling)
    assert len({len(p) for p in PROMPTS}) > 3  # prompt lengths really differ
    for i, prompt in enumerate(PROMPTS):
        single = PromptBatch(small_tok([prompt], return_tensors="pt")["input_ids"],
                             small_tok([prompt], return_tensors="pt")["attention_mask"], batch.seeds[i : i + 1])
        alone = e.generate(single, policy, sampling)
        assert completions(alone)[0] == completions(together)[i]
        n = int(alone.lengths[0])
        assert alone.author[0, :n].tolist() == together.author[i, :n].tolist()
        assert alone.texts[0] == together.texts[i]


def test_eos_finishes_and_budget_truncates(small_model, small_tok, solo):
    eos = small_tok.eos_token_id
    for i, ids in enumerate(completions(solo)):
        if solo.finished[i]:
            assert ids[-1] == eos and eos not in ids[:-1]
            assert not solo.truncated[i]
            assert len(ids) <= GREEDY.max_new_tokens
        else:
            assert solo.truncated[i] and len(ids) == GREEDY.max_new_tokens and eos not in ids
        # after the end: padding, PAD authorship
        assert set(solo.author[i, len(ids):].tolist()) <= {int(Author.PAD)}
        assert set(solo.completion_ids[i, len(ids):].tolist()) <= {small_tok.pad_token_id}
    # the decoded text drops the end token
    assert all("</s>" not in t for t in solo.texts)
    # a budget shorter than every completion truncates everything
    short = engine(small_model, None, small_tok).generate(
        encode(small_tok, PROMPTS), SoloHandoff("senior"), SamplingConfig(temperature=0.0, max_new_tokens=1))
    first = [ids[0] for ids in completions(solo)]
    assert short.completion_ids[:, 0].tolist() == first
    assert short.truncated.tolist() == [t != eos for t in first]


def test_same_seeds_same_rollouts_different_seeds_differ(small_model, other_small_model, small_tok):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20)
    e = engine(small_model, other_small_model, small_tok)
    a = e.generate(encode(small_tok, PROMPTS, seed=3), WordHandoff(p=0.5), sampling)
    b = e.generate(encode(small_tok, PROMPTS, seed=3), WordHandoff(p=0.5), sampling)
    c = e.generate(encode(small_tok, PROMPTS, seed=4), WordHandoff(p=0.5), sampling)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.author, b.author)
    assert a.texts == b.texts and torch.equal(a.handoffs, b.handoffs)
    assert not (torch.equal(a.completion_ids, c.completion_ids) and torch.equal(a.author, c.author))


def test_rollout_counters_and_spans(small_model, other_small_model, small_tok):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    rollout = engine(small_model, other_small_model, small_tok).generate(
        encode(small_tok, PROMPTS * 4), WordHandoff(p=0.5), sampling)
    for i in range(len(PROMPTS) * 4):
        authors = rollout.author[i][rollout.completion_mask[i]].tolist()
        assert int(rollout.handoffs[i]) == sum(a != b for a, b in zip(authors, authors[1:]))
        assert int(rollout.junior_draws[i]) <= int(rollout.decisions[i])
        spans = rollout.spans(i, small_tok)
        assert len(spans) == int(rollout.handoffs[i]) + 1
        assert all(a != b for (a, _), (b, _) in zip(spans, spans[1:]))
        text = "".join(t for _, t in spans)
        for special in small_tok.all_special_tokens:  # a random model may write <pad>, <unk>, </s>
            text = text.replace(special, "")
        assert text == rollout.texts[i]
    assert int(rollout.handoffs.sum()) > 0


def test_different_junior_tokenizer_raises_at_setup(small_model, small_tok):
    other = char_tokenizer("abcdef .\n")
    with pytest.raises(TokenizerMismatchError, match="tokenizer"):
        HFEngine().setup(small_model, small_model, small_tok, other)
    same_vocab_other_eos = char_tokenizer("abcde .\n")
    same_vocab_other_eos.eos_token = "a"
    with pytest.raises(TokenizerMismatchError, match="end sequences"):
        HFEngine().setup(small_model, small_model, small_tok, same_vocab_other_eos)
    HFEngine().setup(small_model, small_model, small_tok, char_tokenizer("abcde .\n"))  # equal: fine


def test_tandem_without_junior_is_a_config_error(small_model, small_tok):
    from tandem_lit.errors import ConfigError

    e = engine(small_model, None, small_tok)
    with pytest.raises(ConfigError, match="junior"):
        e.generate(encode(small_tok, PROMPTS[:2]), WordHandoff(p=0.5), GREEDY)


def test_an_architecture_the_fast_engine_lacks_falls_back_to_hf_engine_loudly(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tandem_lit.rollout.choice import default_engine

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    with caplog.at_level("WARNING", logger="tandem_lit"):
        engine = default_engine(model, model)
    assert isinstance(engine, HFEngine)
    (record,) = [r for r in caplog.records if "FALLING BACK" in r.getMessage()]
    message = record.getMessage()
    assert "gpt2" in message.lower() and "slower" in message and "model.engine" in message
