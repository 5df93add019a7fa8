"""TandemModule: the senior and a frozen junior co-write rollouts; the objective updates the senior.

One training step, top to bottom in ``training_step``:

    prompts -> rollouts.generate(rows, handoff)    both models write one shared sequence, graded
            -> updates.run(result)                 objective over senior tokens; optimiser steps
            -> metrics                             logged at x = optimiser updates so far

Optimisation is manual: each step draws ``batch_size x rollout.sampling.n`` rollouts, then takes
one optimiser update per ``update.mini_batch_size`` prompts, accumulating gradients over
micro-batches of ``update.micro_batch_size`` sequences (and ``memory.micro_batch_tokens`` tokens).
``trainer.global_step`` counts optimiser updates.

The engine decodes from its own rollout copy of the senior (bf16 on a GPU, LoRA merged), loaded
from the trained weights before the first rollout after an update; the update recomputes the
log-probs with the training model. The two phases take turns with the GPU's memory: the engine
frees its KV caches before the update, gradients are freed after it (``MemorySettings``).
The phases are ``RolloutPhase`` and ``UpdatePhase``; validation, test and predict live in
``tandem_lit.evaluation.steps.EvaluationSteps``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch import nn

from tandem_lit.errors import ConfigError
from tandem_lit.evaluation.metrics import JargonDetector, rollout_stats
from tandem_lit.evaluation.report import merge_totals
from tandem_lit.evaluation.steps import EvaluationSteps
from tandem_lit.models import (
    LoraSettings,
    ModelSource,
    apply_lora,
    freeze,
    load_causal_lm,
    load_tokenizer,
    quantization_config,
)
from tandem_lit.objectives.base import Objective
from tandem_lit.rollout import out_of_memory
from tandem_lit.rollout.choice import default_engine
from tandem_lit.rollout.engine import RolloutEngine
from tandem_lit.rollout.handoff import HandoffPolicy
from tandem_lit.rollout.logprobs import avoid_cudnn_attention_backward
from tandem_lit.rollout.record import Author
from tandem_lit.rollout.weights import gathered, rollout_named_tensors
from tandem_lit.runs import start_run_record
from tandem_lit.training import checkpoints, completions, preflight
from tandem_lit.training.distributed import Shares, check_several_processes, reduce_metrics
from tandem_lit.training.memory import GIB, estimate_run_memory, plan_kv_pool, size_rollout_memory
from tandem_lit.training.rollout_phase import RolloutPhase
from tandem_lit.training.settings import (
    EvaluationSettings,
    LoggingSettings,
    MemorySettings,
    RolloutSettings,
    TrainingStalledError,
    UpdateSettings,
)
from tandem_lit.training.update_phase import UpdatePhase
from tandem_lit.verifiers.base import Verifier, label_means

log = logging.getLogger(__name__)

# jsonargparse builds this from `class_path: torch.optim.AdamW` + init_args, leaving the params out
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


class _OfRolloutPhase:
    """A module attribute kept in its rollout phase (the tokenizers: the phase encodes every prompt)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, module, owner=None):
        return self if module is None else getattr(module.rollouts, self.name)

    def __set__(self, module, value) -> None:
        setattr(module.rollouts, self.name, value)


class TandemModule(EvaluationSteps, L.LightningModule):
    """Tandem RL of a senior LM with a frozen junior co-author.

    Args:
        senior: The trained model (hub name or folder).
        verifier: Grades the joint answers (same object for rewards and evaluation).
        objective: The loss: Reinforce, SoftMaskedReinforce or GRPO.
        handoff: Who writes each span of a training rollout (SoloHandoff: plain RL).
        junior: The frozen partner (None only with SoloHandoff(author='senior')).
        lora: Train LoRA adapters instead of full weights.
        engine: Rollout engine (default: FastEngine when it supports the architecture, else
            HFEngine, with a warning; the choice is logged as the ``engine`` hyperparameter). Its
            ``rollout_dtype`` decides the senior's rollout copy (default: bf16 on a GPU).
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
        needs_junior = handoff.only_author != Author.SENIOR or {"junior", "tandem"} & set(self.evaluation.modes)
        if junior is None and needs_junior:
            raise ConfigError(
                f"handoff {handoff!r} and evaluation.modes {self.evaluation.modes} need a junior model: set "
                "`junior`, or use SoloHandoff(author='senior') with evaluation.modes: [senior] for plain RL"
            )
        self.rollouts = RolloutPhase(self.rollout_settings, verifier, junior is not None, self.ready_engine, lambda: self.device)
        self.updates = UpdatePhase(self.update_settings, self.memory, objective, self.sampling)
        self._engine_device: torch.device | None = None
        # optimiser updates (and checkpoint loads) so far, and the version the engine decodes
        self._policy_version = self._engine_version = 0
        self._idle_steps = 0
        self._test_tallies: dict = {}  # eval set name -> DatasetTally, during `tandem-lit test`
        self.estimated_memory = None  # MemoryEstimate of a step, made when fit starts on a GPU
        self.run_id: str | None = None  # set when fit starts; kept by checkpoints across resumes
        self.senior: nn.Module | None = None
        self.junior: nn.Module | None = None
        self.reference: nn.Module | None = None
        # every logged metric row, for plots and summaries. (No save_hyperparameters: the resolved
        # config.yaml is the record of a run, and LightningCLI would rebuild the module from it.)
        self.history: list[dict[str, float]] = []

    @property
    def sampling(self):
        return self.rollout_settings.sampling

    tokenizer = _OfRolloutPhase()
    junior_tokenizer = _OfRolloutPhase()

    # ----------------------------------------------------------------------------------- models

    def configure_model(self) -> None:
        if self.senior is not None:
            return
        self.tokenizer = load_tokenizer(self.senior_source)
        senior = load_causal_lm(self.senior_source, quantization_config(self.lora))
        # (test, validate and predict train nothing: a bf16 senior is what they should decode)
        fitting = self._trainer is None or self._trainer.state.fn in (None, "fit")
        if self.lora is None and fitting:
            preflight.check_weight_precision(senior, self.update_settings.allow_low_precision_weights)
        elif self.lora is not None:
            senior = apply_lora(senior, self.lora)
        if self.memory.gradient_checkpointing:
            senior.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.senior = senior
        if self.junior_source is not None:
            self.junior = freeze(load_causal_lm(self.junior_source))
            self.junior_tokenizer = load_tokenizer(self.junior_source)
        if self.objective.uses_reference and self.lora is None:
            self.reference = freeze(copy.deepcopy(senior))
        mesh = getattr(self, "_device_mesh", None)  # set by FSDP2Strategy (trainer.strategy: fsdp)
        if mesh is not None:
            from tandem_lit.training.distributed import shard_model

            bf16 = str(self.trainer.precision).startswith("bf16")
            self.senior = shard_model(senior, mesh["data_parallel"], bf16_compute=bf16)
        if self.engine is None:
            self.engine = default_engine(self.senior, self.junior)
        if self.engine.queues_rows and self.engine.max_batch is None:  # rollout.batch_size: sequences at once
            self.engine.max_batch = self.rollout_settings.batch_size
        self.updates.bind(self.senior, self.reference, self.manual_backward)

    def ready_engine(self) -> RolloutEngine:
        """The engine, bound to the models where they now live (after Lightning moved them), its
        rollout copy loaded with the current trained weights (once per rollout phase after updates)."""
        if self._engine_device != self.device:
            if self.engine.wants_kv_plan:
                estimate = self.estimated_memory or self.memory_estimate()  # (made at fit start on a GPU)
                self.engine.plan_kv_cache(estimate.rollout["KV caches"])
            with gathered(self.senior):  # (a no-op unless FSDP shards the senior)
                self.engine.setup(self.senior, self.junior, self.tokenizer, self.junior_tokenizer)
            self.updates.vocab = self.engine.sampled_vocab  # the update scores over what the engine samples from
            self._engine_device = self.device
            self._engine_version = self._policy_version
            rollout_dtype = str(next(self.engine.senior.parameters()).dtype).removeprefix("torch.")
            for logger in self.loggers:
                logger.log_hyperparams({"engine": type(self.engine).__name__, "rollout_dtype": rollout_dtype})
        elif self._engine_version != self._policy_version:
            if self.engine.decodes_copy:
                with gathered(self.senior):
                    self.engine.load_weights(rollout_named_tensors(self.senior))
            self._engine_version = self._policy_version
        return self.engine

    def memory_estimate(self, prompts_per_step: int | None = None, mixed_precision: bool | None = None,
                        decode_dtype: torch.dtype | None = None, world: int | None = None):
        """The step's memory per GPU from the models' shapes and this run's settings;
        ``prompts_per_step``, ``mixed_precision`` and ``world`` (FSDP2 ranks) default to the data
        module's and trainer's (``estimate_run_memory``)."""
        trainer = self._trainer
        if prompts_per_step is None:
            prompts_per_step = getattr(getattr(trainer, "datamodule", None), "batch_size", 1)
        if mixed_precision is None:
            mixed_precision = "mixed" in str(getattr(trainer, "precision", "32"))
        if world is None:
            world = getattr(trainer, "world_size", 1)
        kv_pool_tokens, kv_pool_gib = self.engine.kv_pool_size()
        return estimate_run_memory(
            self.senior, self.junior, self.reference is not None, getattr(self.engine, "rollout_dtype", "auto"),
            self.rollout_settings, self.update_settings, self.memory, prompts_per_step, mixed_precision, decode_dtype,
            kv_pool_tokens, kv_pool_gib, world=world, prefill_tokens=getattr(self.engine, "prefill_tokens", None),
        )

    def size_kv_pool(self, capacity: int) -> str:
        """``kv_cache_gib: auto``: the engine's KV pool and prefill size from the card's ``capacity``
        (bytes) and the memory plan (``size_rollout_memory``); the plan is remade at those sizes."""
        sequence_tokens = (self.rollout_settings.max_prompt_tokens or 512) + self.sampling.max_new_tokens
        pool, prefill = size_rollout_memory(capacity, self.estimated_memory, sequence_tokens, self.engine.prefill_tokens)
        self.engine.kv_cache_tokens, self.engine.prefill_tokens = pool, prefill
        self.estimated_memory = self.memory_estimate()
        return f"kv_cache_gib: auto sized the KV pool to {pool:,} token positions and prefill_tokens to {prefill:,}"

    def configure_optimizers(self):
        params = [p for p in self.senior.parameters() if p.requires_grad]
        if self.optimizer_factory is None:
            return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
        try:
            return self.optimizer_factory(params)
        except ValueError as err:  # torch.optim's argument checks (a negative lr, betas outside [0, 1))
            raise ConfigError(
                f"the optimizer refused its settings: {err}. Fix model.init_args.optimizer.init_args "
                "(--print_config shows them)."
            ) from None

    def on_fit_start(self) -> None:
        if self.objective.group_relative and self.sampling.n < 2:
            raise ConfigError(
                f"{type(self.objective).__name__} compares the rollouts of each prompt, and rollout.sampling.n is "
                f"{self.sampling.n}: every advantage would be 0 and nothing would train. Set rollout.sampling.n >= 2 "
                "(Tandem RLVR uses 8), or use Reinforce."
            )
        preflight.check(self, "fit")
        if self.trainer.world_size > 1:
            sampling = self.rollout_settings.dynamic_sampling
            check_several_processes(self.senior, self.trainer, self.update_settings.mini_batch_size,
                                    sampling.prompts_per_step if sampling is not None else None)
        self.run_id = start_run_record(self.trainer, self.run_id)
        if self.trainer.is_global_zero:
            log.info(checkpoints.models_line(self.senior, self.junior, self.lora))
        self.updates.use_fused_kernels(self.device)  # memory.fused_kernels: Liger's kernels, or PyTorch's (logged)
        if self.device.type != "cuda":
            return
        avoid_cudnn_attention_backward()
        self.estimated_memory = self.memory_estimate()
        properties = torch.cuda.get_device_properties(self.device)
        if getattr(self.engine, "kv_cache_gib", None) == "auto":
            log.info(self.size_kv_pool(properties.total_memory))
        if pool := plan_kv_pool(self.engine, self.estimated_memory, properties.total_memory):
            log.info(pool)
        log.info("estimated peak GPU memory of a training step: %s", self.estimated_memory.table())
        if self.memory.check:
            self.estimated_memory.check(properties.total_memory, properties.name)

    # --------------------------------------------------------------------------------- training

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        started = time.perf_counter()
        self.rollouts.timing = {}
        world, optimizer = self.trainer.world_size, self.optimizers().optimizer
        grader_timeouts = getattr(self.verifier, "timeouts", None)
        key = getattr(batch, "epoch", 0) * 1_000_003 + getattr(batch, "index", batch_idx)
        rows, skipped = self.rollouts.prompts_that_fit(batch)  # of the whole batch: every rank iterates the same ones
        shares = Shares(world, self.global_rank, self.update_settings.mini_batch_size, self.device)
        offload_seconds = self.updates.offload_optimizer_state(optimizer, self.device)
        with out_of_memory.phase("rollout", self.device, self.trainer):
            result, stats = self.rollouts.training_rollouts(rows, self.handoff, key, shares) if rows else (None, {})
        self.count_idle_step(result is None, len(rows))  # (decided alike on every rank: all raise, none waits)
        if self.rollout_settings.max_prompt_tokens is not None:
            stats["skipped_long_prompts"] = float(skipped)
        if self.memory.release_rollout_caches and self._engine_device is not None:
            self.engine.release()  # the update's activations get the KV caches' memory
        offload_seconds += self.updates.restore_optimizer_state(optimizer)
        generated = time.perf_counter()
        if result is None:
            stats["skipped_update"] = 1.0
        else:
            with out_of_memory.phase("update", self.device, self.trainer):
                update_metrics = self.updates.run(result, self.optimizers(), self.device, world, self.global_step)
            self._policy_version += int(update_metrics["updates"])
            stats.update(rollout_stats(result.rollout, result.rewards, result.correct, result.group, self.jargon))
            if self.logging_settings.language is not None:  # of the whole text and of each author's own words
                spans = [result.rollout.spans(i, self.tokenizer) for i in range(len(result.rollout.texts))]
                stats.update(self.logging_settings.language.stats(spans))
            stats.update(update_metrics)
            stats["tokens_per_second"] = float(result.rollout.lengths.sum()) / max(generated - started, 1e-9)
        stats["rollout_seconds"] = generated - started
        stats["update_seconds"] = time.perf_counter() - generated
        stats.update(engine_phases(self.rollouts.timing))
        if grader_timeouts is not None:  # graded 0 because the grader ran out of time (or could not decide)
            stats["grader_timeouts"] = float(self.verifier.timeouts - grader_timeouts)
        if self.updates.offload is not None:
            stats["optimizer_offload_seconds"] = offload_seconds
        if self.device.type == "cuda":
            stats["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / GIB
        # the verifier's labels (elegance, tests passed...): means over the grades that carry them,
        # summed over ranks before dividing (ranks hold different numbers of, e.g., correct solutions)
        labels = {name: [mean * count, count] for name, (mean, count) in label_means(result.grades).items()} if result else {}
        if world > 1:
            labels, stats = merge_totals(labels), reduce_metrics(stats)
        stats.update({name: total / count for name, (total, count) in labels.items()})
        row = {f"train/{k}": v for k, v in stats.items()}
        self.log_dict(row, batch_size=len(batch), logger=False)  # for callbacks (monitor, progress bar)
        if result is not None:
            self.log("reward", stats["reward_mean"], prog_bar=True, batch_size=len(batch), logger=False)
            self.write_completions(result, "train")
        self.log_metrics_at_update(row)
        if hasattr(batch, "mark_consumed"):  # before ModelCheckpoint saves, in on_train_batch_end
            batch.mark_consumed()

    def count_idle_step(self, idle: bool, fitting: int) -> None:
        """Fail instead of looping forever when steps keep making no update (``fitting``: the
        prompts of this step's batch that fit ``max_prompt_tokens``)."""
        self._idle_steps = self._idle_steps + 1 if idle else 0
        if self._idle_steps < self.update_settings.max_idle_steps:
            return
        world, limit = self.trainer.world_size, f"rollout.max_prompt_tokens={self.rollout_settings.max_prompt_tokens}"
        if not fitting:
            raise TrainingStalledError(
                f"every prompt of the last {self._idle_steps} batches is longer than {limit}, so no update can happen: "
                "raise it or use shorter prompts."
            )
        if self.rollout_settings.dynamic_sampling is None:  # (one process trains every prompt that fits)
            raise TrainingStalledError(
                f"fewer than {world} prompts of each of the last {self._idle_steps} batches fit {limit}, and the {world} "
                "processes train equal shares, so no update can happen: raise it, use shorter prompts or a larger batch."
            )
        raise TrainingStalledError(
            f"dynamic sampling found no prompt whose rollouts got different rewards in {self._idle_steps} "
            "consecutive steps, so no update can happen: every group is all-correct or all-wrong. Use easier "
            "or harder data, more rollouts per prompt (rollout.sampling.n), or turn dynamic_sampling off."
            + (f" (On {world} processes a step needs at least {world} such prompts.)" if world > 1 else "")
        )

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "validate":  # (fit checked its validation in on_fit_start)
            preflight.check(self, "validate")

    def on_test_start(self) -> None:
        preflight.check(self, "test")

    def on_predict_start(self) -> None:
        preflight.check(self, "predict")

    # ------------------------------------------------------------------ checkpoints and logging

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.keep_trainable(self.senior, checkpoint, self.history, self.run_id)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoints.check_trainable(self.senior, checkpoint)
        self.history = list(checkpoint.get("tandem_lit", {}).get("history", []))
        self.run_id = checkpoint.get("tandem_lit", {}).get("run_id") or self.run_id
        self._policy_version += 1  # the loaded weights reach the engine's copy before the next rollout

    def log_metrics_at_update(self, row: dict[str, float]) -> None:
        """Log a row at x = optimiser updates so far (0 = before training), the x of every plot,
        of completions.jsonl and of the summary."""
        for logger in self.loggers:
            logger.log_metrics(row, step=self.global_step)
        self.history.append({"step": self.global_step, **row})

    def write_completions(self, result, split: str) -> None:
        every = self.logging_settings.completions_every_n_steps
        if not every or self.trainer is None or self.global_step % every or not self.trainer.is_global_zero:
            return
        completions.append(self.trainer.default_root_dir, result, self.tokenizer, split, self.run_id, self.global_step,
                           self.logging_settings.completions_per_log)


def engine_phases(timing: dict[str, float]) -> dict[str, float]:
    """A step's engine phases as train metrics (engines that report ``last_timing``)."""
    if not timing:
        return {}
    return {
        "rollout_setup_seconds": timing["setup_s"],
        "rollout_prefill_seconds": timing["prefill_s"],
        "rollout_decode_seconds": timing["decode_s"],
        "decode_step_ms": 1000 * timing["decode_s"] / max(timing["decode_steps"], 1),
        "rollout_prompt_width": timing["prompt_width"] / timing["calls"],
        # FastEngine's continuous batching: the share of decoded row-steps that wrote a token
        **({"rollout_busy_slot_fraction": timing["busy_slot_fraction"] / timing["calls"]} if "busy_slot_fraction" in timing else {}),
        # ... and its refills: prefills of queued sequences into freed rows, and the sequences they admitted
        **({"rollout_refills": timing["refills"], "rollout_refilled_sequences": timing["refilled_sequences"]}
           if "refilled_sequences" in timing else {}),
        "rollout_decode_steps": timing["decode_steps"],
        # ... and its paged pool: sequences preempted when it filled, the tokens they prefilled to go on
        **({"rollout_preemptions": timing["preemptions"], "rollout_resumed_tokens": timing["resumed_tokens"],
            "rollout_kv_pool_peak_fraction": timing["kv_pool_peak_fraction"] / timing["calls"]}
           if "preemptions" in timing else {}),
    }
