"""Numeric-answer verifiers: GSM8K (answer after ``####``) and plain arithmetic (last number)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from tandem_lit.verifiers.base import Grade, Verifier
from tandem_lit.verifiers.columns import NUMBER, TEXT

# an exponent is part of the number: "2.55e-10" must not be read as 2.55
_NUMBER = re.compile(r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def normalize_number(text: str) -> str | None:
    """Canonical form of a numeric answer: no commas, ``$`` or spaces, no trailing zeros after a
    decimal point (``1,234.50`` -> ``1234.5``, ``7.0`` -> ``7``). None if it is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if cleaned.startswith("+"):
        cleaned = cleaned[1:]
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    value = value.normalize()
    text = format(value, "f")
    return "0" if text in ("-0", "0") else text


def first_number(text: str) -> str | None:
    match = _NUMBER.search(text)
    return normalize_number(match.group()) if match else None


def last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return normalize_number(matches[-1]) if matches else None


class GSM8KVerifier(Verifier):
    """GSM8K: the answer is the first number after the last ``####`` in the completion.

    A completion without ``####`` gets no credit: there is no fallback to "the last number in
    the text", which would grade a different (weaker) task than the one reported.
    Needs the ``answer`` column (the final number, or a full GSM8K solution ending ``#### N``).
    """

    required_columns = ("answer",)
    column_types = {"answer": TEXT | NUMBER}  # a number is its own final answer

    def __init__(self, marker: str = "####"):
        self.marker = marker

    def reference(self, answer: Any) -> str:
        text = str(answer)
        if self.marker in text:
            text = text.rsplit(self.marker, 1)[1]
        number = normalize_number(text)
        if number is None:
            raise ValueError(f"reference answer {answer!r} is not a number; GSM8KVerifier needs numeric answers")
        return number

    def extract(self, completion: str) -> str | None:
        if self.marker not in completion:
            return None
        return first_number(completion.rsplit(self.marker, 1)[1])

    def grade(self, completion: str, answer: Any = None, **columns: Any) -> Grade:
        extracted = self.extract(completion)
        correct = extracted is not None and extracted == self.reference(answer)
        return Grade(correct=correct, reward=float(correct), extracted=extracted)


class ArithmeticVerifier(GSM8KVerifier):
    """Plain arithmetic: the last number anywhere in the completion must equal ``answer``."""

    def extract(self, completion: str) -> str | None:
        return last_number(completion)
