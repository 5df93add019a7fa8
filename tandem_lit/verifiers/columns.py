"""What a dataset field may hold, and the one check that names the file, the row and the field of a
value that does not fit.

Without it a field of the wrong type trains silently as its printed form: a question that is the
number 12 becomes the prompt "12", a list becomes "['a', 'b']". Data modules check the fields
they read when they load a file (their types are declared in ``tandem_lit.data.fields``);
verifiers declare the types of the columns they grade (``Verifier.column_types``). It lives here,
below both, because data modules import verifiers and never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tandem_lit.errors import DataError


@dataclass(frozen=True)
class FieldType:
    """A kind of value: ``name`` says it in words (for the error); ``a | b`` accepts either,
    ``list_of(a)`` a list of them. The test is a module-level function, not a lambda: verifiers
    that hold their column types are pickled into worker processes."""

    name: str
    test: Callable[[Any], bool] | None = None
    options: tuple[FieldType, ...] = ()  # a union: any one accepts
    item: FieldType | None = None  # a list whose every element this accepts

    def accepts(self, value: Any) -> bool:
        if self.options:
            return any(option.accepts(value) for option in self.options)
        if self.item is not None:
            return isinstance(value, list) and all(self.item.accepts(v) for v in value)
        return self.test(value)

    @property
    def expected(self) -> str:
        words = [option.name for option in self.options] or [self.name]
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"

    def __or__(self, other: FieldType) -> FieldType:
        options = (*(self.options or (self,)), *(other.options or (other,)))
        return FieldType(" or ".join(option.name for option in options), options=options)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON true is not a number


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_boolean(value: Any) -> bool:
    return isinstance(value, bool)


def _is_null(value: Any) -> bool:
    return value is None


def _is_object(value: Any) -> bool:
    return isinstance(value, dict)


TEXT = FieldType("a string", _is_text)
NUMBER = FieldType("a number", is_number)
INTEGER = FieldType("an integer", _is_integer)
BOOLEAN = FieldType("true or false", _is_boolean)
NULL = FieldType("null", _is_null)
OBJECT = FieldType("an object", _is_object)


def list_of(item: FieldType, name: str | None = None) -> FieldType:
    if name is None:
        name = f"a list of {item.name.removeprefix('a ').removeprefix('an ')}s"
    return FieldType(name, item=item)


def describe(value: Any) -> str:
    """A value as the file holds it, in JSON's words, with a short excerpt."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    kind = ("a number" if is_number(value) else "a string" if isinstance(value, str) else "a list"
            if isinstance(value, (list, tuple)) else "an object" if isinstance(value, dict) else f"a {type(value).__name__}")
    text = repr(value)
    return f"{kind} ({text if len(text) <= 40 else text[:37] + '...'})"


def field_error(where: str, index: int, name: str, value: Any, expected: str, fix: str = "") -> DataError:
    """The one line: ``<file>: row <i> field '<name>' is <what was found>, expected <type>. <fix>``."""
    line = f"{where}: row {index} field {name!r} is {describe(value)}, expected {expected}"
    return DataError(f"{line}. {fix}" if fix else line)


def check_record(record: Mapping[str, Any], types: Mapping[str, FieldType], where: str, index: int, fix: str = "") -> None:
    """Raise for the first field of ``record`` that ``types`` names and whose value it does not
    accept. Absent fields are the reader's business (``require_fields``): many are optional."""
    for name, kind in types.items():
        if name in record and not kind.accepts(record[name]):
            raise field_error(where, index, name, record[name], kind.expected, fix)


def check_records(records: Iterable[Mapping[str, Any]], types: Mapping[str, FieldType], where: str, fix: str = "") -> None:
    for index, record in enumerate(records):
        check_record(record, types, where, index, fix)
