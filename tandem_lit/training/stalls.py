"""Steps that make no update, counted: after ``update.max_idle_steps`` of them in a row the run
stops with what to change, instead of looping forever over data it cannot train on."""

from __future__ import annotations

from tandem_lit.errors import TrainingStalledError
from tandem_lit.training.settings import RolloutSettings


class IdleSteps:
    """Counts consecutive steps without an update; ``count`` raises ``TrainingStalledError`` at
    the limit. Every rank decides alike (all raise, none waits in a collective)."""

    def __init__(self, rollout: RolloutSettings, limit: int):
        self.rollout, self.limit = rollout, limit
        self.idle = 0

    def count(self, idle: bool, fitting: int, world: int) -> None:
        """``fitting``: the prompts of this step's batch that fit ``max_prompt_tokens``."""
        self.idle = self.idle + 1 if idle else 0
        if self.idle < self.limit:
            return
        limit = f"rollout.max_prompt_tokens={self.rollout.max_prompt_tokens}"
        if not fitting:
            raise TrainingStalledError(
                f"every prompt of the last {self.idle} batches is longer than {limit}, so no update can happen: "
                "raise it or use shorter prompts."
            )
        if self.rollout.dynamic_sampling is None:  # (one process trains every prompt that fits)
            raise TrainingStalledError(
                f"fewer than {world} prompts of each of the last {self.idle} batches fit {limit}, and the {world} "
                "processes train equal shares, so no update can happen: raise it, use shorter prompts or a larger batch."
            )
        raise TrainingStalledError(
            f"dynamic sampling found no prompt whose rollouts got different rewards in {self.idle} "
            "consecutive steps, so no update can happen: every group is all-correct or all-wrong. Use easier "
            "or harder data, more rollouts per prompt (rollout.sampling.n), or turn dynamic_sampling off."
            + (f" (On {world} processes a step needs at least {world} such prompts.)" if world > 1 else "")
        )
