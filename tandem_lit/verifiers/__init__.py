"""Verifiers: numeric (GSM8K, arithmetic), competition math (boxed answers, math-verify)."""

from tandem_lit.verifiers.base import Grade, MissingColumnError, Verifier
from tandem_lit.verifiers.math import MathVerifier, MissingDependencyError
from tandem_lit.verifiers.numeric import ArithmeticVerifier, GSM8KVerifier

__all__ = [
    "ArithmeticVerifier",
    "GSM8KVerifier",
    "Grade",
    "MathVerifier",
    "MissingColumnError",
    "MissingDependencyError",
    "Verifier",
]
