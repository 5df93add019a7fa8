"""Verifier: grades completions. One object serves training rewards and evaluation.

``__call__`` returns rewards for RL; ``evaluate`` returns correctness for pass@k. Both go
through ``grade_batch``, so training and evaluation can never grade differently.
A verifier names the dataset columns it needs (``required_columns``) and what each must hold
(``column_types``); rows without them, or with a value of another type, raise an error that
names the row and the field instead of rewarding zero, before the first step (``check_rows``)
and for every batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from tandem_lit.errors import MissingColumnError
from tandem_lit.verifiers.columns import FieldType, check_record


@dataclass(frozen=True)
class Grade:
    """The verdict on one completion."""

    correct: bool
    reward: float
    extracted: str | None = None  # the answer the verifier read from the completion
    # Per-completion measurements a verifier wants logged, e.g. {"tests_passed_fraction": 0.5} or, on
    # correct solutions only, {"elegance_rate": 1.0}. Each becomes a metric: the mean over the
    # completions that carry it (train/<name>, eval/<mode>_<name>); see ``label_means``.
    labels: dict[str, float] = field(default_factory=dict)


def label_means(grades: Sequence[Grade]) -> dict[str, tuple[float, int]]:
    """{label: (mean over the grades that carry it, how many carry it)}. A label set only on some
    grades (elegance only on correct solutions) is averaged over those only."""
    sums: dict[str, list[float]] = {}
    for grade in grades:
        for name, value in grade.labels.items():
            total = sums.setdefault(name, [0.0, 0])
            total[0] += float(value)
            total[1] += 1
    return {name: (total / count, count) for name, (total, count) in sums.items()}


class Verifier(ABC):
    """Base class. Subclasses implement ``grade`` (one completion) and set ``required_columns``."""

    required_columns: tuple[str, ...] = ()
    column_types: dict[str, FieldType] = {}  # what a required column must hold (tandem_lit.verifiers.columns)

    @abstractmethod
    def grade(self, completion: str, **columns: Any) -> Grade:
        """Grade one completion given its dataset row's columns (e.g. ``answer``)."""

    def grade_batch(self, completions: Sequence[str], **columns: Sequence[Any]) -> list[Grade]:
        """Grade many completions; subclasses may parallelise. Columns are lists, one per completion."""
        self.check_columns(columns, len(completions))
        return [
            self.grade(completion, **{name: values[i] for name, values in columns.items()})
            for i, completion in enumerate(completions)
        ]

    def __call__(self, completions: Sequence[str], **columns: Sequence[Any]) -> Tensor:  # -> [N] float
        return torch.tensor([g.reward for g in self.grade_batch(completions, **columns)], dtype=torch.float32)

    def evaluate(self, completions: Sequence[str], **columns: Sequence[Any]) -> list[bool]:
        return [g.correct for g in self.grade_batch(completions, **columns)]

    def check_columns(self, columns: dict[str, Sequence[Any]], count: int) -> None:
        self._require_columns(columns, "the batch")
        for name, values in columns.items():
            if len(values) != count:
                raise ValueError(f"column {name!r} has {len(values)} values for {count} completions")
        batch = [{name: values[i] for name, values in columns.items() if name in self.column_types} for i in range(count)]
        for i, row in enumerate(batch):
            check_record(row, self.column_types, f"the batch {type(self).__name__} grades", i, self._type_fix())

    def check_rows(self, rows: Sequence[dict[str, Any]], where: str) -> None:
        """Before the first step: every row has the columns this verifier grades, of its types."""
        for i, row in enumerate(rows):
            self._require_columns(row, f"{where}: row {i}")
            check_record(row, self.column_types, where, i, self._type_fix())

    def _require_columns(self, fields, where: str) -> None:
        """One line naming the first field this verifier grades that ``fields`` lacks."""
        missing = [name for name in self.required_columns if name not in fields]
        if missing:
            raise MissingColumnError(
                f"{where} has no field {missing[0]!r}, which {type(self).__name__} grades (it has {sorted(fields)}). "
                f"Map your dataset's field to {missing[0]!r} in the DataModule (e.g. its answer_field option) or pick "
                f"a verifier that matches the data."
            )

    def _type_fix(self) -> str:
        return f"{type(self).__name__} grades this column: fix that row of the data or pick a verifier that matches it"

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"
