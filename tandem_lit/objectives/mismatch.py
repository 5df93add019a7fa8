"""The rollout engine's policy against the trainer's, on the senior's tokens: diagnostics and the
sequence-level pieces of the corrections.

The engine decodes from its own copy of the senior (bf16 on a GPU, other kernels), so the
log-prob it recorded for a token (``rollout``) and the one the trainer computes before its first
update (``old``) differ a little. Per token, ``delta = old - rollout`` is the log of the importance
weight ``w = pi_old / pi_rollout`` that corrects for it. Junior tokens were drawn from the junior,
not from any senior copy: their delta is 0 (weight 1) and they are not measured.

Diagnostics (``MismatchStats``, logged per step as ``train/mismatch_*``), as verl's
``rollout_corr`` metrics, prime-rl's ``mismatch_kl`` and TRL's importance-sampling metrics:

* ``mismatch_kl``: the k3 estimate of KL(pi_rollout || pi_old), mean of ``w - 1 - delta`` (the
  tokens were drawn from pi_rollout; >= 0, 0 when the two agree);
* ``mismatch_ess``: the normalised effective sample size of the weights, ``(sum w)^2 / (n sum
  w^2)``, 1 when every weight is equal, towards 1/n when one token's weight dominates. verl
  computes it on weights clamped into [1/cap, cap]; here on the unclamped weights (bounded only
  at e^+-20), so that it measures the mismatch whatever correction is configured.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem_lit.rollout.record import Author

#: log-ratios are clamped to +-this before exp (verl's bound): e^20 is far past any clip range yet
#: finite in float32, where e^89 is not
LOG_RATIO_BOUND = 20.0


def senior_log_ratio(old: Tensor, rollout: Tensor, author: Tensor) -> Tensor:  # [N, T] each -> [N, T]
    """``old - rollout`` on the senior's tokens, bounded at +-``LOG_RATIO_BOUND``; 0 elsewhere."""
    delta = (old.detach().float() - rollout.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.where(author.long() == Author.SENIOR, delta, 0.0)


def sequence_log_ratio(delta: Tensor) -> Tensor:  # [N, T] -> [N]
    """Log of a sequence's importance weight: the product of its senior tokens' weights."""
    return delta.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def geometric_log_ratio(delta: Tensor, author: Tensor) -> Tensor:  # [N, T], [N, T] -> [N]
    """Log of the geometric mean of a sequence's senior-token weights (0 for a row without one):
    unlike the product it does not grow with the length, so one bound suits short and long rows."""
    senior = (author.long() == Author.SENIOR).sum(-1)
    return delta.sum(-1) / senior.clamp_min(1)


class MismatchStats:
    """``mismatch_kl`` and ``mismatch_ess`` (module docstring) over every senior token of a step.
    Sums stay on the device as passes arrive (no sync per pass); ``metrics`` reads them once."""

    def __init__(self) -> None:
        self._sums: Tensor | None = None  # [k3, tokens, sum w, sum w^2]

    def add(self, old: Tensor, rollout: Tensor | None, author: Tensor) -> None:  # [N, T] each
        if rollout is None:
            return
        senior = author.long() == Author.SENIOR
        delta = senior_log_ratio(old, rollout, author)
        weight = torch.where(senior, torch.exp(delta), 0.0)
        k3 = torch.where(senior, weight - 1.0 - delta, 0.0)
        part = torch.stack([k3.sum(), senior.sum().float(), weight.sum(), weight.square().sum()]).double()
        self._sums = part if self._sums is None else self._sums + part

    def metrics(self) -> dict[str, float]:
        if self._sums is None:
            return {}
        k3, tokens, total, squares = self._sums.tolist()
        if not tokens:
            return {}
        return {"mismatch_kl": k3 / tokens, "mismatch_ess": total * total / (tokens * squares)}
