"""TandemModule: the senior and a frozen junior co-write rollouts; the objective updates the senior.

One training step, top to bottom in ``training_step``:

    prompts -> rollouts.training_rollouts(rows)    both models write one shared sequence, graded
            -> updates.run(result)                 objective over senior tokens; optimiser steps
            -> metrics.row(...)                    logged at x = optimiser updates so far

Optimisation is manual: each step draws ``batch_size x rollout.sampling.n`` rollouts, then takes
one optimiser update per ``update.mini_batch_size`` prompts, accumulating gradients over
micro-batches of ``update.micro_batch_size`` sequences (and ``memory.micro_batch_tokens`` tokens).
``trainer.global_step`` counts optimiser updates. ``RolloutPhase`` owns the engine's life (setup,
weights loaded by version, caches released), ``UpdatePhase`` the updates, ``StepMetrics`` the
step's row, ``EvaluationSteps`` validation, test and predict; the module composes them and owns
the models and Lightning's hooks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch import nn

from tandem_lit.evaluation.metrics import JargonDetector
from tandem_lit.evaluation.steps import EvaluationSteps
from tandem_lit.models import LoraSettings, ModelSource
from tandem_lit.objectives.base import Objective
from tandem_lit.rollout import out_of_memory
from tandem_lit.rollout.choice import default_engine
from tandem_lit.rollout.engine import RolloutEngine
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.logprobs import avoid_cudnn_attention_backward
from tandem_lit.runs import start_run_record
from tandem_lit.training import checkpoints, completions, preflight
from tandem_lit.training.distributed import Shares, check_several_processes
from tandem_lit.training.loading import load_run_models
from tandem_lit.training.memory import estimate_module_memory, plan_device_memory
from tandem_lit.training.partial import use_correction
from tandem_lit.training.rollout_phase import RolloutPhase
from tandem_lit.training.settings import (
    EvaluationSettings,
    LoggingSettings,
    MemorySettings,
    RolloutSettings,
    UpdateSettings,
)
from tandem_lit.training.stalls import IdleSteps
from tandem_lit.training.step_metrics import StepMetrics
from tandem_lit.training.update_phase import UpdatePhase
from tandem_lit.verifiers.base import Verifier

log = logging.getLogger(__name__)

# jsonargparse builds this from `class_path: torch.optim.AdamW` + init_args, leaving the params out
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


class TandemModule(EvaluationSteps, L.LightningModule):
    """Tandem RL of a senior LM with a frozen junior co-author.

    Args:
        senior: The trained model (hub name or folder).
        verifier: Grades the joint answers (same object for rewards and evaluation).
        objective: The loss: Reinforce, SoftMaskedReinforce or GRPO.
        handoff: Who writes each span of a training rollout (SoloHandoff: plain RL).
        junior: The frozen partner (None only with SoloHandoff(author='senior')).
        lora: Train LoRA adapters instead of full weights.
        engine: Rollout engine (default: FastEngine where it supports the architecture, else HFEngine,
            with a warning; logged as the ``engine`` hyperparameter, with its ``rollout_dtype``)
        optimizer: Optimizer factory (default AdamW, lr 1e-6, no weight decay).
        rollout: Sampling, sequences per engine call, prompt formats, prompt filters.
        update: Mini-/micro-batches, clipping, overlong completions, low-precision weights.
        memory: Rollout caches, optimizer offload, activation checkpointing, token-bounded or
            packed micro-batches, Liger's fused kernels and the memory check before the run.
        evaluation: Validation modes and sampling, ``tandem-lit test``'s handoff, pass@k.
        logging: Jargon pattern, language share, sample completions.
    """

    def __init__(
        self,
        senior: ModelSource,
        verifier: Verifier,
        objective: Objective,
        handoff: HandoffPolicy,
        junior: ModelSource | None = None,
        lora: LoraSettings | None = None,
        engine: RolloutEngine | None = None,
        optimizer: OptimizerCallable | None = None,
        rollout: RolloutSettings | None = None,
        update: UpdateSettings | None = None,
        memory: MemorySettings | None = None,
        evaluation: EvaluationSettings | None = None,
        logging: LoggingSettings | None = None,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold trainable weights only (see on_save_checkpoint)
        self.senior_source, self.junior_source = senior, junior
        self.verifier, self.objective, self.handoff = verifier, objective, handoff
        self.lora, self.engine, self.optimizer_factory = lora, engine, optimizer
        self.rollout_settings = rollout or RolloutSettings()
        self.update_settings = update or UpdateSettings()
        self.memory = memory or MemorySettings()
        self.evaluation = (evaluation or EvaluationSettings()).resolved(self.sampling, handoff, junior is not None)
        self.logging_settings = logging or LoggingSettings()
        self.jargon = JargonDetector(self.logging_settings.jargon_pattern)
        self.rollouts = RolloutPhase(self.rollout_settings, verifier, self.update_settings.overlong)
        if self.rollout_settings.partial is not None:  # stale senior tokens: corrected as the setting says
            use_correction(self.rollout_settings.partial, objective)
        self.updates = UpdatePhase(self.update_settings, self.memory, objective, self.sampling)
        self.metrics = StepMetrics(verifier, self.jargon, self.logging_settings.language,
                                   self.rollout_settings.max_prompt_tokens is not None, self.memory.offload_optimizer)
        self.idle_steps = IdleSteps(self.rollout_settings, self.update_settings.max_idle_steps)
        self._test_tallies: dict = {}  # eval set name -> DatasetTally, during `tandem-lit test`
        self.run_id: str | None = None  # set when fit starts; kept by checkpoints across resumes
        self.senior = self.junior = self.reference = None  # (nn.Module, once configure_model or bind_models ran)
        # every logged metric row, for plots and summaries (no save_hyperparameters: a run's config.yaml is its record)
        self.history: list[dict[str, float]] = []

    @property
    def sampling(self):
        return self.rollout_settings.sampling

    tokenizer = property(lambda self: self.rollouts.tokenizer)  # (the rollout phase's: it encodes every prompt)
    junior_tokenizer = property(lambda self: self.rollouts.junior_tokenizer)

    # ----------------------------------------------------------------------------------- models

    def configure_model(self) -> None:
        if self.senior is not None:
            return
        mesh = getattr(self, "_device_mesh", None)  # set by FSDP2Strategy (trainer.strategy: fsdp)
        fitting = self._trainer is None or self._trainer.state.fn in (None, "fit")
        loaded = load_run_models(
            self.senior_source, self.junior_source, self.lora,
            # (test, validate and predict train nothing: a bf16 senior is what they should decode)
            self.update_settings.allow_low_precision_weights or not fitting,
            self.memory.gradient_checkpointing, self.objective.uses_reference, mesh,
            mesh is not None and str(self.trainer.precision).startswith("bf16"))
        self.reference = loaded.reference
        self.bind_models(loaded.senior, loaded.junior, loaded.tokenizer, loaded.junior_tokenizer)

    def bind_models(self, senior: nn.Module, junior: nn.Module | None, tokenizer, junior_tokenizer=None) -> None:
        """The loaded models and tokenizers, bound once to the phases (the engine: the configured
        one, else the default for these models)."""
        self.senior, self.junior = senior, junior
        if self.engine is None:
            self.engine = default_engine(senior, junior)
        self.rollouts.bind(senior, junior, tokenizer, junior_tokenizer, self.engine)
        # the update scores tokens over what the engine samples from
        self.updates.bind(senior, self.reference, self.manual_backward, self.engine.sampled_vocab(tokenizer))

    memory_estimate = estimate_module_memory  # the step's memory per GPU (memory.py)

    def configure_optimizers(self):
        return self.updates.make_optimizer(self.optimizer_factory)

    def on_fit_start(self) -> None:
        self.updates.check_group_size()
        preflight.check(self, "fit")
        if self.trainer.world_size > 1:
            check_several_processes(self.senior, self.trainer, self.update_settings.mini_batch_size,
                                    self.rollout_settings.kept_prompts_per_step)
        self.run_id = start_run_record(self.trainer, self.run_id)
        if self.trainer.is_global_zero:
            log.info(checkpoints.models_line(self.senior, self.junior, self.lora))
        self.updates.use_fused_kernels(self.device)  # memory.fused_kernels: Liger's kernels, or PyTorch's (logged)
        self.log_engine()
        if self.device.type != "cuda":
            return
        avoid_cudnn_attention_backward()
        self.metrics.plan = plan_device_memory(self)  # (each step's row sets its peaks beside it)

    # --------------------------------------------------------------------------------- training

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        self.metrics.start(self.device)
        world, optimizer = self.trainer.world_size, self.optimizers().optimizer
        key = getattr(batch, "epoch", 0) * 1_000_003 + getattr(batch, "index", batch_idx)
        rows, skipped = self.rollouts.prompts_that_fit(batch)  # of the whole batch: every rank iterates the same ones
        shares = Shares(world, self.global_rank, self.update_settings.mini_batch_size, self.device)
        offload_seconds = self.updates.offload_optimizer_state(optimizer, self.device)
        with out_of_memory.phase("rollout", self.device, self.trainer):
            result, rollout_stats = self.rollouts.training_rollouts(rows, self.handoff, key, shares)
        self.idle_steps.count(result is None, len(rows), world)
        if self.memory.release_rollout_caches:
            self.rollouts.release()  # the update's activations get the KV caches' memory
        offload_seconds += self.updates.restore_optimizer_state(optimizer)
        self.metrics.rolled_out(self.device)
        with out_of_memory.phase("update", self.device, self.trainer, self.memory.gradient_checkpointing):
            update = None if result is None else self.updates.run(result, self.optimizers(), self.device, world, self.global_step)
        if update is not None:
            self.rollouts.policy_moved(int(update["updates"]))
        row = self.metrics.row(result, rollout_stats, update, self.rollouts.timing, self.tokenizer, skipped, offload_seconds,
                               self.device, world)
        self.log_step(row, result, len(batch))
        if hasattr(batch, "mark_consumed"):  # before ModelCheckpoint saves, in on_train_batch_end
            batch.mark_consumed()

    def log_step(self, row: dict[str, float], result, batch_size: int) -> None:
        self.log_dict(row, batch_size=batch_size, logger=False)  # for callbacks (monitor, progress bar)
        if result is not None:
            self.log("reward", row["train/reward_mean"], prog_bar=True, batch_size=batch_size, logger=False)
            self.write_completions(result, "train")
        self.log_metrics_at_update(row)

    def check_before(self, stage: str) -> None:
        preflight.check(self, stage)
        self.log_engine()

    def log_engine(self) -> None:  # the engine and its rollout dtype, as hyperparameters
        for logger in self.loggers:
            logger.log_hyperparams(self.rollouts.engine_params())

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":  # (fit checked its validation in on_fit_start)
            self.check_before("validate")

    def on_test_start(self) -> None:
        self.check_before("test")

    def on_predict_start(self) -> None:
        self.check_before("predict")

    # ------------------------------------------------------------------ checkpoints and logging

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.keep_trainable(self.senior, checkpoint, self.history, self.run_id)
        self.rollouts.save_carry(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.check_trainable(self.senior, checkpoint)
        self.history = list(checkpoint.get("tandem_lit", {}).get("history", []))
        self.run_id = checkpoint.get("tandem_lit", {}).get("run_id") or self.run_id
        self.rollouts.loaded(checkpoint)

    def log_metrics_at_update(self, row: dict[str, float]) -> None:
        """Log a row at x = optimiser updates so far (0 = before training), the x of every plot,
        of completions.jsonl and of the summary."""
        for logger in self.loggers:
            logger.log_metrics(row, step=self.global_step)
        self.history.append({"step": self.global_step, **row})

    def write_completions(self, result, split: str) -> None:
        completions.append_sampled(self._trainer, self.logging_settings, result, self.tokenizer, split, self.run_id,
                                   self.global_step)

