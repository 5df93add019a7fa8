"""TextHandoffEngine: tandem rollouts between models with different tokenizers.

The junior here uses a tokenizer whose ids are a permutation of the senior's, and its weights are
permuted to match, so it computes the senior's function of *text*. Any difference between a
tandem rollout and the senior's solo rollout would therefore come from the handoff machinery.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import SMALL_ALPHABET, tiny_llama

from tandem_lit.models.tiny import DEFAULT_ALPHABET, char_tokenizer
from tandem_lit.rollout.engine import (
    HFEngine,
    TokenizerMismatchError,  # noqa: I001
)
from tandem_lit.rollout.handoff import SentenceHandoff, SoloHandoff, TokenHandoff, WordHandoff
from tandem_lit.rollout.record import Author, PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.text_handoff import TextHandoffEngine

PROMPTS = ["abc de.", "dd a", "e.\nab ca"]  # characters of SMALL_ALPHABET
NON_TEXT_SPECIALS = {0, 1, 3}  # <pad>, <s>, <unk> of the character tokenizers


@pytest.fixture(scope="module")
def pair():
    senior_tok = char_tokenizer(SMALL_ALPHABET)
    junior_tok = char_tokenizer(SMALL_ALPHABET[::-1])  # same characters, other ids
    assert senior_tok.get_vocab() != junior_tok.get_vocab()
    senior = tiny_llama(len(senior_tok), seed=5)  # greedy text with spaces, stops and few special tokens
    junior = copy.deepcopy(senior)
    order = [senior_tok.convert_tokens_to_ids(junior_tok.convert_ids_to_tokens(i)) for i in range(len(junior_tok))]
    with torch.no_grad():
        junior.model.embed_tokens.weight.copy_(senior.model.embed_tokens.weight[order])  # tied LM head follows
    return senior, senior_tok, junior, junior_tok


def prompts_for(senior_tok, junior_tok, seed=0):
    s = senior_tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    j = junior_tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    seeds = sequence_seeds(seed, 0, len(PROMPTS))
    return PromptBatch(s.input_ids, s.attention_mask, seeds, PromptBatch(j.input_ids, j.attention_mask, seeds))


def engine_for(pair):
    senior, senior_tok, junior, junior_tok = pair
    engine = TextHandoffEngine()
    engine.setup(senior, junior, senior_tok, junior_tok)
    return engine


@pytest.mark.parametrize("policy", [WordHandoff(0.5), SentenceHandoff(0.5), TokenHandoff(0.5)])
def test_equivalent_partner_gives_the_solo_text(pair, policy):
    senior, senior_tok, junior, junior_tok = pair
    engine = engine_for(pair)
    prompts = prompts_for(senior_tok, junior_tok)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=40)
    tandem = engine.generate(prompts, policy, greedy)
    solo = engine.generate(prompts, SoloHandoff(), greedy)
    compared = 0
    for row in range(len(PROMPTS)):
        ids = solo.completion_ids[row][solo.completion_mask[row]].tolist()
        # a special token other than the end token has no text, so it cannot be handed over:
        # the two rollouts agree up to the first one the models write
        cut = next((i for i, t in enumerate(ids) if t in NON_TEXT_SPECIALS), len(ids))
        prefix = senior_tok.decode(ids[:cut], skip_special_tokens=True)
        assert tandem.texts[row].startswith(prefix), (row, prefix, tandem.texts[row])
        compared += len(prefix)
    assert compared >= 15, "the comparison should cover a real stretch of text"
    assert (tandem.author == Author.JUNIOR).any() and tandem.handoffs.sum() > 0


def test_solo_text_engine_matches_the_lockstep_engine(pair):
    senior, senior_tok, junior, junior_tok = pair
    reference = HFEngine()
    reference.setup(senior, None, senior_tok)
    prompts = prompts_for(senior_tok, junior_tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=30, seed=4)
    assert engine_for(pair).generate(prompts, SoloHandoff(), sampling).texts == reference.generate(prompts, SoloHandoff(), sampling).texts


def test_author_marks_map_onto_senior_tokens(pair):
    senior, senior_tok, junior, junior_tok = pair
    out = engine_for(pair).generate(prompts_for(senior_tok, junior_tok), WordHandoff(0.5), SamplingConfig(temperature=1.0, max_new_tokens=40))
    for row in range(len(PROMPTS)):
        spans = [(author, text) for author, text in out.spans(row, senior_tok)]
        visible = "".join(text for _, text in spans)
        for special in ("<pad>", "<s>", "</s>", "<unk>"):
            visible = visible.replace(special, "")
        assert visible == out.texts[row]
        for author, text in spans[1:]:
            # a handoff happens at a word boundary: each later span starts with whitespace
            assert text[:1].isspace() or text.startswith("<"), (author, text)


def test_same_seed_same_rollout_other_seed_differs(pair):
    senior, senior_tok, junior, junior_tok = pair
    engine = engine_for(pair)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=30)
    a = engine.generate(prompts_for(senior_tok, junior_tok, seed=1), WordHandoff(0.5), sampling)
    b = engine.generate(prompts_for(senior_tok, junior_tok, seed=1), WordHandoff(0.5), sampling)
    c = engine.generate(prompts_for(senior_tok, junior_tok, seed=2), WordHandoff(0.5), sampling)
    assert a.texts == b.texts and torch.equal(a.author, b.author)
    assert a.texts != c.texts


def test_lockstep_engines_refuse_different_tokenizers(pair):
    senior, senior_tok, junior, junior_tok = pair
    with pytest.raises(TokenizerMismatchError, match="TextHandoffEngine"):
        HFEngine().setup(senior, junior, senior_tok, junior_tok)


def test_cli_trains_with_a_junior_that_has_its_own_tokenizer(tmp_path, repo_root):
    from tandem_lit.cli import main
    from tandem_lit.models.tiny import tiny_llama_config, write_model_dir

    junior_tok = char_tokenizer(DEFAULT_ALPHABET[::-1])
    junior_dir = write_model_dir(tmp_path / "junior", tiny_llama_config(len(junior_tok), hidden=32, layers=1), junior_tok)
    root = tmp_path / "run"
    main(args=[
        "fit", "--config", str(repo_root / "configs/gsm8k_tiny.yaml"),
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
        "--model.init_args.junior.path", str(junior_dir),
        "--model.init_args.engine", "TextHandoffEngine",
        "--model.init_args.evaluation.at_start", "false",
        "--data.init_args.source", str(repo_root / "data/gsm8k-sample"),
    ])
    records = [json.loads(line) for line in (root / "completions.jsonl").read_text().splitlines()]
    authors = {span["author"] for record in records for span in record["spans"]}
    assert authors == {"senior", "junior"}


def test_legibility_reads_the_text_in_the_partners_own_tokens(pair):
    """The permuted junior computes the senior's function of text, so its cross-entropy on the
    senior's solo text, re-tokenized for it, equals the senior's own on its own tokens (were the
    senior's ids fed to it, it would read a different text)."""
    from conftest import tiny_tandem_module

    from tandem_lit.objectives import GRPO
    from tandem_lit.training.settings import PromptFormat
    from tandem_lit.verifiers import GSM8KVerifier

    senior, senior_tok, junior, junior_tok = pair
    module = tiny_tandem_module(verifier=GSM8KVerifier(), objective=GRPO(), prompt_format=PromptFormat(chat_template=False))
    engine = HFEngine()
    engine.setup(senior, None, senior_tok)
    s = senior_tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    solo = engine.generate(PromptBatch(s.input_ids, s.attention_mask, sequence_seeds(0, 0, len(PROMPTS))), SoloHandoff(),
                           SamplingConfig(temperature=1.0, max_new_tokens=20))
    module.bind_models(senior, senior, senior_tok, senior_tok)  # the senior reading its own text
    as_text = module.partner_tokens(solo, PROMPTS)  # the text in its tokens (no non-text specials)
    own_nll, own_tokens, chars = module.partner_cross_entropy(as_text, PROMPTS)
    module.bind_models(senior, junior, senior_tok, junior_tok)  # the same function, other token ids
    assert module.partner_has_own_tokenizer()
    nll, tokens, partner_chars = module.partner_cross_entropy(solo, PROMPTS)
    assert tokens == own_tokens and partner_chars == chars == sum(len(t) for t in solo.texts)
    assert nll == pytest.approx(own_nll, rel=1e-4)
    module.bind_models(senior, junior, senior_tok, senior_tok)  # the old behaviour: the senior's ids, fed to the permuted junior
    wrong, _, _ = module.partner_cross_entropy(solo, PROMPTS)
    assert wrong != pytest.approx(own_nll, rel=1e-2)
