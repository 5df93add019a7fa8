"""Numeric verifiers: GSM8K answer extraction and normalisation, plain arithmetic, column checks."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tandem_lit.verifiers import ArithmeticVerifier, GSM8KVerifier, MissingColumnError
from tandem_lit.verifiers.numeric import normalize_number


@pytest.mark.parametrize("completion,answer,correct", [
    ("She sells 24 clips.\n#### 72", "72", True),
    ("#### 1,234", "1234", True),                   # thousands separators
    ("#### $1,234.00", "1234", True),              # dollar sign, trailing .00
    ("#### 18.0", "18", True),                     # trailing .0
    ("#### 7.50", "7.5", True),
    ("#### -3", "-3", True),                       # negative numbers
    ("#### -3", "3", False),
    ("#### $-3", "-3", True),
    ("####72", "72", True),
    ("#### 72.", "72", True),                      # sentence-final full stop
    ("#### 72 dollars", "72", True),
    ("The answer is 72", "72", False),             # no ####: no credit, no fallback to the last number
    ("72", "72", False),
    ("#### 5\nwait, no\n#### 6", "6", True),       # the last #### wins
    ("#### 5\nwait, no\n#### 6", "5", False),
    ("#### 0.5", ".5", True),
    ("#### 1e3", "1000", True),
    ("#### 2.55e-10", "2.55", False),              # an exponent is part of the number
    ("#### 2.55e-10", "0.000000000255", True),
    ("#### 5 eggs", "5", True),
    ("####", "0", False),                          # a marker with no number after it
    ("#### seventy-two", "72", False),
])
def test_gsm8k_extraction_and_normalisation(completion, answer, correct):
    verifier = GSM8KVerifier()
    grade = verifier.grade(completion, answer=answer)
    assert grade.correct is correct
    assert grade.reward == (1.0 if correct else 0.0)


def test_gsm8k_reference_may_be_a_full_solution():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert GSM8KVerifier().reference(solution) == "72"
    assert GSM8KVerifier().grade("so 72\n#### 72", answer=solution).correct
    with pytest.raises(ValueError, match="not a number"):
        GSM8KVerifier().reference("seventy")


def test_gsm8k_extract_reports_what_it_read():
    assert GSM8KVerifier().extract("x\n#### $1,000.50 total") == "1000.5"
    assert GSM8KVerifier().extract("no marker 5") is None
    assert GSM8KVerifier(marker="ANSWER:").extract("ANSWER: 9") == "9"


@pytest.mark.parametrize("text,expected", [
    ("1,234.50", "1234.5"), ("7.0", "7"), ("$5", "5"), ("-0", "0"), ("-0.0", "0"), ("+4", "4"),
    ("0.10", "0.1"), ("100", "100"), ("1e2", "100"), ("3.", "3"), ("abc", None), ("nan", None), ("inf", None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@given(st.integers(-10**9, 10**9))
def test_integers_in_any_gsm8k_format_match(value):
    formatted = [f"{value}", f"{value:,}", f"{value}.0", f"{value}.00"]
    if value >= 0:
        formatted += [f"${value:,}"]
    for text in formatted:
        assert GSM8KVerifier().grade(f"work\n#### {text}", answer=str(value)).correct, text


@pytest.mark.parametrize("completion,answer,correct", [
    ("12 + 30 = 42", "42", True),
    ("12 + 30 = 42.", "42", True),
    ("first 42, then 41", "42", False),   # the LAST number counts
    ("-7", "-7", True),
    ("1,000", "1000", True),
    ("no number", "5", False),
    ("#### 3 and later 4", "4", True),     # no marker needed: the last number
])
def test_arithmetic_verifier(completion, answer, correct):
    assert ArithmeticVerifier().grade(completion, answer=answer).correct is correct


def test_call_and_evaluate_agree_on_real_gsm8k_rows(repo_root):
    rows = [json.loads(line) for line in (repo_root / "data/gsm8k-sample/test.jsonl").read_text().splitlines()[:20]]
    answers = [row["answer"] for row in rows]
    # the reference solutions themselves are correct; shift half of the final numbers to be wrong
    completions = [r["answer"] if i % 2 else r["answer"].rsplit("####", 1)[0] + "#### 987654321" for i, r in enumerate(rows)]
    verifier = GSM8KVerifier()
    rewards = verifier(completions, answer=answers)
    correct = verifier.evaluate(completions, answer=answers)
    assert rewards.dtype == torch.float32 and rewards.shape == (20,)
    assert correct == [bool(i % 2) for i in range(20)]
    assert rewards.tolist() == [float(c) for c in correct]
    grades = verifier.grade_batch(completions, answer=answers)
    assert [g.correct for g in grades] == correct


def test_missing_column_names_the_field():
    with pytest.raises(MissingColumnError, match="'answer'") as info:
        GSM8KVerifier()(["#### 3"], solution=["#### 3"])
    assert "solution" in str(info.value)  # and says what the rows do have
    with pytest.raises(KeyError):  # a DataError is a KeyError too
        GSM8KVerifier().evaluate(["#### 3"])
    with pytest.raises(ValueError, match="2 values for 1"):
        GSM8KVerifier()(["#### 3"], answer=["3", "4"])
