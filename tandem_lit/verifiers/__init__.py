"""Verifiers: numeric (GSM8K, arithmetic)."""

from tandem_lit.verifiers.base import Grade, MissingColumnError, Verifier
from tandem_lit.verifiers.numeric import ArithmeticVerifier, GSM8KVerifier

__all__ = ["ArithmeticVerifier", "GSM8KVerifier", "Grade", "MissingColumnError", "Verifier"]
