"""Handoff policies driven through the real TandemDecoder with random logits.

The decoder is the part every engine shares; its inputs are the two models' next-token logits,
so random logits exercise it exactly as models would. Each property is checked against a
text-level reference written here from the design (not from the implementation): where an author
switch may happen, that words stay whole, how often the junior is drawn.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem_lit.errors import ConfigError
from tandem_lit.models.tiny import char_tokenizer
from tandem_lit.rollout.decoder import TandemDecoder
from tandem_lit.rollout.handoff import (
    LineHandoff,
    ParagraphHandoff,
    SentenceHandoff,
    SoloHandoff,
    TokenClasses,
    TokenHandoff,
    WordHandoff,
    token_texts,
)
from tandem_lit.rollout.record import Author
from tandem_lit.rollout.sampling import SamplingConfig

SENIOR, JUNIOR, PAD = int(Author.SENIOR), int(Author.JUNIOR), int(Author.PAD)
POLICIES = {"token": TokenHandoff, "word": WordHandoff, "sentence": SentenceHandoff, "line": LineHandoff,
            "paragraph": ParagraphHandoff}
CLOSERS = "\"')]}»”’"


class Vocab:
    """Token texts, special ids and the TokenClasses of one vocabulary."""

    def __init__(self, texts: list[str], special: set[int], eos: int, pad: int):
        self.texts = texts
        self.special = special
        self.eos = eos
        self.pad = pad
        self.classes = TokenClasses.from_texts(texts, special)
        self.ids = {t: i for i, t in enumerate(texts)}

    def bias(self, space: float, newline: float, stop: float, eos: float) -> torch.Tensor:  # [V]
        """Logit offsets that make boundaries common; special tokens other than EOS never drawn."""
        b = torch.zeros(len(self.texts))
        for i, t in enumerate(self.texts):
            if i in self.special:
                b[i] = eos if i == self.eos else -math.inf
            elif t.isspace():
                b[i] = newline if "\n" in t else space
            elif "\n" in t:
                b[i] = newline
            elif re.search(r"[.?!]", t):
                b[i] = stop
            elif t.startswith(" "):
                b[i] = space / 2
        return b


def char_vocab() -> Vocab:
    tok = char_tokenizer()
    return Vocab(token_texts(tok), set(tok.all_special_ids), tok.eos_token_id, tok.pad_token_id)


def bpe_vocab() -> Vocab:
    """A hand-made subword vocabulary: leading-space words, suffixes, merged punctuation and line
    breaks (".\\n\\n" as one token, as in Qwen/Llama-3 tokenizers), closing quotes."""
    texts = [
        "<pad>", "<s>", "</s>",
        "The", " cat", " sat", " dog", " the", "ing", "s", "ed", "un", " run", "2", " 4",
        ".", "!", "?", ".\n", ".\n\n", '."', '"', ")", " (", "\n", "\n\n", " ", "  ", " \n", ",",
        "a\n", "b \n \n", " x",
    ]
    return Vocab(texts, {0, 1, 2}, eos=2, pad=0)


VOCABS = {"char": char_vocab(), "bpe": bpe_vocab()}


def decode_steps(
    policy, vocab: Vocab, seeds: torch.Tensor, steps: int, logit_seed: int, bias: torch.Tensor | None = None,
    sampling: SamplingConfig | None = None,
) -> TandemDecoder:
    """Run the decoder for ``steps`` tokens with random senior and junior logits (different ones)."""
    sampling = sampling or SamplingConfig(temperature=1.0, max_new_tokens=steps)
    decoder = TandemDecoder(policy, vocab.classes, sampling, seeds.shape[0], [vocab.eos], vocab.pad)
    decoder.reset(seeds)
    gen = torch.Generator().manual_seed(logit_seed)
    bias = bias if bias is not None else torch.zeros(len(vocab.texts))
    for _ in range(steps):
        senior = torch.randn(seeds.shape[0], len(vocab.texts), generator=gen) * 2 + bias
        junior = torch.randn(seeds.shape[0], len(vocab.texts), generator=gen) * 2 + bias
        decoder.step(senior, junior)
        if decoder.all_finished():
            break
    return decoder


def rows(decoder: TandemDecoder) -> list[tuple[list[int], list[int]]]:
    """(tokens, authors) of each sequence, cut at the end of the written tokens."""
    out = []
    for ids, authors in zip(decoder.tokens.tolist(), decoder.authors.tolist()):
        n = sum(a != PAD for a in authors)
        assert all(a == PAD for a in authors[n:]), "authorship has a gap inside a completion"
        out.append((ids[:n], authors[:n]))
    return out


# ------------------------------------------------------------------ text-level reference rules


def trailing_ws(text: str) -> str:
    return text[len(text.rstrip()):]


def ends_sentence(text: str) -> bool:
    return re.search(r"[.?!][\s" + re.escape(CLOSERS) + r"]*$", text) is not None


def switch_allowed(unit: str, prefix: str, token: str, special: bool) -> bool:
    """May a span of ``unit`` start with ``token`` after the text ``prefix``? (The design's rules.)"""
    if unit == "token":
        return True
    if unit == "word":
        return special or token[:1].isspace()
    if unit == "sentence":
        return (
            special
            or token[:1] == "\n"
            or "\n" in trailing_ws(prefix)
            or (ends_sentence(prefix) and token[:1].isspace())
        )
    if unit == "line":
        return trailing_ws(prefix).count("\n") >= 1 and not token.isspace()
    if unit == "paragraph":
        return trailing_ws(prefix).count("\n") >= 2 and not token.isspace()
    raise AssertionError(unit)


def check_rollout(unit: str, vocab: Vocab, ids: list[int], authors: list[int]) -> None:
    """Every switch at a unit boundary; no word written by two authors; the end token last."""
    text = ""
    char_authors: list[int] = []
    for i, (token, author) in enumerate(zip(ids, authors)):
        assert author in (SENIOR, JUNIOR)
        piece = vocab.texts[token]
        special = token in vocab.special
        if i > 0 and author != authors[i - 1]:
            assert switch_allowed(unit, text, piece, special), (
                f"{unit} switch before {piece!r} after {text[-20:]!r}"
            )
        if special:
            piece = " "  # special tokens separate words
        text += piece
        char_authors += [author] * len(piece)
        if token == vocab.eos:
            assert i == len(ids) - 1, "tokens were written after the end token"
    if unit != "token":
        for word in re.finditer(r"\S+", text):
            owners = set(char_authors[word.start() : word.end()])
            assert len(owners) == 1, f"word {word.group()!r} split between authors"


def switches(authors: list[int]) -> int:
    return sum(a != b for a, b in zip(authors, authors[1:]))


# ------------------------------------------------------------------------------ properties


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    unit=st.sampled_from(sorted(POLICIES)),
    vocab_name=st.sampled_from(sorted(VOCABS)),
    p=st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]),
    first_author=st.sampled_from(["draw", "senior", "junior"]),
    seed=st.integers(0, 2**32 - 1),
    logit_seed=st.integers(0, 2**31 - 1),
    space=st.floats(0, 5),
    newline=st.floats(0, 5),
    stop=st.floats(0, 5),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.9]),
)
def test_switches_only_at_boundaries_and_words_stay_whole(
    unit, vocab_name, p, first_author, seed, logit_seed, space, newline, stop, temperature, top_p
):
    vocab = VOCABS[vocab_name]
    policy = POLICIES[unit](p=p, first_author=first_author)
    steps = 48
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=steps)
    seeds = (torch.arange(6) * 7919 + seed) & 0xFFFFFFFF
    bias = vocab.bias(space, newline, stop, eos=-2.0)
    decoder = decode_steps(policy, vocab, seeds, steps, logit_seed, bias, sampling)
    state = decoder.state
    for b, (ids, authors) in enumerate(rows(decoder)):
        assert len(ids) >= 1
        check_rollout(unit, vocab, ids, authors)
        if first_author != "draw":
            assert authors[0] == (SENIOR if first_author == "senior" else JUNIOR)
        # counters agree with the author tensor
        drawn_first = int(first_author == "draw")
        assert int(state.handoffs[b]) == switches(authors)
        assert int(state.handoffs[b]) <= int(state.decisions[b]) - drawn_first
        assert 0 <= int(state.junior_draws[b]) <= int(state.decisions[b])
        if unit == "token" and policy.only_author is None:  # a draw before every token: draws = authors
            assert int(state.decisions[b]) == len(ids) - 1 + drawn_first
            assert int(state.junior_draws[b]) == authors[1 - drawn_first :].count(JUNIOR)
        if p == 0.0:  # a junior first span (if asked for), then the senior for good
            assert int(state.junior_draws[b]) == 0
            assert authors == sorted(authors, reverse=True)
            if first_author != "junior":
                assert set(authors) == {SENIOR}
        if p == 1.0:  # a senior first span (if asked for), then the junior for good
            assert int(state.junior_draws[b]) == int(state.decisions[b])
            assert authors == sorted(authors)
            if first_author != "senior":
                assert set(authors) == {JUNIOR}
        assert bool(state.ended[b]) == (ids[-1] == vocab.eos)


@pytest.mark.parametrize("unit", sorted(POLICIES))
def test_spans_hold_whole_units_and_both_authors_write(unit):
    """A long tandem run per policy: both authors write and switch, all at unit boundaries."""
    vocab = VOCABS["bpe"]
    seeds = torch.arange(64)
    decoder = decode_steps(POLICIES[unit](p=0.5), vocab, seeds, 96, logit_seed=3,
                           bias=vocab.bias(space=2, newline=2, stop=2, eos=-6))
    total_switches = 0
    for ids, authors in rows(decoder):
        check_rollout(unit, vocab, ids, authors)
        total_switches += switches(authors)
    assert total_switches > 20, "too few switches for the test to mean anything"
    assert int(decoder.state.junior_draws.sum()) > 0


@pytest.mark.parametrize("unit,p", [("token", 0.5), ("word", 0.3), ("sentence", 0.7), ("line", 0.4), ("paragraph", 0.5)])
def test_junior_share_of_draws_converges_to_p(unit, p):
    """Boundary draws only (the senior starts): the junior wins a share p of them, within 5 sigma."""
    vocab = VOCABS["char"]
    seeds = torch.arange(1500) * 104729
    bias = vocab.bias(space=2.5, newline=4, stop=2.5, eos=-8)
    decoder = decode_steps(POLICIES[unit](p=p, first_author="senior"), vocab, seeds, 40, logit_seed=11, bias=bias)
    draws = int(decoder.state.decisions.sum())
    junior = int(decoder.state.junior_draws.sum())
    assert draws > 1000
    sigma = math.sqrt(draws * p * (1 - p))
    assert abs(junior - p * draws) < 5 * sigma, (junior, draws, p)


def test_first_draw_alone_follows_p():
    """With no boundary at all, the only draw is the first author's: share of junior starts ~ p."""
    vocab = VOCABS["char"]
    seeds = torch.arange(4000)
    decoder = decode_steps(WordHandoff(p=0.25), vocab, seeds, 1, logit_seed=0)
    junior_first = (decoder.authors[:, 0] == JUNIOR).float().mean().item()
    assert abs(junior_first - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 4000)
    assert torch.equal(decoder.state.decisions, torch.ones(4000, dtype=torch.long))


@pytest.mark.parametrize("unit", sorted(POLICIES))
def test_same_seed_same_rollout_different_seed_different(unit):
    vocab = VOCABS["char"]
    bias = vocab.bias(space=2, newline=2, stop=2, eos=-6)
    policy = POLICIES[unit](p=0.5)
    a = decode_steps(policy, vocab, torch.arange(16), 48, logit_seed=5, bias=bias)
    b = decode_steps(policy, vocab, torch.arange(16), 48, logit_seed=5, bias=bias)
    c = decode_steps(policy, vocab, torch.arange(16) + 1000, 48, logit_seed=5, bias=bias)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.authors, b.authors)
    assert not torch.equal(a.authors, c.authors)
    assert not torch.equal(a.tokens, c.tokens)


def test_seed_fixes_a_row_whatever_its_batch():
    """A sequence's rollout depends on its own seed and logits only, not on its batch-mates."""
    vocab = VOCABS["char"]
    policy = WordHandoff(p=0.5)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=32)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 8, 2, len(vocab.texts), generator=gen) * 2 + vocab.bias(2, 1, 1, -6)
    seeds = torch.arange(8) * 31 + 5
    full = TandemDecoder(policy, vocab.classes, sampling, 8, [vocab.eos], vocab.pad)
    full.reset(seeds)
    part = TandemDecoder(policy, vocab.classes, sampling, 3, [vocab.eos], vocab.pad)
    part.reset(seeds[[5, 1, 2]])
    for t in range(32):
        full.step(logits[t, :, 0], logits[t, :, 1])
        part.step(logits[t, [5, 1, 2], 0], logits[t, [5, 1, 2], 1])
    assert torch.equal(full.tokens[[5, 1, 2]], part.tokens)
    assert torch.equal(full.authors[[5, 1, 2]], part.authors)


@pytest.mark.parametrize("unit", sorted(POLICIES))
def test_p0_all_senior_p1_all_junior(unit):
    vocab = VOCABS["char"]
    bias = vocab.bias(space=3, newline=3, stop=3, eos=-6)
    for p, author in ((0.0, SENIOR), (1.0, JUNIOR)):
        decoder = decode_steps(POLICIES[unit](p=p), vocab, torch.arange(8), 40, logit_seed=1, bias=bias)
        for _, authors in rows(decoder):
            assert authors and set(authors) == {author}
        assert int(decoder.state.handoffs.sum()) == 0


def test_solo_policies_write_alone_and_need_one_model():
    assert SoloHandoff("senior").only_author == Author.SENIOR
    assert SoloHandoff("junior").only_author == Author.JUNIOR
    assert WordHandoff(p=0.5).only_author is None
    # p=1 with a senior first span is a real tandem: the senior starts, the junior takes over
    assert WordHandoff(p=1.0, first_author="senior").only_author is None
    vocab = VOCABS["char"]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    decoder = TandemDecoder(SoloHandoff("junior"), vocab.classes, sampling, 4, [vocab.eos], vocab.pad)
    decoder.reset(torch.arange(4))
    assert decoder.needs_junior and not decoder.needs_senior
    gen = torch.Generator().manual_seed(0)
    for _ in range(16):
        decoder.step(None, torch.randn(4, len(vocab.texts), generator=gen))
    assert set(decoder.authors[decoder.authors != PAD].tolist()) == {JUNIOR}


@pytest.mark.parametrize("first_author,p,expected", [("senior", 1.0, (SENIOR, JUNIOR)), ("junior", 0.0, (JUNIOR, SENIOR))])
def test_first_author_writes_the_first_span_then_p_decides(first_author, p, expected):
    vocab = VOCABS["char"]
    bias = vocab.bias(space=3, newline=0, stop=0, eos=-8)
    decoder = decode_steps(WordHandoff(p=p, first_author=first_author), vocab, torch.arange(16), 40, 2, bias)
    first, then = expected
    for ids, authors in rows(decoder):
        assert authors[0] == first
        n_first = authors.index(then) if then in authors else len(authors)
        assert set(authors[n_first:]) <= {then}  # one handoff at most, at the first word start
        if n_first < len(authors):
            assert vocab.texts[ids[n_first]][:1].isspace()
    assert int(decoder.state.handoffs.sum()) > 0
    assert int(decoder.state.handoffs.max()) == 1


def no_space_bias(vocab: Vocab) -> torch.Tensor:
    """Logit offsets under which no token starts with whitespace: no natural word boundary."""
    b = vocab.bias(0, 0, 0, eos=-math.inf)
    b[vocab.classes.starts_ws] = -math.inf
    return b


@pytest.mark.parametrize("max_span", [1, 3, 5])
def test_max_span_forces_a_draw_after_that_many_tokens(max_span):
    """No boundary ever comes, yet the junior (p=1) takes over right after max_span tokens."""
    vocab = VOCABS["char"]
    decoder = decode_steps(WordHandoff(p=1.0, max_span=max_span, first_author="senior"), vocab,
                           torch.arange(8), 20, 4, no_space_bias(vocab))
    for _, authors in rows(decoder):
        assert authors == [SENIOR] * max_span + [JUNIOR] * (20 - max_span)
    without = decode_steps(WordHandoff(p=1.0, first_author="senior"), vocab, torch.arange(8), 20, 4, no_space_bias(vocab))
    for _, authors in rows(without):
        assert authors == [SENIOR] * 20  # no boundary, no max_span: the senior keeps writing


@pytest.mark.parametrize("max_span", [3, 5])
def test_max_span_draws_once_per_max_span_tokens(max_span):
    vocab = VOCABS["char"]
    steps = 30
    decoder = decode_steps(WordHandoff(p=0.5, max_span=max_span, first_author="senior"), vocab,
                           torch.arange(32), steps, 4, no_space_bias(vocab))
    # draws at tokens max_span, 2 max_span, ...: each author run is a whole number of max_spans
    assert decoder.state.decisions.tolist() == [(steps - 1) // max_span] * 32
    for _, authors in rows(decoder):
        runs = [len(m.group()) for m in re.finditer(r"(.)\1*", "".join(map(str, authors)))]
        assert all(r % max_span == 0 for r in runs[:-1]), runs


def test_max_span_does_not_split_words_when_boundaries_come_in_time():
    """Words of 3 characters and max_span 8: a boundary always comes before the cap, so words stay
    whole (the cap is for runs without any boundary)."""
    vocab = VOCABS["char"]
    steps = 40
    decoder = TandemDecoder(WordHandoff(p=0.5, max_span=8), vocab.classes,
                            SamplingConfig(temperature=0.0, max_new_tokens=steps), 16, [vocab.eos], vocab.pad)
    decoder.reset(torch.arange(16))
    pattern = [vocab.ids[c] for c in "ab "]
    for t in range(steps):
        logits = torch.zeros(16, len(vocab.texts))
        logits[:, pattern[t % 3]] = 10.0
        decoder.step(logits, logits.clone())
    for ids, authors in rows(decoder):
        check_rollout("word", vocab, ids, authors)


def test_word_boundary_rules_on_known_text():
    """Token classes of a subword vocabulary read as the design says."""
    vocab = VOCABS["bpe"]
    c = vocab.classes
    idx = vocab.ids
    assert c.starts_ws[idx[" cat"]] and not c.starts_ws[idx["ing"]]
    assert c.ends_sentence[idx["."]] and c.ends_sentence[idx['."']] and c.ends_sentence[idx[".\n\n"]]
    assert not c.ends_sentence[idx["The"]]
    assert c.closes[idx['"']] and c.closes[idx[")"]] and not c.closes[idx[" ("]]
    assert c.trailing_newlines[idx[".\n\n"]] == 2 and c.trailing_newlines[idx["b \n \n"]] == 2
    assert c.trailing_newlines[idx["a\n"]] == 1 and c.trailing_newlines[idx[" x"]] == 0
    assert c.special[vocab.eos] and not c.special[idx["The"]]


@pytest.mark.parametrize("text,candidate,unit,expected", [
    ("The cat.", " dog", "sentence", True),
    ("The cat", " dog", "sentence", False),
    ('The cat."', " dog", "sentence", True),
    ("The cat.\n\n", "The", "sentence", True),   # the line break sits inside the token ".\n\n"
    ("The cat.\n\n", "The", "paragraph", True),
    ("The cat.\n", "The", "paragraph", False),
    ("The cat.\n", "The", "line", True),           # a GSM8K step ends at its line break
    ("The cat.", " dog", "line", False),
    ("The cat", "\n", "line", False),              # the break itself stays with the line it ends
    ("b \n \n", " x", "line", True),
    ("The cat", "\n", "sentence", True),
    ("The cat", " dog", "word", True),
    ("The cat", "s", "word", False),
    ("b \n \n", " x", "paragraph", True),          # a blank line that holds spaces
])
def test_boundary_rule_on_known_text(text, candidate, unit, expected):
    """The compiled rule's verdict for one candidate after a known text, via the decoder state."""
    vocab = VOCABS["bpe"]
    rule = POLICIES[unit](p=0.5).compile(vocab.classes)
    ids = tokenize_bpe(vocab, text)
    carry = torch.zeros(1, dtype=torch.long)
    for token in ids:
        carry = rule.update(carry, torch.tensor([token]))
    verdict = bool(rule.at_boundary(carry, torch.tensor([vocab.ids[candidate]]))[0])
    assert verdict == expected
    assert switch_allowed(unit, text, candidate, False) == expected  # the reference agrees


def tokenize_bpe(vocab: Vocab, text: str) -> list[int]:
    """Greedy longest-match tokenisation over the hand-made vocabulary."""
    ids, i = [], 0
    pieces = sorted((t for t in vocab.texts if t not in ("<pad>", "<s>", "</s>")), key=len, reverse=True)
    while i < len(text):
        piece = next(p for p in pieces if text.startswith(p, i))
        ids.append(vocab.ids[piece])
        i += len(piece)
    return ids


def test_sentence_switch_at_a_line_break_does_not_start_with_a_space():
    """The junior, drawn at a line break inside a sentence, must start a new line, not write a
    mid-sentence space (its logits strongly prefer a space)."""
    vocab = VOCABS["char"]
    steps = 30
    decoder = TandemDecoder(SentenceHandoff(p=1.0, first_author="senior"), vocab.classes,
                            SamplingConfig(temperature=0.0, max_new_tokens=steps), 4, [vocab.eos], vocab.pad)
    decoder.reset(torch.arange(4))
    senior_text = "ab\n"
    for t in range(steps):
        senior = torch.zeros(4, len(vocab.texts))
        senior[:, vocab.ids[senior_text[t % 3]]] = 10.0
        junior = torch.zeros(4, len(vocab.texts))
        junior[:, vocab.ids[" "]] = 10.0
        junior[:, vocab.ids["\n"]] = 5.0
        decoder.step(senior, junior)
    for ids, authors in rows(decoder):
        check_rollout("sentence", vocab, ids, authors)
        assert authors[:2] == [SENIOR, SENIOR] and authors[2] == JUNIOR
        assert vocab.texts[ids[2]] == "\n"


@pytest.mark.parametrize("kwargs", [{"p": -0.1}, {"p": 1.5}, {"max_span": 0}, {"first_author": "nobody"}])
def test_bad_settings_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        WordHandoff(**kwargs)
    with pytest.raises(ConfigError):
        SoloHandoff(author="both")
