"""HandoffPolicy: who writes the next span of a tandem rollout.

A span ends where its author ends a unit (word, sentence, line, paragraph): the current author samples
its next token; if that token would start a new unit, a boundary is reached and the policy draws
the author of the next span (junior with probability ``p``). When the draw changes the author,
the new author writes the next token, constrained to tokens that start a unit. So a span always
holds whole units: a multi-token word is never split between authors. ``max_span`` optionally
forces a draw after that many tokens without a boundary (that may split a word; it is off by
default). A switch's tokens are scored under the distribution they were drawn from
(``rollout.switch``, with the token sets of ``BoundaryRule.token_sets``).

Boundaries come from the tokenizer at run time (``TokenClasses``): a word starts with a token
whose text begins with whitespace; a sentence starts at whitespace after ``.?!`` or at a line
break; a line (a GSM8K solution step) at the first non-blank token after a line break; a paragraph
at the first non-blank token after a blank line.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.record import Author

_CLOSERS = "\"')]}»”’"
# .?! then only whitespace and closing quotes/brackets up to the end of the text
_SENTENCE_END = re.compile(r"[.?!][\s" + re.escape(_CLOSERS) + r"]*$")


@dataclass
class TokenClasses:
    """Per-token text facts of one vocabulary, as tensors on the decoding device.  # each [V]"""

    starts_ws: Tensor  # bool, text begins with whitespace
    starts_newline: Tensor  # bool, text begins with a line break
    ws_only: Tensor  # bool, text is non-empty whitespace
    ends_sentence: Tensor  # bool, text ends with . ? ! (whitespace and closing quotes allowed after)
    closes: Tensor  # bool, text is only closing quotes/brackets (and whitespace): a sentence end carries on
    trailing_newlines: Tensor  # long, line breaks at the end of the text (spaces between allowed)
    newlines: Tensor  # long, line breaks anywhere in the text
    special: Tensor  # bool, special tokens (end of sequence, padding, ...)

    @classmethod
    def from_texts(cls, texts: list[str], special_ids: set[int], device: torch.device | str = "cpu") -> TokenClasses:
        def flags(predicate) -> Tensor:
            return torch.tensor([bool(predicate(t)) for t in texts], dtype=torch.bool, device=device)

        def counts(counter) -> Tensor:
            return torch.tensor([counter(t) for t in texts], dtype=torch.long, device=device)

        special = torch.zeros(len(texts), dtype=torch.bool, device=device)
        special[[i for i in special_ids if 0 <= i < len(texts)]] = True
        return cls(
            starts_ws=flags(lambda t: t[:1].isspace()),
            starts_newline=flags(lambda t: t[:1] in ("\n", "\r")),
            ws_only=flags(lambda t: t != "" and t.isspace()),
            ends_sentence=flags(lambda t: _SENTENCE_END.search(t)),
            closes=flags(lambda t: t.strip() != "" and t.strip().strip(_CLOSERS) == ""),
            trailing_newlines=counts(_trailing_newlines),
            newlines=counts(lambda t: t.count("\n")),
            special=special,
        )

    @classmethod
    def from_tokenizer(cls, tokenizer, device: torch.device | str = "cpu") -> TokenClasses:
        return cls.from_texts(token_texts(tokenizer), set(tokenizer.all_special_ids), device)

    def to(self, device: torch.device | str) -> TokenClasses:
        return TokenClasses(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})

    @property
    def vocab_size(self) -> int:
        return self.starts_ws.shape[0]


def _trailing_newlines(text: str) -> int:
    """Line breaks in the whitespace that ends ``text`` (a blank line holding spaces counts too)."""
    return text[len(text.rstrip()):].count("\n")


def token_texts(tokenizer) -> list[str]:
    """The text each token id adds when appended to a sequence, leading whitespace included.

    Decoding a lone token drops a leading space for SentencePiece vocabularies, so each token is
    decoded after an anchor token and the anchor's text is cut off.
    """
    size = len(tokenizer)
    anchor_ids = tokenizer.encode("a", add_special_tokens=False)
    if not anchor_ids:
        return tokenizer.batch_decode([[i] for i in range(size)])
    anchor = anchor_ids[-1:]
    anchor_text = tokenizer.decode(anchor)
    pairs = tokenizer.batch_decode([anchor + [i] for i in range(size)])
    return [p[len(anchor_text):] if p.startswith(anchor_text) else p for p in pairs]


class BoundaryRule(ABC):
    """A HandoffPolicy compiled for one vocabulary: pure tensor functions, CUDA-graph safe."""

    # carry values that give distinct token sets: a carry is clamped into [0, states) to name the
    # sets ``start_allowed`` and ``at_boundary`` take at it (``token_sets``); carries past the last
    # state must give the last state's sets
    states = 1

    def __init__(self, classes: TokenClasses):
        self.classes = classes

    def update(self, carry: Tensor, token: Tensor) -> Tensor:  # [B], [B] -> [B]
        """Fold the token just appended into the per-sequence state the rule needs."""
        return carry

    @abstractmethod
    def at_boundary(self, carry: Tensor, candidate: Tensor) -> Tensor:  # -> [B] bool
        """True where the current author's candidate would start a new span."""

    def start_allowed(self, carry: Tensor) -> Tensor | None:  # -> [V] or [B, V] bool
        """Tokens the next span may start with (None: any token)."""
        return None

    def state(self, carry: Tensor) -> Tensor:  # [B] -> [B] long in [0, states)
        return carry.clamp(0, self.states - 1)

    def token_sets(self) -> Tensor | None:  # -> [2 * states, V] bool
        """Every token set a switch's probabilities are taken over (``rollout.switch``), by carry
        state: row ``s`` holds the tokens a new span may start with at state ``s``
        (``start_allowed``), row ``states + s`` the candidates that end a span there
        (``at_boundary``). None where neither restricts anything (every token starts a span)."""
        carry = torch.arange(self.states, device=self.classes.starts_ws.device)
        every = torch.arange(self.classes.vocab_size, device=carry.device)
        allowed = self.start_allowed(carry)
        if allowed is None:
            allowed = torch.ones_like(every, dtype=torch.bool)
        ends = self.at_boundary(carry.unsqueeze(-1), every.unsqueeze(0))
        shape = (self.states, self.classes.vocab_size)
        return torch.cat([allowed.expand(shape), ends.expand(shape)])


class HandoffPolicy(ABC):
    """Who writes the next span.

    Args:
        p: Probability that the junior writes a span (drawn independently at every boundary).
        max_span: Force a draw after this many tokens without a boundary (None: never; a forced
            draw may split a word between authors).
        first_author: Who writes the first span: ``draw`` (junior with probability ``p``),
            ``senior`` or ``junior``.
        max_spans: End a rollout (as truncated) when it would start span number max_spans + 1
            (Tandem RLVR's evaluation: at most 150 rounds). None: no limit.
    """

    unit = "span"

    def __init__(
        self,
        p: float = 0.5,
        max_span: int | None = None,
        first_author: Literal["draw", "senior", "junior"] = "draw",
        max_spans: int | None = None,
    ):
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"handoff probability p must be in [0, 1], got {p}")
        if max_span is not None and max_span < 1:
            raise ConfigError(f"max_span must be a positive number of tokens or None, got {max_span}")
        if first_author not in ("draw", "senior", "junior"):
            raise ConfigError(f"first_author must be 'draw', 'senior' or 'junior', got {first_author!r}")
        if max_spans is not None and max_spans < 1:
            raise ConfigError(f"max_spans must be a positive number of spans or None, got {max_spans}")
        self.p = float(p)
        self.max_span = max_span
        self.first_author = first_author
        self.max_spans = max_spans

    @abstractmethod
    def compile(self, classes: TokenClasses) -> BoundaryRule:
        """The boundary rule of this policy for one vocabulary."""

    @property
    def only_author(self) -> Author | None:
        """The single author of every token, when one model writes everything (so the engine
        can skip the other model's forward); None in a real tandem."""
        if self.p == 0.0 and self.first_author != "junior":
            return Author.SENIOR
        if self.p == 1.0 and self.first_author != "senior":
            return Author.JUNIOR
        return None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(p={self.p}, max_span={self.max_span}, first_author={self.first_author!r}, "
                f"max_spans={self.max_spans})")


class _EveryToken(BoundaryRule):
    def at_boundary(self, carry: Tensor, candidate: Tensor) -> Tensor:
        return torch.ones_like(candidate, dtype=torch.bool)

    def token_sets(self) -> None:
        return None  # any token starts and ends a span: no draw is restricted


class _WordStart(BoundaryRule):
    def at_boundary(self, carry: Tensor, candidate: Tensor) -> Tensor:
        c = self.classes
        return c.starts_ws[candidate] & ~c.special[candidate]

    def start_allowed(self, carry: Tensor) -> Tensor:
        return self.classes.starts_ws | self.classes.special


class _SentenceStart(_WordStart):
    states = 4  # carry = ended + 2 * line, each 0 or 1
    # carry = ended + 2 * line: ``ended`` = the text so far ends with .?! (then only whitespace or
    # closing quotes); ``line`` = it ends with a line break (then only whitespace). A line break
    # may sit inside a token (".\n\n"), so both come from the token texts, not from single tokens.
    def update(self, carry: Tensor, token: Tensor) -> Tensor:
        c = self.classes
        ended = torch.where(c.ws_only[token] | c.closes[token], carry & 1, c.ends_sentence[token].long())
        line = (c.trailing_newlines[token] > 0) | (c.ws_only[token] & (carry >= 2))
        return ended + 2 * line.long()

    def at_boundary(self, carry: Tensor, candidate: Tensor) -> Tensor:
        c = self.classes
        after_line = (carry >= 2) & ~c.ws_only[candidate]
        after_sentence = ((carry & 1) == 1) & c.starts_ws[candidate]
        return (after_line | after_sentence | c.starts_newline[candidate]) & ~c.special[candidate]

    def start_allowed(self, carry: Tensor) -> Tensor:  # [B, V]
        # Where the boundary is a line break inside a sentence, the new author must not start
        # with a plain space: that would begin its span mid-sentence.
        c = self.classes
        after_line = (carry >= 2).unsqueeze(-1)
        after_sentence = ((carry & 1) == 1).unsqueeze(-1) & c.starts_ws
        return after_line | after_sentence | c.starts_newline | c.special


class _ParagraphStart(BoundaryRule):
    # carry = number of line breaks at the end of the text so far
    line_breaks = 2  # a blank line

    @property
    def states(self) -> int:  # every carry from line_breaks on is a boundary state alike
        return self.line_breaks + 1

    def update(self, carry: Tensor, token: Tensor) -> Tensor:
        c = self.classes
        return torch.where(c.ws_only[token], carry + c.newlines[token], c.trailing_newlines[token])

    def at_boundary(self, carry: Tensor, candidate: Tensor) -> Tensor:
        c = self.classes
        return (carry >= self.line_breaks) & ~c.ws_only[candidate] & ~c.special[candidate]

    def start_allowed(self, carry: Tensor) -> Tensor:
        return ~self.classes.ws_only


class _LineStart(_ParagraphStart):
    line_breaks = 1


class TokenHandoff(HandoffPolicy):
    """A draw before every token."""

    unit = "token"

    def compile(self, classes: TokenClasses) -> BoundaryRule:
        return _EveryToken(classes)


class WordHandoff(HandoffPolicy):
    """A draw at every word boundary (the Tandem Training and Tandem RLVR training schedule)."""

    unit = "word"

    def compile(self, classes: TokenClasses) -> BoundaryRule:
        return _WordStart(classes)


class SentenceHandoff(HandoffPolicy):
    """A draw after each sentence (``.?!`` followed by whitespace) and at each line break."""

    unit = "sentence"

    def compile(self, classes: TokenClasses) -> BoundaryRule:
        return _SentenceStart(classes)


class ParagraphHandoff(HandoffPolicy):
    """A draw after each blank line (the Tandem RLVR evaluation schedule)."""

    unit = "paragraph"

    def compile(self, classes: TokenClasses) -> BoundaryRule:
        return _ParagraphStart(classes)


class LineHandoff(HandoffPolicy):
    """A draw after each line break: one reasoning step per line, as GSM8K's annotated solutions
    are written (the Tandem Training paper's "step" handoff)."""

    unit = "line"

    def compile(self, classes: TokenClasses) -> BoundaryRule:
        return _LineStart(classes)


class SoloHandoff(HandoffPolicy):
    """No handoff: one model writes everything (``author='senior'``: the plain-RL baseline;
    ``author='junior'``: the junior alone)."""

    unit = "solo"

    def __init__(self, author: Literal["senior", "junior"] = "senior"):
        if author not in ("senior", "junior"):
            raise ConfigError(f"SoloHandoff author must be 'senior' or 'junior', got {author!r}")
        super().__init__(p=0.0 if author == "senior" else 1.0, first_author=author)
        self.author = author

    def compile(self, classes: TokenClasses) -> BoundaryRule:
        return _WordStart(classes)  # never consulted: p is 0 or 1

    def __repr__(self) -> str:
        return f"SoloHandoff(author={self.author!r})"
