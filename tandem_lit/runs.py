"""The run record: which run a folder holds (``run.json``), so rows and resumes can name it.

Kept apart from ``callbacks`` (which needs jsonargparse through Lightning's CLI) so that the
module imports on machines with torch, transformers and Lightning alone.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import lightning as L

from tandem_lit.write_faults import write_atomically

RUN_RECORD = "run.json"


def read_run_record(folder: Path) -> dict[str, Any]:
    """The run folder's ``run.json`` (run id, MLflow run id), or {} when there is none."""
    path = Path(folder) / RUN_RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def start_run_record(trainer: L.Trainer, run_id: str | None) -> str:
    """This run's id (kept across resumes: the checkpoint carries it), written to ``run.json`` with
    the MLflow run id, so that a resume continues the same MLflow run."""
    loggers = mlflow_loggers(trainer)
    mlflow_id = loggers[0].run_id if loggers else None
    run_id = run_id or mlflow_id or uuid.uuid4().hex
    if trainer.world_size > 1:  # rank 0's: the others have no MLflow run and drew their own uuid
        run_id = trainer.strategy.broadcast(run_id)
    if trainer.is_global_zero:
        folder = Path(trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / RUN_RECORD, json.dumps({"run_id": run_id, "mlflow_run_id": mlflow_id}) + "\n")
    return run_id


def mlflow_loggers(trainer: L.Trainer) -> list:
    from lightning.pytorch.loggers import MLFlowLogger

    return [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]


def log_artifact(trainer: L.Trainer, path: Path, folder: str | None = None) -> None:
    """Attach a file to the run's MLflow record (every MLflow logger of the trainer)."""
    for logger in mlflow_loggers(trainer):
        logger.experiment.log_artifact(logger.run_id, str(path), folder)
