"""LanguageShare: the fraction of a solution (or of each author's part of it) in a target language.

py3langid is the default identifier (the ``language`` extra); lingua is optional and its test is
skipped without it."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_lit.errors import ConfigError
from tandem_lit.evaluation.language import LanguageShare, MissingDependencyError, blank_math, letters
from tandem_lit.rollout.record import Author

pytest.importorskip("py3langid")

FRENCH = "Elle a 12 pommes et en mange 4."  # 20 letters
FRENCH_2 = "Il lui reste donc 8 pommes."  # 20 letters
ENGLISH = "Then she has 8 apples left."  # 20 letters
EQUATION = "$x_{left} = x_{total} - x_{eaten} = 12 - 4 = <<12-4=8>>8$"  # 17 letters, all math


@pytest.fixture(scope="module")
def french():
    return LanguageShare("fr", languages=["en", "fr", "de", "es", "bg"])


@pytest.fixture(scope="module")
def french_any():
    """Every language py3langid knows as a candidate."""
    return LanguageShare("fr")


def test_known_sentences_are_all_or_nothing(french, french_any):
    for metric in (french, french_any):
        assert metric.share("Donc elle a 12 pommes, et il lui reste 8 pommes.") == 1.0
        assert metric.share("So she has 12 apples, and 8 apples are left.") == 0.0
        assert metric.share(f"{FRENCH} {FRENCH_2}") == 1.0
        assert metric.share(f"{ENGLISH}\nSo the answer is 8 apples.") == 0.0


def test_mixed_solution_skips_the_equation_line(french):
    assert letters(FRENCH) == letters(FRENCH_2) == letters(ENGLISH) == 20
    solution = f"{FRENCH} {FRENCH_2}\n{ENGLISH}\n{EQUATION}"
    assert french.share(solution) == pytest.approx(2 / 3)
    assert [text for _, text in french.pieces([("text", solution)])] == [
        "Elle a pommes et en mange", "Il lui reste donc pommes.", "Then she has apples left.", "",
    ]  # a word with a digit goes whole, its full stop too
    kept = LanguageShare("fr", languages=["en", "fr", "de", "es", "bg"], ignore_math=False)
    assert kept.share(solution) < 0.6  # math kept, the equation line reads as English


def test_share_weighs_letters_not_sentences(french):
    long_french = "Elle achète ensuite quelques pommes rouges au marché du village."
    assert french.share(f"{long_french} So she has apples.") == pytest.approx(
        letters(long_french) / (letters(long_french) + letters("So she has apples"))
    )


def test_calculator_annotations_numbers_and_latex_carry_no_language(french):
    for math_only in (EQUATION, "<<48/2=24>>24", "#### 24", "$x^2 + 3x = 10$", "\\boxed{24}", "3 * $4 = $12",
                      "\\frac{1}{2} \\cdot 8 = 4", "$$\nx = 5\n$$", ""):
        assert french.share(math_only) is None, math_only
    assert blank_math("Elle paie 3 * $4 = $12 pour <<3*4=12>>12 pommes.").split() == ["Elle", "paie", "pour", "pommes."]
    # prices are not inline math: the words between two $ amounts stay
    assert blank_math("She pays $5 and gets $3 back.").split() == ["She", "pays", "and", "gets", "back."]
    # a long English-looking annotation does not pull a French sentence toward English
    assert french.share("Il lui reste <<total_apples_left=apples-eaten=12-4=8>>8 pommes rouges.") == 1.0


def test_math_kept_is_identified(french):
    kept = LanguageShare("fr", languages=["en", "fr"], min_chars=1, ignore_math=False)
    assert kept.share("So x = 5") is not None  # the letters of math count when math is kept
    assert french.share("So x = 5") is None  # two letters left: below min_chars


def test_short_units_are_skipped_not_counted(french):
    assert french.share("Donc 24.") is None
    assert french.share(f"So 24.\n{FRENCH}") == 1.0  # "So" alone has too few letters to be English


def test_per_author_shares():
    metric = LanguageShare("fr", languages=["en", "fr"])
    spans = [
        (Author.SENIOR, "First, she buys 12 apples at the market. "),
        (Author.JUNIOR, "Ensuite elle en mange quatre à midi. "),
        (Author.SENIOR, "12 - 4 = <<12-4=8>>8\n"),
        (Author.JUNIOR, "Il lui reste donc huit pommes."),
    ]
    assert metric.share_by_author(spans) == {"senior": 0.0, "junior": 1.0}
    assert metric.share_by_author([("senior", "12 * 4 = 48"), ("junior", "Donc elle a douze pommes.")]) == {
        "senior": None, "junior": 1.0,
    }


def test_sentence_shared_by_two_authors_is_split_by_author():
    metric = LanguageShare("fr", languages=["en", "fr"], min_chars=4)
    spans = [("senior", "Donc elle a encore"), ("junior", " twelve red apples"), ("senior", " dans son panier.")]
    assert metric.pieces(spans) == [("senior", "Donc elle a encore dans son panier."), ("junior", "twelve red apples")]
    assert metric.share_by_author(spans) == {"senior": 1.0, "junior": 0.0}
    whole = LanguageShare("fr", unit="text", languages=["en", "fr"])
    assert set(whole.share_by_author(spans)) == {"senior", "junior"}
    span = LanguageShare("fr", unit="span", languages=["en", "fr"], min_chars=4)
    assert [text for _, text in span.pieces(spans)] == ["Donc elle a encore", "twelve red apples", "dans son panier."]


def test_units(french):
    solution = f"{FRENCH} {FRENCH_2} {ENGLISH}"
    assert french.share(solution) == pytest.approx(2 / 3)
    whole = LanguageShare("fr", unit="text", languages=["en", "fr"])
    assert whole.share(solution) in (0.0, 1.0)  # one unit: all of it is one language
    assert LanguageShare("fr", unit="span", languages=["en", "fr"]).share(solution) == whole.share(solution)


def test_rate_skips_texts_without_language(french):
    texts = ["Elle a douze pommes rouges.", "She has twelve red apples.", "12 + 4 = 16", ""]
    assert french.shares(texts) == [1.0, 0.0, None, None]
    assert french.rate(texts) == 0.5  # 0.25 if texts without language counted as 0
    assert french.rate(["12 + 4 = 16"]) is None
    assert french.rate([]) is None


def test_step_stats_from_rollout_spans(french):
    rollouts = [
        [(Author.SENIOR, "She buys twelve apples. "), (Author.JUNIOR, "Elle en mange quatre.")],
        [(Author.SENIOR, "Elle achète douze pommes. "), (Author.JUNIOR, "Elle en mange quatre.")],
        [(Author.SENIOR, "48 / 2 = 24"), (Author.JUNIOR, "Elle en mange quatre.")],
    ]
    assert french.rate_by_author(rollouts) == {"senior": 0.5, "junior": 1.0}
    stats = french.stats(rollouts)
    assert stats["senior_language_share"] == 0.5 and stats["junior_language_share"] == 1.0
    first = letters("Elle en mange quatre") / letters("She buys twelve apples Elle en mange quatre")
    assert stats["language_share"] == pytest.approx((first + 1.0 + 1.0) / 3)
    assert french.stats([[(Author.SENIOR, "1 + 1 = 2")]]) == {}


@pytest.mark.parametrize(("identifier", "module"), [("py3langid", "py3langid"), ("lingua", "lingua")])
def test_missing_identifier_fails_at_construction(monkeypatch, identifier, module):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'tandem-lit\[language\]'") as info:
        LanguageShare("fr", identifier=identifier)
    assert identifier in str(info.value)


@pytest.mark.parametrize(
    "settings_",
    [
        dict(languages=["en", "de"]),  # the target is not a candidate
        dict(languages=["fr"]),  # one candidate decides nothing
        dict(languages=["en", "fr", "xx"]),
        dict(language="xx"),
        dict(unit="word"),
        dict(identifier="fasttext"),
        dict(min_chars=0),
    ],
)
def test_config_errors(settings_):
    with pytest.raises(ConfigError):
        LanguageShare(**settings_)


def test_lingua_identifier():
    pytest.importorskip("lingua")
    metric = LanguageShare("fr", identifier="lingua", languages=["en", "fr"])
    assert metric.shares([f"{FRENCH} {FRENCH_2}", ENGLISH, EQUATION]) == [1.0, 0.0, None]


def test_benchmark_set_accuracy(repo_root, monkeypatch):
    """The default identifier, restricted to the five languages, on the hand-labelled set."""
    monkeypatch.syspath_prepend(str(repo_root))
    from benchmarks.language_id import measure

    result = measure("py3langid", restrict=True, ignore_math=True, repeats=1)
    assert result["accuracy"] >= 0.99 and result["short_accuracy"] >= 0.99, result["errors"]


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=300))
def test_share_is_a_fraction_and_never_raises(text):
    metric = LanguageShare("fr", min_chars=1)
    value = metric.share(text)
    assert value is None or 0.0 <= value <= 1.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["senior", "junior"]), st.text(max_size=60)), max_size=8),
       st.sampled_from(["sentence", "span", "text"]))
def test_author_shares_are_fractions(spans, unit):
    metric = LanguageShare("fr", unit=unit, languages=["en", "fr"], min_chars=1)
    shares = metric.share_by_author(spans)
    assert set(shares) <= {"senior", "junior"}
    assert all(value is None or 0.0 <= value <= 1.0 for value in shares.values())


# ------------------------------------------------------------------- word lists (the offline demo)

WORDS = {"en": ["first", "then", "are", "left", "pens"], "fr": ["d'abord", "ensuite", "il", "en", "reste", "stylos"]}


def test_word_lists_count_listed_words_only():
    from tandem_lit.evaluation.language import WordListLanguageShare

    metric = WordListLanguageShare("fr", WORDS)
    assert metric.share(" D'abord 7+5=12 stylos. Ensuite il en reste 12-3=9.\n#### 9") == 1.0
    assert metric.share(" First 7+5=12 pens. Then 12-3=9 are left.\n#### 9") == 0.0
    # 2 of 5 listed words are French; the name, "has" (no list) and the math count for none
    assert metric.share("First Ann has 7+5=12 stylos. ENSUITE 12-3=9 are left.") == pytest.approx(2 / 5)
    assert metric.shares(["#### 9", "Ann has 7+5=12", "", "<<7+5=12>>12"]) == [None, None, None, None]
    assert metric.rate(["D'abord", "First", "Ann"]) == 0.5  # the text without a listed word is skipped
    assert WordListLanguageShare("en", WORDS).share("First Ann has 7+5=12 stylos.") == 0.5


def test_word_lists_by_author():
    from tandem_lit.evaluation.language import WordListLanguageShare

    metric = WordListLanguageShare("fr", WORDS)
    rollout = [(Author.SENIOR, " First"), (Author.JUNIOR, " 7+5=12"), (Author.SENIOR, " stylos."),
               (Author.JUNIOR, " Ensuite il"), (Author.SENIOR, " en reste 12-3=9.\n#### 9")]
    assert metric.share_by_author(rollout) == {"senior": pytest.approx(3 / 4), "junior": 1.0}
    stats = metric.stats([rollout, [(Author.SENIOR, " First 7+5=12 pens.")], [(Author.JUNIOR, " 12")]])
    assert stats["language_share"] == pytest.approx((5 / 6 + 0.0) / 2)
    assert stats["senior_language_share"] == pytest.approx((3 / 4 + 0.0) / 2) and stats["junior_language_share"] == 1.0
    assert metric.stats([[(Author.SENIOR, "1 + 1 = 2")]]) == {}


@pytest.mark.parametrize(
    "words",
    [
        {"fr": ["il"]},  # one language decides nothing
        {"en": ["first"], "de": ["erst"]},  # the target has no list
        {"en": ["first", "en"], "fr": ["EN"]},  # a word in two lists
    ],
)
def test_word_list_config_errors(words):
    from tandem_lit.evaluation.language import WordListLanguageShare

    with pytest.raises(ConfigError):
        WordListLanguageShare("fr", words)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["senior", "junior"]),
                          st.lists(st.sampled_from([*"abc .\n7+=", "il", "First", "D'abord"]), max_size=20).map("".join)),
                max_size=8))
def test_word_list_shares_are_fractions(spans):
    from tandem_lit.evaluation.language import WordListLanguageShare

    shares = WordListLanguageShare("fr", WORDS).share_by_author(spans)
    assert set(shares) <= {"senior", "junior"}
    assert all(value is None or 0.0 <= value <= 1.0 for value in shares.values())
