"""Metrics of rollouts and evaluations: pass@k, jargon, junior share, and per-step statistics."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric

from tandem_lit.rollout.record import Author, Rollout

#: GSM8K calculator annotations, e.g. ``<<48/2=24>>`` (the Tandem Training "jargon")
GSM8K_JARGON = r"<<[^<>\n]*>>"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k), for n samples with c correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class PassAtK(Metric):
    """Mean unbiased pass@k over problems, for several k at once.

    ``update(correct)`` takes a [problems, n] bool tensor (n samples per problem).
    """

    full_state_update = False

    def __init__(self, ks: Sequence[int] = (1,), **kwargs):
        super().__init__(**kwargs)
        self.ks = tuple(ks)
        self.add_state("total", default=torch.zeros(len(self.ks), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("problems", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, correct: Tensor) -> None:
        n = correct.shape[1]
        counts = correct.sum(dim=1).tolist()
        for i, k in enumerate(self.ks):
            if k > n:
                raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
            self.total[i] += sum(pass_at_k(n, c, k) for c in counts)
        self.problems += correct.shape[0]

    def compute(self) -> dict[int, Tensor]:
        return {k: self.total[i] / self.problems.clamp_min(1) for i, k in enumerate(self.ks)}


class JargonDetector:
    """Whether a solution uses jargon: a match of ``pattern`` (default: GSM8K calculator
    annotations ``<<a*b=c>>``, the Tandem Training skill-gap jargon)."""

    def __init__(self, pattern: str = GSM8K_JARGON):
        self.pattern = re.compile(pattern)

    def __call__(self, text: str) -> bool:
        return self.pattern.search(text) is not None

    def rate(self, texts: Sequence[str]) -> float:
        return sum(self(t) for t in texts) / len(texts) if texts else 0.0


def rollout_stats(rollout: Rollout, rewards: Tensor, correct: Sequence[bool], group: Tensor, jargon: JargonDetector) -> dict[str, float]:
    """Per-step statistics of a batch of rollouts (the numbers a tandem run is judged by)."""
    rewards = rewards.float().cpu()
    group = group.cpu()
    lengths = rollout.lengths.float().cpu()
    zero_variance = [bool((rewards[group == g] == rewards[group == g][0]).all()) for g in group.unique()]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "accuracy": sum(correct) / len(correct),
        "zero_variance_groups": sum(zero_variance) / len(zero_variance),
        "junior_token_share": rollout.junior_token_share(),
        "handoffs_per_sequence": float(rollout.handoffs.float().mean()),
        "response_length": float(lengths.mean()),
        "truncation_rate": float(rollout.truncated.float().mean()),
        "jargon_rate": jargon.rate(rollout.texts),
    }



class LogprobGap:
    """How far the rollout engine's log-probs of the senior's tokens are from the training model's.

    The engine decodes a bf16 copy; the update runs the float32 master under autocast. The gap is
    measured on every senior-written token of a step (``train/rollout_logp_gap_mean`` / ``_max``),
    never assumed zero: a jump flags a stale or broken weight sync.
    """

    def __init__(self) -> None:
        # sums kept on the device as tokens arrive (no sync per pass); read once, by ``read``
        self._sums: Tensor | None = None  # [total, tokens, largest]

    def add(self, train: Tensor, rollout: Tensor | None, author: Tensor) -> None:  # [N, T] each
        if rollout is None:
            return
        senior = author == Author.SENIOR
        gap = torch.where(senior, (train.detach().float() - rollout.float()).abs(), 0.0)
        part = torch.stack([gap.sum(), senior.sum().float(), gap.amax() if gap.numel() else gap.new_zeros(())])
        if self._sums is None:
            self._sums = part
        else:
            self._sums = torch.stack([self._sums[0] + part[0], self._sums[1] + part[1], torch.maximum(self._sums[2], part[2])])

    def read(self) -> tuple[float, int, float]:
        """(summed gap, senior tokens, largest gap) so far: one device sync."""
        if self._sums is None:
            return 0.0, 0, 0.0
        total, tokens, largest = self._sums.tolist()
        return total, int(tokens), largest

    @property
    def total(self) -> float:
        return self.read()[0]

    @property
    def tokens(self) -> int:
        return self.read()[1]

    @property
    def largest(self) -> float:
        return self.read()[2]

    def metrics(self) -> dict[str, float]:
        total, tokens, largest = self.read()
        if not tokens:
            return {}
        return {"rollout_logp_gap_mean": total / tokens, "rollout_logp_gap_max": largest}
