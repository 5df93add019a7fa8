"""Handoff switches are scored under the distribution each token was drawn from (rollout.switch).

At junior -> senior the senior's first token is drawn among span-start tokens only: its recorded
and recomputed log-prob is log p(x) - log Z. At senior -> junior the senior's discarded candidate
ended its span, with probability Z_end: log Z_end is added to the senior's last token. The
frequencies of many seeded draws at switch positions match the recorded probabilities (and not
the unrestricted ones); every engine records what the update recomputes.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from conftest import SMALL_ALPHABET, tiny_llama

from tandem_lit.models.tiny import char_tokenizer
from tandem_lit.rollout import logprobs
from tandem_lit.rollout.decoder import TandemDecoder
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import (
    LineHandoff,
    ParagraphHandoff,
    SentenceHandoff,
    TokenClasses,
    TokenHandoff,
    WordHandoff,
)
from tandem_lit.rollout.record import Author, PromptBatch, concat_rollouts
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine
from tandem_lit.rollout.switch import set_log_mass
from tandem_lit.rollout.text_handoff import TextHandoffEngine

ROWS = 4000
T = 0.7
PROMPTS = ["abc de.", "dd a", "e.\nab ca", "c", "a. b", "ab c"]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(SMALL_ALPHABET)  # word starts: " " and "\n" (and the special tokens may start a span)


@pytest.fixture(scope="module")
def pair(tok):
    return tiny_llama(len(tok), seed=0), tiny_llama(len(tok), seed=1, hidden=32, layers=1, heads=2, kv_heads=1)


def next_logits(model, tok, prompt: str) -> torch.Tensor:  # [1, V]: the model's logits after ``prompt``
    with torch.no_grad():
        return model(tok(prompt, return_tensors="pt").input_ids).logits[:, -1].float()


def two_steps(tok, senior_logits, junior_logits, first_author: str, p: float) -> dict[str, torch.Tensor]:
    """ROWS seeded sequences of two tokens, each step's logits fixed (the models' after one context)."""
    policy = WordHandoff(p, first_author=first_author)
    sampling = SamplingConfig(temperature=T, max_new_tokens=2, ignore_eos=True)
    decoder = TandemDecoder(policy, TokenClasses.from_tokenizer(tok), sampling, ROWS, [tok.eos_token_id], tok.pad_token_id)
    decoder.reset(sequence_seeds(11, 0, ROWS))
    for _ in range(2):
        decoder.step(senior_logits.expand(ROWS, -1), junior_logits.expand(ROWS, -1))
    return decoder.outputs()


def within_binomial(frequency: float, probability: float, n: int, sigmas: float = 4.5) -> bool:
    return abs(frequency - probability) <= sigmas * math.sqrt(probability * (1 - probability) / n) + 1e-9


def test_junior_to_senior_switch_tokens_come_as_often_as_recorded(tok, pair):
    """The junior writes first and always hands over at a word start (p = 0): at step 1 the senior
    draws among span starts. Each token's frequency among those draws is its recorded probability
    (the renormalised one), far from the unrestricted one the engines recorded before."""
    senior, junior = pair
    senior_logits = next_logits(senior, tok, "e.\nab ca")  # a third of its mass on span starts
    junior_logits = next_logits(junior, tok, "ab c")  # half of it on word starts: many switches
    out = two_steps(tok, senior_logits, junior_logits, "junior", p=0.0)
    switched = out["authors"][:, 1] == Author.SENIOR
    assert bool((out["start_sets"][:, 1] != 0).eq(switched).all())  # the switch rows, and only they, are coded
    n = int(switched.sum())
    assert n > 1500
    tokens, recorded = out["tokens"][switched, 1], out["logprobs"][switched, 1]
    unrestricted = (senior_logits[0] / T).log_softmax(-1)
    old_fits = []
    for x in tokens.unique().tolist():
        mine = tokens == x
        frequency = float(mine.sum()) / n
        probability = float(recorded[mine][0].exp())
        assert torch.allclose(recorded[mine], recorded[mine][0])  # one context: one probability per token
        assert within_binomial(frequency, probability, n), (x, frequency, probability)
        if frequency > 0.05:
            old_fits.append(within_binomial(frequency, float(unrestricted[x].exp()), n))
    assert old_fits and not any(old_fits)  # the unrestricted probability fails every common token
    # the recorded probabilities: the senior's, renormalised over the tokens that may start a span
    classes = TokenClasses.from_tokenizer(tok)
    allowed = classes.starts_ws | classes.special
    renormalised = unrestricted - unrestricted[allowed].logsumexp(-1)
    torch.testing.assert_close(recorded, renormalised[tokens])
    assert math.isclose(float(renormalised[allowed].exp().sum()), 1.0, rel_tol=1e-5)


def test_senior_to_junior_switch_scores_the_span_end_on_the_seniors_last_token(tok, pair):
    """The senior writes first and hands over at every word start (p = 1): its step-0 token, then
    its span's end at step 1, happen together as often as the recorded probability of its token
    says (log p(x) + log Z_end), not as often as p(x)."""
    senior, junior = pair
    senior_logits = next_logits(senior, tok, "dd e")  # a third of its mass on word starts
    junior_logits = next_logits(junior, tok, "ab c")
    out = two_steps(tok, senior_logits, junior_logits, "senior", p=1.0)
    switched = out["authors"][:, 1] == Author.JUNIOR
    assert bool((out["end_sets"][:, 1] != 0).eq(switched).all())
    assert bool((out["start_sets"][:, 1] != 0).eq(switched).all())  # the junior's token was constrained too
    assert 800 < int(switched.sum()) < ROWS - 800
    unrestricted = (senior_logits[0] / T).log_softmax(-1)
    old_fits = []
    for x in out["tokens"][:, 0].unique().tolist():
        event = (out["tokens"][:, 0] == x) & switched
        if not event.any():
            continue
        frequency = float(event.sum()) / ROWS  # P(senior writes x, then its span ends)
        probability = float(out["logprobs"][event, 0][0].exp())
        assert within_binomial(frequency, probability, ROWS), (x, frequency, probability)
        if frequency > 0.05:
            old_fits.append(within_binomial(frequency, float(unrestricted[x].exp()), ROWS))
    assert old_fits and not any(old_fits)  # p(x) alone fails every common token
    # where the senior went on, its token keeps its plain log-prob
    kept = ~switched
    torch.testing.assert_close(out["logprobs"][kept, 0], unrestricted[out["tokens"][kept, 0]])


def test_renormalisation_by_hand():
    """A five-token vocabulary, by hand in float64: the log-mass of a set and the recorded log-probs."""
    texts = ["</s>", " a", " b", "c", "d"]
    classes = TokenClasses.from_texts(texts, {0})
    rule = WordHandoff().compile(classes)
    sets = rule.token_sets()
    assert sets.tolist() == [[True, True, True, False, False], [False, True, True, False, False]]  # starts, ends
    logits = [0.5, 1.0, 2.0, 0.0, -1.0]
    p = [math.exp(v / T) for v in logits]
    p = [v / sum(p) for v in p]
    logp = (torch.tensor([logits]) / T).log_softmax(-1)
    for code, members in ((1, [0, 1, 2]), (2, [1, 2])):
        expected = math.log(sum(p[i] for i in members))
        assert math.isclose(float(set_log_mass(logp, sets, torch.tensor([code]))), expected, rel_tol=1e-6)
    assert float(set_log_mass(logp, sets, torch.tensor([0]))) == 0.0
    # the decoder: a senior who starts after the junior's word records log(p_x / Z_start); a
    # senior whose word ends at a handover adds log Z_end to its last token
    for first_author, p_junior in (("junior", 0.0), ("senior", 1.0)):
        decoder = TandemDecoder(WordHandoff(p_junior, first_author=first_author), classes,
                                SamplingConfig(temperature=T, max_new_tokens=2, ignore_eos=True), 64, [0], 0)
        decoder.reset(sequence_seeds(3, 0, 64))
        junior = torch.tensor([[0.0, 3.0, 3.0, 0.0, 0.0]])  # mostly word starts: most rows switch
        for _ in range(2):
            decoder.step(torch.tensor([logits]).expand(64, -1), junior.expand(64, -1))
        switched = decoder.authors[:, 1] != decoder.authors[:, 0]
        assert switched.sum() > 10
        for row in switched.nonzero().flatten().tolist():
            first, second = decoder.tokens[row, :2].tolist()
            if first_author == "junior":
                assert math.isclose(float(decoder.logprobs[row, 1]), math.log(p[second] / (p[0] + p[1] + p[2])), rel_tol=1e-5)
            else:
                assert math.isclose(float(decoder.logprobs[row, 0]), math.log(p[first] * (p[1] + p[2])), rel_tol=1e-5)
                # the junior's token, scored by the senior under the same restriction
                assert math.isclose(float(decoder.logprobs[row, 1]), math.log(p[second] / (p[0] + p[1] + p[2])), rel_tol=1e-5)


@pytest.mark.parametrize("policy", [WordHandoff(), SentenceHandoff(), ParagraphHandoff(), LineHandoff()])
def test_token_sets_are_the_sets_the_rules_draw_from(policy):
    texts = ["</s>", " a", "a", ".", ". ", ".\n", "\n\n", " ", "\n", "b", "\"", " \n"]
    classes = TokenClasses.from_texts(texts, {0})
    rule = policy.compile(classes)
    sets, every = rule.token_sets(), torch.arange(len(texts))
    reachable, frontier = {0}, [0]  # the carries the rule's own update reaches from the start (a few)
    while frontier:
        carry = frontier.pop()
        for after in rule.update(torch.full_like(every, carry), every).tolist():
            if after not in reachable and after < 6:
                reachable.add(after)
                frontier.append(after)
    assert len(reachable) >= rule.states
    for carry in sorted(reachable):
        state = int(rule.state(torch.tensor([carry])))
        allowed = rule.start_allowed(torch.tensor([carry]))
        assert torch.equal(allowed.expand(1, -1)[0], sets[state])
        assert torch.equal(rule.at_boundary(torch.tensor([[carry]]), every[None]).expand(1, -1)[0], sets[rule.states + state])


def test_a_draw_before_every_token_restricts_nothing(tok):
    assert TokenHandoff().compile(TokenClasses.from_tokenizer(tok)).token_sets() is None


def lockstep(kind: str, senior, junior, tok):
    engine = HFEngine(rollout_dtype="float32") if kind == "hf" else FastEngine(kernels="torch", rollout_dtype="float32")
    engine.setup(senior, junior, tok)
    return engine


def prompts_for(tok, junior_tok=None, repeat=3):
    texts = PROMPTS * repeat
    enc = tok(texts, padding=True, padding_side="left", return_tensors="pt")
    seeds = sequence_seeds(5, 0, len(texts))
    partner = None
    if junior_tok is not None:
        j = junior_tok(texts, padding=True, padding_side="left", return_tensors="pt")
        partner = PromptBatch(j.input_ids, j.attention_mask, seeds)
    return PromptBatch(enc.input_ids, enc.attention_mask, seeds, partner)


def assert_recompute_equals_record(rollout, senior, only_senior_tokens: bool):
    """The update's log-probs (chunked and packed) equal the engine's at every token, switch
    tokens included, and there the switch terms are not small."""
    scored = rollout.author == Author.SENIOR if only_senior_tokens else rollout.completion_mask
    with torch.no_grad():
        for packed in (False, True):
            train = logprobs.completion_logprobs(senior, rollout, T, packed=packed)
            torch.testing.assert_close(train[scored], rollout.senior_logprobs[scored], rtol=1e-4, atol=1e-4)
        plain = logprobs.completion_logprobs(senior, dataclass_without_sets(rollout), T)
    senior_tokens = rollout.author == Author.SENIOR
    starts = (rollout.start_set != 0) & senior_tokens  # junior -> senior switch tokens
    ends = torch.nn.functional.pad((rollout.end_set != 0)[:, 1:], (0, 1))  # senior tokens before a senior -> junior switch
    assert int(starts.sum()) >= 3 and int(ends.sum()) >= 3, (int(starts.sum()), int(ends.sum()))
    assert bool((senior_tokens[ends]).all())
    # the terms the switches add: what the unrestricted log-probs leave out
    start_terms, end_terms = (rollout.senior_logprobs - plain)[starts], (rollout.senior_logprobs - plain)[ends]
    assert bool((start_terms >= 0).all()) and float(start_terms.mean()) > 0.05  # -log Z_start
    assert bool((end_terms <= 0).all()) and float(end_terms.mean()) < -0.05  # log Z_end
    others = senior_tokens & ~starts & ~ends  # every other senior token keeps its plain log-prob
    torch.testing.assert_close(rollout.senior_logprobs[others], plain[others], rtol=1e-4, atol=1e-4)


def dataclass_without_sets(rollout):
    return dataclasses.replace(rollout, start_set=None, end_set=None, token_sets=None)


@pytest.mark.parametrize("kind", ["hf", "fast"])
@pytest.mark.parametrize("policy", [WordHandoff(0.5), SentenceHandoff(0.5)])
def test_lockstep_engines_record_what_the_update_recomputes(tok, pair, kind, policy):
    senior, junior = pair
    rollout = lockstep(kind, senior, junior, tok).generate(prompts_for(tok), policy, SamplingConfig(temperature=T, max_new_tokens=32))
    assert_recompute_equals_record(rollout, senior, only_senior_tokens=False)


def test_text_handoff_engine_records_what_the_update_recomputes(tok, pair):
    senior, junior = pair
    junior_tok = char_tokenizer(SMALL_ALPHABET[::-1])  # the same characters under other ids
    order = [tok.convert_tokens_to_ids(junior_tok.convert_ids_to_tokens(i)) for i in range(len(junior_tok))]
    permuted = copy.deepcopy(junior)  # the junior's function of text, in its own ids
    with torch.no_grad():
        permuted.model.embed_tokens.weight.copy_(junior.model.embed_tokens.weight[order])  # the tied head follows
    engine = TextHandoffEngine()
    engine.setup(senior, permuted, tok, junior_tok)
    rollout = engine.generate(prompts_for(tok, junior_tok), WordHandoff(0.5), SamplingConfig(temperature=T, max_new_tokens=32))
    assert bool((rollout.senior_logprobs[rollout.author == Author.JUNIOR] == 0).all())
    assert_recompute_equals_record(rollout, senior, only_senior_tokens=True)


def test_recomputed_switch_terms_carry_their_gradient(monkeypatch, tok, pair):
    """Chunked and checkpointed, the recompute's gradient is that of log p(x) - log Z_start (+ log
    Z_end on the token before), computed over full logits."""
    senior, junior = pair
    rollout = lockstep("hf", senior, junior, tok).generate(prompts_for(tok, repeat=1), WordHandoff(0.5),
                                                           SamplingConfig(temperature=T, max_new_tokens=32))
    assert int((rollout.start_set != 0).sum()) > 0 and int((rollout.end_set != 0).sum()) > 0
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    logits = senior(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    full = (logits[:, rollout.prompt_ids.shape[1] - 1 : -1].float() / T).log_softmax(-1)  # [N, W, V]
    sets = rollout.token_sets
    start, end = rollout.start_set.long(), rollout.end_set.long()
    chosen = full.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    start_mass = set_log_mass(full.flatten(0, 1), sets, start.flatten()).view_as(chosen)
    end_mass = set_log_mass(full.flatten(0, 1), sets, end.flatten()).view_as(chosen)
    expected = chosen - start_mass + torch.nn.functional.pad(end_mass[:, 1:], (0, 1))
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * len(tok))  # chunks of a few positions
    got = logprobs.completion_logprobs(senior, rollout, T)
    written = rollout.completion_mask
    torch.testing.assert_close(got[written], expected[written], rtol=1e-5, atol=1e-5)
    weight = senior.model.layers[0].mlp.up_proj.weight
    (want,) = torch.autograd.grad((expected * written).sum(), weight)
    (have,) = torch.autograd.grad((got * written).sum(), weight)
    assert float((have - want).norm() / want.norm()) < 1e-5


def test_rollout_rows_keep_their_switch_codes(tok, pair):
    senior, junior = pair
    rollout = lockstep("hf", senior, junior, tok).generate(prompts_for(tok, repeat=1), WordHandoff(0.5),
                                                           SamplingConfig(temperature=T, max_new_tokens=16))
    part = rollout.select([2, 0]).trimmed()
    assert torch.equal(part.start_set, rollout.start_set[[2, 0], : part.completion_ids.shape[1]])
    assert torch.equal(part.end_set, rollout.end_set[[2, 0], : part.completion_ids.shape[1]])
    both = concat_rollouts([rollout.select([1]), rollout.select([3])], tok.pad_token_id)
    assert torch.equal(both.token_sets, rollout.token_sets)
    assert torch.equal(both.start_set[1, : rollout.completion_ids.shape[1]], rollout.start_set[3])
