"""Settings of a TandemModule run, plain records chosen in YAML under ``model.init_args``: one
group per phase of a step (``rollout``, ``update``, ``memory``, ``evaluation``, ``logging``) and
the records inside them (prompt format, overlong handling, dynamic sampling)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from tandem_lit.errors import ConfigError
from tandem_lit.evaluation.language import LanguageShare
from tandem_lit.evaluation.steps import EvalMode
from tandem_lit.models.liger import FusedKernels
from tandem_lit.rollout.handoff import HandoffPolicy, ParagraphHandoff
from tandem_lit.rollout.record import Author
from tandem_lit.rollout.sampling import SamplingConfig


@dataclass
class PromptFormat:
    """How a row's ``prompt`` becomes model input.

    Args:
        chat_template: Wrap the prompt as a user message with the tokenizer's chat template
            (None: when the tokenizer has one).
        system_prompt: Optional system message (chat template only).
        enable_thinking: Passed to chat templates that have a thinking switch (Qwen3).
        template: A format string around the row's prompt before the chat template, e.g.
            ``"{prompt}\n\nRéponds en français."``; it must contain ``{prompt}`` (None: the prompt as is).
    """

    chat_template: bool | None = None
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    template: str | None = None

    def __post_init__(self) -> None:
        if self.template is not None:
            try:
                self.template.format(prompt="")
            except (KeyError, IndexError, ValueError) as err:
                raise ConfigError(
                    f"prompt_format.template {self.template!r} is not a format string over {{prompt}} only ({err!r}); "
                    "write literal braces as {{ and }}"
                ) from None
            if "{prompt}" not in self.template:
                raise ConfigError(f"prompt_format.template {self.template!r} must contain {{prompt}}, where the row's prompt goes")

    def text(self, prompt: str) -> str:
        return prompt if self.template is None else self.template.format(prompt=prompt)

    def uses_chat_template(self, tokenizer) -> bool:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.chat_template and not has_template:
            raise ConfigError("prompt_format.chat_template is true but a model's tokenizer has no chat template")
        return has_template if self.chat_template is None else self.chat_template

    def render(self, prompt: str, tokenizer) -> str:
        """The model input for a row's prompt: the template, then the chat template around it
        (a user message after the optional system message), or the text as is."""
        prompt = self.text(prompt)
        if not self.uses_chat_template(tokenizer):
            return prompt
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        extra = {"enable_thinking": self.enable_thinking} if self.enable_thinking is not None else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


@dataclass
class OverlongPolicy:
    """What a completion that ran out of tokens (truncated), or came close, contributes to training.

    The rewards it gives (``rewards``) are the ones the objective sees and the ones dynamic
    sampling filters on, so a group it keeps has advantages that differ (verl's DAPO recipe filters
    on the verifier's accuracy instead: there a group of equal accuracy but different lengths is
    dropped, and one whose rewards the penalty made equal is kept with zero advantage).

    Args:
        mode: ``keep`` (graded like any other), ``mask`` (left out of the loss and its normaliser,
            DAPO's overlong filtering; it still counts in its group's reward statistics),
            ``penalty`` (its reward is replaced by ``penalty``) or ``soft`` (DAPO's soft overlong
            punishment, by length, truncated or not: the reward gains
            ``min(0, (max_new_tokens - buffer - length) / buffer) * penalty_factor``, 0 up to
            ``buffer`` tokens before the cap, falling linearly to ``-penalty_factor`` at it).
        penalty: The reward of a truncated completion in ``penalty`` mode.
        buffer: ``soft``: the tokens before the cap over which the punishment grows (DAPO's
            L_cache; verl's ``overlong_buffer.len``), at most ``max_new_tokens``.
        penalty_factor: ``soft``: the punishment at the cap (verl's ``overlong_buffer.penalty_factor``).
    """

    mode: Literal["keep", "mask", "penalty", "soft"] = "keep"
    penalty: float = 0.0
    buffer: int | None = None
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in ("keep", "mask", "penalty", "soft"):
            raise ConfigError(f"overlong.mode must be 'keep', 'mask', 'penalty' or 'soft', got {self.mode!r}")
        if self.mode == "soft" and (self.buffer is None or self.buffer < 1):
            raise ConfigError(f"overlong.mode soft needs overlong.buffer >= 1 token (DAPO's L_cache), got {self.buffer}")
        if self.penalty_factor < 0:
            raise ConfigError(f"overlong.penalty_factor must be >= 0, got {self.penalty_factor}")

    def rewards(self, rewards: Tensor, lengths: Tensor, truncated: Tensor, max_tokens: int) -> Tensor:  # [N] each -> [N]
        """The rewards the objective sees: the verifier's with this policy applied."""
        if self.mode == "penalty":
            return torch.where(truncated, self.penalty, rewards)
        if self.mode != "soft":
            return rewards
        if self.buffer > max_tokens:
            raise ConfigError(f"overlong.buffer ({self.buffer}) must be at most rollout.sampling.max_new_tokens ({max_tokens})")
        over = (max_tokens - self.buffer - lengths.to(rewards.device, torch.float32)) / self.buffer
        return rewards + over.clamp(max=0.0) * self.penalty_factor


@dataclass
class DynamicSampling:
    """Train only on prompts whose rollouts disagree (DAPO's dynamic sampling).

    A group whose rewards are all equal has zero GRPO advantage: it costs generation and teaches
    nothing. Each step generates for ``prompts_per_step`` prompts, drops such groups, and refills
    from the rest of the data batch (the batch is the pool: make it larger than
    ``prompts_per_step``) for at most ``max_rounds`` rounds. Logged: kept and dropped groups and
    rounds per step; a step with no informative group makes no update. On W processes the ranks
    keep the groups one process keeps and train equal shares of them: ``prompts_per_step`` must
    split over W as a data batch does, and a step that keeps fewer trains a multiple of W
    (``train/balance_dropped_groups``; docs/distributed.md).

    Args:
        prompts_per_step: Groups to train on per step.
        max_rounds: Generation rounds per step at most.
    """

    prompts_per_step: int
    max_rounds: int = 3

    def __post_init__(self) -> None:
        if min(self.prompts_per_step, self.max_rounds) < 1:
            raise ConfigError("dynamic_sampling.prompts_per_step and max_rounds must be >= 1")


@dataclass
class PartialRollouts:
    """Partial rollouts with bounded staleness: the engine never drains (docs/partial_rollouts.md).

    A rollout phase keeps more prompt groups in flight than a step trains on: the step's data
    batch plus the groups carried over from earlier steps, which go first. It ends once the step's
    groups are complete (a group trains only when every rollout of it ended); the sequences still
    running are paused with everything they wrote and go on in the next phase under the new
    weights. Each senior token keeps the policy version that wrote it; junior tokens are never
    stale (the junior is frozen).

    Args:
        in_flight_prompts: Prompt groups in flight at once (carried + new), over all processes.
            At least the data batch; the surplus is what a phase carries over. The first steps
            train fewer groups until that many are in flight.
        max_staleness: The most optimiser updates a trained senior token may be behind the
            weights its step updates (>= 1; 0 would be synchronous: leave ``partial`` unset). A
            step makes one update per PPO mini-batch, and a carried token trains at least one
            step's updates after it was written: a bound below them is refused.
        stale: What happens to a carried sequence that would exceed ``max_staleness``:
            ``correct`` finishes it in this phase (the phase waits for it) under the new policy,
            its stale tokens corrected; ``redraw`` drops what it wrote and draws it again from its
            prompt (same seed, new weights).
        correction: How stale senior tokens are corrected. ``decoupled`` (AReaL's decoupled PPO):
            the proximal policy is the trainer's old log-probs, the behaviour policy the engine's
            log-probs recorded when the token was written; each stale senior token's loss term
            is multiplied by ``min(exp(old - behaviour), correction_cap)`` (replacing the
            objective's ``tis_cap`` factor on those tokens). ``tis``: the objective's own
            ``tis_cap``/``tis_level`` correction covers them (every token's recorded log-prob is
            its behaviour log-prob); the objective must set ``tis_cap``.
        correction_cap: The truncation of ``decoupled``'s weights.
        keep_caches: What happens to the paused sequences' keys and values over the update.
            ``none`` (default): released, and rebuilt by prefilling each sequence's prompt and
            tokens when it resumes, in both models, under the new weights. ``junior``: the
            junior's (its weights never change, so they are what a prefill would rebuild) go to
            host memory and back, and only the senior prefills. ``both``: the senior's too, as
            PipelineRL's in-flight weight updates do: a resumed sequence's new tokens then attend
            to keys the old weights wrote, so they are drawn from neither policy exactly; their
            recorded log-probs are what they were drawn with, and the objective's ``tis_cap``
            (required) corrects them as any engine-vs-trainer gap. FastEngine with
            ``kv_cache: paged`` (plain attention models) only. Host memory: the paused positions'
            keys and values, both models' for ``both`` (docs/partial_rollouts.md).
    """

    in_flight_prompts: int
    max_staleness: int = 1
    stale: Literal["correct", "redraw"] = "correct"
    correction: Literal["decoupled", "tis"] = "decoupled"
    correction_cap: float = 2.0
    keep_caches: Literal["none", "junior", "both"] = "none"

    def __post_init__(self) -> None:
        if self.in_flight_prompts < 1:
            raise ConfigError(f"rollout.partial.in_flight_prompts must be >= 1, got {self.in_flight_prompts}")
        if self.max_staleness < 1:
            raise ConfigError("rollout.partial.max_staleness must be >= 1 (0 is synchronous: leave rollout.partial unset)")
        if self.stale not in ("correct", "redraw"):
            raise ConfigError(f"rollout.partial.stale must be 'correct' or 'redraw', got {self.stale!r}")
        if self.correction not in ("decoupled", "tis"):
            raise ConfigError(f"rollout.partial.correction must be 'decoupled' or 'tis', got {self.correction!r}")
        if self.correction_cap <= 0:
            raise ConfigError(f"rollout.partial.correction_cap must be > 0, got {self.correction_cap}")
        if self.keep_caches not in ("none", "junior", "both"):
            raise ConfigError(f"rollout.partial.keep_caches must be 'none', 'junior' or 'both', got {self.keep_caches!r}")

    @property
    def kept_models(self) -> tuple[str, ...]:
        """The models whose paused caches are kept over the update (``StopRule.keep_caches``)."""
        return {"none": (), "junior": ("junior",), "both": ("senior", "junior")}[self.keep_caches]


@dataclass
class MemorySettings:
    """How a step fits the GPU: rollouts and the update take turns with the big buffers.

    Args:
        release_rollout_caches: Free the engine's KV caches and captured graphs after each rollout
            phase, so the update's activations can use that memory (re-allocated and re-captured
            by the next rollout: ``train/rollout_setup_seconds``). Off: keep them (faster when
            both phases fit side by side).
        offload_optimizer: Move the optimizer state to pinned host memory during rollouts, so
            its room (AdamW's two float32 moments per trained weight) goes to KV caches; the copy
            each way costs a little of every step (docs/performance.md).
        gradient_checkpointing: Recompute each decoder layer of the senior in the backward pass
            instead of keeping its activations (about a third more update compute).
        micro_batch_tokens: Bound each forward/backward pass by tokens (rows x padded length)
            as well as by ``micro_batch_size`` rows; rows are grouped by length. None: rows only.
            With ``pack_sequences`` the bound is the packed length (the sum of the rows' tokens).
        fill_passes: With ``micro_batch_tokens``, put as many rows in each pass as its token
            bound holds, ignoring ``micro_batch_size`` (verl's dynamic batch size): with
            long-tailed response lengths the short rows then share a pass as one long row fills
            it, instead of every pass holding ``micro_batch_size`` rows however short. Fewer,
            larger passes; the same gradient (a sum over rows); the memory plan counts a pass at
            the token bound either way. Off: at most ``micro_batch_size`` rows a pass.
        pack_sequences: Run each forward/backward pass of the update as one row of the
            micro-batch's sequences concatenated (prompt + completion, no padding), position ids
            restarting per sequence and attention kept within each sequence
            (``rollout.logprobs``); the same log-probs, loss and gradients as padded rows, without
            the padding's compute. Needs sdpa, eager, flex or flash attention; not for models
            with linear-attention layers (Qwen3.5). An ``sdpa`` senior runs PyTorch's
            variable-length flash kernel for the update (``models.varlen_attention``; CUDA with
            torch >= 2.10, else sdpa's block-diagonal mask). Off: padded rows.
        fused_kernels: Liger-Kernel's Triton kernels in the senior's training forward: RMSNorm,
            SwiGLU, rotary (Llama/Mistral/Qwen2/Qwen3; Qwen3.5 without rotary) and a fused
            vocabulary projection + log-prob (``models.liger``). ``auto``: when liger-kernel is
            installed (``pip install 'tandem-lit[liger]'``) and the senior trains on a CUDA GPU,
            else PyTorch's kernels, said once in the log. ``liger``: the same, and an error where
            they cannot run. ``off``: PyTorch's kernels. The log-probs are the same to bf16
            rounding; the junior, the reference copy and the engine's rollout copy never change.
        cast_weights_once: Under mixed precision, the update casts the senior's float32 linear
            weights to the compute dtype once per optimiser update (``training.compute_weights``)
            instead of autocast casting them in every forward pass, and each pass's gradient is
            added straight into the float32 weights' ``.grad``: the same arithmetic, far less memory
            traffic outside the matmuls. Off: autocast's cast per forward.
        forward_only_pass_scale: How many times a training pass's rows and tokens
            (``update.micro_batch_size``, ``micro_batch_tokens``) a forward-only pass holds: the
            old and the reference log-probs keep no activations for a backward, so a pass of 4x
            the tokens holds one layer's temporaries, not every layer's saved tensors (the memory
            plan counts the larger of the two), and a quarter of the passes spends a quarter of
            the host's launch time. 1: the training passes' size.
        check: Before the first step, estimate the step's peak memory from the shapes and fail
            with what does not fit (and which setting to change) instead of running out mid-run.
    """

    release_rollout_caches: bool = True
    offload_optimizer: bool = False
    gradient_checkpointing: bool = False
    micro_batch_tokens: int | None = None
    fill_passes: bool = False
    pack_sequences: bool = False
    fused_kernels: FusedKernels = "auto"
    cast_weights_once: bool = True
    forward_only_pass_scale: int = 4
    check: bool = True

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"memory.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.fill_passes and self.micro_batch_tokens is None:
            raise ConfigError("memory.fill_passes fills each pass up to memory.micro_batch_tokens: set that bound too")
        if self.forward_only_pass_scale < 1:
            raise ConfigError(f"memory.forward_only_pass_scale must be >= 1, got {self.forward_only_pass_scale}")
        if self.fused_kernels not in ("auto", "liger", "off"):
            raise ConfigError(f"memory.fused_kernels must be 'auto', 'liger' or 'off', got {self.fused_kernels!r}")


# ------------------------------------------------------------------------------------------------
# TandemModule's settings, one group per phase of a step. Each group is one YAML key of the
# module (``rollout:``, ``update:``, ``memory:``, ``evaluation:``, ``logging:``).


@dataclass
class RolloutSettings:
    """How a step's rollouts are drawn.

    Args:
        sampling: Training rollouts (``n`` = rollouts per prompt, GRPO's group size).
        batch_size: Sequences decoded at once (None: all of a step's rollouts); bounds the KV
            cache memory of generation. The one such setting: the engine gets it at setup
            (``RolloutEngine.max_batch``). FastEngine takes a step's rollouts in one call as a
            queue, decodes this many at once and refills finished sequences' room; engines without
            a queue (HFEngine, TextHandoffEngine) get calls of this many sequences.
        max_prompt_tokens: Training skips prompts longer than this (after the chat template),
            counted in ``train/skipped_long_prompts`` (verl's overlong-prompt filter). Evaluation
            never skips. None: no limit. On W processes a step trains a multiple of W of the
            prompts that fit (``train/balance_dropped_groups``: the last ones left out).
        dynamic_sampling: Drop prompt groups whose rewards all agree and refill (None: off).
        partial: Partial rollouts: more prompts in flight than a step trains, the unfinished ones
            paused and resumed in the next step, staleness bounded and corrected (None: off, every
            step's rollouts are drawn and finished under its own weights).
        prompt_format: Chat template use, system prompt and prompt template (the senior's; also
            the junior's unless ``junior_prompt_format`` is set).
        junior_prompt_format: The junior's own prompt (e.g. a system prompt telling it to answer in
            French), while both models share the response tokens. None: the senior's.
        authorship_z: Fail when the junior's share of handoff draws is further than this many
            standard deviations from ``handoff.p`` (an engine that ignores the policy).
    """

    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=1.0, n=2))
    batch_size: int | None = None
    max_prompt_tokens: int | None = None
    dynamic_sampling: DynamicSampling | None = None
    partial: PartialRollouts | None = None
    prompt_format: PromptFormat = field(default_factory=PromptFormat)
    junior_prompt_format: PromptFormat | None = None
    authorship_z: float = 6.0

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"rollout.batch_size must be >= 1 sequence, got {self.batch_size}")
        if self.partial is not None and self.dynamic_sampling is not None:
            raise ConfigError("rollout.partial and rollout.dynamic_sampling cannot be combined: set one of them")

    @property
    def kept_prompts_per_step(self) -> int | None:
        """With dynamic sampling, the prompt groups a step keeps (the data batch is only their pool); else None."""
        return self.dynamic_sampling.prompts_per_step if self.dynamic_sampling is not None else None


@dataclass
class UpdateSettings:
    """How a step's rollouts update the senior.

    Args:
        mini_batch_size: Prompts per optimiser update (None: the whole step batch, one update).
        micro_batch_size: Sequences per forward/backward pass (gradient accumulation).
        max_grad_norm: Clip the gradient norm (None: no clipping).
        overlong: What truncated completions contribute (keep, mask, penalty).
        max_idle_steps: Stop with an error after this many consecutive training steps that could
            make no update (dynamic sampling found no signal, or every prompt was too long):
            such a run would otherwise never reach ``max_steps``.
        allow_low_precision_weights: Train a full-weight senior held in bfloat16/float16. Off by
            default: AdamW updates smaller than half a bf16 rounding step vanish (at lr 1e-6 most
            do), so such a run silently barely trains. Use float32 weights (optionally with
            ``trainer.precision: bf16-mixed``) or LoRA instead.
        logp_gap_warning: Warn (once per run) when ``train/rollout_logp_gap_mean``, the mean
            |training log-prob - engine log-prob| of the senior's tokens, exceeds this many nats
            (docs/metrics.md: ~0.06 is normal for a bf16 rollout copy of Qwen3-4B). None: never.
        logp_gap_limit: Stop the run, before the step's first optimizer update is applied, when
            that mean gap exceeds this many nats: the importance ratios would be off by more than
            e^limit (a broken weight sync or engine, not rounding). None: never stop (the
            warning still says it).
    """

    mini_batch_size: int | None = None
    micro_batch_size: int = 16
    max_grad_norm: float | None = 1.0
    overlong: OverlongPolicy = field(default_factory=OverlongPolicy)
    max_idle_steps: int = 20
    allow_low_precision_weights: bool = False
    logp_gap_warning: float | None = 0.2
    logp_gap_limit: float | None = 1.0

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(f"update.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.logp_gap_limit is not None and self.logp_gap_limit <= 0:
            raise ConfigError(f"update.logp_gap_limit must be > 0 nats or null, got {self.logp_gap_limit}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ConfigError(f"update.mini_batch_size must be >= 1 prompt, got {self.mini_batch_size}")



@dataclass
class EvaluationSettings:
    """Validation (checkpoint selection) and ``tandem-lit test``.

    Args:
        sampling: Validation rollouts (None: greedy, one per prompt, the training token budget;
            with ``n`` > 1 the validation also logs ``eval/<mode>_pass_at_<k>``).
        modes: Validation runs each: ``senior`` alone, ``junior`` alone, ``tandem`` (with
            ``handoff``). Metrics are logged as ``eval/<mode>_<metric>``. None: ``[senior]``
            without a junior, else ``[senior, tandem, junior]``.
        handoff: Handoff of the ``tandem`` eval mode (None: the training handoff). A no-handoff
            control sets the tandem run's handoff here, so that both runs' tandem accuracy is
            measured the same way.
        at_start: Validate once before the first update (logged at step 0).
        test_handoff: Handoff of ``tandem-lit test`` (None: paragraph level, p=0.5, the model
            under test writes first, as in Tandem RLVR's evaluation).
        test_sampling: Sampling of ``tandem-lit test`` (None: ``sampling``).
        test_forced_token: ``tandem-lit test`` also forces one junior token into each solo
            sample (where the two models' top tokens differ) and reports the change in success
            (``forced_token_*``; tandem_lit/evaluation/forced_token.py).
        pass_k: The k of the reported pass@k (those <= n).
    """

    sampling: SamplingConfig | None = None
    modes: list[EvalMode] | None = None
    handoff: HandoffPolicy | None = None
    at_start: bool = True
    test_handoff: HandoffPolicy | None = None
    test_sampling: SamplingConfig | None = None
    test_forced_token: bool = False
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4, 8])

    def resolved(self, training: SamplingConfig, handoff: HandoffPolicy, has_junior: bool) -> EvaluationSettings:
        """These settings with every None filled from the training run's."""
        sampling = self.sampling or SamplingConfig(temperature=0.0, max_new_tokens=training.max_new_tokens)
        modes = list(self.modes) if self.modes is not None else (["senior", "tandem", "junior"] if has_junior else ["senior"])
        unknown = set(modes) - {"senior", "junior", "tandem"}
        if unknown:
            raise ConfigError(f"evaluation.modes may hold 'senior', 'junior', 'tandem'; got {sorted(unknown)}")
        if self.test_forced_token and not has_junior:
            raise ConfigError("evaluation.test_forced_token needs a junior model (its token is the one forced): set `junior`")
        if not has_junior and (handoff.only_author != Author.SENIOR or {"junior", "tandem"} & set(modes)):
            raise ConfigError(
                f"handoff {handoff!r} and evaluation.modes {modes} need a junior model: set "
                "`junior`, or use SoloHandoff(author='senior') with evaluation.modes: [senior] for plain RL"
            )
        return replace(
            self, sampling=sampling, modes=modes, handoff=self.handoff or handoff,
            test_handoff=self.test_handoff or ParagraphHandoff(p=0.5, first_author="senior"),
            test_sampling=self.test_sampling or sampling, pass_k=sorted(set(self.pass_k)),
        )


@dataclass
class LoggingSettings:
    """What is measured and written besides the loss.

    Args:
        jargon_pattern: Regex whose match marks a solution as using jargon.
        language: The language share of rollouts and evaluations (``LanguageShare``:
            ``train/language_share``, ``train/senior_language_share``, ``eval/<mode>_language_share``;
            docs/language.md). None: not measured.
        completions_every_n_steps: Append sample completions, spans marked by author, to
            ``completions.jsonl`` in the run folder every this many steps (0: never).
        completions_per_log: How many completions each time.
    """

    jargon_pattern: str = r"<<[^<>\n]*>>"
    language: LanguageShare | None = None
    completions_every_n_steps: int = 10
    completions_per_log: int = 4
