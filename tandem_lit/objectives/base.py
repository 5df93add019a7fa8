"""Objective: pure tensors in, (loss, metrics) out.

Every objective weights each completion token by who wrote it: a senior token counts 1, a junior
token counts ``junior_weight`` (0 masks it as in Tandem RLVR, 1 treats it as the senior's as in
the Tandem Training main runs, 0 < j < 1 soft-masks it), padding counts 0. The weights come only
from the rollout's ``author`` tensor: without it the objective raises rather than silently
training on every token (which would be plain RL, not tandem RL).

Micro-batching: the module computes ``advantages`` and a ``LossScale`` once over the whole
optimiser batch and passes them with each micro-batch, so the micro-batch losses add up to the
full-batch loss exactly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from tandem_lit.errors import AuthorshipError, ConfigError
from tandem_lit.objectives.mismatch import geometric_log_ratio, senior_log_ratio, sequence_log_ratio
from tandem_lit.rollout.record import Author

#: sums a list of numbers over the processes of a run (``training.distributed.all_reduce_sum``)
RankSum = Callable[[list[float]], list[float]]
TisLevel = Literal["token", "sequence"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass
class ObjectiveInputs:
    """One (micro-)batch of rollouts as the objective sees it."""

    logp: Tensor  # [N, T] senior log-probs of the completion tokens under the current policy
    author: Tensor | None  # [N, T] Author codes of the completion tokens
    rewards: Tensor  # [N] verifier rewards
    group: Tensor  # [N] long, prompt id: rollouts of one prompt share it
    old_logp: Tensor | None = None  # [N, T] log-probs when the rollouts were drawn (None: on-policy)
    ref_logp: Tensor | None = None  # [N, T] reference-policy log-probs, for the KL penalty
    advantages: Tensor | None = None  # [N] precomputed over the whole batch (else from rewards/group)
    mask: Tensor | None = None  # [N] bool, sequences allowed into the loss (e.g. not truncated); None = all
    # [N, T] the senior's log-probs as the rollout engine computed them (its bf16 copy): only for
    # truncated importance sampling, never the ratio's denominator (that is ``old_logp``)
    rollout_logp: Tensor | None = None
    # [N, T] bool: senior tokens written by older weights than the update starts from (partial
    # rollouts, ``Rollout.staleness`` > 0); None: every token is fresh
    stale: Tensor | None = None


@dataclass
class LossScale:
    """Normalisers of the aggregated loss, computed over the whole optimiser batch."""

    weight_sum: float  # sum of token weights of the sequences that enter the loss
    sequences: int  # number of sequences that enter the loss with a token of weight > 0
    max_tokens: int  # completion token budget (constant normalisation)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` holds (0 when it holds nowhere)."""
    mask = mask.float()
    return (values * mask).sum() / mask.sum().clamp_min(1)


def weighted_rows(weights: Tensor, keep: Tensor) -> int:  # [N, T], [N] bool
    """The rows that enter the loss with some weight: the seq-mean aggregations' count. A row whose
    every token weighs 0 (all the junior's at ``junior_weight`` 0) adds nothing to the numerator,
    so it stays out of the count too (verl's seq-mean rule), rather than diluting the mean."""
    return int((keep & (weights.sum(-1) > 0)).sum())


def token_weights(author: Tensor | None, junior_weight: float, like: Tensor, check: bool = True) -> Tensor:  # -> [N, T] float
    """Loss weight of every completion token from its author; raises on missing or bad authorship.
    ``check=False`` skips the look at the codes (a device sync) for rows already checked: an
    update checks each mini-batch once (``Objective.loss_scale``), not each of its passes."""
    if author is None:
        raise AuthorshipError(
            "the rollout batch has no authorship mask (author is None); tandem objectives refuse to "
            "train without it, because that would silently be plain RL. Produce rollouts with a "
            "tandem-lit engine, or attach an `author` tensor (Author.SENIOR/JUNIOR/PAD per token)."
        )
    if author.shape != like.shape:
        raise AuthorshipError(f"author has shape {tuple(author.shape)} but the log-probs have {tuple(like.shape)}")
    if author.dtype.is_floating_point or author.dtype == torch.bool:
        raise AuthorshipError(f"author must hold integer Author codes, got dtype {author.dtype}")
    codes = author.long()
    known = (codes == Author.SENIOR) | (codes == Author.JUNIOR) | (codes == Author.PAD)
    if check and not bool(known.all()):
        bad = sorted(set(codes[~known].tolist()))
        raise AuthorshipError(f"author holds codes {bad} inside completions; expected SENIOR (2), JUNIOR (3) or PAD (0)")
    weights = torch.zeros_like(like, dtype=torch.float32)
    weights = torch.where(codes == Author.SENIOR, 1.0, weights)
    return torch.where(codes == Author.JUNIOR, float(junior_weight), weights)


class Objective(ABC):
    """Base class: token weights from authorship, advantages, per-token loss, aggregation.

    Args:
        junior_weight: Loss weight of a junior-written token (0 masks it).
        aggregation: How per-token losses become one number: ``token-mean`` (sum over all tokens
            / total weight), ``seq-mean-token-mean`` (mean over sequences of each sequence's
            token mean), ``seq-mean-token-sum`` (mean over sequences of token sums) or
            ``seq-mean-token-sum-norm`` (token sum / (sequences x max tokens), Dr. GRPO).
        tis_cap: Truncated importance sampling (verl's ``tis_imp_ratio_cap``; Yao et al., 2025):
            rollouts are decoded from a bf16 copy while the loss runs the training model, so
            each senior token's policy-gradient term is multiplied by
            ``min(exp(train_logp - rollout_logp), tis_cap)`` (detached). None: off. Junior tokens
            were drawn from the junior, not from any senior copy: their factor is 1.
        tis_level: ``token`` (each senior token its own weight, above) or ``sequence`` (verl's
            ``rollout_is: sequence``): every token of a row is multiplied by the row's weight,
            ``min(exp(sum over its senior tokens of (train_logp - rollout_logp)), tis_cap)``, the
            whole sequence's likelihood ratio (unbiased before the cap, higher variance).
        geo_mask: Geometric-mean sequence masking (verl's ``rollout_rs: geometric`` with
            ``rollout_rs_threshold``): a row whose senior tokens' geometric-mean weight
            ``exp(mean(train_logp - rollout_logp))`` lies outside ``[1 / geo_mask, geo_mask]`` is
            left out of the loss and its normaliser (verl suggests 1.0002 to 1.001; > 1).
            None: off. Needs the old log-probs of every row before the passes: the update then
            computes the first mini-batch's in a forward-only pass too.
    """

    #: True when the loss needs log-probs from before the update (importance ratio)
    uses_old_logp: bool = False
    #: partial rollouts' decoupled correction (``rollout.partial.correction: decoupled``): a stale
    #: senior token's factor is ``min(exp(old - behaviour), stale_cap)``; None: no such correction
    stale_cap: float | None = None
    #: True when advantages compare the rollouts of one prompt (needs sampling.n >= 2)
    group_relative: bool = False

    def __init__(self, junior_weight: float, aggregation: Aggregation = "token-mean", tis_cap: float | None = None,
                 tis_level: TisLevel = "token", geo_mask: float | None = None):
        if junior_weight < 0:
            raise ConfigError(f"junior_weight must be >= 0, got {junior_weight}")
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
        if tis_cap is not None and tis_cap <= 0:
            raise ConfigError(f"tis_cap must be > 0 (verl uses 2.0), got {tis_cap}")
        if tis_level not in ("token", "sequence"):
            raise ConfigError(f"tis_level must be 'token' or 'sequence', got {tis_level!r}")
        if tis_level != "token" and tis_cap is None:
            raise ConfigError(f"tis_level {tis_level!r} weights by the importance ratio up to tis_cap: set tis_cap (verl uses 2.0)")
        if geo_mask is not None and geo_mask <= 1:
            raise ConfigError(f"geo_mask must be > 1 (verl suggests 1.0002 to 1.001), got {geo_mask}")
        self.junior_weight = float(junior_weight)
        self.aggregation = aggregation
        self.tis_cap = None if tis_cap is None else float(tis_cap)
        self.tis_level = tis_level
        self.geo_mask = None if geo_mask is None else float(geo_mask)

    @property
    def uses_reference(self) -> bool:
        """True when the loss needs reference-policy log-probs (KL penalty)."""
        return False

    @abstractmethod
    def advantages(self, rewards: Tensor, group: Tensor, over_ranks: RankSum | None = None) -> Tensor:  # [N], [N] -> [N]
        """The per-sequence learning signal, computed over the whole batch. On several processes
        each holds whole groups of the batch, and ``over_ranks`` sums a list of numbers over the
        processes: a statistic of the whole batch (``scale_rewards: batch``) goes through it, so
        that W processes compute what one process computes (None: one process)."""

    def included(self, advantages: Tensor) -> Tensor:  # [N] -> [N] bool
        """Sequences that enter the loss and its normaliser (default: all)."""
        return torch.ones_like(advantages, dtype=torch.bool)

    @abstractmethod
    def token_loss(self, inputs: ObjectiveInputs, advantages: Tensor, counted: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-token loss before weighting  # -> [N, T], metrics

        ``counted`` [N, T] bool marks the tokens that enter the loss (weight > 0): token metrics
        are averaged over those only, so masked junior tokens never dilute them."""

    def importance_correction(self, inputs: ObjectiveInputs, counted: Tensor) -> tuple[Tensor | float, dict[str, Tensor]]:
        """The importance factor of each token: the truncated-importance-sampling factor (1.0 when
        ``tis_cap`` is None), per token or per sequence (``tis_level``); on stale senior tokens,
        with ``stale_cap``, the decoupled correction instead (``stale_correction``)."""
        factor, metrics = self.tis_correction(inputs, counted)
        if self.stale_cap is None or inputs.stale is None:
            return factor, metrics
        return self.stale_correction(inputs, counted, factor, metrics)

    def stale_correction(self, inputs: ObjectiveInputs, counted: Tensor, factor: Tensor | float,
                         metrics: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Decoupled PPO (AReaL) on partial rollouts' stale senior tokens: the proximal policy is
        the trainer's old log-probs, the behaviour policy the engine's log-probs recorded when the
        token was written (by older weights); the token's factor is ``min(exp(old - behaviour),
        stale_cap)``, detached, in place of ``factor``. Fresh tokens keep ``factor``."""
        behaviour = self.engine_logprobs(inputs.rollout_logp, "rollout.partial.correction: decoupled")
        old = inputs.old_logp if inputs.old_logp is not None else inputs.logp.detach()
        weight = torch.exp(senior_log_ratio(old, behaviour, inputs.author))
        stale = inputs.stale & (inputs.author.long() == Author.SENIOR)
        capped = weight.clamp(max=self.stale_cap)
        base = factor if isinstance(factor, Tensor) else torch.full_like(capped, float(factor))
        measured = counted & stale
        metrics = {**metrics, "stale_weight_mean": masked_mean(capped, measured),
                   "stale_capped_fraction": masked_mean((weight >= self.stale_cap).float(), measured)}
        return torch.where(stale, capped, base).detach(), metrics

    def tis_correction(self, inputs: ObjectiveInputs, counted: Tensor) -> tuple[Tensor | float, dict[str, Tensor]]:
        """The truncated-importance-sampling factor of each token (1.0 when ``tis_cap`` is None)."""
        if self.tis_cap is None:
            return 1.0, {}
        rollout = self.engine_logprobs(inputs.rollout_logp, "tis_cap")
        old = inputs.old_logp if inputs.old_logp is not None else inputs.logp.detach()
        delta = senior_log_ratio(old, rollout, inputs.author)
        senior = inputs.author.long() == Author.SENIOR
        if self.tis_level == "token":
            weight = torch.exp(delta)
        else:  # the row's likelihood ratio on each of its tokens (junior tokens too: they are the row's)
            weight = torch.exp(sequence_log_ratio(delta)).unsqueeze(-1).expand_as(delta)
        factor = weight.clamp(max=self.tis_cap)
        if self.tis_level == "token":
            factor = torch.where(senior, factor, 1.0)
        measured = counted & senior
        return factor.detach(), {
            "tis_weight_mean": masked_mean(factor, measured),
            "tis_capped_fraction": masked_mean((weight >= self.tis_cap).float(), measured),
        }

    def engine_logprobs(self, rollout_logp: Tensor | None, setting: str) -> Tensor:
        if rollout_logp is None:
            raise ConfigError(
                f"{setting} needs the rollout engine's log-probs of the senior (Rollout.senior_logprobs), and this "
                f"batch has none: use an engine that records them (FastEngine, HFEngine) or set {setting}: null"
            )
        return rollout_logp

    @property
    def masks_sequences(self) -> bool:
        """True when rows leave the loss by their old log-probs (``geo_mask``): the update then
        needs every row's old log-probs before its passes."""
        return self.geo_mask is not None

    def rejected(self, old_logp: Tensor, rollout_logp: Tensor | None, author: Tensor) -> Tensor:  # [N, T] each -> [N] bool
        """Rows that geometric-mean sequence masking (``geo_mask``) leaves out of the loss."""
        if self.geo_mask is None:
            return torch.zeros(old_logp.shape[0], dtype=torch.bool, device=old_logp.device)
        rollout = self.engine_logprobs(rollout_logp, "geo_mask")
        geometric = geometric_log_ratio(senior_log_ratio(old_logp, rollout, author), author)
        return geometric.abs() > math.log(self.geo_mask)

    def loss_scale(self, author: Tensor | None, advantages: Tensor, max_tokens: int, mask: Tensor | None = None) -> LossScale:
        """Normalisers over a whole optimiser batch (pass the same to each micro-batch)."""
        keep = self.included(advantages) if mask is None else self.included(advantages) & mask
        weights = token_weights(author, self.junior_weight, like=author if author is not None else advantages)
        return LossScale(weight_sum=float(weights[keep].sum()), sequences=weighted_rows(weights, keep), max_tokens=max_tokens)

    def __call__(self, inputs: ObjectiveInputs, scale: LossScale | None = None) -> tuple[Tensor, dict[str, float]]:
        loss, metrics = self.loss_and_metrics(inputs, scale)
        return loss, {name: float(value) for name, value in metrics.items()}

    def loss_and_metrics(self, inputs: ObjectiveInputs, scale: LossScale | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and its metrics as 0-d tensors on the loss's device: no host sync, so that an
        update's passes queue on the GPU back to back (``__call__``: the metrics as floats).
        With ``scale`` (from ``loss_scale``, which has checked these rows' authorship) the
        authorship codes are not looked at again."""
        weights = token_weights(inputs.author, self.junior_weight, like=inputs.logp, check=scale is None)
        advantages = inputs.advantages if inputs.advantages is not None else self.advantages(inputs.rewards, inputs.group)
        keep = self.included(advantages) if inputs.mask is None else self.included(advantages) & inputs.mask
        weights = weights * keep.unsqueeze(-1)
        if scale is None:
            scale = LossScale(float(weights.sum()), weighted_rows(weights, keep), inputs.logp.shape[1])
        per_token, metrics = self.token_loss(inputs, advantages, weights > 0)
        loss = self._aggregate(per_token, weights, scale)
        out = {name: value.detach() for name, value in metrics.items()}
        out["loss"] = loss.detach()
        out["included_fraction"] = keep.float().mean()
        return loss, out

    def _aggregate(self, per_token: Tensor, weights: Tensor, scale: LossScale) -> Tensor:
        weighted = per_token * weights
        if self.aggregation == "token-mean":
            return weighted.sum() / max(scale.weight_sum, 1e-8)
        sequences = max(scale.sequences, 1)
        if self.aggregation == "seq-mean-token-mean":
            per_sequence = weighted.sum(-1) / weights.sum(-1).clamp_min(1e-8)
            return per_sequence.sum() / sequences
        if self.aggregation == "seq-mean-token-sum":
            return weighted.sum() / sequences
        return weighted.sum() / (sequences * scale.max_tokens)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

