"""The ``tandem-lit`` command: LightningCLI over TandemModule (or SFTModel) and a PromptDataModule.

    tandem-lit fit  --config configs/demo.yaml
    tandem-lit fit  --config configs/paper_a/sft_jargon_llama2.yaml
    tandem-lit test --config configs/eval/math_handoff.yaml
    tandem-lit fit  --config configs/gsm8k_tiny.yaml --print_config

Component classes are chosen in YAML by ``class_path``; importing the component packages here
lets short names (``GRPO``, ``WordHandoff``, ``GSM8KVerifier``) resolve. Everything a run writes
(MLflow store, checkpoints, plots, completions, config) goes under ``trainer.default_root_dir``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

import tandem_lit.data  # noqa: F401  (short class_path names)
import tandem_lit.data.sft_data  # noqa: F401
import tandem_lit.demo  # noqa: F401  (registers demo:// model paths)
import tandem_lit.objectives  # noqa: F401
import tandem_lit.rollout  # noqa: F401
import tandem_lit.verifiers  # noqa: F401
from tandem_lit.data.base import PromptDataModule
from tandem_lit.errors import ConfigError, TandemLitError
from tandem_lit.runs import RUN_RECORD, read_run_record
from tandem_lit.training.callbacks import (
    AtomicCheckpointIO,
    GracefulStop,
    ResumeCheckpoint,
    RunReport,
    SaveConfigToRun,
    TandemProgressBar,
    check_checkpoint,
)
from tandem_lit.training.distributed import (
    FSDP2Strategy,
    external_launch,
    launch_rank,
    launch_settings,
    process_group_error,
)
from tandem_lit.training.module import TandemModule  # noqa: F401  (short class_path names)
from tandem_lit.training.sft import SFTModel  # noqa: F401
from tandem_lit.write_faults import run_write_error

RUN_FOLDER_ENV = "TANDEM_LIT_RUN_FOLDER"

TRAINER_DEFAULTS = {
    "default_root_dir": "runs/default",
    "max_steps": 100,
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    "check_val_every_n_epoch": None,
    "val_check_interval": 25,
    "devices": 1,
    "enable_model_summary": False,  # its table counts FLOPs as 0 and says nothing of the rollout copy
}


class TandemCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # best_checkpoint: the checkpoint selected by a validation metric, saved when validation
        # ends (on when `monitor` is set); checkpoint: last.ckpt to resume from, every N updates
        # and at the end. Both write to <run>/checkpoints.
        parser.add_lightning_class_args(ModelCheckpoint, "best_checkpoint")
        parser.set_defaults({
            "best_checkpoint.mode": "max", "best_checkpoint.save_top_k": 1, "best_checkpoint.every_n_train_steps": 0,
            "best_checkpoint.every_n_epochs": 1, "best_checkpoint.filename": "best-step{step}",
            "best_checkpoint.auto_insert_metric_name": False,
        })
        parser.add_lightning_class_args(ResumeCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0, "checkpoint.every_n_train_steps": 50})

    def _prepare_subcommand_parser(self, klass, subcommand: str, **kwargs):
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand in ("test", "validate"):  # the module prints one table per run, not Lightning's per eval set
            parser.set_defaults({"verbose": False})
        return parser

    def _parse_ckpt_path(self) -> None:
        """Lightning loads the whole checkpoint here to read hyperparameters (tens of GB for a 4B
        senior with its AdamW state). tandem-lit saves none (the run's config.yaml is the record),
        so only check that the file is there and readable, without reading its tensors."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if path:
            check_checkpoint(path)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        root = Path(config.trainer.default_root_dir).expanduser().resolve()
        resume = config.get("ckpt_path")
        # torchrun or srun started this process with the others: their counts, and every rank picks
        # the same folder (no rank writes to it before all have joined the process group)
        config.trainer.devices, config.trainer.num_nodes = launch_settings(config.trainer.devices, config.trainer.num_nodes)
        launched = os.environ.get(RUN_FOLDER_ENV) if int(os.environ.get("LOCAL_RANK", "0")) > 0 else None
        if launched and external_launch() is None:  # a process Lightning started for rank > 0: the folder rank 0 chose
            root = Path(launched)
        elif self.subcommand == "fit" and not resume:
            root = unused_run_folder(root)
        elif self.subcommand == "fit" and run_folder_of(resume):  # a resume continues in its own run's folder
            root = run_folder_of(resume)
        os.environ[RUN_FOLDER_ENV] = str(root)  # inherited by the processes of the other ranks
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"cannot create the run folder {root}: {err.strerror or err}. Set --trainer.default_root_dir to a "
                "writable folder."
            ) from None
        config.trainer.default_root_dir = str(root)
        for section in ("checkpoint", "best_checkpoint"):
            if section in config and config[section].dirpath is None:
                config[section].dirpath = str(root / "checkpoints")
        if config.trainer.logger is None and launch_rank() > 0:  # rank 0 logs (and alone creates the store)
            config.trainer.logger = False
        elif config.trainer.logger is None:  # not set by the user: a local MLflow store in the run folder
            init_args = Namespace(
                experiment_name="tandem-lit",
                tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
                artifact_location=(root / "mlartifacts").as_uri(),
                run_name=root.name,
            )
            earlier = read_run_record(root) if resume and self.subcommand == "fit" else {}
            if earlier.get("mlflow_run_id"):  # a resumed run continues its MLflow run
                init_args.run_id = earlier["mlflow_run_id"]
            config.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.MLFlowLogger", init_args=init_args)

    def instantiate_trainer(self, **kwargs):
        # (no callbacks= here: that would replace the user's --trainer.callbacks)
        trainer_config = self._get(self.config_init, "trainer")
        if trainer_config.get("strategy") == "fsdp":  # FSDP2 (tandem_lit.training.distributed says why), not Lightning's FSDP1
            trainer_config["strategy"] = FSDP2Strategy()
        callbacks = trainer_config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer_config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            trainer_config["callbacks"] = [*callbacks, TandemProgressBar()]
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ModuleNotFoundError) as err:  # accelerator, devices, strategy, ... refused
            # (a ModuleNotFoundError here: the accelerator or strategy chosen needs a package, e.g. torch_xla)
            raise ConfigError(refused_trainer_settings(err, trainer_config)) from None
        best = self._get(self.config_init, "best_checkpoint")
        if best is not None and best.monitor is None:  # no metric to select by: no best checkpoint
            trainer.callbacks = [c for c in trainer.callbacks if c is not best]
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if not any(isinstance(c, RunReport) for c in trainer.callbacks):
            trainer.callbacks.append(RunReport())
        if not any(isinstance(c, GracefulStop) for c in trainer.callbacks):
            trainer.callbacks.append(GracefulStop())
        return trainer


def build_cli(args: list[str] | None = None, run: bool = True) -> TandemCLI:
    """Parse ``args`` (default: the command line) and run the subcommand; returns the CLI object
    (``.trainer``, ``.model``, ``.datamodule``) for programmatic use. ``run=False``: parse a
    config without a subcommand and build the objects only."""
    configure_logs()
    return TandemCLI(
        L.LightningModule,  # TandemModule (tandem RL) or SFTModel (supervised, tandem_lit.training.sft)
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=SaveConfigToRun,
        save_config_kwargs={"overwrite": True},
        trainer_defaults=TRAINER_DEFAULTS,
        args=args,
        auto_configure_optimizers=False,
        seed_everything_default=0,  # every random draw of a run has its own explicit seed anyway
        parser_kwargs={"exit_on_error": False},  # main() turns a config error into one line
        run=run,
    )


class _Drop(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


def _drop(logger_name: str, *fragments: str) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _Drop) and f.fragments == fragments for f in logger.filters):
        logger.addFilter(_Drop(*fragments))


def configure_logs() -> None:
    """Silence what a user of tandem-lit cannot act on, each where it arises: Lightning's
    advertising tips and messages about choices made on purpose (the frozen junior is in eval
    mode; checkpoints under manual optimisation), a torch deprecation inside Lightning, MLflow's
    store set-up lines, weight-loading bars. The model summary is one line of our own
    (``TandemModule.on_fit_start``)."""
    _drop("lightning.pytorch.utilities.rank_zero", "💡 Tip")
    _drop("lightning.pytorch.loggers.mlflow", "not found. Creating it")  # a new run folder's first run
    # MLflow logs a database error's traceback before raising it: main() prints the one line (or the
    # traceback, for what is not a fault of the disk)
    _drop("mlflow.store.db.utils", "SQLAlchemy database error")
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")  # the frozen junior, on purpose
    # we want the post-update state in a checkpoint (global_step counts updates already made)
    warnings.filterwarnings("ignore", message=r".*ModelCheckpoint with manual optimization.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", module=r"lightning\..*")
    # main(args=[...]) and build_cli(args) are the programmatic API: the arguments given are the run's,
    # whatever the host process's own argv (pytest's, a notebook's) holds
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended", module=r"lightning\..*")
    # on several processes every rank logs the totals already merged over ranks (evaluation.report.merge_totals)
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.* when logging on epoch level in distributed")
    # accelerator: cpu on a machine with a GPU is a choice the config made
    warnings.filterwarnings("ignore", message=r"GPU available but not used", module=r"lightning\..*")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow configures its loggers
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # in case it already has
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    ours = logging.getLogger("tandem_lit")  # our own INFO lines (models, evaluation at start, memory estimate)
    if not any(isinstance(h, _StderrNow) for h in ours.handlers):
        handler = _StderrNow()
        handler.setFormatter(logging.Formatter("%(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)


class _StderrNow(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (main() may run several times in one
    process, each with its own stderr, e.g. under pytest's capture), on a line of its own above
    the progress bar."""

    @property
    def stream(self):
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):  # clears the progress bar, writes, redraws it
            super().emit(record)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def unused_run_folder(root: Path) -> Path:
    """``root`` if it holds no earlier run, else the first free ``<root>-2``, ``<root>-3``, ... (said
    once): a new run never mixes its checkpoints, logs and completions with an earlier one's."""
    def used(folder: Path) -> bool:
        checkpoints = folder / "checkpoints"
        return (folder / RUN_RECORD).exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))

    if not used(root):
        return root
    version = 2
    while used(root.with_name(f"{root.name}-{version}")):
        version += 1
    fresh = root.with_name(f"{root.name}-{version}")
    if launch_rank() == 0:
        print(
            f"tandem-lit: {root} holds an earlier run; this run writes to {fresh}. To continue the earlier run, pass "
            f"--ckpt_path {root / 'checkpoints' / 'last.ckpt'}.",
            file=sys.stderr,
        )
    return fresh


def run_folder_of(checkpoint: str | Path) -> Path | None:
    """The run folder a checkpoint was written in (``<run>/checkpoints/<name>``, beside ``run.json``)."""
    folder = Path(checkpoint).expanduser().absolute().parent.parent
    return folder.resolve() if (folder / RUN_RECORD).is_file() else None


def main(args: list[str] | None = None) -> None:
    """The ``tandem-lit`` console command; tests call ``main(args=[...])``.

    A user-fixable error (``TandemLitError``, or a file of the run that cannot be written: a full
    disk, a read-only folder) ends the run with one line on stderr and exit code 2.
    """
    command = sys.argv[1:] if args is None else args
    try:
        if command[:1] == ["export"]:  # not a Trainer method, so not a LightningCLI subcommand
            export_main(command[1:])
        else:
            build_cli(args)  # (None: LightningCLI reads sys.argv itself; it warns when given both)
    except SIGTERMException as err:  # a graceful stop: GracefulStop saved the run and said so
        raise SystemExit(128 + int(getattr(err, "signum", 15))) from None
    except Exception as err:
        # a full disk, a read-only run folder, a port in use, a rank that died: one line each
        cause = user_error(err) or run_write_error(err) or process_group_error(err)
        message = str(cause) if cause is not None else refused_by_dependency(err)
        if message is None and isinstance(err, argparse.ArgumentError):
            message = config_error_line(err)
        if os.environ.get("TANDEM_LIT_TRACEBACK") or message is None:
            raise
        print(f"tandem-lit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def export_main(args: list[str]) -> None:
    """``tandem-lit export RUN_FOLDER [--ckpt_path ...] [--out ...] [--dtype ...]`` (``training/export.py``)."""
    from tandem_lit.rollout.weights import ROLLOUT_DTYPES
    from tandem_lit.training.export import __doc__ as export_doc
    from tandem_lit.training.export import export_run

    parser = argparse.ArgumentParser(prog="tandem-lit export", description=export_doc.split("\n\n")[0])
    parser.add_argument("run_folder", help="the run's folder (holds config.yaml and checkpoints/)")
    parser.add_argument("--ckpt_path", default=None, help="default: <run_folder>/checkpoints/last.ckpt")
    parser.add_argument("--out", default=None, help="default: <run_folder>/export")
    parser.add_argument("--dtype", default=None, choices=sorted(ROLLOUT_DTYPES), help="default: as trained")
    options = parser.parse_args(args)

    def build_module(config: Path):
        return build_cli(["--config", str(config), "--trainer.logger", "false"], run=False).model

    out = export_run(build_module, options.run_folder, options.ckpt_path, options.out, options.dtype)
    print(f"tandem-lit: exported the senior to {out}")


def config_error_line(err: argparse.ArgumentError) -> str:
    """jsonargparse's nested explanation of a bad option, as one line: the lines that name the
    option and what is wrong with it (not the alternatives it also tried, such as None)."""
    noise = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
             "Expected a <class 'NoneType'>")
    parts = [line.strip(" -") for line in str(err).splitlines() if line.strip() and not line.strip(" -").startswith(noise)]
    return " ".join(parts) + " (--help lists the options; --print_config shows the resolved config)"


def refused_trainer_settings(err: Exception, trainer_config) -> str:
    """Lightning's refusal of the trainer section, as one line naming the settings it judged."""
    names = ("accelerator", "devices", "num_nodes", "strategy", "precision")
    chosen = ", ".join(f"{name}={trainer_config.get(name)!r}" for name in names if trainer_config.get(name) is not None)
    reason = str(err).strip().splitlines()[0].rstrip(".!") if str(err).strip() else type(err).__name__
    return (f"the trainer settings ({chosen}) were refused: {reason}. Change them in the config's trainer section or "
            "with --trainer.<name> (--print_config shows the resolved config)")


def refused_by_dependency(err: BaseException) -> str | None:
    """One line for an error a dependency raised on a setting before any of our code ran in that
    call: Lightning's MisconfigurationException from its own loops and connectors (e.g. a
    ``val_check_interval`` longer than an epoch). The same exception raised under a tandem_lit
    hook or step is our misuse of Lightning, a bug: None, and the traceback is shown."""
    if not isinstance(err, MisconfigurationException) or raised_under_our_code(err):
        return None
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"Lightning refused a setting: {reason} (--print_config shows the resolved config)"


def raised_under_our_code(err: BaseException) -> bool:
    """Whether a frame of tandem_lit other than this file is on the traceback of ``err``."""
    package = Path(__file__).resolve().parent
    frame = err.__traceback__
    while frame is not None:
        path = Path(frame.tb_frame.f_code.co_filename).resolve()
        if package in path.parents and path != Path(__file__).resolve():
            return True
        frame = frame.tb_next
    return False


def user_error(err: BaseException | None) -> TandemLitError | None:
    """The user-fixable error behind ``err`` (jsonargparse wraps errors raised while it builds a
    component from the config)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, TandemLitError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    main()
