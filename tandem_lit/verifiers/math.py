"""Competition-math verifier: the last ``\\boxed{...}`` of a completion, graded by math-verify.

Hermetic by design (DESIGN.md, decision 5):

- math-verify (pinned, the ``math`` extra) is the only judge of equivalence. If it is missing
  or another version, construction raises; if its parser backend is broken, each grader
  process's start-up self-test fails and the first grade raises. There is no weaker
  string-matching path, which is how the reference implementation silently lost credit for
  ``p(s)=s^2+w^2`` vs ``s^2+w^2``.
- math-verify's own timeouts use ``signal.alarm`` (main thread only, cannot stop C code), so
  they are switched off and every grade runs in a worker process with a wall-clock limit
  (``tandem_lit.verifiers.workers``). An expression that makes sympy hang costs its completion
  a zero reward; the worker is replaced and grading goes on, from any thread.
- One object grades training rewards, validation and test, and grades are cached by
  (grader version, extracted answer, reference).

What the rules in ``math_grader.py`` add to math-verify, each for a false negative or false
positive found on real data (docs/math.md has the sanity run):

- The answer is the LAST box, found with balanced braces (``\\boxed{\\frac{1}{2}}``), also
  ``\\fbox``; no box (or a box cut off by truncation) means no credit — no "last number in the
  text" fallback.
- math-verify parses the extracted answer whole. Its default configs search the text for any
  parseable piece and grade that piece, so ``\\frac{1}{3}E_{1}+\\frac{2}{3}E_{2}`` and ``...E_{3}``
  both read as 2/3; here an answer it cannot parse only matches an identical string.
- Scientific notation ``2.55e-10`` is rewritten to ``2.55\\times10^{-10}`` on both sides
  (math-verify reads ``2.55*e - 10``, with Euler's number); ``10^-3`` to ``10^{-3}``; base
  subscripts ``52_8`` to their value (42); a trailing period is dropped.
- Constants are compared with a relative tolerance (``rel_tol``) when either side is a
  decimal; math-verify rounds to 6 decimal places, which calls ``2.55e-10`` equal to
  ``2.56e-10`` and ``7.353e14`` different from ``7.353000001e14``.
- A bare left-hand side (``p(s) = ...``, ``b = m``) never makes a correct answer wrong: when
  one side is ``name = value``, the values are compared; ``x = A`` vs ``x = B`` compares A
  with B directly (math-verify would also call sympy's ``solve``, which can hang); an
  equation with no unknowns left (``N=n``, case-folded to ``n = n``) is compared by value too.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from tandem_lit.errors import ConfigError, DataError, MissingDependencyError
from tandem_lit.verifiers import math_grader
from tandem_lit.verifiers.base import Grade, Verifier
from tandem_lit.verifiers.columns import NUMBER, TEXT, list_of
from tandem_lit.verifiers.math_grader import (
    INSTALL_HINT,
    EmptyReferenceError,
    extract_boxed,
    normalize_answer,
    normalize_references,
)
from tandem_lit.verifiers.workers import WorkerPool

__all__ = ["MathVerifier", "MissingDependencyError", "extract_boxed", "normalize_answer", "normalize_references"]

MATH_VERIFY_VERSION = "0.9.0"  # the pin in pyproject.toml's `math` extra
RULES_VERSION = 1  # bump when the rules in math_grader.py change (the grader version keys the cache)


def require_math_verify(version: str | None) -> str:
    """Import math-verify or raise a clear error; returns the installed version."""
    try:
        import math_verify  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(
            f"MathVerifier needs math-verify=={MATH_VERIFY_VERSION}, which is not installed ({err}). "
            f"Install it with: {INSTALL_HINT}"
        ) from err
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        found = installed_version("math-verify")
    except PackageNotFoundError:
        found = "unknown"
    if version is not None and found != version:
        raise ConfigError(
            f"MathVerifier is pinned to math-verify=={version}, but {found} is installed; grades can differ "
            f"between versions. Install the pin with: {INSTALL_HINT} (or set math_verify_version: null to "
            f"grade with {found}, recorded in the grader version)"
        )
    return found


# -- the verifier -------------------------------------------------------------------------------


class MathVerifier(Verifier):
    """Boxed-answer math (MATH, AIME, AMC, Minerva, OlympiadBench, DeepScaleR), graded by math-verify.

    Needs the ``answer`` column: a string, a number (``27.0`` is 27) or a list of acceptable
    strings. Reward 1.0 for an equivalent last ``\\boxed{}``, else 0.0.

    Args:
        timeout_s: Wall-clock limit for grading one completion; over it, the reward is 0 and the
            grade is counted in ``timeouts`` (logged as ``train/grader_timeouts``).
        batch_timeout_s: Wall-clock budget of one batch: grades still running when it is spent are
            stopped and the rest are not run (reward 0, counted), so a batch of hostile answers
            costs at most this, not timeout_s x answers / workers. None: no budget.
        workers: Grader processes (started on first use); default min(4, CPU count).
        rel_tol: Relative tolerance when either number is a decimal (exact values compare exactly).
        cache_size: Grades kept in memory, keyed by (grader version, answer, reference).
        math_verify_version: Required math-verify version; None accepts the installed one.
        memory_limit_mb: Address-space limit of each grader process; None for none.
    """

    required_columns = ("answer",)
    # a list holds alternatives (any one is correct); numbers as the eval sets store them (AMC's 27.0)
    column_types = {"answer": TEXT | NUMBER | list_of(TEXT | NUMBER, "a list of strings or numbers")}

    def __init__(
        self,
        timeout_s: float = 10.0,
        workers: int | None = None,
        rel_tol: float = 1e-6,
        cache_size: int = 100_000,
        math_verify_version: str | None = MATH_VERIFY_VERSION,
        memory_limit_mb: int | None = 4096,
        batch_timeout_s: float | None = 60.0,
    ):
        if batch_timeout_s is not None and batch_timeout_s < timeout_s:
            raise ConfigError(f"batch_timeout_s ({batch_timeout_s}) must be at least timeout_s ({timeout_s}), or null")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        if workers is not None and workers < 1:
            raise ConfigError(f"workers must be >= 1 (or null for the default), got {workers}")
        if not 0 <= rel_tol < 1:
            raise ConfigError(f"rel_tol must be in [0, 1), got {rel_tol}")
        self.timeout_s = timeout_s
        self.workers = workers
        self.rel_tol = rel_tol
        self.cache_size = cache_size
        self.math_verify_version = math_verify_version
        self.memory_limit_mb = memory_limit_mb
        self.batch_timeout_s = batch_timeout_s
        found = require_math_verify(math_verify_version)
        self.grader_version = f"tandem-lit-math/{RULES_VERSION} math-verify/{found}"
        self._setup_runtime()

    def _setup_runtime(self) -> None:
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, tuple[str, ...]], bool] = OrderedDict()
        self.timeouts = 0  # grades that overran, whose worker died, or too deep to decide: rewarded 0
        self.recent_timeouts: deque[tuple[str, tuple[str, ...]]] = deque(maxlen=20)  # (answer, references)

    # Lightning pickles/deep-copies modules (checkpoints, spawn strategies): never live processes.
    def __getstate__(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_pool", "_lock", "_cache", "timeouts", "recent_timeouts")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup_runtime()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the grader processes (they also stop at garbage collection and interpreter exit)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @property
    def pool(self) -> WorkerPool:
        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(
                    f"{math_grader.__file__}:worker_grader",  # by path: the worker never imports torch
                    size=self.workers or min(4, os.cpu_count() or 1),
                    timeout_s=self.timeout_s,
                    memory_limit_mb=self.memory_limit_mb,
                )
            return self._pool

    @staticmethod
    def references(answer: Any) -> tuple[str, ...]:
        """The row's ``answer`` as normalised alternatives."""
        try:
            return normalize_references(answer)
        except EmptyReferenceError as err:
            raise DataError(
                f"{err}; MathVerifier needs a string, a number or a list of strings in the 'answer' field of "
                f"every row. Fix or drop that row in the dataset."
            ) from err

    def extract(self, completion: str) -> str | None:
        boxed = extract_boxed(completion)
        if boxed is None:
            return None
        return normalize_answer(boxed) or None

    def grade(self, completion: str, answer: Any = None, **columns: Any) -> Grade:
        return self.grade_batch([completion], answer=[answer])[0]

    def grade_batch(self, completions: Sequence[str], **columns: Sequence[Any]) -> list[Grade]:
        self.check_columns(columns, len(completions))
        extracted = [self.extract(c) for c in completions]
        keys = [
            (self.grader_version, answer, self.references(reference)) if answer is not None else None
            for answer, reference in zip(extracted, columns["answer"])
        ]
        verdicts: dict[tuple[str, str, tuple[str, ...]], bool] = {}
        with self._lock:
            for key in keys:
                if key is not None and key in self._cache:
                    self._cache.move_to_end(key)
                    verdicts[key] = self._cache[key]
        todo = list(dict.fromkeys(k for k in keys if k is not None and k not in verdicts))  # each once
        if todo:
            results = self.pool.run([(answer, references, self.rel_tol) for _, answer, references in todo], self.batch_timeout_s)
            with self._lock:
                for key, result in zip(todo, results):
                    if result.status == "error":  # a bug in the grader, not a property of the answer
                        raise RuntimeError(f"math grader failed on {key[1]!r} vs {key[2]!r}:\n{result.error}")
                    decided = result.status == "ok" and result.value is not None
                    verdicts[key] = decided and bool(result.value)
                    if decided:  # a timeout may be load, not the answer: not cached
                        self._cache[key] = verdicts[key]
                    else:
                        self.timeouts += 1
                        self.recent_timeouts.append(key[1:])
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        grades = []
        for key, answer in zip(keys, extracted):
            correct = key is not None and verdicts[key]
            grades.append(Grade(correct=correct, reward=float(correct), extracted=answer))
        return grades

    def __repr__(self) -> str:
        return (
            f"MathVerifier(timeout_s={self.timeout_s}, workers={self.workers}, rel_tol={self.rel_tol}, "
            f"grader_version={self.grader_version!r})"
        )
