"""Sanity check of MathVerifier on the real eval sets.

For every problem, grade (a) its own reference answer wrapped as ``\\boxed{...}`` — must be
correct (>= 99% per dataset) — and (b) a perturbed answer (a number changed, or the expression
altered) — must be wrong (<= 1%). Prints a per-dataset table and every miss.

    python scripts/grader_sanity.py --root ../shared/data            # all sets, every problem
    python scripts/grader_sanity.py --root ../shared/data --limit 20 # quick look

The rows come through ``MathEvalDataModule``, so the answer normalisation is tested too.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from decimal import Decimal

from tandem_lit.data.math import EVAL_SETS, load_eval_rows
from tandem_lit.verifiers.math import MathVerifier
from tandem_lit.verifiers.math_grader import make_parser, normalize_references

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}")


def perturb(reference: str) -> str:
    """A wrong answer close to ``reference``: its first number plus one (the first, because units
    such as ``\mbox{ cm}^2`` come last and are ignored by design); else a changed text or ``+1``."""
    first = _NUMBER.search(reference)
    if first:
        return reference[: first.start()] + str(Decimal(first.group()) + 1) + reference[first.end() :]
    text = list(_TEXT.finditer(reference))
    if text:
        last = text[-1]
        return reference[: last.start(1)] + last.group(1) + "X" + reference[last.end(1) :]
    return f"{reference}+1"


def first_reference(answer: str | list[str]) -> str:
    return answer[0] if isinstance(answer, list) else answer


@dataclass
class SetReport:
    name: str
    n: int = 0
    correct: int = 0  # own reference graded correct
    perturbed: int = 0  # perturbed answer graded correct (should be ~0)
    unparsed: list[str] = field(default_factory=list)  # references math-verify reads only as text
    misses: list[str] = field(default_factory=list)

    @property
    def correct_pct(self) -> float:
        return 100.0 * self.correct / max(self.n, 1)

    @property
    def perturbed_pct(self) -> float:
        return 100.0 * self.perturbed / max(self.n, 1)

    @property
    def parsed_pct(self) -> float:
        return 100.0 * (self.n - len(self.unparsed)) / max(self.n, 1)


def check_set(verifier: MathVerifier, name: str, rows: list[dict], parsed=None) -> SetReport:
    """Grade each row's own reference and a perturbed one; with ``parsed`` (``make_parser()``),
    also note the references math-verify cannot turn into a formula (matched only verbatim)."""
    report = SetReport(name, n=len(rows))
    if parsed is not None:
        import sympy

        for i, row in enumerate(rows):
            reference = normalize_references(row["answer"])[0]
            if not any(isinstance(x, (sympy.Basic, sympy.MatrixBase)) for x in parsed(reference)):
                report.unparsed.append(f"{name}[{i}] {reference!r}")
    own = [f"The final answer is $\\boxed{{{first_reference(r['answer'])}}}$." for r in rows]
    wrong_answers = [perturb(first_reference(r["answer"])) for r in rows]
    wrong = [f"The final answer is $\\boxed{{{w}}}$." for w in wrong_answers]
    answers = [r["answer"] for r in rows]
    own_ok = verifier.evaluate(own, answer=answers)
    wrong_ok = verifier.evaluate(wrong, answer=answers)
    for i, row in enumerate(rows):
        report.correct += own_ok[i]
        report.perturbed += wrong_ok[i]
        if not own_ok[i]:
            report.misses.append(f"{name}[{i}] reference graded WRONG: answer={row['answer']!r}")
        if wrong_ok[i]:
            report.misses.append(
                f"{name}[{i}] perturbed graded CORRECT: answer={row['answer']!r} perturbed={wrong_answers[i]!r}"
            )
    return report


def markdown_table(reports: list[SetReport]) -> str:
    lines = [
        "| dataset | n | reference correct | perturbed correct | misses | reference parsed by math-verify |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in reports:
        lines.append(
            f"| {r.name} | {r.n} | {r.correct_pct:.1f}% | {r.perturbed_pct:.1f}% | {len(r.misses)} | {r.parsed_pct:.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="data folder in the ../shared/data layout")
    parser.add_argument("--datasets", nargs="*", default=list(EVAL_SETS), help="eval set names (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="first N problems per set")
    parser.add_argument("--workers", type=int, default=2, help="grader processes")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per grade")
    args = parser.parse_args(argv)

    start = time.monotonic()
    reports = []
    parsed = make_parser()
    with MathVerifier(timeout_s=args.timeout, workers=args.workers) as verifier:
        for name in args.datasets:
            rows = load_eval_rows(name, root=args.root, limit=args.limit)
            reports.append(check_set(verifier, name, rows, parsed))
            print(f"{name}: {reports[-1].n} problems graded", file=sys.stderr, flush=True)
        print(f"grader: {verifier.grader_version}; timeouts: {verifier.timeouts}; {time.monotonic() - start:.0f} s")
        for answer, references in verifier.recent_timeouts:
            print(f"- timed out (graded wrong): {answer!r} vs {references!r}")
    print()
    print(markdown_table(reports))
    print()
    misses = [m for r in reports for m in r.misses]
    print(f"misses ({len(misses)}):" if misses else "misses: none")
    for miss in misses:
        print(f"- {miss}")
    unparsed = [u for r in reports for u in r.unparsed]
    print(f"\nreferences math-verify reads only as text, so only the same LaTeX matches them ({len(unparsed)}):")
    for item in unparsed:
        print(f"- {item}")
    failed = [r.name for r in reports if r.correct_pct < 99.0 or r.perturbed_pct > 1.0]
    if failed:
        print(f"\nbelow target (>= 99% reference, <= 1% perturbed): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
