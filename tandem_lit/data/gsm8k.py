"""GSM8K (Cobbe et al., 2021): grade-school word problems, answer after ``####``.

Reads a local folder with ``train.jsonl``/``test.jsonl`` (the openai/grade-school-math layout,
as in ../shared/data/gsm8k), a single JSONL file, or a hub dataset name (``openai/gsm8k``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem_lit.data.base import PromptDataModule, Split, held_out_split, read_records, require_fields
from tandem_lit.data.fields import GSM8K_QUESTION, GSM8K_SOLUTION, template_fields, template_types
from tandem_lit.errors import DataError
from tandem_lit.paths import looks_local, missing_path_message
from tandem_lit.verifiers.columns import check_records


def local_table(source: str, split: str) -> Path | None:
    """The local file ``load_table`` reads for ``split`` (None: ``source`` is a hub name)."""
    path = Path(source).expanduser()
    if path.is_dir():
        for name in (f"{split}.jsonl", f"{split}.json"):
            if (path / name).exists():
                return path / name
        raise DataError(f"dataset folder {path} has no {split}.jsonl or {split}.json")
    return path if path.is_file() else None


def table_name(source: str, split: str) -> str:
    """Where ``load_table``'s rows come from, for messages: the file, or the hub dataset."""
    local = local_table(source, split)
    return str(local) if local is not None else f"{source} (hub, split {split})"


def load_table(source: str, split: str, hub_config: str | None = None) -> list[dict[str, Any]]:
    """Rows of ``split`` from a local folder (``<split>.jsonl`` / ``<split>.json``), a file, or the hub."""
    local = local_table(source, split)
    if local is not None:
        return read_records(local)
    if looks_local(source):
        raise DataError(missing_path_message(source, "dataset path"))
    try:
        import datasets
    except ImportError as err:  # a core dependency; only a broken install lands here
        raise ImportError("loading datasets from the hub needs the `datasets` package: pip install datasets") from err
    try:
        rows = [dict(r) for r in datasets.load_dataset(source, hub_config, split=split)]
    except (OSError, ValueError, ConnectionError) as err:  # DatasetNotFoundError is a FileNotFoundError
        raise DataError(
            f"could not load dataset {source!r} (split {split!r}) from the hub: {str(err).splitlines()[0] if str(err) else type(err).__name__}. "
            "Check the name and that the hub is reachable, or give a local folder/file."
        ) from err
    if not rows:
        raise DataError(f"dataset {source!r} has no rows in split {split!r}")
    return rows


def final_answer(solution: str) -> str:
    """The number after a GSM8K solution's ``####``; a solution without one is not GSM8K data."""
    if "####" not in solution:
        raise DataError(f"GSM8K solution has no '#### <number>' final answer: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip()


class GSM8KDataModule(PromptDataModule):
    """GSM8K prompts with the final number as ``answer`` (for ``GSM8KVerifier``).

    Args:
        source: Local folder or file, or hub name (``openai/gsm8k``).
        prompt_template: Format string over the row's fields (``{question}``).
        val_size: Rows held out of the training split (seeded) for validation.
        train_limit: Use only the first N training rows (after the held-out slice).
        test_limit: Use only the first N test rows.
        question_field: Field holding the problem text.
        answer_field: Field holding the solution that ends with ``#### <number>``.
        batch_size: Prompts per training step.
        eval_batch_size: Prompts per validation/test batch.
        seed: Seed of the training order and the held-out slice.
    """

    def __init__(
        self,
        source: str = "openai/gsm8k",
        prompt_template: str = "Question: {question}\nAnswer:",
        val_size: int = 100,
        train_limit: int | None = None,
        test_limit: int | None = None,
        question_field: str = "question",
        answer_field: str = "answer",
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed)
        self.source = source
        self.prompt_template = prompt_template
        self.val_size = val_size
        self.train_limit = train_limit
        self.test_limit = test_limit
        self.question_field = question_field
        self.answer_field = answer_field

    def load_split(self, split: Split) -> list[dict[str, Any]]:
        if split == "test":
            rows = self._read("test")[: self.test_limit]
        else:
            train, val = held_out_split(self._read("train"), self.val_size, self.seed)
            rows = val if split == "val" else train[: self.train_limit]
        return [self._row(r) for r in rows]

    def _read(self, split: str) -> list[dict[str, Any]]:
        rows = load_table(self.source, split, hub_config="main")
        require_fields(
            rows, [self.question_field, self.answer_field], f"GSM8K {split} split of {self.source}",
            "Point `source` at GSM8K-format data or set question_field/answer_field to your field names.",
        )
        types = {
            **template_types(template_fields(self.prompt_template, "prompt_template")),
            self.question_field: GSM8K_QUESTION, self.answer_field: GSM8K_SOLUTION,
        }
        check_records(rows, types, table_name(self.source, split), "Fix that row of the file or drop it.")
        return rows

    def _row(self, record: dict[str, Any]) -> dict[str, Any]:
        solution = str(record[self.answer_field])
        question = record[self.question_field]
        return {
            "prompt": self.prompt_template.format(**{**record, "question": question}),
            "question": question,
            "answer": final_answer(solution),
            "solution": solution,
        }
