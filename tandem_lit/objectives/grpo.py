"""GRPO (Shao et al., 2024) as used by Tandem RLVR (Jiao et al., 2026).

Advantages are rewards normalised within each prompt's group of rollouts; the loss is the PPO
clipped surrogate with separate low/high clip ranges (DAPO's asymmetric clipping), optionally
dual-clipped for negative advantages (Ye et al., 2020; verl's ``clip_ratio_c``), an optional KL
penalty to a reference policy with the k3 estimator (Schulman's unbiased, positive estimator;
optionally clamped, as verl's ``low_var_kl`` clamps at 10), and junior tokens weighted
``junior_weight`` (default 0: masked, as in Tandem RLVR).

The ratio's denominator ``old_logp`` always comes from the training model: recomputed before
the first update when a step makes several, and the current log-probs (detached) when it makes
one, where the two are the same forward (verl recomputes it; the value is identical). The
rollout engine's own log-probs (a bf16 copy) enter only through ``tis_cap``.

``scale_rewards``: ``group`` divides by the group's standard deviation (GRPO), ``batch`` by the
whole batch's (Hu et al., REINFORCE++ style; over every process's rows, as TRL gathers them),
``none`` keeps the centred rewards (Dr. GRPO).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from tandem_lit.errors import ConfigError
from tandem_lit.objectives.base import Aggregation, Objective, ObjectiveInputs, RankSum, TisLevel, masked_mean
from tandem_lit.objectives.mismatch import LOG_RATIO_BOUND


def group_centred(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """Rewards minus their group mean, and each row's group standard deviation (unbiased).  # [N], [N]"""
    _, index = torch.unique(group, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups, device=rewards.device).index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros(groups, device=rewards.device).index_add_(0, index, rewards)
    mean = total / count
    centred = rewards - mean[index]
    square = torch.zeros(groups, device=rewards.device).index_add_(0, index, centred**2)
    std = (square / (count - 1).clamp_min(1)).sqrt()
    return centred, std[index]


def batch_std(rewards: Tensor, over_ranks: RankSum | None = None) -> float | None:
    """The unbiased standard deviation of the whole batch's rewards (None under 2 rewards), from
    their count, sum and sum of squares summed ``over_ranks``: every process divides by the one
    number a single process would (TRL gathers the rewards before ``scale_rewards="batch"``)."""
    moments = [float(rewards.numel()), float(rewards.double().sum()), float(rewards.double().square().sum())]
    count, total, squares = over_ranks(moments) if over_ranks is not None else moments
    if count < 2:
        return None
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))


class GRPO(Objective):
    """Group Relative Policy Optimisation with a clipped importance ratio.

    Args:
        clip_low: ``eps_low``: the ratio is clipped below at 1 - clip_low.
        clip_high: ``eps_high``: the ratio is clipped above at 1 + clip_high (DAPO uses 0.28).
        scale_rewards: ``group``, ``batch`` or ``none`` (see module docstring).
        kl_coef: Weight of the k3 KL penalty to the reference policy (0: no reference needed).
        junior_weight: Loss weight of junior-written tokens (0: masked, as in Tandem RLVR).
        aggregation: See ``Objective``.
        eps: Added to the standard deviation before dividing.
        clip_ratio_c: Dual clip: for a negative advantage the per-token loss is at most
            ``-advantage * clip_ratio_c`` (> 1; verl's default 3.0), so a token whose ratio has
            run far past the clip range cannot dominate the update. None: off.
        kl_clamp: Clamp the per-token k3 KL term to [-kl_clamp, kl_clamp] (verl's low_var_kl
            uses 10). None: no clamp.
        tis_cap, tis_level, geo_mask: See ``Objective`` (truncated importance sampling per token
            or sequence, geometric-mean sequence masking; None: off).
    """

    uses_old_logp = True
    group_relative = True

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        scale_rewards: Literal["group", "batch", "none"] = "group",
        kl_coef: float = 0.0,
        junior_weight: float = 0.0,
        aggregation: Aggregation = "token-mean",
        eps: float = 1e-6,
        clip_ratio_c: float | None = None,
        kl_clamp: float | None = None,
        tis_cap: float | None = None,
        tis_level: TisLevel = "token",
        geo_mask: float | None = None,
    ):
        super().__init__(junior_weight=junior_weight, aggregation=aggregation, tis_cap=tis_cap, tis_level=tis_level,
                         geo_mask=geo_mask)
        if clip_ratio_c is not None and clip_ratio_c <= 1:
            raise ConfigError(f"clip_ratio_c must be > 1 (verl's default is 3.0), got {clip_ratio_c}")
        if kl_clamp is not None and kl_clamp <= 0:
            raise ConfigError(f"kl_clamp must be > 0, got {kl_clamp}")
        if scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
        if clip_low < 0 or clip_high < 0:
            raise ConfigError(f"clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
        if kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {kl_coef}")
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.scale_rewards = scale_rewards
        self.kl_coef = float(kl_coef)
        self.eps = float(eps)
        self.clip_ratio_c = None if clip_ratio_c is None else float(clip_ratio_c)
        self.kl_clamp = None if kl_clamp is None else float(kl_clamp)

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def advantages(self, rewards: Tensor, group: Tensor, over_ranks: RankSum | None = None) -> Tensor:
        rewards = rewards.float()
        centred, group_std = group_centred(rewards, group)  # (each group lies on one process)
        if self.scale_rewards == "group":
            return centred / (group_std + self.eps)
        if self.scale_rewards == "batch":
            std = batch_std(rewards, over_ranks)
            return centred / (std + self.eps) if std is not None else centred
        return centred

    def token_loss(self, inputs: ObjectiveInputs, advantages: Tensor, counted: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        logp = inputs.logp
        old = inputs.old_logp if inputs.old_logp is not None else logp.detach()
        log_ratio = logp - old
        clamped = log_ratio.detach().abs() > LOG_RATIO_BOUND
        # exp of a log-ratio past ~88 is inf in float32 (an inf loss or a NaN gradient): bounded
        # as verl bounds it; a clamped token's gradient is 0, and the share is logged
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        adv = advantages.unsqueeze(-1)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        per_token = torch.maximum(unclipped, clipped)
        metrics = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), counted),
            "ratio_mean": masked_mean(ratio.detach(), counted),
            "ratio_clamped_fraction": masked_mean(clamped.float(), counted),
            "advantage_std": advantages.std() if advantages.numel() > 1 else advantages.new_zeros(()),
        }
        if self.clip_ratio_c is not None:
            bound = -adv * self.clip_ratio_c  # positive where the advantage is negative
            dual = (adv < 0) & (per_token > bound)
            per_token = torch.where(dual, bound, per_token)
            metrics["dual_clip_fraction"] = masked_mean(dual.float(), counted)
        correction, tis_metrics = self.importance_correction(inputs, counted)
        per_token = per_token * correction
        metrics.update(tis_metrics)
        if self.kl_coef > 0:
            if inputs.ref_logp is None:
                raise ConfigError("GRPO with kl_coef > 0 needs reference log-probs (ref_logp), got None")
            delta = (inputs.ref_logp - logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # as verl's low_var_kl
            kl = torch.exp(delta) - delta - 1.0  # k3 estimator of KL(pi || ref)
            if self.kl_clamp is not None:
                kl = kl.clamp(-self.kl_clamp, self.kl_clamp)
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = masked_mean(kl.detach(), counted)
        return per_token, metrics
