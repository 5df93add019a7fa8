"""Elegance bonus: a correctness verifier, plus a judge's say on the style of correct solutions.

The extension of Tandem RLVR (REFERENCES.md, "Elegance"): on AIME-level HARP problems with
several solution paths, an LLM judge labels each correct solution elegant (a short idea:
symmetry, complementary counting, an invariant) or bashy (casework, brute force), and elegant
correct solutions earn 50% more reward. The hypothesis under test is that tandem rollouts push
the senior toward bashy solutions, which a junior can continue more easily.

Correctness stays the inner verifier's alone: the judge is asked only about correct solutions,
it can only add to a reward, and its failures (no reply, an unreadable verdict) cost the bonus,
never the reward for being right. docs/elegance.md covers configuration and metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.base import Grade, Verifier
from tandem_lit.verifiers.columns import TEXT, FieldType
from tandem_lit.verifiers.judge import Judge

__all__ = ["EleganceVerifier"]


class EleganceVerifier(Verifier):
    """Wraps any correctness verifier; elegant correct solutions earn ``reward x (1 + bonus)``.

    Needs the inner verifier's columns plus ``problem`` (the bare problem text, without the
    instruction the prompt adds). The judge sees the whole completion, reasoning included, since
    in a tandem rollout the reasoning is the solution; a completion over
    ``max_solution_chars`` is sent as its head and tail around a marker saying how much was cut.

    Labels on correct solutions only (averaged over them, logged as ``train/elegance_rate``,
    ``eval/<mode>_elegance_rate``...): ``elegance_rate`` (1.0 elegant, else 0.0) and
    ``judge_failure_rate`` (1.0 when the judge gave no verdict, which counts as not elegant).

    Args:
        verifier: The correctness verifier (e.g. ``MathVerifier``).
        judge: ``HTTPJudge`` or ``TransformersJudge`` (``tandem_lit.verifiers.judge``).
        bonus: Extra reward fraction for an elegant correct solution (0.5: x1.5, the extension's).
        max_solution_chars: Longest solution text sent to the judge; None: no limit.
    """

    def __init__(self, verifier: Verifier, judge: Judge, bonus: float = 0.5, max_solution_chars: int | None = 20_000):
        if bonus < 0:
            raise ConfigError(f"bonus must be >= 0 (a fraction of the reward added for elegance), got {bonus}")
        if max_solution_chars is not None and max_solution_chars < 100:
            raise ConfigError(f"max_solution_chars must be >= 100 (or null for no limit), got {max_solution_chars}")
        self.verifier = verifier
        self.judge = judge
        self.bonus = bonus
        self.max_solution_chars = max_solution_chars
        self.required_columns = tuple(dict.fromkeys((*verifier.required_columns, "problem")))

    @property
    def column_types(self) -> dict[str, FieldType]:
        return {**self.verifier.column_types, "problem": TEXT}  # the judge reads the problem

    @property
    def timeouts(self) -> int:
        """The inner verifier's grader timeouts (the trainer logs ``train/grader_timeouts`` from
        them); AttributeError when it keeps none, so ``getattr(v, "timeouts", None)`` is None."""
        return self.verifier.timeouts

    def close(self) -> None:
        for part in (self.verifier, self.judge):
            if hasattr(part, "close"):
                part.close()

    def __enter__(self) -> EleganceVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def solution_text(self, completion: str) -> str:
        """What the judge reads: the completion, or its head and tail when it is too long."""
        limit = self.max_solution_chars
        if limit is None or len(completion) <= limit:
            return completion
        head = limit // 2
        cut = len(completion) - limit
        return f"{completion[:head]}\n[... {cut} characters cut ...]\n{completion[len(completion) - (limit - head) :]}"

    def grade(self, completion: str, **columns: Any) -> Grade:
        return self.grade_batch([completion], **{name: [value] for name, value in columns.items()})[0]

    def grade_batch(self, completions: Sequence[str], **columns: Sequence[Any]) -> list[Grade]:
        self.check_columns(columns, len(completions))
        grades = list(self.verifier.grade_batch(completions, **columns))
        correct = [i for i, grade in enumerate(grades) if grade.correct]
        for i in correct:
            problem = columns["problem"][i]
            if not isinstance(problem, str) or not problem.strip():
                raise DataError(
                    f"EleganceVerifier needs the problem text in the 'problem' field, got {problem!r}; "
                    "the math DataModules set it on every row."
                )
        verdicts = self.judge.judge_batch(
            [(columns["problem"][i], self.solution_text(completions[i])) for i in correct]
        )
        for i, verdict in zip(correct, verdicts):
            grade = grades[i]
            grades[i] = replace(
                grade,
                reward=grade.reward * (1 + self.bonus) if verdict.elegant else grade.reward,
                labels={
                    **grade.labels,
                    "elegance_rate": float(bool(verdict.elegant)),
                    "judge_failure_rate": float(verdict.failure is not None),
                },
            )
        return grades

    def __repr__(self) -> str:
        return (
            f"EleganceVerifier(verifier={self.verifier!r}, judge={self.judge!r}, bonus={self.bonus}, "
            f"max_solution_chars={self.max_solution_chars})"
        )
