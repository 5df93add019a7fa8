"""Per-model prompts: the junior may read its own prompt (system prompt or template, e.g. "answer
in French") while both models share the response tokens. Every engine conditions each model on
its own prompt, the engines agree with each other, and the trainer's legibility and the forced-
token experiment read the solutions after the junior's own prompt."""

from __future__ import annotations

import pytest
import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine
from tandem_lit.training.settings import PromptFormat
from tests.test_fast_engine import DEVICES, assert_same_rollouts, build

SENIOR_PROMPTS = ["Q: 2+3?\nA:", "Hi", "The quick brown fox", "1. a\n\n2."]
# the junior's own prompts: different text and different lengths, longer and shorter
JUNIOR_PROMPTS = ["Réponds en français. Q: 2+3?\nA:", "Salut", "Le renard", "En français: 1. a\n\n2."]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=20, seed=3)


def batch(tokenizer, prompts, partner=None, device="cpu"):
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    seeds = sequence_seeds(0, 0, len(prompts))
    own = None
    if partner is not None:
        penc = tokenizer(partner, padding=True, padding_side="left", return_tensors="pt")
        own = PromptBatch(penc.input_ids, penc.attention_mask, seeds)
    return PromptBatch(enc.input_ids, enc.attention_mask, seeds, own).to(device)


@pytest.fixture(scope="module")
def tokenizer():
    from tandem_lit.models.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    return build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)


def make(kind, senior, junior, tokenizer):
    engine = HFEngine(rollout_dtype="float32") if kind == "hf" else FastEngine(kernels="torch", rollout_dtype="float32")
    engine.setup(senior, junior, tokenizer)
    return engine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["hf", "fast"])
def test_the_junior_writes_after_its_own_prompt(tokenizer, models, kind, device):
    senior, junior = (m.to(device) for m in models)
    engine = make(kind, senior, junior, tokenizer)
    junior_only = SoloHandoff(author="junior")
    with_partner = engine.generate(batch(tokenizer, SENIOR_PROMPTS, JUNIOR_PROMPTS, device), junior_only, SAMPLING)
    # the same rollouts as giving the junior its prompts as the batch's own
    direct = engine.generate(batch(tokenizer, JUNIOR_PROMPTS, device=device), junior_only, SAMPLING)
    assert with_partner.texts == direct.texts
    # and not what it writes after the senior's prompt (the test has teeth)
    shared = engine.generate(batch(tokenizer, SENIOR_PROMPTS, device=device), junior_only, SAMPLING)
    assert with_partner.texts != shared.texts
    # the senior, alone, ignores the partner prompts
    senior_only = SoloHandoff(author="senior")
    assert (engine.generate(batch(tokenizer, SENIOR_PROMPTS, JUNIOR_PROMPTS, device), senior_only, SAMPLING).texts
            == engine.generate(batch(tokenizer, SENIOR_PROMPTS, device=device), senior_only, SAMPLING).texts)


@pytest.mark.parametrize("device", DEVICES)
def test_fast_and_reference_engines_agree_in_tandem_with_per_model_prompts(tokenizer, models, device):
    senior, junior = (m.to(device) for m in models)
    prompts = batch(tokenizer, SENIOR_PROMPTS, JUNIOR_PROMPTS, device)
    for sampling in (SamplingConfig(temperature=0.0, max_new_tokens=20), SAMPLING):
        reference = make("hf", senior, junior, tokenizer).generate(prompts, WordHandoff(p=0.5), sampling)
        fast = make("fast", senior, junior, tokenizer).generate(prompts, WordHandoff(p=0.5), sampling)
        assert_same_rollouts(reference, fast)
        assert 0 < int((reference.author == 2).sum()) < int(reference.lengths.sum())  # both wrote


def test_partner_prompts_equal_to_the_senior_change_nothing(tokenizer, models):
    senior, junior = models
    engine = make("fast", senior, junior, tokenizer)
    plain = engine.generate(batch(tokenizer, SENIOR_PROMPTS), WordHandoff(p=0.5), SAMPLING)
    same = engine.generate(batch(tokenizer, SENIOR_PROMPTS, SENIOR_PROMPTS), WordHandoff(p=0.5), SAMPLING)
    assert_same_rollouts(plain, same)


def test_prompt_template_is_checked_and_applied():
    assert PromptFormat(template="{prompt}\n\nRéponds en français.").text("2+2?") == "2+2?\n\nRéponds en français."
    assert PromptFormat().text("2+2?") == "2+2?"
    with pytest.raises(ConfigError, match=r"must contain \{prompt\}"):
        PromptFormat(template="Answer in French.")
    with pytest.raises(ConfigError, match=r"not a format string over \{prompt\} only"):
        PromptFormat(template="{prompt} {language}")


def tiny_module(junior_format, small_tok, small_model, other_small_model, **extra):
    from tandem_lit.objectives import Reinforce
    from tandem_lit.rollout.choice import default_engine
    from tandem_lit.verifiers import ArithmeticVerifier
    from tests.conftest import tiny_tandem_module

    module = tiny_tandem_module(
        verifier=ArithmeticVerifier(), objective=Reinforce(), prompt_format=PromptFormat(chat_template=False),
        junior_prompt_format=junior_format, test_sampling=SamplingConfig(temperature=1.0, max_new_tokens=16, n=2, seed=1),
        **extra,
    )
    module.engine = default_engine(small_model, other_small_model)
    module.bind_models(small_model, other_small_model, small_tok, small_tok)
    return module


@pytest.mark.usefixtures("in_repo")
def test_the_trainer_gives_the_junior_its_own_prompt(small_tok, small_model, other_small_model):
    rows = [{"prompt": "ab c", "answer": "1"}, {"prompt": "d.e", "answer": "2"}]
    own = tiny_module(PromptFormat(chat_template=False, template="ee {prompt}"), small_tok, small_model, other_small_model)
    shared = tiny_module(None, small_tok, small_model, other_small_model)
    pretemplated = [{**row, "prompt": f"ee {row['prompt']}"} for row in rows]
    junior_only = SoloHandoff(author="junior")
    # the junior alone after its own prompt = the junior alone on prompts that already carry that text
    assert (own.rollouts.generate(rows, junior_only, own.evaluation.test_sampling, key=0).rollout.texts
            == shared.rollouts.generate(pretemplated, junior_only, shared.evaluation.test_sampling, key=0).rollout.texts)
    # legibility: the junior's cross-entropy on the senior's solutions after its own prompt
    solo = own.rollouts.generate(rows, SoloHandoff("senior"), own.evaluation.test_sampling, key=0).rollout
    prompts = [row["prompt"] for row in rows for _ in range(2)]
    nll_own = own.partner_cross_entropy(solo, prompts)
    view = shared.partner_view(solo, prompts)
    assert torch.equal(view.prompt_ids, solo.prompt_ids)  # no junior format: the senior's prompts
    relabelled = own.partner_view(solo, prompts)
    expected = shared.rollouts.encode_prompts([f"ee {p}" for p in prompts])
    assert torch.equal(relabelled.prompt_ids, expected["input_ids"])
    assert nll_own != shared.partner_cross_entropy(solo, prompts)


def test_the_text_handoff_engine_gives_the_junior_its_own_prompt(tokenizer, models):
    from tandem_lit.rollout.text_handoff import TextHandoffEngine

    senior, junior = models
    engine = TextHandoffEngine(rollout_dtype="float32")
    engine.setup(senior, junior, tokenizer, tokenizer)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
    junior_only = SoloHandoff(author="junior")
    own = engine.generate(batch(tokenizer, SENIOR_PROMPTS, JUNIOR_PROMPTS), junior_only, greedy)
    # what the junior writes greedily after its own prompt, in the reference engine
    reference = make("hf", senior, junior, tokenizer).generate(batch(tokenizer, JUNIOR_PROMPTS), junior_only, greedy)
    assert own.texts == reference.texts
