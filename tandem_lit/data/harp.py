"""HARP (Yue et al. 2024): competition problems with several human-written solution paths, the
training set of the extension's elegance experiment (seed 000, "Extension 3").

The data ships zipped on purpose (to keep it out of web crawls); it is read in place, never
unzipped to disk. Filters, as the extension describes them:

- several solution paths (``min_solutions``, default 2): a problem with one path gives the
  policy no choice between an elegant and a bashy argument;
- AIME-level (``contests``, default every AIME contest: AIME, AIME_I, AIME_II);
- no year that the evaluation sets cover (``exclude_years``, default 2023-2025: AMC 2023,
  AIME 2024 and 2025), so that training never sees a test problem.

With the defaults the stored copy gives 694 problems. The extension kept 374: it also had its
judge label every reference path and kept problems with both kinds, a selection that needs the
judge (docs/elegance.md); ``limit`` or your own filtered file reproduce a smaller set.
"""

from __future__ import annotations

import re
from typing import Any

from tandem_lit.data.base import read_records
from tandem_lit.data.fields import HARP_FIELDS as HARP_TYPES
from tandem_lit.data.math import BOXED_INSTRUCTION, FIX_RECORD, DeepScaleRDataModule
from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.columns import check_records

HARP_FIELDS = ("problem", "answer", "year", "contest", "num_solutions")


def harp_year(record: dict[str, Any]) -> int:
    """The year of a HARP record (``"2021_Fall"`` is 2021)."""
    match = re.match(r"\s*(\d{4})", str(record.get("year", "")))
    if match is None:
        raise DataError(f"HARP record {record.get('contest')} #{record.get('number')} has no year: {record.get('year')!r}")
    return int(match.group(1))


def keep_harp(record: dict[str, Any], contests: list[str], min_solutions: int, exclude_years: set[int], levels: list[int] | None) -> bool:
    return (
        any(record["contest"].startswith(c) for c in contests)
        and int(record["num_solutions"]) >= min_solutions
        and harp_year(record) not in exclude_years
        and (levels is None or int(record.get("level", 0)) in levels)
    )


class HARPDataModule(DeepScaleRDataModule):
    """HARP problems for RL (boxed-answer rewards, e.g. with an elegance bonus), a seeded held-out
    slice as validation, optional eval sets as the test split.

    Args:
        source: The HARP file: ``HARP.jsonl.zip`` (read zipped) or a JSONL file with HARP's fields.
        contests: Keep contests whose name starts with one of these (``AIME`` keeps AIME, AIME_I, AIME_II).
        min_solutions: Keep problems with at least this many human solution paths.
        exclude_years: Drop problems from these years (those of the eval sets).
        levels: Keep only these HARP difficulty levels (1-6; None: all).
        val_size, train_limit, eval_datasets, eval_root, eval_sources, eval_limit, instruction,
        batch_size, eval_batch_size, seed: as in ``DeepScaleRDataModule``.
    """

    dataset_label = "harp"

    def __init__(
        self,
        source: str,
        contests: list[str] | None = None,
        min_solutions: int = 2,
        exclude_years: list[int] | None = None,
        levels: list[int] | None = None,
        val_size: int = 32,
        train_limit: int | None = None,
        eval_datasets: list[str] | None = None,
        eval_root: str | None = None,
        eval_sources: dict[str, str] | None = None,
        eval_limit: int | None = None,
        instruction: str = BOXED_INSTRUCTION,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__(
            source=source, val_size=val_size, train_limit=train_limit, eval_datasets=eval_datasets,
            eval_root=eval_root, eval_sources=eval_sources, eval_limit=eval_limit, instruction=instruction,
            batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed,
        )
        if min_solutions < 1:
            raise ConfigError(f"min_solutions must be >= 1, got {min_solutions}")
        self.contests = list(contests) if contests is not None else ["AIME"]
        self.min_solutions = min_solutions
        self.exclude_years = list(exclude_years) if exclude_years is not None else [2023, 2024, 2025]
        self.levels = list(levels) if levels is not None else None

    def _records(self) -> list[tuple[str, int, dict[str, Any]]]:
        records = read_records(self.source)
        missing = [f for f in HARP_FIELDS if f not in records[0]]
        if missing:
            raise DataError(
                f"{self.source} is not HARP: its records lack {missing} (they have {sorted(records[0])}). Point "
                "`source` at HARP.jsonl.zip from github.com/aadityasingh/HARP, or use DeepScaleRDataModule for "
                "problem/answer files"
            )
        check_records(records, HARP_TYPES, self.source, FIX_RECORD)
        years = set(self.exclude_years)
        kept = [(self.source, i, r) for i, r in enumerate(records) if keep_harp(r, self.contests, self.min_solutions, years, self.levels)]
        if not kept:
            raise DataError(
                f"no HARP problem passes the filters (contests {self.contests}, at least {self.min_solutions} "
                f"solutions, years not in {sorted(years)}, levels {self.levels}); loosen them"
            )
        return kept
