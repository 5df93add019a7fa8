"""Competition-math DataModules: DeepScaleR-style training sets and the eval suites.

Every row is ``{"prompt", "answer", "dataset", "problem"}``: ``prompt`` is the problem plus the
boxed-answer instruction (the user message; TandemModule applies the chat template), ``answer``
is what ``MathVerifier`` grades against — a string, or a list of acceptable strings.

The eval sets differ in field names and answer types; ``math_row`` normalises them (see
../shared/data/README.md): the problem is ``problem`` or ``question``; the answer is ``answer``
or ``final_answer``, else the last ``\\boxed{}`` of ``solution`` (Minerva); AMC floats become
integers (``27.0`` -> ``"27"``); one-element lists are unwrapped and trailing newlines and
``$`` delimiters stripped; a list with several entries stays a list of alternatives, except
OlympiadBench's ``is_multiple_answer`` lists, which are joined (all values are required).

Each known eval set loads from a local data folder (``root``, in the ../shared/data layout),
from a file or folder given in ``sources``, or from its hub id through ``datasets.load_dataset``:

    aime24         HuggingFaceH4/aime_2024                       (split train)
    aime25         yentinglin/aime_2025                          (split train)
    amc23          zwhe99/amc23                                  (split test)
    math500        HuggingFaceH4/MATH-500                        (split test)
    minerva        math-ai/minervamath                           (split test)
    olympiadbench  Hothan/OlympiadBench, OE_TO_maths_en_COMP     (split train)
    deepscaler_{aime,amc,math,minerva,olympiad}: the DeepScaleR eval files, local only.

Prefer ``minerva`` to ``deepscaler_minerva``: in at least 29 of its 272 problems the DeepScaleR
``answer`` is the answer of an earlier subproblem quoted in the problem text (docs/math.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem_lit.data.base import EvalBatches, PromptDataModule, Split, held_out_split, read_records
from tandem_lit.data.fields import MATH_FIELDS
from tandem_lit.data.gsm8k import load_table
from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.columns import check_record, check_records
from tandem_lit.verifiers.math import extract_boxed

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROBLEM_FIELDS = ("problem", "question")
ANSWER_FIELDS = ("answer", "final_answer")
FIX_RECORD = "Fix that record of the file or drop it."


@dataclass(frozen=True)
class EvalSet:
    """Where a known eval set lives: paths under a data root (first that exists) and a hub id."""

    files: tuple[str, ...]
    hub: str | None = None
    hub_config: str | None = None
    hub_split: str = "test"


EVAL_SETS: dict[str, EvalSet] = {
    "aime24": EvalSet(("aime24/test.jsonl",), "HuggingFaceH4/aime_2024", hub_split="train"),
    "aime25": EvalSet(("aime25/test.jsonl",), "yentinglin/aime_2025", hub_split="train"),
    "amc23": EvalSet(("amc23/test.jsonl",), "zwhe99/amc23"),
    "math500": EvalSet(("math500/test.jsonl",), "HuggingFaceH4/MATH-500"),
    "minerva": EvalSet(("minerva_math/test.jsonl", "minerva/test.jsonl"), "math-ai/minervamath"),
    "olympiadbench": EvalSet(("olympiadbench/test.jsonl",), "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
    "deepscaler_aime": EvalSet(("deepscaler/test/aime.json",)),
    "deepscaler_amc": EvalSet(("deepscaler/test/amc.json",)),
    "deepscaler_math": EvalSet(("deepscaler/test/math.json",)),
    "deepscaler_minerva": EvalSet(("deepscaler/test/minerva.json",)),
    "deepscaler_olympiad": EvalSet(("deepscaler/test/olympiad_bench.json",)),
}


# -- normalisation ------------------------------------------------------------------------------


def clean_answer(value: Any) -> str | None:
    """One answer as a clean string: ``27.0`` -> ``"27"``, ``"$69$,$84$\\n"`` -> ``"69,84"``."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    text = str(value).strip().replace("\\$", "\0").replace("$", "").replace("\0", "\\$").strip()
    return text or None


def normalize_answer_field(value: Any, multiple_required: bool = False) -> str | list[str] | None:
    """The ``answer`` column: a string, or a list of alternatives (None if there is no answer)."""
    if not isinstance(value, (list, tuple)):
        return clean_answer(value)
    answers = list(dict.fromkeys(a for a in map(clean_answer, value) if a is not None))
    if not answers:
        return None
    if multiple_required and len(answers) > 1:
        return ", ".join(answers)
    return answers[0] if len(answers) == 1 else answers


def math_row(record: dict[str, Any], dataset: str, where: str, index: int, instruction: str) -> dict[str, Any]:
    """A prompt row from one eval/training record of any of the supported layouts."""
    problem = next((record[f] for f in PROBLEM_FIELDS if isinstance(record.get(f), str) and record[f].strip()), None)
    if problem is None:
        raise DataError(
            f"{where}: record {index} has no problem text in {' or '.join(map(repr, PROBLEM_FIELDS))} "
            f"(it has {sorted(record)}). Point the source at a math dataset with one of these fields."
        )
    if isinstance(record.get("context"), str) and record["context"].strip():  # OlympiadBench's shared preamble
        problem = f"{record['context'].strip()}\n\n{problem}"
    answer = None
    for field in ANSWER_FIELDS:
        if field in record:
            answer = normalize_answer_field(record[field], bool(record.get("is_multiple_answer")))
            break
    else:
        if isinstance(record.get("solution"), str):
            answer = normalize_answer_field(extract_boxed(record["solution"]))
    if answer is None:
        raise DataError(
            f"{where}: record {index} has no usable answer: no {' / '.join(map(repr, ANSWER_FIELDS))} field "
            f"(or it is empty) and no \\boxed{{}} answer in 'solution' (fields: {sorted(record)}). Add an "
            f"'answer' field to the file."
        )
    prompt = f"{problem.strip()}\n\n{instruction}" if instruction else problem.strip()
    return {"prompt": prompt, "answer": answer, "dataset": dataset, "problem": problem}


# -- loading ------------------------------------------------------------------------------------


def _unknown(name: str) -> DataError:
    return DataError(
        f"unknown math eval dataset {name!r}; known names: {', '.join(EVAL_SETS)}. For another file or hub "
        f"dataset, give its path as the name, or map a name to it with `sources` ({{name: path or hub id}})."
    )


def check_eval_name(name: str, sources: dict[str, str] | None = None) -> None:
    if name not in EVAL_SETS and name not in (sources or {}) and not Path(name).expanduser().exists():
        raise _unknown(name)


def load_eval_records(name: str, root: str | None = None, sources: dict[str, str] | None = None) -> tuple[str, list]:
    """(description of where it came from, raw records) for one eval set."""
    known = EVAL_SETS.get(name)
    source = (sources or {}).get(name)
    if source is None and known is None:
        if Path(name).expanduser().exists():
            source = name
        else:
            raise _unknown(name)
    if source is not None:
        path = Path(source).expanduser()
        if path.exists():
            return str(path), load_table(str(path), "test")
        hub_config = known.hub_config if known is not None and known.hub == source else None
        split = known.hub_split if known is not None and known.hub == source else "test"
        return f"{source} (hub, split {split})", load_table(source, split, hub_config=hub_config)
    if root is not None:
        base = Path(root).expanduser()
        if not base.is_dir():
            raise DataError(f"math data root {base} is not a folder; point `root` at a folder like ../shared/data")
        tried = [*known.files, f"{name}/test.jsonl", f"{name}/test.json", f"{name}.jsonl", f"{name}.json"]
        for relative in tried:
            if (base / relative).is_file():
                return str(base / relative), read_records(base / relative)
        raise DataError(f"no file for eval set {name!r} under {base} (tried {', '.join(dict.fromkeys(tried))})")
    if known.hub is None:
        raise DataError(f"eval set {name!r} has no hub copy; pass `root` (a folder holding {known.files[0]})")
    return f"{known.hub} (hub, split {known.hub_split})", load_table(known.hub, known.hub_split, known.hub_config)


def dataset_name(entry: str) -> str:
    """Short name of a ``datasets`` entry: itself, or a file's stem / a folder's name for a path."""
    if entry in EVAL_SETS:
        return entry
    path = Path(entry)
    return path.stem if path.suffix else path.name


def load_eval_rows(
    name: str,
    root: str | None = None,
    sources: dict[str, str] | None = None,
    limit: int | None = None,
    instruction: str = BOXED_INSTRUCTION,
) -> list[dict[str, Any]]:
    where, records = load_eval_records(name, root, sources)
    records = records[:limit]
    check_records(records, MATH_FIELDS, where, FIX_RECORD)
    short = dataset_name(name)
    return [math_row(record, short, where, i, instruction) for i, record in enumerate(records)]


# -- DataModules --------------------------------------------------------------------------------


class MathEvalDataModule(PromptDataModule):
    """Eval suites for ``tandem-lit test``: one test dataloader per dataset, in the given order
    (Lightning passes ``dataloader_idx`` to ``test_step``; ``dataset_names[idx]`` names it).

    Args:
        datasets: Known names (aime24, aime25, amc23, math500, minerva, olympiadbench,
            deepscaler_{aime,amc,math,minerva,olympiad}) or paths to JSON/JSONL files.
        root: Local data folder in the ../shared/data layout; None loads known sets from the hub.
        sources: Per-name override: a file, a folder with test.jsonl, or a hub id.
        limit: Use only the first N problems of each set.
        instruction: Appended to each problem after a blank line ("" for none).
        batch_size: Prompts per batch.
        eval_batch_size: Prompts per test batch (default: batch_size).
        seed: Unused by the eval order (it is the file order); kept for the shared base class.
    """

    def __init__(
        self,
        datasets: list[str],
        root: str | None = None,
        sources: dict[str, str] | None = None,
        limit: int | None = None,
        instruction: str = BOXED_INSTRUCTION,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed)
        if not datasets:
            raise ConfigError(f"MathEvalDataModule needs at least one dataset; known names: {', '.join(EVAL_SETS)}")
        for name in datasets:
            check_eval_name(name, sources)
        names = [dataset_name(d) for d in datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"datasets {datasets} name the same set twice")
        if limit is not None and limit < 1:
            raise ConfigError(f"limit must be >= 1 (or null for all), got {limit}")
        self.datasets = list(datasets)
        self.root = root
        self.sources = dict(sources or {})
        self.limit = limit
        self.instruction = instruction
        self._per_set: dict[str, list[dict[str, Any]]] = {}

    @property
    def dataset_names(self) -> list[str]:
        return [dataset_name(d) for d in self.datasets]

    def rows_of(self, entry: str) -> list[dict[str, Any]]:
        if entry not in self._per_set:
            self._per_set[entry] = load_eval_rows(entry, self.root, self.sources, self.limit, self.instruction)
        return self._per_set[entry]

    def load_split(self, split: Split) -> list[dict[str, Any]]:
        if split != "test":
            raise ConfigError(
                f"MathEvalDataModule only has a test split (asked for {split!r}); train with DeepScaleRDataModule, "
                f"whose held-out slice is the validation split"
            )
        return [row for entry in self.datasets for row in self.rows_of(entry)]

    def test_dataloader(self) -> list[EvalBatches]:
        return [EvalBatches(self.rows_of(entry), self.eval_batch_size) for entry in self.datasets]

    def predict_dataloader(self) -> list[EvalBatches]:
        return self.test_dataloader()


class DeepScaleRDataModule(PromptDataModule):
    """DeepScaleR-style RL training problems (problem + answer), with a seeded held-out slice as
    the validation split (checkpoint selection by pass@k) and optional eval sets as the test split.

    Args:
        source: Hub name (``agentica-org/DeepScaleR-Preview-Dataset``), a JSON/JSONL file, or a
            folder of them (e.g. ../shared/data/deepscaler/train).
        files: Files to read from a ``source`` folder (default: every .json/.jsonl in it), or
            ``data_files`` for a hub source.
        val_size: Problems held out of training (seeded) for validation.
        train_limit: Use only the first N training problems (after the held-out slice).
        eval_datasets: Eval sets for the test split (names/paths as in MathEvalDataModule).
        eval_root: Local data folder for the eval sets (None: hub).
        eval_sources: Per-name overrides for the eval sets.
        eval_limit: Use only the first N problems of each eval set.
        instruction: Appended to each problem after a blank line ("" for none).
        batch_size: Prompts per training step.
        eval_batch_size: Prompts per validation/test batch.
        seed: Seed of the training order and the held-out slice.
    """

    dataset_label = "deepscaler"  # the rows' ``dataset`` field

    def __init__(
        self,
        source: str = "agentica-org/DeepScaleR-Preview-Dataset",
        files: list[str] | None = None,
        val_size: int = 64,
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
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed)
        self.eval_data = (
            MathEvalDataModule(
                eval_datasets, eval_root, eval_sources, eval_limit, instruction, batch_size, eval_batch_size, seed
            )
            if eval_datasets
            else None
        )
        self.source = source
        self.files = list(files) if files else None
        self.val_size = val_size
        self.train_limit = train_limit
        self.instruction = instruction
        self._train_rows: list[dict[str, Any]] | None = None  # train + val, before the held-out split

    @property
    def dataset_names(self) -> list[str]:
        return self.eval_data.dataset_names if self.eval_data is not None else []

    def _records(self) -> list[tuple[str, int, dict[str, Any]]]:
        """(where, index in its file, record) for every training record; repeated problems dropped."""
        path = Path(self.source).expanduser()
        if path.is_dir():
            names = self.files or sorted(p.name for p in path.iterdir() if p.suffix in (".json", ".jsonl"))
            if not names:
                raise DataError(f"training folder {path} holds no .json/.jsonl files; pass `files`")
            found = [(str(path / n), i, r) for n in names for i, r in enumerate(read_records(path / n))]
        elif path.is_file():
            found = [(str(path), i, r) for i, r in enumerate(read_records(path))]
        elif self.source.startswith((".", "/", "~")) or self.source.count("/") > 1:
            raise DataError(f"training source {self.source} does not exist; give a folder, a file, or a hub name")
        else:
            import datasets

            try:
                table = datasets.load_dataset(self.source, data_files=self.files, split="train")
            except (OSError, ValueError, ConnectionError) as err:  # DatasetNotFoundError is a FileNotFoundError
                raise DataError(
                    f"could not load training dataset {self.source!r} from the hub: "
                    f"{str(err).splitlines()[0] if str(err) else type(err).__name__}. Check the name and that the "
                    "hub is reachable, or give a local folder/file."
                ) from None
            found = [(f"{self.source} (hub)", i, dict(r)) for i, r in enumerate(table)]
        for where, index, record in found:  # wrong types end the run: only records without an answer are skipped
            check_record(record, MATH_FIELDS, where, index, FIX_RECORD)
        unique: dict[str, tuple[str, int, dict[str, Any]]] = {}
        for where, index, record in found:
            key = next((str(record[f]).strip() for f in PROBLEM_FIELDS if record.get(f)), f"{where}#{index}")
            unique.setdefault(key, (where, index, record))
        return list(unique.values())

    def _training_rows(self) -> list[dict[str, Any]]:
        if self._train_rows is not None:
            return self._train_rows
        rows, skipped = [], []
        for where, index, record in self._records():
            try:
                rows.append(math_row(record, self.dataset_label, where, index, self.instruction))
            except DataError as err:  # a training problem without an answer cannot be rewarded: leave it out
                skipped.append(str(err))
        if not rows:
            raise DataError(
                f"no usable training rows in {self.source}; first problem: {skipped[0] if skipped else '-'}"
            )
        if skipped:
            warnings.warn(
                f"DeepScaleRDataModule skipped {len(skipped)} record(s) without an answer; first: {skipped[0]}",
                stacklevel=2,
            )
        self._train_rows = rows
        return rows

    def load_split(self, split: Split) -> list[dict[str, Any]]:
        if split == "test":
            if self.eval_data is None:
                raise ConfigError("DeepScaleRDataModule has no test split: set eval_datasets (e.g. [aime24, amc23])")
            return self.eval_data.load_split("test")
        train, val = held_out_split(self._training_rows(), self.val_size, self.seed)
        return val if split == "val" else train[: self.train_limit]

    def test_dataloader(self) -> list[EvalBatches]:
        if self.eval_data is None:
            raise ConfigError("DeepScaleRDataModule has no test split: set eval_datasets (e.g. [aime24, amc23])")
        return self.eval_data.test_dataloader()
