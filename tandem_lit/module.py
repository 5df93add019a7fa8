"""TandemModule: the senior and a frozen junior co-write rollouts; the objective updates the senior.

One training step, top to bottom in ``training_step``:

    prompts -> engine.generate(prompts, handoff)   both models write one shared sequence
            -> verifier(texts, **columns)           rewards of the joint answers
            -> objective(logp, author, rewards)     junior tokens weighted explicitly
            -> optimiser step(s) on the senior      LoRA or full weights; the junior never moves

Optimisation is manual: each step draws ``batch_size x sampling.n`` rollouts, then takes one
optimiser update per ``mini_batch_size`` prompts, accumulating gradients over micro-batches of
``micro_batch_size`` sequences (and ``memory.micro_batch_tokens`` tokens).
``trainer.global_step`` counts optimiser updates.

The engine decodes from its own rollout copy of the senior (bf16 on a GPU, LoRA merged), loaded
from the trained weights before the first rollout after an update; the update recomputes the
log-probs with the training model. The two phases take turns with the GPU's memory: the engine
frees its KV caches before the update, gradients are freed after it (``MemorySettings``).
Validation, test and predict live in ``eval_steps.EvaluationSteps``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from tandem_lit.distributed import (
    all_reduce_sum,
    balance,
    full_value,
    max_over_ranks,
    merge_totals,
    rank_rows,
    reduce_metrics,
)
from tandem_lit.errors import ConfigError, NonFiniteGradientError
from tandem_lit.eval_steps import EvalMode, EvaluationSteps
from tandem_lit.language import LanguageShare
from tandem_lit.logprobs import avoid_cudnn_attention_backward, completion_logprobs
from tandem_lit.memory import GIB, ModelShape, OptimizerOffload, StepSettings, estimate_step_memory, pack_by_tokens
from tandem_lit.metrics import JargonDetector, LogprobGap, rollout_stats
from tandem_lit.models import (
    LoraSettings,
    ModelSource,
    apply_lora,
    freeze,
    load_causal_lm,
    load_tokenizer,
    quantization_config,
)
from tandem_lit.objectives.base import AuthorshipError, Objective, ObjectiveInputs
from tandem_lit.results import RolloutResult, concat_results
from tandem_lit.rollout.engine import HFEngine, RolloutEngine
from tandem_lit.rollout.handoff import HandoffPolicy, ParagraphHandoff
from tandem_lit.rollout.record import Author, PromptBatch, Rollout
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.weights import gathered, is_sharded, needs_copy, rollout_dtype, rollout_named_tensors
from tandem_lit.runs import start_run_record
from tandem_lit.settings import DynamicSampling, MemorySettings, OverlongPolicy, PromptFormat, TrainingStalledError
from tandem_lit.verifiers.base import Verifier, label_means

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
        engine: Rollout engine (default: FastEngine when it supports the architecture, else
            HFEngine, with a warning; the choice is logged as the ``engine`` hyperparameter). Its
            ``rollout_dtype`` decides the senior's rollout copy (default: bf16 on a GPU).
        sampling: Training rollouts (``n`` = rollouts per prompt, GRPO's group size).
        eval_sampling: Validation rollouts (default greedy, one per prompt; with ``n`` > 1 the
            validation also logs ``eval/<mode>_pass_at_<k>`` for checkpoint selection).
        test_handoff: Handoff of ``tandem-lit test`` (default: paragraph level, p=0.5, the model
            under test writes first, as in Tandem RLVR's evaluation).
        test_sampling: Sampling of ``tandem-lit test`` (default: eval_sampling).
        test_forced_token: ``tandem-lit test`` also forces one junior token into each solo
            sample (where the two models' top tokens differ) and reports the change in success
            (``forced_token_*``; the extension's experiment, tandem_lit/forced_token.py).
        pass_k: The k of the reported pass@k (those <= n).
        optimizer: Optimizer factory (default AdamW, lr 1e-6, no weight decay).
        mini_batch_size: Prompts per optimiser update (None: the whole step batch, one update).
        rollout_batch_size: Sequences per engine call (None: all of a step's rollouts at once);
            bounds the KV cache memory of generation.
        micro_batch_size: Sequences per forward/backward pass (gradient accumulation).
        memory: Rollout caches, optimizer offload, activation checkpointing, token-bounded
            micro-batches and the memory check before the run (``MemorySettings``).
        max_grad_norm: Clip the gradient norm (None: no clipping).
        max_prompt_tokens: Training skips prompts longer than this (after the chat template),
            counted in ``train/skipped_long_prompts`` (verl's overlong-prompt filter). Evaluation
            never skips. None: no limit.
        overlong: What truncated completions contribute (keep, mask, penalty).
        dynamic_sampling: Drop prompt groups whose rewards all agree and refill (None: off).
        max_idle_steps: Stop with an error after this many consecutive training steps that could
            make no update (dynamic sampling found no signal, or every prompt was too long):
            such a run would otherwise never reach ``max_steps``.
        allow_low_precision_weights: Train a full-weight senior held in bfloat16/float16. Off by
            default: AdamW updates smaller than half a bf16 rounding step vanish (at lr 1e-6 most
            do), so such a run silently barely trains. Use float32 weights (optionally with
            ``trainer.precision: bf16-mixed``) or LoRA instead.
        prompt_format: Chat template use, system prompt and prompt template (the senior's; also
            the junior's unless ``junior_prompt_format`` is set).
        junior_prompt_format: The junior's own prompt (e.g. a system prompt telling it to answer in
            French), while both models share the response tokens. None: the senior's.
        eval_modes: Validation runs each: ``senior`` alone, ``junior`` alone, ``tandem`` (with
            ``eval_handoff``). Metrics are logged as ``eval/<mode>_<metric>``.
        eval_handoff: Handoff of the ``tandem`` eval mode (None: the training handoff). A
            no-handoff control sets the tandem run's handoff here, so that both runs' tandem
            accuracy is measured the same way.
        evaluate_at_start: Validate once before the first update (logged at step 0).
        jargon_pattern: Regex whose match marks a solution as using jargon.
        language: The language share of rollouts and evaluations (``LanguageShare``:
            ``train/language_share``, ``train/senior_language_share``, ``eval/<mode>_language_share``;
            docs/language.md). None: not measured.
        authorship_z: Fail when the junior's share of handoff draws is further than this many
            standard deviations from ``handoff.p`` (an engine that ignores the policy).
        completions_every_n_steps: Append sample completions, spans marked by author, to
            ``completions.jsonl`` in the run folder every this many steps (0: never).
        completions_per_log: How many completions each time.
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
        sampling: SamplingConfig | None = None,
        eval_sampling: SamplingConfig | None = None,
        test_handoff: HandoffPolicy | None = None,
        test_sampling: SamplingConfig | None = None,
        test_forced_token: bool = False,
        pass_k: list[int] | None = None,
        optimizer: OptimizerCallable | None = None,
        mini_batch_size: int | None = None,
        rollout_batch_size: int | None = None,
        micro_batch_size: int = 16,
        memory: MemorySettings | None = None,
        max_grad_norm: float | None = 1.0,
        max_prompt_tokens: int | None = None,
        overlong: OverlongPolicy | None = None,
        dynamic_sampling: DynamicSampling | None = None,
        max_idle_steps: int = 20,
        allow_low_precision_weights: bool = False,
        prompt_format: PromptFormat | None = None,
        junior_prompt_format: PromptFormat | None = None,
        eval_modes: list[EvalMode] | None = None,
        eval_handoff: HandoffPolicy | None = None,
        evaluate_at_start: bool = True,
        jargon_pattern: str = r"<<[^<>\n]*>>",
        language: LanguageShare | None = None,
        authorship_z: float = 6.0,
        completions_every_n_steps: int = 10,
        completions_per_log: int = 4,
    ):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold trainable weights only (see on_save_checkpoint)
        self.senior_source = senior
        self.junior_source = junior
        self.verifier = verifier
        self.objective = objective
        self.handoff = handoff
        self.lora = lora
        self.engine = engine
        self._engine_device: torch.device | None = None
        self.sampling = sampling or SamplingConfig(temperature=1.0, n=2)
        self.eval_sampling = eval_sampling or SamplingConfig(temperature=0.0, max_new_tokens=self.sampling.max_new_tokens)
        self.test_handoff = test_handoff or ParagraphHandoff(p=0.5, first_author="senior")
        self.test_sampling = test_sampling or self.eval_sampling
        self.test_forced_token = test_forced_token
        self.pass_k = sorted(set(pass_k or [1, 2, 4, 8]))
        self._test_tallies: dict = {}  # eval set name -> DatasetTally, during `tandem-lit test`
        self.optimizer_factory = optimizer
        self.mini_batch_size = mini_batch_size
        self.rollout_batch_size = rollout_batch_size
        self.micro_batch_size = micro_batch_size
        self.memory = memory or MemorySettings()
        self._offload = OptimizerOffload() if self.memory.offload_optimizer else None
        # optimiser updates (and checkpoint loads) so far, and the version the engine decodes
        self._policy_version = 0
        self._engine_version = 0
        self.rollout_timing: dict[str, float] = {}  # the engine's phase times, summed over this step's calls
        self.estimated_memory = None  # MemoryEstimate of a step, made when fit starts on a GPU
        self.run_id: str | None = None  # set when fit starts; kept by checkpoints across resumes
        self.max_grad_norm = max_grad_norm
        self.max_prompt_tokens = max_prompt_tokens
        self.overlong = overlong or OverlongPolicy()
        self.dynamic_sampling = dynamic_sampling
        self.max_idle_steps = max_idle_steps
        self.allow_low_precision_weights = allow_low_precision_weights
        self._idle_steps = 0
        self.prompt_format = prompt_format or PromptFormat()
        self.junior_prompt_format = junior_prompt_format
        self.eval_modes = list(eval_modes) if eval_modes is not None else (["senior"] if junior is None else ["senior", "tandem", "junior"])
        self.eval_handoff = eval_handoff or handoff
        self.evaluate_at_start = evaluate_at_start
        self.jargon = JargonDetector(jargon_pattern)
        self.language = language
        self.authorship_z = authorship_z
        self.completions_every_n_steps = completions_every_n_steps
        self.completions_per_log = completions_per_log
        self._check_config()
        self.senior: nn.Module | None = None
        self.junior: nn.Module | None = None
        self.reference: nn.Module | None = None
        self.tokenizer = None
        # every logged metric row, for plots and summaries. (No save_hyperparameters: the resolved
        # config.yaml is the record of a run, and LightningCLI would rebuild the module from it.)
        self.history: list[dict[str, float]] = []

    def _check_config(self) -> None:
        needs_junior = self.handoff.only_author != Author.SENIOR or "junior" in self.eval_modes or "tandem" in self.eval_modes
        if self.junior_source is None and needs_junior:
            raise ConfigError(
                f"handoff {self.handoff!r} and eval_modes {self.eval_modes} need a junior model: set "
                "`junior`, or use SoloHandoff(author='senior') with eval_modes: [senior] for plain RL"
            )
        if self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ConfigError(f"mini_batch_size must be >= 1 prompt, got {self.mini_batch_size}")
        if self.test_forced_token and self.junior_source is None:
            raise ConfigError("test_forced_token needs a junior model (its token is the one forced): set `junior`")
        unknown = set(self.eval_modes) - {"senior", "junior", "tandem"}
        if unknown:
            raise ConfigError(f"eval_modes may hold 'senior', 'junior', 'tandem'; got {sorted(unknown)}")

    # ----------------------------------------------------------------------------------- models

    def configure_model(self) -> None:
        if self.senior is not None:
            return
        self.tokenizer = load_tokenizer(self.senior_source)
        senior = load_causal_lm(self.senior_source, quantization_config(self.lora))
        if self.lora is None:
            self.check_weight_precision(senior)
        else:
            senior = apply_lora(senior, self.lora)
        if self.memory.gradient_checkpointing:
            senior.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.senior = senior
        junior_tokenizer = None
        if self.junior_source is not None:
            self.junior = freeze(load_causal_lm(self.junior_source))
            junior_tokenizer = load_tokenizer(self.junior_source)
        if self.objective.uses_reference and self.lora is None:
            import copy

            self.reference = freeze(copy.deepcopy(senior))
        self.junior_tokenizer = junior_tokenizer
        mesh = getattr(self, "_device_mesh", None)  # set by FSDP2Strategy (trainer.strategy: fsdp)
        if mesh is not None:
            from tandem_lit.distributed import shard_model

            bf16 = str(self.trainer.precision).startswith("bf16")
            self.senior = shard_model(senior, mesh["data_parallel"], bf16_compute=bf16)
        if self.engine is None:
            self.engine = default_engine(self.senior, self.junior)

    def ready_engine(self) -> RolloutEngine:
        """The engine, bound to the models where they now live (after Lightning moved them), its
        rollout copy loaded with the current trained weights (once per rollout phase after updates)."""
        if self._engine_device != self.device:
            with gathered(self.senior):  # (a no-op unless FSDP shards the senior)
                self.engine.setup(self.senior, self.junior, self.tokenizer, self.junior_tokenizer)
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

    def on_fit_start(self) -> None:
        if self.objective.group_relative and self.sampling.n < 2:
            raise ConfigError(
                f"{type(self.objective).__name__} compares the rollouts of each prompt, and sampling.n is "
                f"{self.sampling.n}: every advantage would be 0 and nothing would train. Set sampling.n >= 2 "
                "(Tandem RLVR uses 8), or use Reinforce."
            )
        if self.trainer.world_size > 1:
            self.check_several_processes()
        self.run_id = start_run_record(self.trainer, self.run_id)
        if self.trainer.is_global_zero:
            log.info(self.models_line())
        if self.device.type != "cuda":
            return
        avoid_cudnn_attention_backward()
        self.estimated_memory = self.memory_estimate()
        log.info("estimated peak GPU memory of a training step: %s", self.estimated_memory.table())
        if self.memory.check:
            properties = torch.cuda.get_device_properties(self.device)
            self.estimated_memory.check(properties.total_memory, properties.name)

    def check_several_processes(self) -> None:
        """What must hold for W ranks to take equal shares of every step (``rank_rows``)."""
        world = self.trainer.world_size
        if not is_sharded(self.senior):
            raise ConfigError(
                f"{world} processes with trainer.strategy {type(self.trainer.strategy).__name__}: tandem-lit trains on "
                "several processes with trainer.strategy: fsdp (FSDP2) only"
            )
        batch_size = getattr(self.trainer.datamodule, "batch_size", None)
        if batch_size is not None:
            try:
                rank_rows(batch_size, world, 0, self.mini_batch_size)
            except ValueError:
                raise ConfigError(
                    f"data batch_size {batch_size} in mini-batches of {self.mini_batch_size or batch_size} prompts does not "
                    f"split over {world} processes: make every mini-batch a multiple of {world} prompts"
                ) from None
        for what, value in (("dynamic_sampling", self.dynamic_sampling), ("max_prompt_tokens", self.max_prompt_tokens)):
            if value is not None:  # both make ranks' shares unequal
                raise ConfigError(f"{what} is not supported on several processes yet: unset it, or train on one")

    def models_line(self) -> str:
        """One line on what trains and what does not (in place of Lightning's model summary)."""
        def count(model: nn.Module, trainable: bool | None = None) -> str:
            n = sum(p.numel() for p in model.parameters() if trainable is None or p.requires_grad == trainable)
            return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} K"

        dtype = str(next(self.senior.parameters()).dtype).removeprefix("torch.")
        line = f"senior {count(self.senior)} parameters ({count(self.senior, True)} trained, {dtype}"
        line += f", LoRA r={self.lora.r})" if self.lora else ")"
        if self.junior is not None:
            line += f"; junior {count(self.junior)} (frozen)"
        return line

    def memory_estimate(
        self, prompts_per_step: int | None = None, mixed_precision: bool | None = None, decode_dtype: torch.dtype | None = None,
    ):
        """The step's memory from the models' shapes and this run's settings (``tandem_lit.memory``);
        ``prompts_per_step`` and ``mixed_precision`` default to the data module's and trainer's,
        ``decode_dtype`` to the engine's rollout dtype here (pass bf16 to size a GPU run elsewhere)."""
        requested = getattr(self.engine, "rollout_dtype", "auto")
        if decode_dtype is None and requested != "live":
            decode_dtype = rollout_dtype(requested, self.senior)
        copy = decode_dtype is not None and needs_copy(self.senior, decode_dtype)
        senior = ModelShape.of(self.senior)
        junior = ModelShape.of(self.junior) if self.junior is not None else None
        trainer = self._trainer
        if prompts_per_step is None:
            prompts_per_step = getattr(getattr(trainer, "datamodule", None), "batch_size", 1)
        step_rollouts = prompts_per_step * self.sampling.n
        per_call = max(1, (self.rollout_batch_size or step_rollouts) // self.sampling.n) * self.sampling.n
        sequence_tokens = (self.max_prompt_tokens or 512) + self.sampling.max_new_tokens
        micro_tokens = self.micro_batch_size * sequence_tokens
        if self.memory.micro_batch_tokens is not None:
            micro_tokens = min(micro_tokens, max(self.memory.micro_batch_tokens, sequence_tokens))
        settings = StepSettings(
            rollout_sequences=min(per_call, step_rollouts),
            sequence_tokens=sequence_tokens,
            micro_batch_tokens=micro_tokens,
            rollout_bytes=decode_dtype.itemsize if copy else senior.param_bytes,
            rollout_copy=copy,
            junior_bytes=junior.param_bytes if junior else 0,
            mixed_precision=(
                "mixed" in str(getattr(trainer, "precision", "32")) if mixed_precision is None else mixed_precision
            ),
            checkpointing=self.memory.gradient_checkpointing,
            offload_optimizer=self.memory.offload_optimizer,
            reference_copy=self.reference is not None,
        )
        return estimate_step_memory(senior, junior, settings)

    def check_weight_precision(self, senior: nn.Module) -> None:
        dtype = next(senior.parameters()).dtype
        if dtype in (torch.bfloat16, torch.float16) and not self.allow_low_precision_weights:
            raise ConfigError(
                f"the senior's weights are {dtype} and would be trained in place: optimiser updates below the "
                f"{dtype} rounding step vanish (at lr 1e-6 most AdamW updates do). Load it with dtype: float32 "
                "(add trainer.precision: bf16-mixed for bf16 compute), train LoRA adapters, or set "
                "allow_low_precision_weights: true if you mean it."
            )

    def configure_optimizers(self):
        params = [p for p in self.senior.parameters() if p.requires_grad]
        if self.optimizer_factory is None:
            return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
        return self.optimizer_factory(params)

    # --------------------------------------------------------------------------------- rollouts

    def uses_chat_template(self, tokenizer, fmt: PromptFormat | None = None) -> bool:
        return (fmt or self.prompt_format).uses_chat_template(tokenizer)

    def format_prompt(self, prompt: str, tokenizer=None, fmt: PromptFormat | None = None) -> str:
        """The model input for a row's prompt (``PromptFormat.render``; the senior's format by default)."""
        return (fmt or self.prompt_format).render(prompt, tokenizer or self.tokenizer)

    def encode_prompts(self, prompts: list[str], tokenizer=None, padding: bool = True, fmt: PromptFormat | None = None) -> dict:
        """Token ids of formatted prompts (left-padded; a chat template brings its own special tokens)."""
        tokenizer = tokenizer or self.tokenizer
        texts = [self.format_prompt(p, tokenizer, fmt) for p in prompts]
        add_special = not self.uses_chat_template(tokenizer, fmt)
        if not padding:
            return tokenizer(texts, add_special_tokens=add_special)
        return tokenizer(texts, padding=True, padding_side="left", return_tensors="pt", add_special_tokens=add_special)

    def encode_junior_prompts(self, prompts: list[str]) -> dict:
        """The prompts as the junior reads them: its tokenizer and its own prompt format."""
        return self.encode_prompts(prompts, self.junior_tokenizer, fmt=self.junior_prompt_format or self.prompt_format)

    def rollout(
        self, rows: list[dict[str, Any]], policy: HandoffPolicy, sampling: SamplingConfig, key: int,
        row_ids: list[int] | None = None,
    ) -> RolloutResult:
        """Generate ``sampling.n`` rollouts per row and grade them. ``key`` fixes the seeds;
        ``row_ids``, the rows' places in the whole batch when they are one rank's share of it.

        The engine gets at most ``rollout_batch_size`` sequences per call (its KV caches are
        sized for one call); seeds are those of the whole batch, so chunking changes nothing else.
        """
        seeds = sequence_seeds(sampling.seed, key, (max(row_ids) + 1 if row_ids else len(rows)) * sampling.n)
        if row_ids:  # the seeds these rows get in one process
            seeds = seeds.view(-1, sampling.n)[torch.tensor(row_ids)].reshape(-1)
        per_call = max(1, (self.rollout_batch_size or len(rows) * sampling.n) // sampling.n)
        parts = []
        for start in range(0, len(rows), per_call):
            chunk = rows[start : start + per_call]
            part = self._rollout_chunk(chunk, policy, sampling, seeds[start * sampling.n : (start + len(chunk)) * sampling.n])
            part.group += start
            parts.append(part)
        return parts[0] if len(parts) == 1 else concat_results(parts, self.engine.pad_token_id)

    def _rollout_chunk(self, rows: list[dict[str, Any]], policy: HandoffPolicy, sampling: SamplingConfig, seeds: Tensor) -> RolloutResult:
        prompts_text = [row["prompt"] for row in rows for _ in range(sampling.n)]
        encoded = self.encode_prompts(prompts_text)
        partner = None
        if self.junior is not None and (getattr(self.engine, "needs_partner_prompts", False) or self.junior_prompt_format):
            junior = self.encode_junior_prompts(prompts_text)
            partner = PromptBatch(junior["input_ids"], junior["attention_mask"], seeds)
        prompts = PromptBatch(encoded["input_ids"], encoded["attention_mask"], seeds, partner).to(self.device)
        engine = self.ready_engine()
        rollout = engine.generate(prompts, policy, sampling)
        if hasattr(engine, "last_timing"):
            for name, value in dict(engine.last_timing(), calls=1).items():
                self.rollout_timing[name] = self.rollout_timing.get(name, 0.0) + value
        self.check_authorship(rollout, policy)
        columns = {name: [row[name] for row in rows for _ in range(sampling.n)] for name in rows[0] if name != "prompt"}
        grades = self.verifier.grade_batch(rollout.texts, **columns)
        group = torch.arange(len(rows)).repeat_interleave(sampling.n)
        return RolloutResult(rollout, grades, group, columns)

    def check_authorship(self, rollout: Rollout, policy: HandoffPolicy) -> None:
        """Fail closed: a tandem batch must carry authorship that follows the policy's draws."""
        if rollout.author is None:
            raise AuthorshipError("the engine returned rollouts without an author tensor")
        junior_tokens = int((rollout.author == Author.JUNIOR).sum())
        if policy.only_author == Author.SENIOR and junior_tokens:
            raise AuthorshipError(f"{policy!r} should give all-senior rollouts, but {junior_tokens} tokens are junior's")
        if policy.only_author is not None:
            return
        draws, junior = int(rollout.decisions.sum()), int(rollout.junior_draws.sum())
        if junior > 0 and junior_tokens == 0 and int(rollout.lengths.sum()) > draws:
            raise AuthorshipError("the junior was drawn but wrote no token: authorship was lost on the way")
        if draws >= 20 and 0 < policy.p < 1:
            z = (junior - policy.p * draws) / math.sqrt(draws * policy.p * (1 - policy.p))
            if abs(z) > self.authorship_z:
                raise AuthorshipError(
                    f"the junior won {junior} of {draws} handoff draws with p={policy.p} (z={z:.1f}); "
                    "the engine is not following the handoff policy"
                )

    # --------------------------------------------------------------------------------- training

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        started = time.perf_counter()
        self.rollout_timing = {}
        grader_timeouts = getattr(self.verifier, "timeouts", None)
        key = getattr(batch, "epoch", 0) * 1_000_003 + getattr(batch, "index", batch_idx)
        rows, skipped = self.prompts_that_fit(batch)
        row_ids = None
        if self.trainer.world_size > 1:  # this rank's share (every rank iterates the same batches)
            row_ids = rank_rows(len(rows), self.trainer.world_size, self.global_rank, self.mini_batch_size)
            rows = [rows[i] for i in row_ids]
        offload_seconds = self.offload_optimizer_state()
        if not rows:
            result, sampling_stats = None, {}
        elif self.dynamic_sampling is None:
            result, sampling_stats = self.rollout(rows, self.handoff, self.sampling, key, row_ids), {}
        else:
            result, sampling_stats = self.informative_rollouts(rows, key)
        self._count_idle_step(result is None, no_prompts=not rows)
        if self.max_prompt_tokens is not None:
            sampling_stats["skipped_long_prompts"] = float(skipped)
        if self.memory.release_rollout_caches and self._engine_device is not None:
            self.engine.release()  # the update's activations get the KV caches' memory
        offload_seconds += self.restore_optimizer_state()
        generated = time.perf_counter()
        if result is None:
            stats = dict(sampling_stats, skipped_update=1.0)
        else:
            update_metrics = self.optimise(result)
            stats = rollout_stats(result.rollout, result.rewards, result.correct, result.group, self.jargon)
            if self.language is not None:  # of the whole text and of each author's own words
                rollout = result.rollout
                stats.update(self.language.stats([rollout.spans(i, self.tokenizer) for i in range(len(rollout.texts))]))
            stats.update(update_metrics)
            stats.update(sampling_stats)
            stats["tokens_per_second"] = float(result.rollout.lengths.sum()) / max(generated - started, 1e-9)
        stats["rollout_seconds"] = generated - started
        stats["update_seconds"] = time.perf_counter() - generated
        stats.update(engine_phases(self.rollout_timing))
        if grader_timeouts is not None:  # graded 0 because the grader ran out of time (or could not decide)
            stats["grader_timeouts"] = float(self.verifier.timeouts - grader_timeouts)
        if self._offload is not None:
            stats["optimizer_offload_seconds"] = offload_seconds
        if self.device.type == "cuda":
            stats["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / GIB
        # the verifier's labels (elegance, tests passed...): means over the grades that carry them,
        # summed over ranks before dividing (ranks hold different numbers of, e.g., correct solutions)
        labels = {name: [mean * count, count] for name, (mean, count) in label_means(result.grades).items()} if result is not None else {}
        if self.trainer.world_size > 1:
            labels = merge_totals(labels)
        stats.update({name: total / count for name, (total, count) in labels.items()})
        if self.trainer.world_size > 1:
            stats = reduce_metrics(stats)
        row = {f"train/{k}": v for k, v in stats.items()}
        self.log_dict(row, batch_size=len(batch), logger=False)  # for callbacks (monitor, progress bar)
        if result is not None:
            self.log("reward", stats["reward_mean"], prog_bar=True, batch_size=len(batch), logger=False)
            self.write_completions(result, "train")
        self.log_metrics_at_update(row)
        if hasattr(batch, "mark_consumed"):  # before ModelCheckpoint saves, in on_train_batch_end
            batch.mark_consumed()

    def offload_optimizer_state(self) -> float:
        """Optimizer state to the host for the rollouts (``memory.offload_optimizer``); seconds taken."""
        started = time.perf_counter()
        if self._offload is not None and self.device.type == "cuda":
            self._offload.to_host(self.optimizers().optimizer)
        return time.perf_counter() - started

    def restore_optimizer_state(self) -> float:
        started = time.perf_counter()
        if self._offload is not None:
            self._offload.to_device(self.optimizers().optimizer)
        return time.perf_counter() - started

    def log_metrics_at_update(self, row: dict[str, float]) -> None:
        """Log a row at x = optimiser updates so far (0 = before training), the x of every plot,
        of completions.jsonl and of the summary."""
        for logger in self.loggers:
            logger.log_metrics(row, step=self.global_step)
        self.history.append({"step": self.global_step, **row})

    def _count_idle_step(self, idle: bool, no_prompts: bool) -> None:
        """Fail instead of looping forever when steps keep making no update."""
        self._idle_steps = self._idle_steps + 1 if idle else 0
        if self._idle_steps < self.max_idle_steps:
            return
        if no_prompts:
            raise TrainingStalledError(
                f"every prompt of the last {self._idle_steps} batches is longer than max_prompt_tokens="
                f"{self.max_prompt_tokens}, so no update can happen: raise max_prompt_tokens or use shorter prompts."
            )
        raise TrainingStalledError(
            f"dynamic sampling found no prompt whose rollouts got different rewards in {self._idle_steps} "
            "consecutive steps, so no update can happen: every group is all-correct or all-wrong. Use easier "
            "or harder data, more rollouts per prompt (sampling.n), or turn dynamic_sampling off."
        )

    def prompts_that_fit(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """The rows whose formatted prompt fits ``max_prompt_tokens``, and how many were skipped."""
        if self.max_prompt_tokens is None:
            return list(rows), 0
        lengths = [len(ids) for ids in self.encode_prompts([row["prompt"] for row in rows], padding=False)["input_ids"]]
        kept = [row for row, n in zip(rows, lengths) if n <= self.max_prompt_tokens]
        return kept, len(rows) - len(kept)

    def informative_rollouts(self, pool: list[dict[str, Any]], key: int) -> tuple[RolloutResult | None, dict[str, float]]:
        """Dynamic sampling: rollouts of up to ``prompts_per_step`` prompts whose rewards differ."""
        target, kept, dropped, rounds, start = self.dynamic_sampling.prompts_per_step, [], 0, 0, 0
        while sum(len(part.group.unique()) for part in kept) < target and start < len(pool) and rounds < self.dynamic_sampling.max_rounds:
            need = target - sum(len(part.group.unique()) for part in kept)
            rows = pool[start : start + need]
            start += len(rows)
            result = self.rollout(rows, self.handoff, self.sampling, key * 16 + rounds)
            rounds += 1
            useful = result.groups_with_spread()
            dropped += len(rows) - len(useful)
            if useful:
                kept.append(result.keep_groups(useful, offset=sum(len(p.group.unique()) for p in kept)))
        stats = {"sampling_rounds": float(rounds), "dropped_groups": float(dropped),
                 "kept_groups": float(sum(len(p.group.unique()) for p in kept))}
        if kept:
            return concat_results(kept, self.engine.pad_token_id), stats
        log.warning("dynamic sampling found no prompt with differing rewards in %d rounds: no update this step", rounds)
        return None, stats

    def optimise(self, result: RolloutResult) -> dict[str, float]:
        """Objective and optimiser updates on one batch of graded rollouts."""
        rollout, group = result.rollout, result.group.to(self.device)
        rewards = result.rewards.to(self.device)
        truncated = rollout.truncated.to(self.device)
        if self.overlong.mode == "penalty":
            rewards = torch.where(truncated, self.overlong.penalty, rewards)
        allowed = ~truncated if self.overlong.mode == "mask" else None
        optimizer = self.optimizers()
        prompts = int(group.max()) + 1
        world = self.trainer.world_size if self._trainer is not None else 1
        # with W ranks each holds 1/W of every mini-batch (``rank_rows``)
        per_update = self.mini_batch_size // world if self.mini_batch_size else prompts
        updates = [torch.nonzero((group >= s) & (group < s + per_update)).squeeze(-1) for s in range(0, prompts, per_update)]
        advantages = self.objective.advantages(rewards, group)
        # the ratio's denominator comes from the training model: recomputed before the first of
        # several updates; with one update it is the same forward's log-probs, detached
        old_logp = self.behaviour_logprobs(rollout) if self.objective.uses_old_logp and len(updates) > 1 else None
        ref_logp = self.reference_logprobs(rollout) if self.objective.uses_reference else None
        gap = LogprobGap()
        if old_logp is not None:
            gap.add(old_logp, rollout.senior_logprobs, rollout.author)
        totals: dict[str, float] = {}
        for rows in updates:
            mask = allowed[rows] if allowed is not None else None
            scale = self.objective.loss_scale(rollout.author[rows], advantages[rows], self.sampling.max_new_tokens, mask)
            micros = self.micro_batches(rollout, rows)
            if world > 1:  # normalisers of the whole mini-batch; as many passes as the busiest rank
                weight_sum, sequences = all_reduce_sum([scale.weight_sum, scale.sequences], self.device)
                scale = dataclasses.replace(scale, weight_sum=weight_sum, sequences=int(sequences))
                micros = balance(micros, max_over_ranks(len(micros), self.device))
            optimizer.zero_grad(set_to_none=True)
            for micro in micros:
                part = rollout.select(micro).trimmed()
                width = part.completion_ids.shape[1]
                logp = self.sequence_logprobs(self.senior, part)
                if old_logp is None:
                    gap.add(logp, part.senior_logprobs, part.author)
                inputs = ObjectiveInputs(
                    logp=logp,
                    author=part.author,
                    rewards=rewards[micro],
                    group=group[micro],
                    old_logp=old_logp[micro, :width] if old_logp is not None else None,
                    ref_logp=ref_logp[micro, :width] if ref_logp is not None else None,
                    advantages=advantages[micro],
                    mask=allowed[micro] if allowed is not None else None,
                    rollout_logp=part.senior_logprobs,
                )
                loss, metrics = self.objective(inputs, scale)
                self.manual_backward(loss * world)  # FSDP averages gradients over ranks
                # micro-batch losses add up to the update's loss; other metrics are row averages
                totals["loss"] = totals.get("loss", 0.0) + metrics.pop("loss") / len(updates)
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0.0) + value * len(micro) / len(group)
            # the norm is needed anyway: a non-finite gradient must never reach the weights
            norm = float(full_value(torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), self.max_grad_norm or math.inf)))
            if not math.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteGradientError(
                    f"the gradient norm is {norm} at step {self.global_step}: this update was not applied and the "
                    "run stops (resume from the last checkpoint). Look for "
                    "non-finite rewards or log-probs; lower the learning rate, set max_grad_norm, or train "
                    "with trainer.precision 32-true to see whether mixed precision causes it"
                )
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm / len(updates)
            optimizer.step()
            self._policy_version += 1
        optimizer.zero_grad(set_to_none=True)  # no gradient memory held through the next rollouts
        totals["updates"] = float(len(updates))
        totals.update(gap.metrics())
        return totals

    def micro_batches(self, rollout: Rollout, rows: Tensor) -> list[Tensor]:
        """The rows of one update in forward/backward passes of at most ``micro_batch_size`` rows
        and ``memory.micro_batch_tokens`` padded tokens (``memory.pack_by_tokens``). The gradient
        is a sum over rows: grouping does not change it."""
        if self.memory.micro_batch_tokens is None:
            return list(rows.split(self.micro_batch_size))
        prompts, completions = rollout.prompt_mask.sum(-1)[rows].tolist(), rollout.lengths[rows].tolist()
        packed = pack_by_tokens(prompts, completions, self.micro_batch_size, self.memory.micro_batch_tokens)
        return [rows[torch.tensor(b, device=rows.device)] for b in packed]

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.senior.parameters() if p.requires_grad]

    def sequence_logprobs(self, model: nn.Module, rollout: Rollout, temperature: float | None = None) -> Tensor:  # -> [N, T]
        """Log-probs of the completion tokens under ``model`` (teacher-forced, one forward).

        Logits are divided by the sampling temperature, as the sampler drew from that
        distribution (the TRL / verl convention), so importance ratios compare like with like.
        """
        return completion_logprobs(model, rollout, self.sampling.temperature if temperature is None else temperature)

    @torch.no_grad()
    def behaviour_logprobs(self, rollout: Rollout) -> Tensor:  # -> [N, T]
        """Senior log-probs before any update of this step (the ratio's denominator)."""
        return self.logprobs_by_rows(rollout, lambda part: self.sequence_logprobs(self.senior, part))

    @torch.no_grad()
    def reference_logprobs(self, rollout: Rollout) -> Tensor:  # -> [N, T]
        """Log-probs under the reference policy: the initial senior (LoRA disabled, or a frozen copy)."""
        if self.reference is not None:
            return self.logprobs_by_rows(rollout, lambda part: self.sequence_logprobs(self.reference, part))
        with self.senior.disable_adapter():
            return self.logprobs_by_rows(rollout, lambda part: self.sequence_logprobs(self.senior, part))

    def logprobs_by_rows(self, rollout: Rollout, logprobs: Callable[[Rollout], Tensor]) -> Tensor:  # -> [N, T]
        """``logprobs`` over the whole batch in micro-batches, padding columns trimmed per pass."""
        rows = torch.arange(rollout.completion_ids.shape[0], device=self.device)
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=self.device)
        for micro in self.micro_batches(rollout, rows):
            part = logprobs(rollout.select(micro).trimmed())
            out[micro, : part.shape[1]] = part.float()
        return out

    # ------------------------------------------------------------------------------- evaluation

    # ---------------------------------------------------------------------------- checkpointing

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only what training changes: the junior, the reference copy and frozen base
        weights are rebuilt from their sources on load."""
        trainable = {f"senior.{n}" for n, p in self.senior.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["tandem_lit"] = {"trainable_keys": sorted(trainable), "history": self.history, "run_id": self.run_id}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = set(checkpoint.get("tandem_lit", {}).get("trainable_keys", []))
        expected = {f"senior.{n}" for n, p in self.senior.named_parameters() if p.requires_grad}
        # (FSDP2Strategy has loaded the weights into the shards already and passes no state_dict)
        missing = expected - set(checkpoint["state_dict"] if "state_dict" in checkpoint else saved)
        if missing or (saved and saved != expected):
            raise RuntimeError(
                f"checkpoint does not match this model: {len(missing)} trainable tensors missing "
                f"(e.g. {sorted(missing)[:3]}); load it with the same senior and lora settings it was trained with"
            )
        self.history = list(checkpoint.get("tandem_lit", {}).get("history", []))
        self.run_id = checkpoint.get("tandem_lit", {}).get("run_id") or self.run_id
        self._policy_version += 1  # the loaded weights reach the engine's copy before the next rollout

    # ---------------------------------------------------------------------------------- logging

    def write_completions(self, result: RolloutResult, split: str) -> None:
        every = self.completions_every_n_steps
        if not every or self.trainer is None or self.global_step % every or not self.trainer.is_global_zero:
            return
        path = Path(self.trainer.default_root_dir) / "completions.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for i in range(min(self.completions_per_log, len(result.grades))):
                spans = result.rollout.spans(i, self.tokenizer)
                record = {
                    "run_id": self.run_id,
                    "step": self.global_step,
                    "split": split,
                    "prompt": self.tokenizer.decode(result.rollout.prompt_ids[i][result.rollout.prompt_mask[i].bool()]),
                    "reward": result.grades[i].reward,
                    "correct": result.grades[i].correct,
                    "extracted": result.grades[i].extracted,
                    "spans": [{"author": a.name.lower(), "text": t} for a, t in spans],
                    "marked": "".join(f"[{a.name[0]}]{t}" for a, t in spans),
                }
                f.write(json.dumps(record) + "\n")


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
    }


def default_engine(senior: nn.Module, junior: nn.Module | None) -> RolloutEngine:
    """FastEngine where it supports both models; otherwise HFEngine, said loudly (never silently).

    The senior's architecture is what counts: FastEngine decodes its own bf16 copy of it (LoRA
    merged, a 4-bit QLoRA base dequantised), so its training weights may be of any kind. The
    frozen junior is decoded in place, so its weights must be plain too."""
    from tandem_lit.rollout.static import check_architecture, decoder_model
    from tandem_lit.rollout.weights import plain_model

    try:
        check_architecture(plain_model(senior).config)
        if junior is not None:
            decoder_model(junior)
    except ConfigError as reason:
        log.warning(
            "FALLING BACK to HFEngine, the per-token reference loop (4.6-12x slower rollouts than FastEngine on a "
            "GPU, docs/benchmarks.md): %s. Set model.engine to choose the engine yourself.", reason,
        )
        return HFEngine()
    from tandem_lit.rollout.static import FastEngine

    return FastEngine()

