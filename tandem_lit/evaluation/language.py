"""Language share: the fraction of a solution written in a target language, per rollout and per author.

In the Tandem Training skill+language and language-gap settings the junior writes another language
(e.g. French) and the senior's own language drifts toward it; this is the number that shows the
drift. A solution is cut into units (sentences, author spans, or the whole text); math is blanked
out first, because numbers, equations, ``<<48/2=24>>`` calculator annotations and LaTeX carry no
language (an identifier would call them English, or anything); a unit with fewer than
``min_chars`` letters left has no language and is skipped; every other unit is identified by an
offline language identifier and weighs its letters. So

    share = letters in units identified as the target / letters in all identified units

and a solution with no identifiable unit has no share (None), never 0. docs/language.md has the
accuracy of both identifiers on short math sentences and the failure modes.
"""

from __future__ import annotations

import bisect
import importlib
import re
from collections.abc import Sequence
from enum import Enum
from functools import lru_cache
from typing import Literal, Protocol

from tandem_lit.errors import ConfigError, MissingDependencyError

__all__ = ["LanguageShare", "Lingua", "MissingDependencyError", "Py3LangId", "WordListLanguageShare", "blank_math"]

#: the pins of pyproject.toml's ``language`` extra (docs/language.md measured these versions)
PY3LANGID_VERSION = "0.4.0"
LINGUA_VERSION = "2.1.1"
INSTALL_HINT = "pip install 'tandem-lit[language]'"

# Math regions, blanked whole: GSM8K calculator annotations, $$...$$, \[...\], \(...\), and inline
# $...$ by pandoc's rule (the opening $ has a non-space to its right, the closing one a non-space to
# its left and no digit after it), so that the prices in "pays $5 and gets $3 back" are not math.
MATH_REGION = re.compile(
    r"<<[^<>\n]*>>"
    r"|\$\$.+?\$\$"
    r"|\\\[.+?\\\]"
    r"|\\\(.+?\\\)"
    r"|\$(?=\S)(?:[^$\n\\]|\\.)*?(?<=\S)\$(?!\d)",
    re.DOTALL,
)
# A word with a digit, an operator or a LaTeX character is math too: 12, $24, 3x, 5km, x=5, \frac{1}{2}
MATH_WORD = re.compile(r"\S*[0-9=+*/^<>×÷·±≤≥≠≈√∑∫∞\\{}_|]\S*")
# A sentence ends at . ! ? followed by white space, or at a line break
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")
# py3langid's label for text with no linguistic content
NO_LANGUAGE = "zxx"

Unit = Literal["sentence", "span", "text"]
IdentifierName = Literal["py3langid", "lingua"]


def blank_math(text: str) -> str:
    """``text`` with every math region and math word replaced by spaces (offsets are kept)."""

    def spaces(match: re.Match) -> str:
        return " " * (match.end() - match.start())

    return MATH_WORD.sub(spaces, MATH_REGION.sub(spaces, text))


def letters(text: str) -> int:
    return sum(ch.isalpha() for ch in text)


def author_key(author: object) -> str:
    """``Author.SENIOR`` -> ``"senior"`` (the codes ``Rollout.spans`` returns); strings as they are."""
    return author.name.lower() if isinstance(author, Enum) else str(author)


def import_identifier(module: str, package: str, version: str, name: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"LanguageShare(identifier={name!r}) needs {package}=={version}, which is not installed ({err}). "
            f"Install it with: {INSTALL_HINT} (or pip install {package}=={version})"
        ) from err


class LanguageIdentifier(Protocol):
    """Names the language of each text: an ISO 639-1 code, or None when it cannot tell."""

    labels: frozenset[str]  # the codes it can answer

    def __call__(self, texts: Sequence[str]) -> list[str | None]: ...


@lru_cache(maxsize=8)
def load_py3langid(languages: tuple[str, ...] | None):
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    model = LanguageIdentifier.from_model_file(MODEL_FILE)  # 0.7 s: loaded once per candidate set
    unknown = set(languages or ()) - set(model.labels)
    if unknown:
        raise ConfigError(f"py3langid does not know the language code(s) {sorted(unknown)}; it knows {model.labels}")
    if languages:
        model.set_languages(list(languages))
    return model


class Py3LangId:
    """py3langid: langid.py's naive Bayes over byte n-grams, in numpy; 139 languages, a 4.5 MB package."""

    def __init__(self, languages: Sequence[str] | None = None):
        module = import_identifier("py3langid", "py3langid", PY3LANGID_VERSION, "py3langid")
        if not hasattr(module.langid.LanguageIdentifier, "from_model_file"):  # py3langid < 0.4
            raise MissingDependencyError(
                f"LanguageShare needs py3langid=={PY3LANGID_VERSION}, found {module.__version__}: {INSTALL_HINT}"
            )
        self.model = load_py3langid(tuple(languages) if languages else None)
        self.labels = frozenset(self.model.labels) - {NO_LANGUAGE}

    def __call__(self, texts: Sequence[str]) -> list[str | None]:
        codes = [self.model.classify(text)[0] for text in texts]
        return [None if code == NO_LANGUAGE else code for code in codes]


class Lingua:
    """Lingua: character n-gram models (1- to 5-grams) plus rules, in Rust; 75 languages, a 96 MB package (1.2 GiB loaded with every language)."""

    def __init__(self, languages: Sequence[str] | None = None):
        lingua = import_identifier("lingua", "lingua-language-detector", LINGUA_VERSION, "lingua")
        known = {language.iso_code_639_1.name.lower(): language for language in lingua.Language.all()}
        unknown = set(languages or ()) - set(known)
        if unknown:
            raise ConfigError(f"lingua does not know the language code(s) {sorted(unknown)}; it knows {sorted(known)}")
        if languages:
            builder = lingua.LanguageDetectorBuilder.from_languages(*(known[code] for code in languages))
        else:
            builder = lingua.LanguageDetectorBuilder.from_all_languages()
        self.detector = builder.build()  # models load on first use, per language
        self.labels = frozenset(languages or known)

    def __call__(self, texts: Sequence[str]) -> list[str | None]:
        found = self.detector.detect_languages_in_parallel_of(list(texts))
        return [language.iso_code_639_1.name.lower() if language is not None else None for language in found]


IDENTIFIERS = {"py3langid": Py3LangId, "lingua": Lingua}


class LanguageShare:
    """Fraction of a solution's letters written in ``language``, by an offline language identifier.

    Args:
        language: Target language, an ISO 639-1 code (``fr`` for a French junior).
        unit: What is identified as one piece: ``sentence`` (split at ``.!?`` + space and at line
            breaks), ``span`` (each author span whole; a plain text is one span), or ``text`` (all
            of a solution, or all of one author's part of it). Per author, a sentence contributes
            the author's own words in it (the other author's words removed).
        identifier: ``py3langid`` (the default: fast, 4.5 MB) or ``lingua`` (a 100 MB model).
            docs/language.md compares them on short math sentences.
        languages: Candidate languages (ISO 639-1), e.g. ``[en, fr]`` for an English senior with a
            French junior; None: every language the identifier knows. Restricting the set is what
            makes short sentences reliable (docs/language.md).
        min_chars: A unit with fewer letters than this (after math is blanked) has no language:
            it is skipped, not counted against the target.
        ignore_math: Blank out numbers, equations, calculator annotations and LaTeX before
            identification (off only to measure what they do to an identifier).
    """

    def __init__(
        self,
        language: str = "fr",
        unit: Unit = "sentence",
        identifier: IdentifierName = "py3langid",
        languages: list[str] | None = None,
        min_chars: int = 8,
        ignore_math: bool = True,
    ):
        if unit not in ("sentence", "span", "text"):
            raise ConfigError(f"LanguageShare unit must be sentence, span or text, got {unit!r}")
        if identifier not in IDENTIFIERS:
            raise ConfigError(f"LanguageShare identifier must be one of {sorted(IDENTIFIERS)}, got {identifier!r}")
        if min_chars < 1:
            raise ConfigError(f"LanguageShare min_chars must be at least 1, got {min_chars}")
        if languages is not None:
            languages = list(dict.fromkeys(code.lower() for code in languages))
            if len(languages) < 2:
                raise ConfigError(f"LanguageShare languages needs at least two candidates, got {languages}")
            if language.lower() not in languages:
                raise ConfigError(f"LanguageShare target {language!r} is not among languages {languages}")
        self.language = language.lower()
        self.unit = unit
        self.languages = languages
        self.min_chars = min_chars
        self.ignore_math = ignore_math
        self.identifier: LanguageIdentifier = IDENTIFIERS[identifier](languages)
        if self.language not in self.identifier.labels:
            raise ConfigError(f"{identifier} does not know the target language {language!r}")

    # -- one solution ---------------------------------------------------------------------------

    def share(self, text: str) -> float | None:
        """Fraction of the letters of ``text``'s identified units in the target language; None
        when no unit has ``min_chars`` letters outside math."""
        return self.shares([text])[0]

    def shares(self, texts: Sequence[str]) -> list[float | None]:
        return [by_author.get("text") for by_author in self._shares([[("text", text)] for text in texts])]

    def share_by_author(self, spans: Sequence[tuple[object, str]]) -> dict[str, float | None]:
        """The share of each author's own writing in one rollout, from its (author, text) spans in
        order (``Rollout.spans(row, tokenizer)``). Every author that wrote something is a key;
        None: nothing it wrote has a language."""
        return self._shares([spans])[0]

    # -- batches --------------------------------------------------------------------------------

    def rate(self, texts: Sequence[str]) -> float | None:
        """Mean share over the texts that have one; None when none has."""
        return mean([s for s in self.shares(texts) if s is not None])

    def rate_by_author(self, rollouts: Sequence[Sequence[tuple[object, str]]]) -> dict[str, float]:
        """Per author, the mean share over the rollouts where its writing has a language."""
        found: dict[str, list[float]] = {}
        for by_author in self._shares(rollouts):
            for author, value in by_author.items():
                if value is not None:
                    found.setdefault(author, []).append(value)
        return {author: sum(values) / len(values) for author, values in found.items()}

    def stats(self, rollouts: Sequence[Sequence[tuple[object, str]]]) -> dict[str, float]:
        """Step metrics from a batch of rollouts' spans: ``language_share`` (whole solutions) and
        ``<author>_language_share`` (e.g. ``senior_language_share``). A metric with no
        identifiable text in the batch is left out rather than logged as 0."""
        whole = self.rate(["".join(text for _, text in spans) for spans in rollouts])
        stats = {} if whole is None else {"language_share": whole}
        stats.update({f"{author}_language_share": v for author, v in self.rate_by_author(rollouts).items()})
        return stats

    # -- the work -------------------------------------------------------------------------------

    def pieces(self, spans: Sequence[tuple[object, str]]) -> list[tuple[str, str]]:
        """(author, text to identify) for each unit and each author in it, math blanked, white
        space collapsed: what the identifier sees."""
        text = "".join(part for _, part in spans)
        blanked = blank_math(text) if self.ignore_math else text
        starts, ends, owners, position = [], [], [], 0
        for author, part in spans:
            if part:
                starts.append(position)
                owners.append(author_key(author))
                position += len(part)
                ends.append(position)
        if self.unit == "sentence":
            cuts = [(m.start(), m.end()) for m in SENTENCE_BREAK.finditer(text)]
            bounds = [0, *(c for cut in cuts for c in cut), len(text)]
            units = list(zip(bounds[::2], bounds[1::2]))
        elif self.unit == "span":
            units = list(zip(starts, ends))
        else:
            units = [(0, len(text))]
        pieces = []
        for begin, end in units:
            words: dict[str, list[str]] = {}
            first = max(bisect.bisect_right(starts, begin) - 1, 0)
            for i in range(first, bisect.bisect_left(starts, end)):
                if ends[i] > begin:
                    words.setdefault(owners[i], []).append(blanked[max(begin, starts[i]) : min(end, ends[i])])
            pieces.extend((author, " ".join(" ".join(parts).split())) for author, parts in words.items())
        return pieces

    def _shares(self, rollouts: Sequence[Sequence[tuple[object, str]]]) -> list[dict[str, float | None]]:
        per_rollout = [self.pieces(spans) for spans in rollouts]
        # One identifier call for the whole batch: lingua runs it in parallel
        wanted = [text for pieces in per_rollout for _, text in pieces if letters(text) >= self.min_chars]
        codes = iter(self.identifier(wanted) if wanted else [])
        results = []
        for pieces in per_rollout:
            target: dict[str, int] = {}
            identified: dict[str, int] = {}
            for author, text in pieces:
                target.setdefault(author, 0)
                identified.setdefault(author, 0)
                count = letters(text)
                if count < self.min_chars:
                    continue
                code = next(codes)
                if code is None:
                    continue
                identified[author] += count
                target[author] += count if code == self.language else 0
            results.append({a: target[a] / identified[a] if identified[a] else None for a in identified})
        return results


class WordListLanguageShare(LanguageShare):
    """Fraction of a solution's listed words that are ``language``'s: a language share for a closed
    vocabulary, such as the offline demo's synthetic world (``tandem_lit.data.world.VOCABULARY``),
    whose short sentences of names, numbers and a few connectives a statistical identifier cannot
    be trusted on, and whose made-up languages it does not know.

    A text is cut into words at white space, math words are dropped (as ``LanguageShare`` blanks
    them), end punctuation is stripped and case ignored; a word in one of the ``words`` lists counts
    for that language, any other word (a name, a word of no list, a garbled word) for none:

        share = listed words of ``language`` / listed words of every language

    A text with no listed word has no share (None), never 0. Per author, each author's own words
    count. It answers ``share``, ``shares``, ``share_by_author``, ``rate``, ``rate_by_author`` and
    ``stats`` as ``LanguageShare`` does, so it goes wherever a ``LanguageShare`` does
    (``TandemModule(language=...)``).

    Args:
        language: Target language: a key of ``words``.
        words: Each language's words, e.g. ``{en: [first, then], fr: ["d'abord", ensuite]}``;
            at least two languages, no word in two lists.
    """

    def __init__(self, language: str, words: dict[str, list[str]]):
        # No super().__init__(): there is no identifier to load; pieces() reads these fields.
        self.words = {code.lower(): frozenset(w.lower() for w in listed) for code, listed in words.items()}
        if len(self.words) < 2:
            raise ConfigError(f"WordListLanguageShare needs the words of at least two languages, got {sorted(self.words)}")
        if language.lower() not in self.words:
            raise ConfigError(f"WordListLanguageShare target {language!r} is not among the languages {sorted(self.words)}")
        shared = sorted(w for a in self.words for b in self.words if a < b for w in self.words[a] & self.words[b])
        if shared:
            raise ConfigError(f"WordListLanguageShare word lists must be disjoint; in two lists: {shared}")
        self.language = language.lower()
        self.languages = list(self.words)
        self.unit: Unit = "text"
        self.ignore_math = True
        self.owner = {word: code for code, listed in self.words.items() for word in listed}

    def counts(self, text: str) -> dict[str, int]:
        """Listed words of each language in ``text`` (math blanked)."""
        found = dict.fromkeys(self.words, 0)
        for word in blank_math(text).split():
            code = self.owner.get(word.strip(".,;:!?").lower())
            if code is not None:
                found[code] += 1
        return found

    def _shares(self, rollouts: Sequence[Sequence[tuple[object, str]]]) -> list[dict[str, float | None]]:
        results = []
        for spans in rollouts:
            target: dict[str, int] = {}
            listed: dict[str, int] = {}
            for author, text in self.pieces(spans):
                found = self.counts(text)
                target[author] = target.get(author, 0) + found[self.language]
                listed[author] = listed.get(author, 0) + sum(found.values())
            results.append({a: target[a] / listed[a] if listed[a] else None for a in listed})
        return results


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
