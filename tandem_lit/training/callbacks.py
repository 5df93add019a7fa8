"""Run-folder plumbing: atomic checkpoints, the end-of-run report (plots, summary), artifacts."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from tandem_lit.errors import ConfigError
from tandem_lit.runs import log_artifact
from tandem_lit.training.distributed import check_same_config
from tandem_lit.training.sharded import META, is_sharded_checkpoint, read_sharded
from tandem_lit.write_faults import fault_line, write_atomically, write_fault

log = logging.getLogger(__name__)

# Curves worth a picture, each a list of metric names drawn on one axis.
PLOTS = {
    "jargon_rate": ["eval/senior_jargon_rate", "eval/tandem_jargon_rate", "eval/junior_jargon_rate"],
    "accuracy": ["eval/senior_accuracy", "eval/tandem_accuracy", "eval/junior_accuracy"],
    "train_reward": ["train/reward_mean", "train/accuracy"],
    "junior_share": ["train/junior_token_share", "eval/tandem_junior_token_share"],
}


CHECKPOINT_READ_ERRORS = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError)


def unreadable_checkpoint(path, err: BaseException) -> ConfigError:
    others = sorted(p.name for p in Path(path).parent.glob("*.ckpt") if p != Path(path))
    return ConfigError(
        f"checkpoint {path} cannot be read ({str(err).splitlines()[0][:120]}): it is truncated or not a "
        f"tandem-lit checkpoint. Resume from another one{' (' + ', '.join(others) + ')' if others else ''}, "
        "or leave --ckpt_path out to start a new run."
    )


def check_checkpoint(path: str) -> None:
    """A checkpoint to resume from exists and its index reads (memory-mapped: no tensor is read);
    a sharded checkpoint (a folder) has its shards' index and its metadata."""
    path = str(Path(path).expanduser())
    if Path(path).is_dir():
        if not is_sharded_checkpoint(path):
            raise unreadable_checkpoint(path, ValueError("a folder without .metadata and meta.pt"))
        path = str(Path(path) / META)
    elif not Path(path).is_file():
        raise ConfigError(
            f"--ckpt_path {path} does not exist. Resume from <run folder>/checkpoints/last.ckpt, or leave "
            "--ckpt_path out to start a new run."
        )
    try:
        torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except CHECKPOINT_READ_ERRORS as err:
        raise unreadable_checkpoint(path, err) from None


def read_checkpoint(path) -> dict[str, Any]:
    """A checkpoint's contents with full tensors, from one file (memory-mapped) or a sharded folder."""
    if is_sharded_checkpoint(path):
        return read_sharded(path)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write the checkpoint beside its target, fsync, then rename over it: a crash leaves either
    the old file or the new one, never a torn file (Lightning's own path may copy from /tmp).
    A file that cannot be read back (truncated, not a checkpoint) is a one-line error."""

    def load_checkpoint(self, path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            if is_sharded_checkpoint(path):  # written by several processes, resumed on one
                return read_sharded(path)
            return super().load_checkpoint(path, *args, **kwargs)
        except CHECKPOINT_READ_ERRORS as err:
            raise unreadable_checkpoint(path, err) from None

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, path)
        except Exception as err:  # torch's zip writer wraps the OSError of a full disk in a RuntimeError
            fault = write_fault(err)
            code = fault[0] if fault else MemoryError if isinstance(err, MemoryError) else None
            if code is None:
                raise
            partial.unlink(missing_ok=True)  # (frees the space it took before the line reads the last one)
            raise fault_line(code, f"checkpoint {path}", None, path.parent / "last.ckpt") from err
        finally:
            partial.unlink(missing_ok=True)


class ResumeCheckpoint(ModelCheckpoint):
    """Checkpoints to resume from: ``last.ckpt`` every ``every_n_train_steps`` updates, once more
    when training ends, and when a signal stops it (``GracefulStop``), so the weights of the last
    finished update are never lost between two periodic saves.

    A step followed by a validation is saved after that validation, so the checkpoint holds its
    rows: a run killed during the validation resumes from the checkpoint before and redoes the
    step and its validation, instead of skipping the validation for good.

    Args:
        sharded: Every process writes its own shards of the weights and optimizer state, in
            parallel, into one folder per checkpoint (``trainer.strategy: fsdp``; faster for a large
            senior); default: one file of full tensors gathered to rank 0. Either resumes on any
            number of processes and exports.
    """

    def __init__(self, *args: Any, sharded: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharded = sharded
        self._after_validation: tuple | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.sharded and stage == "fit":
            if not hasattr(trainer.strategy, "sharded_checkpoints"):
                raise ConfigError(
                    f"checkpoint.sharded needs trainer.strategy: fsdp (it is {type(trainer.strategy).__name__}): "
                    "one process writes one file; leave checkpoint.sharded out"
                )
            trainer.strategy.sharded_checkpoints = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        if loop._should_check_val_fx(trainer.fit_loop._data_fetcher):  # Lightning validates after this hook
            self._after_validation = (outputs, batch, batch_idx)
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._after_validation is not None and not trainer.sanity_checking:
            args, self._after_validation = self._after_validation, None
            super().on_train_batch_end(trainer, pl_module, *args)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_last_now(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):  # the step finished: its state is consistent
            self.save_last_now(trainer)

    def save_last_now(self, trainer: L.Trainer) -> None:
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class TandemProgressBar(TQDMProgressBar):
    """The bar counts optimiser updates against ``max_steps`` (not epochs of a data set that a run
    rarely finishes) and shows the numbers that matter under short names.

    Validation during fit draws no second bar (nested bars leave partial lines wherever output
    is not a terminal): the training bar says ``validation i/n`` meanwhile, and one line with the
    accuracies is written above it when validation ends."""

    NAMES = {"reward": "reward", "eval/senior_accuracy": "senior acc"}

    @property
    def train_description(self) -> str:
        return "train"

    @property
    def validation_description(self) -> str:
        return "validation"

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self.on_train_epoch_start(trainer)  # counted in updates from the start (validation at start runs first)

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        bar = self.train_progress_bar
        by_updates = bool(trainer.max_steps and trainer.max_steps > 0)
        bar.reset(total=trainer.max_steps if by_updates else self.total_train_batches)
        bar.n = trainer.global_step if by_updates else 0
        bar.unit = "update" if by_updates else "it"
        bar.set_description(self.train_description)

    def init_validation_tqdm(self):
        if self.trainer.state.fn == "fit":  # the training bar shows validation's progress
            return Tqdm(disable=True)
        return super().init_validation_tqdm()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_start(trainer, pl_module)
        self._validation_started = time.perf_counter()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        if self.val_progress_bar is not None:
            self.val_progress_bar.set_description(self.validation_description)
        bar = self._train_progress_bar
        if trainer.state.fn == "fit" and not trainer.sanity_checking and bar is not None and not bar.disable:
            total = self.total_val_batches_current_dataloader
            bar.set_description(f"validation {batch_idx + 1}/{total:.0f}" if total != float("inf") else "validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        bar = self._train_progress_bar
        if trainer.state.fn != "fit" or trainer.sanity_checking or bar is None or bar.disable:
            return
        bar.set_description(self.train_description)
        accuracies = [
            f"{name.removeprefix('eval/').removesuffix('_accuracy')} acc {float(value):.3f}"
            for name, value in sorted(trainer.callback_metrics.items())
            if name.startswith("eval/") and name.endswith("_accuracy")
        ]
        seconds = time.perf_counter() - getattr(self, "_validation_started", time.perf_counter())
        bar.write(f"validation after update {trainer.global_step} ({seconds:.0f} s): {', '.join(accuracies) or 'done'}",
                  file=bar.fp)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = trainer.global_step if trainer.max_steps and trainer.max_steps > 0 else batch_idx + 1
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        return {short: metrics[name] for name, short in self.NAMES.items() if name in metrics}

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_test_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        name = batch[0].get("dataset") if len(batch) and isinstance(batch[0], dict) else None
        if name and self.test_progress_bar is not None:
            self.test_progress_bar.set_description(f"test {name}")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        progress = getattr(pl_module, "test_progress", None)  # the whole protocol's rollouts and time left
        if progress is not None and self.test_progress_bar is not None and not self.test_progress_bar.disable:
            self.test_progress_bar.set_postfix_str(progress.line())


class GracefulStop(L.Callback):
    """Ctrl-C (SIGINT) and SIGTERM stop training at the end of the current step: the first signal
    asks Lightning to stop at the step boundary (its SIGTERM path), where ``ResumeCheckpoint``
    saves ``last.ckpt`` and ``RunReport`` writes history, summary and plots; a second Ctrl-C
    stops at once. ``tandem-lit`` then exits with 128 + the signal number."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # SIGTERM needs nothing of ours: Lightning's handler already stops at the step boundary.
        # (Installed here, after Lightning saved the process's handlers, which it restores at the end.)
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda signum, frame: self._interrupt(trainer, signum))

    def _interrupt(self, trainer: L.Trainer, signum: int) -> None:
        if trainer.received_sigterm:  # the second Ctrl-C: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        trainer._signal_connector.received_sigterm = True  # Lightning's stop-at-the-step-boundary flag
        print("\ntandem-lit: stopping after this step (it will be saved); Ctrl-C again to stop now", file=sys.stderr)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()
        if isinstance(exception, SIGTERMException):
            exception.signum = int(self.signum or signal.SIGTERM)
            checkpoint = getattr(trainer.checkpoint_callback, "dirpath", None)
            where = f" Resume with --ckpt_path {Path(checkpoint) / 'last.ckpt'}." if checkpoint else ""
            print(f"tandem-lit: stopped by a signal after update {trainer.global_step}; the run is saved.{where}", file=sys.stderr)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class SaveConfigToRun(SaveConfigCallback):
    """Save the resolved config as ``config.yaml`` in the run folder and as an MLflow artifact.

    (Lightning's version writes to ``trainer.log_dir``, which an MLflow logger with a database
    store does not have.)
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and torch.distributed.is_initialized():  # every rank here, before the first collective of a step
            check_same_config(self.config.as_dict())
        if self.already_saved or not trainer.is_global_zero:
            return
        path = Path(trainer.default_root_dir) / self.config_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, str(path), skip_none=False, overwrite=True, multifile=self.multifile)
        log_artifact(trainer, path)
        for logger in trainer.loggers:  # searchable run parameters (the YAML stays the full record)
            logger.log_hyperparams({k: v for k, v in self.config.as_dict().items() if k in ("model", "data")})
        self.already_saved = True


def metric_series(history: list[dict[str, float]], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric over the module's history rows, in step order."""
    points = sorted((row["step"], row[metric]) for row in history if metric in row)
    return [step for step, _ in points], [value for _, value in points]


def plot_history(history: list[dict[str, float]], folder: Path) -> list[Path]:
    """One PNG per curve group in PLOTS, from the module's metric history."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, metrics in PLOTS.items():
        series = {m: metric_series(history, m) for m in metrics}
        series = {m: (steps, values) for m, (steps, values) in series.items() if steps}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for metric, (steps, values) in series.items():
            ax.plot(steps, values, marker="o" if len(steps) < 40 else None, markersize=3, label=metric)
        ax.set_xlabel("optimiser updates")
        ax.set_ylabel(name.replace("_", " "))
        if "accuracy" in name or "rate" in name or "share" in name:
            ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def first_and_last(history: list[dict[str, float]], metric: str) -> tuple[float, float] | None:
    values = [row[metric] for row in history if metric in row]
    return (values[0], values[-1]) if values else None


class RunReport(L.Callback):
    """At the end of fit: plots, ``summary.json``, ``history.jsonl`` (every logged metric row),
    a printed summary, MLflow artifacts."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started = time.perf_counter()
        self.first_update = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_update = trainer.global_step  # (a resumed run's, restored by now)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):  # a graceful stop: the run so far gets its report
            self.write(trainer, pl_module)

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        folder = Path(trainer.default_root_dir)
        history = getattr(pl_module, "history", [])
        plots = plot_history(history, folder / "plots")
        summary: dict[str, Any] = {
            "updates": trainer.global_step,
            "wall_seconds": round(time.perf_counter() - self.started, 1),
            # a run resumed from a checkpoint: the update it went on from (its wall seconds are this run's)
            **({"resumed_at": self.first_update} if self.first_update else {}),
            "run_folder": str(folder.resolve()),
        }
        for metric in sorted({m for row in history for m in row if m.startswith("eval/")}):
            span = first_and_last(history, metric)
            summary[metric] = {"first": round(span[0], 4), "last": round(span[1], 4)}
        # whole or not at all: a resumed run's earlier history survives a disk that fills now
        write_atomically(folder / "summary.json", json.dumps(summary, indent=2))
        run_id = getattr(pl_module, "run_id", None)
        write_atomically(folder / "history.jsonl", "".join(json.dumps({"run_id": run_id, **row}) + "\n" for row in history))
        print(format_summary(summary))
        for path in plots:
            log_artifact(trainer, path, "plots")
        for name in ("summary.json", "history.jsonl", "completions.jsonl"):
            if (folder / name).exists():
                log_artifact(trainer, folder / name)


def format_summary(summary: dict[str, Any]) -> str:
    resumed = summary.get("resumed_at") or 0
    run = summary["updates"] - resumed
    done = f"{run} update{'' if run == 1 else 's'}"
    if resumed:
        done += f" (resumed at update {resumed}, {summary['updates']} in all)"
    lines = [f"tandem-lit: {done} in {summary['wall_seconds']:.0f} s"]
    for metric, span in summary.items():
        if isinstance(span, dict):
            lines.append(f"  {metric:<36} {span['first']:.3f} -> {span['last']:.3f}")
    lines.append(f"  run folder: {summary['run_folder']}")
    return "\n".join(lines)
