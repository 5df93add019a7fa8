"""REINFORCE as in Tandem Training (West et al., 2025).

Main runs: binary reward, SGD on the log-likelihood of correct rollouts only, incorrect rollouts
discarded, junior tokens not masked (``Reinforce()``). Appendix E: failed rollouts re-enter with a
negative weight ``c`` and junior tokens are soft-masked by ``j < 1`` (``SoftMaskedReinforce``,
defaults c=-0.5, j=0.2, the values validation picked for the skill-gap setting).

The loss of a rollout is ``-coef * sum_t w_t log p(token_t)`` with ``coef = reward`` for a
rewarded rollout and ``coef = failed_weight`` for one with reward <= 0. Rollouts with coef 0 are
left out of the loss and of its normaliser, so positive-only REINFORCE is exactly supervised
fine-tuning on the correct rollouts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem_lit.objectives.base import Aggregation, Objective, ObjectiveInputs, RankSum, TisLevel


class Reinforce(Objective):
    """REINFORCE on binary (or graded) rewards.

    Args:
        failed_weight: ``c``, the sequence weight of a rollout with reward <= 0 (0 discards it).
        junior_weight: ``j``, the loss weight of a junior-written token (1: not masked).
        aggregation: See ``Objective``.
        tis_cap, tis_level, geo_mask: See ``Objective`` (truncated importance sampling per token
            or sequence, geometric-mean sequence masking; None: off).
    """

    def __init__(
        self, failed_weight: float = 0.0, junior_weight: float = 1.0, aggregation: Aggregation = "token-mean",
        tis_cap: float | None = None, tis_level: TisLevel = "token", geo_mask: float | None = None,
    ):
        super().__init__(junior_weight=junior_weight, aggregation=aggregation, tis_cap=tis_cap, tis_level=tis_level,
                         geo_mask=geo_mask)
        self.failed_weight = float(failed_weight)

    def advantages(self, rewards: Tensor, group: Tensor, over_ranks: RankSum | None = None) -> Tensor:
        rewards = rewards.float()
        return torch.where(rewards > 0, rewards, torch.full_like(rewards, self.failed_weight))

    def included(self, advantages: Tensor) -> Tensor:
        return advantages != 0

    def token_loss(self, inputs: ObjectiveInputs, advantages: Tensor, counted: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        correction, metrics = self.importance_correction(inputs, counted)
        per_token = -advantages.unsqueeze(-1) * inputs.logp * correction
        return per_token, {"positive_fraction": (advantages > 0).float().mean(), **metrics}


class SoftMaskedReinforce(Reinforce):
    """Tandem Training appendix E: failed rollouts weighted ``c``, junior tokens weighted ``j``."""

    def __init__(
        self, failed_weight: float = -0.5, junior_weight: float = 0.2, aggregation: Aggregation = "token-mean",
        tis_cap: float | None = None, tis_level: TisLevel = "token", geo_mask: float | None = None,
    ):
        super().__init__(failed_weight=failed_weight, junior_weight=junior_weight, aggregation=aggregation, tis_cap=tis_cap,
                         tis_level=tis_level, geo_mask=geo_mask)
