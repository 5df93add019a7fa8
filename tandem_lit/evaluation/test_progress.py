"""``tandem-lit test`` over a long protocol: how far it is, and what it keeps when stopped.

A paper-size test is thousands of rollouts (every problem of every set, ``n`` solo and ``n``
handoff samples each), hours on one GPU. So:

- ``EvalProgress`` counts the rollouts done against the whole protocol's and projects the time
  left from the rollouts measured so far (the progress bar shows it);
- ``FinishedSets`` writes each eval set's raw tally to ``eval/tallies.json`` as soon as the set is
  done (with ``results.json``/``results.md`` of the sets done so far), so a stopped test keeps what
  it measured. A re-run with the same settings (model, checkpoint file, sampling, handoff, pass@k,
  problems per set) takes the finished sets from there and measures only the rest; with other
  settings it measures everything again. Delete ``eval/tallies.json`` to measure again anyway.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from tandem_lit.evaluation.report import DatasetTally

log = logging.getLogger(__name__)

TALLIES = "tallies.json"


@dataclasses.dataclass
class EvalProgress:
    """Rollouts of a test: all of them, those done (measured or kept from an earlier run), and the
    time the measured ones took."""

    total: int = 0
    done: int = 0
    measured: int = 0
    started: float = dataclasses.field(default_factory=lambda: time.perf_counter())

    def seconds_left(self) -> float | None:
        if not self.measured:
            return None
        return (time.perf_counter() - self.started) / self.measured * max(self.total - self.done, 0)

    def line(self) -> str:
        left = self.seconds_left()
        when = "time left unknown" if left is None else f"{format_seconds(left)} left"
        return f"rollouts {self.done:,}/{self.total:,}, {when}"


def format_seconds(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def tally_to_json(tally: DatasetTally) -> dict[str, Any]:
    return dataclasses.asdict(tally)


def tally_from_json(saved: dict[str, Any]) -> DatasetTally:
    fields = {f.name for f in dataclasses.fields(DatasetTally)}
    tally = DatasetTally(**{k: v for k, v in saved.items() if k in fields})
    tally.forced = [tuple(x) for x in tally.forced]
    return tally


def checkpoint_identity(path: str | None) -> dict[str, Any] | None:
    """A checkpoint file as the settings see it: its path, size and modification time (a file
    rewritten under the same name is another model)."""
    if not path or not os.path.exists(path):
        return None
    stat = os.stat(path)
    return {"path": str(Path(path).resolve()), "bytes": stat.st_size, "mtime": int(stat.st_mtime)}


class FinishedSets:
    """The eval sets a test has finished, kept in ``<folder>/tallies.json`` with the settings they
    were measured under."""

    def __init__(self, folder: Path, settings: dict[str, Any]):
        self.folder, self.settings = folder, json.loads(json.dumps(settings, default=str))
        self.sets: dict[str, dict[str, Any]] = {}  # name -> {"problems": N, "tally": ...}

    def load(self) -> dict[str, DatasetTally]:
        """Sets an earlier run of these settings finished: {name: tally}."""
        path = self.folder / TALLIES
        if not path.exists():
            return {}
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("%s cannot be read: every eval set is measured again", path)
            return {}
        if saved.get("settings") != self.settings:
            log.warning("%s holds results of other settings: every eval set is measured again", path)
            return {}
        self.sets = dict(saved.get("sets", {}))
        return {name: tally_from_json(entry["tally"]) for name, entry in self.sets.items()}

    def problems(self, name: str) -> int | None:
        entry = self.sets.get(name)
        return entry["problems"] if entry else None

    def add(self, name: str, tally: DatasetTally) -> None:
        """Keep a finished set (written at once: atomically, so a stop mid-write loses nothing)."""
        self.sets[name] = {"problems": len(tally.solo_correct), "tally": tally_to_json(tally)}
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / TALLIES
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps({"settings": self.settings, "sets": self.sets}))
        os.replace(partial, path)
