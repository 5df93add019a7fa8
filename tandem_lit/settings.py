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
    """

    chat_template: bool | None = None
    system_prompt: str | None = None
    enable_thinking: bool | None = None


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
