"""PromptDataModule: serves batches of prompt rows.

A row is a dict with a ``prompt`` (the user's text; the module applies the tokenizer's chat
template when configured) plus the columns the verifier needs (``answer``, ...). Batches are
plain lists of rows. The training order is a seeded shuffle per epoch and resumes exactly: the
loader's position counts batches the module has finished, not batches prefetched.
"""

from __future__ import annotations

import json
import random
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L

from tandem_lit.data.fields import ROW_FIELDS
from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.columns import check_records

Split = Literal["train", "val", "test"]


class PromptRows:
    """One batch of rows, tagged with where it came from so the module can mark it consumed.

    Deliberately not a ``list``: Lightning moves a batch to the device by rebuilding every list
    it finds (``type(batch)(items)``), which would drop the tags, so that the loader's position
    never moved and every step drew the seeds of step 0. A plain object passes through as is.
    """

    def __init__(self, rows: list[dict[str, Any]], source: SeededBatches | None = None, epoch: int = 0, index: int = 0):
        self.rows = list(rows)
        self.source = source
        self.epoch = epoch
        self.index = index

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __eq__(self, other: object) -> bool:
        return self.rows == (other.rows if isinstance(other, PromptRows) else other)

    def __repr__(self) -> str:
        return f"PromptRows({len(self.rows)} rows, epoch={self.epoch}, index={self.index})"

    def mark_consumed(self) -> None:
        if self.source is not None:
            self.source.consumed(self)


class SeededBatches:
    """Batches of rows in a seeded order, reshuffled each epoch; a resumable training loader.

    Lightning saves ``state_dict()`` in checkpoints and calls ``load_state_dict`` before it
    iterates again, so a resumed run sees exactly the batches the uninterrupted run would have.
    """

    def __init__(self, rows: list[dict[str, Any]], batch_size: int, seed: int, shuffle: bool = True):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if len(rows) < batch_size:
            raise ConfigError(f"the training split has {len(rows)} rows, fewer than one batch of {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # batches of this epoch the module has finished

    def __len__(self) -> int:
        return len(self.rows) // self.batch_size  # the last partial batch is dropped

    def order(self, epoch: int) -> list[int]:
        index = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(index)
        return index

    def __iter__(self) -> Iterator[PromptRows]:
        epoch, start = self.epoch, self.position
        if start >= len(self):  # the previous epoch was finished: begin the next one
            epoch, start = epoch + 1, 0
        order = self.order(epoch)
        for b in range(start, len(self)):
            picked = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield PromptRows([self.rows[i] for i in picked], self, epoch, b)

    def consumed(self, batch: PromptRows) -> None:
        self.epoch, self.position = batch.epoch, batch.index + 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "rows": len(self.rows), "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("rows") != len(self.rows) or state.get("seed") != self.seed:
            raise ConfigError(
                f"the checkpoint's training data ({state.get('rows')} rows, seed {state.get('seed')}) differs from "
                f"this run's ({len(self.rows)} rows, seed {self.seed}); resume with the same data settings"
            )
        self.epoch, self.position = state["epoch"], state["position"]


class EvalBatches:
    """Consecutive batches of an evaluation split (not a list: Lightning reads a list of loaders
    as several dataloaders)."""

    def __init__(self, rows: list[dict[str, Any]], batch_size: int):
        self.batches = [PromptRows(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]

    def __iter__(self) -> Iterator[PromptRows]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class PromptDataModule(L.LightningDataModule):
    """Base class: subclasses implement ``load_split`` returning rows with a ``prompt``.

    Args:
        batch_size: Prompts per training step (each gets ``sampling.n`` rollouts).
        eval_batch_size: Prompts per validation/test batch (default: batch_size).
        seed: Seed of the training order and of held-out slices.
    """

    def __init__(self, batch_size: int = 8, eval_batch_size: int | None = None, seed: int = 0):
        super().__init__()
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.seed = seed
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._train_batches: SeededBatches | None = None

    @abstractmethod
    def load_split(self, split: Split) -> list[dict[str, Any]]:
        """All rows of one split, each with a ``prompt`` string and the verifier's columns."""

    def rows(self, split: Split) -> list[dict[str, Any]]:
        if split not in self._rows:
            rows = self.load_split(split)
            where = f"{type(self).__name__} {split} rows"
            for i, row in enumerate(rows):
                if "prompt" not in row:
                    raise DataError(f"{where}: row {i} has no 'prompt' (fields: {sorted(row)})")
            check_records(rows, ROW_FIELDS, where, "A data module must serve its prompts as text.")
            self._rows[split] = rows
        return self._rows[split]

    def train_dataloader(self) -> SeededBatches:
        if self._train_batches is None:
            self._train_batches = SeededBatches(self.rows("train"), self.batch_size, self.seed)
        return self._train_batches

    def val_dataloader(self) -> EvalBatches:
        return EvalBatches(self.rows("val"), self.eval_batch_size)

    def test_dataloader(self) -> EvalBatches:
        return EvalBatches(self.rows("test"), self.eval_batch_size)

    def predict_dataloader(self) -> EvalBatches:
        return EvalBatches(self.rows("test"), self.eval_batch_size)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows from a JSONL file, a JSON array, or a zip holding one JSONL member. A line that is
    not JSON or not UTF-8, a file with no records or that cannot be read, is an error naming the
    file (and the line)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset file {path} does not exist")
    if path.suffix == ".zip":
        import zipfile

        try:
            with zipfile.ZipFile(path) as archive:
                members = [m for m in archive.namelist() if m.endswith((".jsonl", ".json"))]
                if len(members) != 1:
                    raise ConfigError(f"{path} should hold one .jsonl/.json member, found {members}")
                where = f"{path}:{members[0]}"
                text = _decode(archive.read(members[0]), where)
                suffix = Path(members[0]).suffix
        except (zipfile.BadZipFile, OSError) as err:
            raise DataError(f"dataset file {path} is not a readable zip archive ({err}); unpack it or give the .jsonl") from None
    else:
        where = str(path)
        try:
            text = _decode(path.read_bytes(), where)
        except OSError as err:  # a folder, no permission, an I/O error
            raise DataError(f"dataset file {path} cannot be read ({err.strerror or err}); point the source at a readable file") from None
        suffix = path.suffix
    if suffix == ".json" or text.lstrip().startswith("["):
        records = _parse(text, where, line_offset=0)
        if not isinstance(records, list):
            raise DataError(f"{where} holds a JSON {type(records).__name__}, expected an array of records")
    else:
        records = [_parse(line, where, number) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not records:
        raise DataError(f"{where} holds no records: point the source at a file with at least one row")
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DataError(f"{where}: record {bad + 1} is a JSON {type(records[bad]).__name__}, expected an object of fields")
    return records


def _decode(data: bytes, where: str) -> str:
    """The text of a dataset file; bytes that are not UTF-8 are an error naming the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(
            f"{where}, line {line}: not valid UTF-8 (byte {data[err.start]:#04x} at column {column}); save the file as "
            "UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line"
        ) from None


def _parse(text: str, where: str, line_offset: int):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        line = line_offset or err.lineno
        raise DataError(
            f"{where}, line {line}: not valid JSON ({err.msg}, column {err.colno}); fix or remove that line"
        ) from None


def require_fields(rows: list[dict[str, Any]], fields: list[str], where: str, fix: str) -> None:
    """Raise a clear error naming the first row that lacks one of ``fields``."""
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise DataError(f"{where}: row {i} has no field {missing[0]!r} (it has {sorted(row)}). {fix}")


def held_out_split(rows: list[dict[str, Any]], size: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): a seeded slice of ``size`` rows kept out of training."""
    if size < 0 or size >= len(rows):
        raise ConfigError(
            f"val_size {size} leaves no training rows: the training split has {len(rows)} rows. "
            f"Set val_size between 0 and {len(rows) - 1}."
        )
    index = list(range(len(rows)))
    random.Random(seed).shuffle(index)
    held = set(index[:size])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]
