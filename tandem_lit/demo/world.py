"""The demo's task world: short arithmetic word problems, generated from a seed.

A problem is one or two calculations in a sentence or two; its solution is a few words of
reasoning around the calculations, ending with ``#### <answer>`` (GSM8K's format, read by
``GSM8KVerifier``). Every solution exists in two styles that differ only in how a calculation is
written:

    plain   "First 7+5=12 pens. Then 12-3=9 are left.\\n#### 9"
    jargon  "First 7+5=<<7+5=12>>12 pens. Then 12-3=<<12-3=9>>9 are left.\\n#### 9"

The jargon is GSM8K's calculator annotation ``<<a*b=c>>`` before the result, the private notation
of the Tandem Training skill-gap experiment: the senior writes it, the junior never saw it.

Held-out problems (validation and test) are a fixed slice of the question space chosen by a hash
of the question text, so no model ever trains on them, whatever the seeds.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

Style = Literal["plain", "jargon"]
STYLES: tuple[Style, ...] = ("plain", "jargon")
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
ANSWER_MARKER = "\n#### "
HELD_OUT_PERCENT = 10  # share of the question space kept for validation and test

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Ola", "Pam")
THINGS = ("apples", "pens", "cards", "eggs", "books", "coins", "shells", "stamps", "beads", "cups")


@dataclass(frozen=True)
class Calc:
    """One calculation ``a op b``, written in either style."""

    a: int
    op: Literal["+", "-", "*"]
    b: int

    @property
    def result(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        return self.a * self.b

    @property
    def expression(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    def render(self, style: Style) -> str:
        # Both styles put the result right after "a op b=", so a fact learned in one style serves
        # the other; the jargon only inserts the annotation, as GSM8K's calculator does.
        if style == "jargon":
            return f"{self.expression}=<<{self.expression}={self.result}>>{self.result}"
        return f"{self.expression}={self.result}"


Part = str | Calc


@dataclass(frozen=True)
class Problem:
    """A word problem and its solution as text pieces and calculations."""

    template: str
    question: str
    parts: tuple[Part, ...]  # the solution's reasoning, calculations in order

    @property
    def calcs(self) -> list[Calc]:
        return [p for p in self.parts if isinstance(p, Calc)]

    @property
    def answer(self) -> int:
        return self.calcs[-1].result

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(question=self.question)

    def solution(self, style: Style) -> str:
        """The completion that follows the prompt: starts with a space, ends ``#### answer``."""
        body = "".join(p.render(style) if isinstance(p, Calc) else p for p in self.parts)
        return f" {body}{ANSWER_MARKER}{self.answer}"

    def first_calc_end(self, style: Style) -> int:
        """Offset in ``solution(style)`` where the first calculation's result ends: a prefix
        shorter than this shows nothing of the style."""
        text = " "
        for part in self.parts:
            text += part.render(style) if isinstance(part, Calc) else part
            if isinstance(part, Calc):
                return len(text)
        raise AssertionError("every problem has a calculation")

    @property
    def held_out(self) -> bool:
        return is_held_out(self.question)


def is_held_out(question: str) -> bool:
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


# ----------------------------------------------------------------------------------- templates
# Each template draws its numbers and returns (question, solution parts). Every calculation comes
# from a few small tables of facts: sums and products of one-digit numbers, differences of a
# number up to 18 and a one-digit number, and sums up to 18 times 2, 3 or 4. A ~0.6M-parameter
# character model learns nearly all of them in minutes; a smaller, shorter-trained one only part.
# Two-step problems carry the first result into the second calculation.


def _packs_total(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} has {a} bags with {b} {thing} in each. How many {thing} in all?"
    return question, (f"{a} bags of {b} is ", Calc(a, "*", b), f" {thing}.")


def _gets_more(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} has {a} {thing} and finds {b} more. How many {thing} now?"
    return question, (f"Now {name} has ", Calc(a, "+", b), f" {thing}.")


def _gives_away(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    b = rng.randint(2, 9)
    a = rng.randint(b + 2, b + 9)
    question = f"{name} has {a} {thing} and gives {b} away. How many are left?"
    return question, ("", Calc(a, "-", b), f" {thing} are left.")


def _weekly(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 4)
    question = f"{name} gets {a} {thing} on Monday and {b} on Friday. How many in {c} weeks?"
    return question, ("Each week ", Calc(a, "+", b), f". In {c} weeks ", Calc(a + b, "*", c), f" {thing}.")


def _buys_and_gives(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(2, min(9, a + b - 1))
    question = f"{name} has {a} {thing}, buys {b} more and gives {c} away. How many are left?"
    return question, ("First ", Calc(a, "+", b), f" {thing}. Then ", Calc(a + b, "-", c), " are left.")


def _bags_left(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(4, 9), rng.randint(2, 9)
    c = rng.randint(2, a - 2)
    question = f"{name} has {a} bags of {b} {thing} and gives {c} bags away. How many {thing} are left?"
    return question, ("", Calc(a, "-", c), " bags are left. ", Calc(a - c, "*", b), f" {thing}.")


TEMPLATES: dict[str, Callable[[random.Random, str, str], tuple[str, tuple[Part, ...]]]] = {
    "packs_total": _packs_total,
    "gets_more": _gets_more,
    "gives_away": _gives_away,
    "weekly": _weekly,
    "buys_and_gives": _buys_and_gives,
    "bags_left": _bags_left,
}


def draw_problem(rng: random.Random, templates: tuple[str, ...] | None = None) -> Problem:
    """One random problem (uniform over ``templates``, default all)."""
    names = templates or tuple(TEMPLATES)
    template = rng.choice(names)
    question, parts = TEMPLATES[template](rng, rng.choice(NAMES), rng.choice(THINGS))
    return Problem(template, question, parts)


def problems(
    seed: int, count: int, split: Literal["train", "held_out"], templates: tuple[str, ...] | None = None
) -> list[Problem]:
    """``count`` distinct problems of one side of the held-out line, reproducible from ``seed``."""
    unknown = set(templates or ()) - set(TEMPLATES)
    if unknown:
        raise ValueError(f"unknown templates {sorted(unknown)}; known: {sorted(TEMPLATES)}")
    want_held_out = split == "held_out"
    out: list[Problem] = []
    seen: set[str] = set()
    for problem in _stream(seed, templates):
        if problem.held_out == want_held_out and problem.question not in seen:
            seen.add(problem.question)
            out.append(problem)
            if len(out) == count:
                return out
    raise AssertionError("unreachable: the stream is infinite")


def _stream(seed: int, templates: tuple[str, ...] | None) -> Iterator[Problem]:
    rng = random.Random(f"tandem-lit-demo-world/{seed}")
    misses = 0
    while True:
        yield draw_problem(rng, templates)
        misses += 1
        if misses > 10_000_000:  # a world too small for the requested count
            raise ValueError("the problem space is exhausted: ask for fewer problems or more templates")


# --------------------------------------------------------------------------- training examples


def cut_points(text: str) -> list[int]:
    """Word boundaries of a completion (offsets of whitespace characters after the first word):
    where a tandem handoff may happen, so where a training prefix may end."""
    return [i for i, ch in enumerate(text) if ch.isspace() and i > 0]


def styled_continuation(problem: Problem, rng: random.Random, style: Style) -> tuple[str, str]:
    """(prefix, continuation) of the solution in ``style``, cut at a random word boundary after the
    first calculation's result, so that the prefix shows its style and the continuation keeps it."""
    text = problem.solution(style)
    start = problem.first_calc_end(style)
    cut = rng.choice([i for i in cut_points(text) if i >= start])
    return text[:cut], text[cut:]
