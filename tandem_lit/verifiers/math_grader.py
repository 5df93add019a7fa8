"""The grading rules of ``MathVerifier``, free of torch and of the rest of tandem_lit.

Worker processes load this file by path (not through the ``tandem_lit`` package, whose import
pulls in torch), so a grader process starts in well under a second plus math-verify's own
import. The parent uses the same functions for extraction and normalisation, so both sides of
the process boundary apply one set of rules.
"""

from __future__ import annotations

import cmath
import math
import re
import sys
from typing import Any

INSTALL_HINT = "pip install 'tandem-lit[math]'"


class EmptyReferenceError(ValueError):
    """A row's reference answer is empty (the verifier turns it into a DataError)."""


# -- extraction and normalisation (parent process; linear time, no sympy) ------------------------

_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])(\s*\{)?|\\[{}\\]|[{}]")
_BARE_BOX_CONTENT = re.compile(r"\s*([^\s$]+)")
_SCIENTIFIC = re.compile(r"(?<![\w\\.])(\d+(?:\.\d+)?|\.\d+)[eE]([+-]?)(\d+)(?![\w.])")
_TRAILING_PERIOD = re.compile(r"(?<!\\)[\s.]+$")
_SIGNED_EXPONENT = re.compile(r"\^\s*([+-]\d+(?:\.\d+)?)")
_BASE_NUMBER = re.compile(r"(?<![\w\\.])(\d[0-9A-Z]*)_(?:\{(\d{1,2})\}|(\d{1,2}))(?!\w)")
_NUMPY = re.compile(r"\bnp\.([A-Za-z]+)")  # Minerva references: np.arcsin(10/13)
_BARE_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=[\s/)*+,-]|$)")  # Minerva references: -1./3
_DEGREES_CF = re.compile(r"(\^\s*\{?\s*\\circ\s*\}?)\s*(?:\\(?:mathrm|text)\s*\{\s*[CF]\s*\}|[CF](?![A-Za-z]))")
_ARC_PRIMES = re.compile(r"(?<=\d)\s*(?:\^\s*\{\s*(?:\\prime\s*)+\}|\^\s*\\prime|'{1,2})")  # 45'' (arc units)
_DOUBLE_PRIME = re.compile(r"(?<=[A-Za-z)}])''")
_PRIME = re.compile(r"(?<=[A-Za-z)}])'")
_TEXT_UNIT = re.compile(
    r"(?:\s|\\[,;:! ]|~)*\\(?:text|mbox|mathrm|textrm|rm)\s*\{([^{}]*)\}"
    r"(?:\s*\^\s*(?:\{[^{}]*\}|-?\d))?\s*$"
)
_UNIT_WORD = re.compile(
    r"\s+(?:cm|mm|km|nm|kg|mg|ml|kHz|MHz|GHz|Hz|eV|keV|MeV|GeV|kJ|kW|inch(?:es)?|feet|foot|ft|meters?|metres?|"
    r"miles?|mph|seconds?|sec|minutes?|min|hours?|hrs?|days?|weeks?|years?|yrs?|units?|degrees?|dollars?|cents?|"
    r"pounds?|ounces?|liters?|litres?|gallons?|sq(?:uare)?\s+\w+)(?:\s*\^\s*(?:\{[^{}]*\}|-?\d))?\s*$"
)
_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_FRAC_VARIANT = re.compile(r"\\[dt]frac(?![A-Za-z])")
_SHORT_SUBSCRIPT = re.compile(r"_([A-Za-z0-9])")
_SPACING = re.compile(r"\s+|\\[,;:! ]")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d[\d,]*(?:\.\d+)?|\\frac\{\d+\}\{\d+\})(?:\s*\\times\s*10\^\{?[-+]?\d+\}?)?$")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), or None.

    "Last" is by closing position, so a box nested in a box yields the outer one. A box left
    open at the end (a truncated completion) means there is no final answer.
    """
    stack: list[int | None] = []  # content start for a box, None for a plain brace
    best: tuple[int, str] | None = None  # (end position, content)
    for token in _BOX_TOKEN.finditer(text):
        raw = token.group()
        if raw[0] == "\\" and len(raw) == 2:
            continue  # \{ \} \\ are not grouping braces
        if raw == "{":
            stack.append(None)
        elif raw == "}":
            if stack:
                start = stack.pop()
                if start is not None:
                    best = (token.start(), text[start : token.start()])
        elif token.group(1) is not None:
            stack.append(token.end())
        else:  # "\boxed 5": the box holds the next token
            bare = _BARE_BOX_CONTENT.match(text, token.end())
            if bare and bare.group(1)[0] not in "{}\\":
                best = (bare.end(), bare.group(1))
    if any(start is not None for start in stack):
        return None
    if best is None:
        return None
    content = best[1].strip()
    return content or None


def normalize_answer(text: str) -> str:
    """Rewrite an answer string the way both sides are compared (before math-verify parses it).

    Each rule is for a form seen in references or model answers that math-verify misreads.
    Units: only explicitly marked text (``\\text{ cm}^2``, ``\\mathrm{~K}``) at the end is dropped,
    and unit words (``cm``, ``inches``) after a plain number; a bare trailing letter stays a
    variable (math-verify's own unit rule turns ``v t`` into ``v``: switched off in the worker).
    """
    text = text.strip().replace("\\$", "").replace("$", "")
    text = _NUMPY.sub(r"\\\1", text)
    text = _TRAILING_PERIOD.sub("", text)  # "(-\\infty, 0) \\cup \\{1\\}." does not parse with the period
    text = _BARE_DECIMAL_POINT.sub("", text)
    text = _DEGREES_CF.sub(r"\1", text)  # 1950^\\circ C -> 1950^\\circ (not 1950 * C)
    text = _ARC_PRIMES.sub("", text)
    text = _PRIME.sub("^{\\\\prime}", _DOUBLE_PRIME.sub("^{\\\\prime\\\\prime}", text))  # x' as x^{\\prime}
    text = _SCIENTIFIC.sub(_scientific_to_latex, text)
    text = _SIGNED_EXPONENT.sub(r"^{\1}", text)  # 10^-10 -> 10^{-10}
    text = _BASE_NUMBER.sub(_base_to_decimal, text)
    for _ in range(3):  # "15000 \\text{ kcal m}^{-2} \\text{yr}^{-1}": one unit group at a time
        unit = _TEXT_UNIT.search(text)
        if unit is None or unit.group(1).strip() in ("e", "i") or not text[: unit.start()].strip():
            break
        text = text[: unit.start()].rstrip()
    unit = _UNIT_WORD.search(text)
    if unit is not None and _PLAIN_NUMBER.match(text[: unit.start()].strip()):
        text = text[: unit.start()]
    return text.strip()


def canonical_latex(text: str) -> str:
    """LaTeX with spacing, ``\\left``/``\\right`` and subscript braces removed: equal strings here are
    the same formula (``E_1, E_2`` and ``E_{1},E_{2}``, which sympy cannot parse)."""
    text = _SIZING.sub("", text)
    text = _FRAC_VARIANT.sub(r"\\frac", text)
    text = _SHORT_SUBSCRIPT.sub(r"_{\1}", text)
    return _SPACING.sub("", text)


def _scientific_to_latex(match: re.Match[str]) -> str:
    mantissa, sign, exponent = match.groups()
    return f"{mantissa}\\times10^{{{'-' if sign == '-' else ''}{exponent}}}"


def _base_to_decimal(match: re.Match[str]) -> str:
    digits, base = match.group(1), int(match.group(2) or match.group(3))
    try:
        return str(int(digits, base)) if 2 <= base <= 36 else match.group()
    except ValueError:  # not a numeral of that base (e.g. 19_8): leave it to math-verify
        return match.group()


def normalize_references(answer: Any) -> tuple[str, ...]:
    """Reference answer(s) as strings. A list holds alternatives (any one is correct); an answer
    that needs several values (OlympiadBench multiple answers) is one string such as ``1, 3``."""
    items = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    references: list[str] = []
    for item in items:
        if isinstance(item, bool) or item is None:
            continue
        if isinstance(item, (int, float)):
            if isinstance(item, float) and not math.isfinite(item):
                continue
            text = str(int(item)) if float(item).is_integer() else repr(float(item))
        else:
            text = normalize_answer(str(item))
        if text and text not in references:
            references.append(text)
    if not references:
        raise EmptyReferenceError(f"reference answer {answer!r} is empty")
    return tuple(references)


# -- grading (worker process) -------------------------------------------------------------------


def make_parser():
    """``parsed(text)``: math-verify's reading of one extracted answer, with its own timeout off
    (the caller bounds the time). A list holding a sympy object and/or the normalised string."""
    import logging

    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the "timeout disabled" warning; we enforce it

    from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse

    # The answer is already extracted, so math-verify must parse it whole. Its default configs
    # search the text for anything parseable (a `\\frac{2}{3}` inside an unparseable expression,
    # the last number for ExprExtractionConfig) and grade that: `... E_{2}` vs `... E_{3}` would
    # both read as 2/3. With no anchor-free patterns, an unparseable answer stays a string and
    # only the same string matches it.
    # Its unit rule drops any trailing single letter after a space ("v t" -> "v", "\\frac{1}{m} t"
    # -> "\\frac{1}{m}"): off; normalize_answer drops marked-up units instead.
    normalization = LatexNormalizationConfig(
        basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False
    )
    configs = [
        LatexExtractionConfig(
            try_extract_without_anchor=False, boxed_match_priority=0, normalization_config=normalization
        )
    ]

    def parsed(text: str) -> list[Any]:
        return parse("\\boxed{" + text + "}", extraction_config=configs, parsing_timeout=None)

    return parsed


def worker_grader():
    """Factory run once in each worker: import math-verify, self-test it, return ``grade``."""
    import sympy
    from math_verify import verify

    # deep but valid answers (a \frac nested 200 deep) recurse deeper than Python's default 1,000
    # frames in the LaTeX parser and sympy; this process does nothing else
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 50_000))
    parsed = make_parser()

    def as_number(expr: Any) -> complex | None:
        """Value of a constant (no symbols); None for anything else (left to math-verify)."""
        if not isinstance(expr, sympy.Expr) or expr.free_symbols:
            return None
        if expr.has(sympy.UnevaluatedExpr):  # a percentage: math-verify knows 9% == 9
            return None
        try:
            value = complex(sympy.N(expr, 30))
        except (TypeError, ValueError, OverflowError):
            return None
        return value if cmath.isfinite(value) else None

    def is_assignment(expr: Any) -> bool:
        """``name = value`` or ``f(x) = value``."""
        if not isinstance(expr, sympy.Eq):
            return False
        lhs = expr.lhs
        return isinstance(lhs, sympy.Symbol) or (
            isinstance(lhs, sympy.core.function.AppliedUndef) and all(a.is_Symbol for a in lhs.args)
        )

    def bare_value(expr: Any) -> Any:
        """``value`` of an assignment; else the expression itself."""
        return expr.rhs if is_assignment(expr) else expr

    def degenerate(expr: Any) -> bool:
        """An equation without unknowns, e.g. ``N=n`` read as ``n = n`` (math-verify folds case);
        math-verify's solve-and-compare calls any two of these equal."""
        try:
            return isinstance(expr, sympy.Eq) and not (expr.lhs - expr.rhs).free_symbols
        except Exception:  # noqa: BLE001 - matrices, sets: not this case
            return False

    def plain_symbols(parsed_items: list[Any]) -> list[Any]:
        """Symbols without assumptions: math-verify makes them real unless the text looks complex
        (a standalone ``i``), so ``3+3 i`` and ``3+3i`` would hold different symbols ``a``."""
        return [
            item.xreplace({s: sympy.Symbol(s.name) for s in item.free_symbols if isinstance(s, sympy.Symbol)})
            if isinstance(item, sympy.Basic)
            else item
            for item in parsed_items
        ]

    def equivalent(gold: list[Any], pred: list[Any], rel_tol: float, unwrap: bool = True) -> bool:
        gold_expr = next((g for g in gold if isinstance(g, sympy.Basic)), None)
        pred_expr = next((p for p in pred if isinstance(p, sympy.Basic)), None)
        if gold_expr is not None and pred_expr is not None:
            gold_symbols = {s.name: s for s in gold_expr.free_symbols if isinstance(s, sympy.Symbol)}
            if any(gold_symbols.get(s.name, s) != s for s in pred_expr.free_symbols if isinstance(s, sympy.Symbol)):
                gold, pred = plain_symbols(gold), plain_symbols(pred)
                gold_expr = next(g for g in gold if isinstance(g, sympy.Basic))
                pred_expr = next(p for p in pred if isinstance(p, sympy.Basic))
        if unwrap and (
            degenerate(gold_expr)
            or degenerate(pred_expr)
            # x = A vs x = B is A vs B; math-verify would also try sympy's solve, which can hang
            or (is_assignment(gold_expr) and is_assignment(pred_expr) and gold_expr.lhs == pred_expr.lhs)
        ):
            return equivalent([bare_value(gold_expr)], [bare_value(pred_expr)], rel_tol, unwrap=False)
        decimal = any(isinstance(e, sympy.Basic) and e.has(sympy.Float) for e in (gold_expr, pred_expr))
        gold_value = as_number(gold_expr) if decimal else None
        pred_value = as_number(pred_expr) if gold_value is not None else None
        if gold_value is not None and pred_value is not None:  # relative, not math-verify's 6 decimal places
            return abs(gold_value - pred_value) <= rel_tol * max(abs(gold_value), abs(pred_value))
        if verify(gold, pred, timeout_seconds=None):
            return True
        if unwrap and gold_expr is not None and pred_expr is not None:
            gold_bare, pred_bare = bare_value(gold_expr), bare_value(pred_expr)
            if gold_bare is not gold_expr or pred_bare is not pred_expr:
                return equivalent([gold_bare], [pred_bare], rel_tol, unwrap=False)
        return False

    def grade(answer: str, references: tuple[str, ...], rel_tol: float) -> bool | None:
        """True / False; None when the grader could not decide (too deep to parse even so): the
        caller counts it like a timeout instead of calling the answer wrong."""
        if canonical_latex(answer) in {canonical_latex(r) for r in references}:
            return True  # the same LaTeX up to spacing: no need to ask sympy (which may not parse it)
        try:
            pred = parsed(answer)
            return bool(pred) and any(equivalent(parsed(ref), pred, rel_tol) for ref in references)
        except (RecursionError, MemoryError):
            return None
        except Exception:  # noqa: BLE001 - sympy raises anything on odd input; that answer is wrong
            return False

    checks = [
        ("\\frac{1}{2}", ("0.5",), True),
        ("3", ("4",), False),
        ("x=2", ("2",), True),
        ("(x-1)(x+1)", ("x^2-1",), True),
    ]
    for answer, references, expected in checks:
        if grade(answer, references, 1e-6) is not expected:
            raise RuntimeError(
                f"math-verify self-test failed: {answer!r} vs {references} should be {expected}. The parser "
                f"backend (latex2sympy2_extended / antlr4) is probably missing or mismatched: {INSTALL_HINT}"
            )
    return grade
