"""The type of every field the shipped data modules read, in one place.

Each module checks the records it reads against its table here when it loads them, so a field of
the wrong type ends the run with one line naming the file, the row, the field and what was found
(``tandem_lit.verifiers.columns``), instead of training on its printed form. A field a table
does not name is not read. Absent fields are reported by the readers (``require_fields``, or
the module's own "has no problem text" lines); ``null`` is accepted only where the reader treats
it as absent.
"""

from __future__ import annotations

import re
import string

from tandem_lit.errors import ConfigError
from tandem_lit.verifiers.columns import BOOLEAN, INTEGER, NULL, NUMBER, OBJECT, TEXT, FieldType, list_of

# The rows every data module serves: the prompt is text (the chat template and the tokenizer read it).
ROW_FIELDS = {"prompt": TEXT}

# GSM8K (and its SFT preset): the roles; the modules map them to question_field / answer_field.
# Fields a prompt or target template names are text too (``template_types``).
GSM8K_QUESTION = TEXT
GSM8K_SOLUTION = TEXT  # the worked solution ending "#### <number>"

# A math answer: text, a number (AMC stores 27.0), or a list of alternatives; null means "none"
# (the record is skipped in training, an error in evaluation).
MATH_ANSWER = TEXT | NUMBER | list_of(TEXT | NUMBER, "a list of strings or numbers") | NULL

MATH_FIELDS: dict[str, FieldType] = {
    "problem": TEXT | NULL,
    "question": TEXT | NULL,
    "context": TEXT | NULL,  # OlympiadBench's shared preamble
    "answer": MATH_ANSWER,
    "final_answer": MATH_ANSWER,
    "solution": TEXT | list_of(TEXT) | NULL,  # read (for its last \boxed{}) only when a string and no answer field
    "is_multiple_answer": BOOLEAN | NULL,
}

HARP_FIELDS: dict[str, FieldType] = {
    **MATH_FIELDS,
    "year": TEXT | INTEGER,  # "2021_Fall" or 2021
    "contest": TEXT,
    "num_solutions": INTEGER,
    "level": INTEGER | NULL,
    "number": INTEGER | TEXT | NULL,
}

# One stdin/stdout case of APPS's MapCoder file and of Codeforces (DeepCoder).
def _is_case(value) -> bool:
    return isinstance(value, dict) and "input" in value and "output" in value


_CASE = FieldType("an object with 'input' and 'output'", _is_case)
_IDENT = TEXT | INTEGER | NULL

CODE_FIELDS: dict[str, FieldType] = {
    "question": TEXT | NULL,  # APPS hub
    "description": TEXT | NULL,  # APPS, MapCoder's file
    "problem": TEXT | NULL,  # DeepCoder
    "starter_code": TEXT | NULL,
    "difficulty": TEXT | NULL,
    "input_output": TEXT | OBJECT,  # APPS hub: JSON text of {inputs, outputs, fn_name?}
    "test_list": list_of(_CASE, "a list of objects with 'input' and 'output'"),
    "tests": list_of(_CASE, "a list of objects with 'input' and 'output'") | OBJECT,  # DeepCoder
    "id": _IDENT,
    "problem_id": _IDENT,
    "name": _IDENT,
}


def template_fields(template: str, name: str) -> list[str]:
    """The row fields a format string reads (``{question}`` -> ``question``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ConfigError(f"{name} {template!r} is not a valid format string ({err}); write fields as {{field}}") from None
    fields = [re.split(r"[.\[]", field)[0] for _, field, _, _ in parsed if field is not None]
    if "" in fields:
        raise ConfigError(f"{name} {template!r} has an empty {{}}: name the row field, e.g. {{question}}")
    return list(dict.fromkeys(fields))


def template_types(fields: list[str]) -> dict[str, FieldType]:
    """A prompt or target template prints the fields it names: each must be text."""
    return {name: TEXT for name in fields}
