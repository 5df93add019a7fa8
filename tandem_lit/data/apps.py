"""Code problems with unit tests (APPS and the DeepCoder sets) for ``CodeVerifier``.

Every row is ``{"prompt", "tests", "dataset", "problem"}``: ``prompt`` is the statement, the
starter code if the problem has one, and the answer-format instruction; ``tests`` is the
verifier's normalised test column (``tandem_lit.verifiers.code``: stdin/stdout cases, call-based
cases with a function name, or a functional ``check(candidate)``).

Sources (a file, a folder of files, or a hub name), recognised by their fields:

    APPS, hub layout      codeparrot/apps: question, input_output (JSON), starter_code, difficulty
    APPS, MapCoder file   ../shared/data/apps/test.jsonl: description, test_list, starter_code
    DeepCoder files       ../shared/data/deepcoder_code/{train,test}/*.json: problem, tests

Repeated problems are dropped (the MapCoder APPS file holds 128 distinct problems in 150 rows).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tandem_lit.data.base import PromptDataModule, Split, held_out_split, read_records
from tandem_lit.data.fields import CODE_FIELDS
from tandem_lit.data.gsm8k import load_table, table_name
from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.columns import check_record

CODE_INSTRUCTION = (
    "Write a solution in Python 3. Put the complete program in a single ```python code block at the end of "
    "your answer."
)
STDIN_NOTE = "The program reads the input from standard input and prints the answer to standard output."


def code_row(record: dict[str, Any], dataset: str, where: str, index: int, instruction: str) -> dict[str, Any]:
    """A prompt row from one record of any supported layout (the tests normalised by the verifier's
    own functions, so that data and grading agree on the format)."""
    from tandem_lit.verifiers.code import apps_tests, deepcoder_tests

    problem = next((record[f] for f in ("question", "description", "problem") if isinstance(record.get(f), str)), None)
    if problem is None or not problem.strip():
        raise DataError(
            f"{where}: record {index} has no problem statement in 'question', 'description' or 'problem' "
            f"(fields: {sorted(record)}). Point the source at APPS or DeepCoder-style files."
        )
    if "test_list" in record or "input_output" in record:
        tests = apps_tests(record)
    elif "tests" in record:
        tests = deepcoder_tests(record)
    else:
        raise DataError(
            f"{where}: record {index} has no tests ('test_list', 'input_output' or 'tests'; fields: "
            f"{sorted(record)}): a code problem without tests cannot be rewarded. Drop it or add its tests."
        )
    starter = str(record.get("starter_code") or "").strip()
    parts = [problem.strip()]
    if starter and starter not in problem:
        parts.append(f"Complete this starter code:\n```python\n{starter}\n```")
    if tests["kind"] == "stdio":
        parts.append(STDIN_NOTE)
    if instruction:
        parts.append(instruction)
    return {"prompt": "\n\n".join(parts), "tests": tests, "dataset": dataset, "problem": problem.strip()}


def problem_key(record: dict[str, Any]) -> str:
    for field in ("problem_id", "id", "question", "description", "problem"):
        if record.get(field) not in (None, ""):
            return f"{field}:{record[field]}"
    return repr(sorted(record.items()))[:200]


class APPSDataModule(PromptDataModule):
    """Code problems with tests for RL (``CodeVerifier`` rewards), a seeded held-out slice as
    validation, and optional eval sets as the test split (one test dataloader per set).

    Args:
        source: Hub name (``codeparrot/apps``), a JSON/JSONL file, or a folder of them.
        files: Files to read from a ``source`` folder (default: every .json/.jsonl in it).
        hub_split: Split of a hub ``source`` (training and validation rows).
        eval_split: Split of hub ``eval_sources``.
        difficulties: Keep only these APPS difficulties (``introductory``, ``interview``,
            ``competition``); None keeps all (records without the field are kept).
        val_size: Problems held out of training (seeded) for validation.
        train_limit: Use only the first N training problems (after the held-out slice).
        eval_sources: {name: file, folder or hub name} of the test split's sets.
        eval_limit: Use only the first N problems of each eval set.
        instruction: The answer-format instruction at the end of each prompt ("" for none).
        batch_size: Prompts per training step.
        eval_batch_size: Prompts per validation/test batch.
        seed: Seed of the training order and the held-out slice.
    """

    def __init__(
        self,
        source: str = "codeparrot/apps",
        files: list[str] | None = None,
        hub_split: str = "train",
        eval_split: str = "test",
        difficulties: list[str] | None = None,
        val_size: int = 32,
        train_limit: int | None = None,
        eval_sources: dict[str, str] | None = None,
        eval_limit: int | None = None,
        instruction: str = CODE_INSTRUCTION,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed)
        if eval_limit is not None and eval_limit < 1:
            raise ConfigError(f"eval_limit must be >= 1 (or null for all), got {eval_limit}")
        self.source = source
        self.files = list(files) if files else None
        self.hub_split = hub_split
        self.eval_split = eval_split
        self.difficulties = list(difficulties) if difficulties else None
        self.val_size = val_size
        self.train_limit = train_limit
        self.eval_sources = dict(eval_sources or {})
        self.eval_limit = eval_limit
        self.instruction = instruction
        self._train_rows: list[dict[str, Any]] | None = None
        self._eval_rows: dict[str, list[dict[str, Any]]] = {}

    @property
    def dataset_names(self) -> list[str]:
        return list(self.eval_sources)

    def _read(self, source: str, split: str, files: list[str] | None = None) -> list[tuple[str, int, dict[str, Any]]]:
        path = Path(source).expanduser()
        if path.is_dir():
            names = files or sorted(p.name for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
            if not names:
                raise DataError(f"code data folder {path} holds no .json/.jsonl files; pass `files`")
            return [(str(path / n), i, r) for n in names for i, r in enumerate(read_records(path / n))]
        records = load_table(source, split)
        return [(table_name(source, split), i, r) for i, r in enumerate(records)]

    def _load_rows(self, source: str, dataset: str, split: str, files: list[str] | None = None) -> list[dict[str, Any]]:
        unique: dict[str, tuple[str, int, dict[str, Any]]] = {}
        for where, index, record in self._read(source, split, files):
            # wrong types end the run; only problems without usable tests are skipped (below)
            check_record(record, CODE_FIELDS, where, index, "Fix that record of the file or drop it.")
            if self.difficulties is None or record.get("difficulty", self.difficulties[0]) in self.difficulties:
                unique.setdefault(problem_key(record), (where, index, record))
        rows, skipped = [], []
        for where, index, record in unique.values():
            try:
                rows.append(code_row(record, dataset, where, index, self.instruction))
            except DataError as err:  # a problem without usable tests cannot be rewarded: leave it out, loudly
                skipped.append(str(err))
        if not rows:
            raise DataError(f"no usable code problems in {source}; first problem: {skipped[0] if skipped else '-'}")
        if skipped:
            warnings.warn(f"{type(self).__name__} skipped {len(skipped)} problem(s) of {source}; first: {skipped[0]}", stacklevel=2)
        return rows

    def eval_rows(self, name: str) -> list[dict[str, Any]]:
        if name not in self._eval_rows:
            self._eval_rows[name] = self._load_rows(self.eval_sources[name], name, self.eval_split)[: self.eval_limit]
        return self._eval_rows[name]

    def load_split(self, split: Split) -> list[dict[str, Any]]:
        if split == "test":
            if not self.eval_sources:
                raise ConfigError("APPSDataModule has no test split: set eval_sources ({name: file or hub name})")
            return [row for name in self.eval_sources for row in self.eval_rows(name)]
        if self._train_rows is None:
            self._train_rows = self._load_rows(self.source, "apps", self.hub_split, self.files)
        train, val = held_out_split(self._train_rows, self.val_size, self.seed)
        return val if split == "val" else train[: self.train_limit]

    def test_dataloader(self):
        from tandem_lit.data.base import EvalBatches

        if not self.eval_sources:
            raise ConfigError("APPSDataModule has no test split: set eval_sources ({name: file or hub name})")
        return [EvalBatches(self.eval_rows(name), self.eval_batch_size) for name in self.eval_sources]
