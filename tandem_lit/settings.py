"""Settings of a TandemModule run that are plain records: prompt formatting, overlong
handling, dynamic sampling. Chosen in YAML under ``model.init_args``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem_lit.errors import ConfigError, TandemLitError


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


class TrainingStalledError(TandemLitError, RuntimeError):
    """Training cannot make progress with these settings."""


@dataclass
class OverlongPolicy:
    """What a completion that ran out of tokens (truncated) contributes to training.

    Args:
        mode: ``keep`` (graded like any other), ``mask`` (left out of the loss and its normaliser,
            DAPO's overlong filtering; it still counts in its group's reward statistics) or
            ``penalty`` (its reward is replaced by ``penalty``).
        penalty: The reward of a truncated completion in ``penalty`` mode.
    """

    mode: Literal["keep", "mask", "penalty"] = "keep"
    penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("keep", "mask", "penalty"):
            raise ConfigError(f"overlong.mode must be 'keep', 'mask' or 'penalty', got {self.mode!r}")


@dataclass
class DynamicSampling:
    """Train only on prompts whose rollouts disagree (DAPO's dynamic sampling).

    A group whose rewards are all equal has zero GRPO advantage: it costs generation and teaches
    nothing. Each step generates for ``prompts_per_step`` prompts, drops such groups, and refills
    from the rest of the data batch (the batch is the pool: make it larger than
    ``prompts_per_step``) for at most ``max_rounds`` rounds. Logged: kept and dropped groups and
    rounds per step; a step with no informative group makes no update.

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
class MemorySettings:
    """How a step fits the GPU: rollouts and the update take turns with the big buffers.

    Args:
        release_rollout_caches: Free the engine's KV caches and captured graphs after each rollout
            phase, so the update's activations can use that memory (re-allocated and re-captured
            by the next rollout: ``train/rollout_setup_seconds``). Off: keep them (faster when
            both phases fit side by side).
        offload_optimizer: Move the optimizer state to pinned host memory during rollouts (the
            32 GB of a 4B model's AdamW state make room for KV caches; ~1.3 s each way).
        gradient_checkpointing: Recompute each decoder layer of the senior in the backward pass
            instead of keeping its activations (about a third more update compute).
        micro_batch_tokens: Bound each forward/backward pass by tokens (rows x padded length)
            as well as by ``micro_batch_size`` rows; rows are grouped by length. None: rows only.
        check: Before the first step, estimate the step's peak memory from the shapes and fail
            with what does not fit (and which setting to change) instead of running out mid-run.
    """

    release_rollout_caches: bool = True
    offload_optimizer: bool = False
    gradient_checkpointing: bool = False
    micro_batch_tokens: int | None = None
    check: bool = True

    def __post_init__(self) -> None:
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"memory.micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
