"""The demo's task world: short arithmetic word problems, generated from a seed.

A problem is one or two calculations in a sentence or two; its solution is a few words of
reasoning around the calculations, ending with ``#### <answer>`` (GSM8K's format, read by
``GSM8KVerifier``). Every solution exists in two styles that differ only in how a calculation is
written:

    plain   "First 7+5=12 pens. Then 12-3=9 are left.\\n#### 9"
    jargon  "First 7+5=<<7+5=12>>12 pens. Then 12-3=<<12-3=9>>9 are left.\\n#### 9"

The jargon is GSM8K's calculator annotation ``<<a*b=c>>`` before the result, the private notation
of the Tandem Training skill-gap experiment: the senior writes it, the junior never saw it.

Every solution also exists in two languages, for the language-gap experiment: English (``en``, the
default) and French (``fr``, without accents: the demo's tokenizer is printable ASCII). They differ
in their words and word order, never in their calculations or the ``#### <answer>`` line:

    en      "First 7+5=12 pens. Then 12-3=9 are left.\\n#### 9"
    fr      "D'abord 7+5=12 stylos. Ensuite il en reste 12-3=9.\\n#### 9"

The question stays in English (it is the prompt both models read). ``VOCABULARY`` lists each
language's words: the two lists are disjoint, and every word of a solution is in its language's
list, a name or math, which is what the demo's language share counts.

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
Language = Literal["en", "fr"]
LANGUAGES: tuple[Language, ...] = ("en", "fr")
PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
ANSWER_MARKER = "\n#### "
HELD_OUT_PERCENT = 10  # share of the question space kept for validation and test

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Ola", "Pam")
THINGS = ("apples", "pens", "cards", "eggs", "books", "coins", "shells", "stamps", "beads", "cups")
THINGS_FR = dict(zip(THINGS, ("pommes", "stylos", "cartes", "oeufs", "livres", "pieces", "coquillages", "timbres", "perles", "tasses")))
# Every word a solution may write outside names and math, per language (lower case, no full stops)
VOCABULARY: dict[Language, tuple[str, ...]] = {
    "en": ("bags", "of", "is", "now", "has", "are", "left", "each", "week", "in", "weeks", "first", "then", *THINGS),
    "fr": ("sacs", "de", "font", "a", "maintenant", "il", "reste", "en", "chaque", "semaine", "semaines", "d'abord",
           "ensuite", "donc", *THINGS_FR.values()),
}


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


@dataclass(frozen=True)
class Phrase:
    """Solution text between calculations, in each language."""

    en: str
    fr: str

    def render(self, language: Language) -> str:
        return self.en if language == "en" else self.fr


Part = Phrase | Calc


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

    def solution(self, style: Style = "plain", language: Language = "en") -> str:
        """The completion that follows the prompt: starts with a space, ends ``#### answer``."""
        body = "".join(p.render(style) if isinstance(p, Calc) else p.render(language) for p in self.parts)
        return f" {body}{ANSWER_MARKER}{self.answer}"

    def first_calc_end(self, style: Style = "plain", language: Language = "en") -> int:
        """Offset in ``solution(style, language)`` where the first calculation's result ends: a
        prefix shorter than this shows nothing of the style."""
        text = " "
        for part in self.parts:
            text += part.render(style) if isinstance(part, Calc) else part.render(language)
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


def _thing(thing: str) -> Phrase:
    return Phrase(f" {thing}.", f" {THINGS_FR[thing]}.")


def _packs_total(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} has {a} bags with {b} {thing} in each. How many {thing} in all?"
    return question, (Phrase(f"{a} bags of {b} is ", f"{a} sacs de {b} font "), Calc(a, "*", b), _thing(thing))


def _gets_more(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    question = f"{name} has {a} {thing} and finds {b} more. How many {thing} now?"
    return question, (Phrase(f"Now {name} has ", f"{name} a maintenant "), Calc(a, "+", b), _thing(thing))


def _gives_away(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    b = rng.randint(2, 9)
    a = rng.randint(b + 2, b + 9)
    question = f"{name} has {a} {thing} and gives {b} away. How many are left?"
    return question, (Phrase("", "Il reste "), Calc(a, "-", b), Phrase(f" {thing} are left.", f" {THINGS_FR[thing]}."))


def _weekly(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 4)
    question = f"{name} gets {a} {thing} on Monday and {b} on Friday. How many in {c} weeks?"
    return question, (
        Phrase("Each week ", "Chaque semaine "), Calc(a, "+", b),
        Phrase(f". In {c} weeks ", f". En {c} semaines "), Calc(a + b, "*", c), _thing(thing),
    )


def _buys_and_gives(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(2, min(9, a + b - 1))
    question = f"{name} has {a} {thing}, buys {b} more and gives {c} away. How many are left?"
    return question, (
        Phrase("First ", "D'abord "), Calc(a, "+", b),
        Phrase(f" {thing}. Then ", f" {THINGS_FR[thing]}. Ensuite il en reste "), Calc(a + b, "-", c), Phrase(" are left.", "."),
    )


def _bags_left(rng: random.Random, name: str, thing: str) -> tuple[str, tuple[Part, ...]]:
    a, b = rng.randint(4, 9), rng.randint(2, 9)
    c = rng.randint(2, a - 2)
    question = f"{name} has {a} bags of {b} {thing} and gives {c} bags away. How many {thing} are left?"
    return question, (
        Phrase("", "Il reste "), Calc(a, "-", c), Phrase(" bags are left. ", " sacs. Donc "), Calc(a - c, "*", b), _thing(thing),
    )


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


def words(text: str) -> list[str]:
    """The words of a solution as ``VOCABULARY`` spells them: lower case, end punctuation off."""
    return [w.strip(".,;:!?").lower() for w in text.split()]


def language_cuts(text: str, language: Language) -> list[int]:
    """Word boundaries of a solution in ``language`` after its first word of that language."""
    vocabulary = set(VOCABULARY[language])
    return [i for i in cut_points(text) if vocabulary & set(words(text[:i]))]


def language_prefix(problem: Problem, language: Language) -> str:
    """The shortest prefix of the solution in ``language`` that has its first calculation's result
    and a word of ``language``: the half-solution the build report asks each model to continue."""
    text = problem.solution(language=language)
    start = problem.first_calc_end(language=language)
    return text[: next(i for i in language_cuts(text, language) if i >= start)]


def language_continuation(problem: Problem, rng: random.Random, language: Language) -> tuple[str, str]:
    """(prefix, continuation) of the solution in ``language``, cut at a random word boundary after
    its first word of ``language``, so that the prefix shows its language and the continuation
    keeps it. (English solutions of some templates start with the calculation: their first
    English word comes after it.)"""
    text = problem.solution(language=language)
    cut = rng.choice(language_cuts(text, language))
    return text[:cut], text[cut:]
