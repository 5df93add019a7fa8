"""Verifiers: numeric (GSM8K, arithmetic), competition math (boxed answers, math-verify), code run
in a sandbox against unit tests, and an elegance judge on top of any of them."""

from tandem_lit.errors import MissingDependencyError
from tandem_lit.verifiers.base import Grade, MissingColumnError, Verifier
from tandem_lit.verifiers.code import CodeVerifier, SandboxRefusedError, apps_tests, deepcoder_tests
from tandem_lit.verifiers.elegance import EleganceVerifier
from tandem_lit.verifiers.judge import HTTPJudge, Judge, JudgeAuthError, TransformersJudge, Verdict
from tandem_lit.verifiers.math import MathVerifier
from tandem_lit.verifiers.numeric import ArithmeticVerifier, GSM8KVerifier

__all__ = [
    "ArithmeticVerifier",
    "CodeVerifier",
    "EleganceVerifier",
    "GSM8KVerifier",
    "Grade",
    "HTTPJudge",
    "Judge",
    "JudgeAuthError",
    "MathVerifier",
    "MissingColumnError",
    "MissingDependencyError",
    "SandboxRefusedError",
    "TransformersJudge",
    "Verdict",
    "Verifier",
    "apps_tests",
    "deepcoder_tests",
]
