"""The log-probs of handoff switches: each token scored under the distribution it was drawn from.

At a boundary where the author changes (``TandemDecoder._handoff``), two things happen that an
ordinary token's log-prob leaves out:

- the new author's first token is drawn from its distribution restricted to the tokens that may
  start a span (``BoundaryRule.start_allowed``), so its probability is ``p(x) / Z``, ``Z`` the
  author's mass on that set. Where the senior wrote it (junior -> senior), ``-log Z`` belongs to
  the senior's log-prob, and its expectation (``grad log Z``) is not zero;
- at senior -> junior, the senior's candidate is discarded once it proved to start a span: the
  senior chose to end its span there, with probability ``Z_end``, its mass on the candidates
  ``at_boundary`` accepts. That factor depends on the senior and is scored on the senior's last
  token of the span (``log p(last token) + log Z_end``): the joint event "this token, then the
  span ends", so all of the senior's factors land on tokens the senior wrote.

The sampling itself is unchanged (the same tokens for the same seeds); the engines record, and
the update recomputes (``rollout.logprobs``), the log-probs with these terms, from per-token codes
in the ``Rollout``: ``start_set`` (the set a token was drawn from; 0: the whole vocabulary) and
``end_set`` (the set of the senior's discarded candidate at this position), both 1-based rows of
``Rollout.token_sets`` (``BoundaryRule.token_sets``). A junior token drawn at a switch is scored by
the senior under the same restriction, so a junior weight of 1 still treats it as the senior's.
docs/architecture.md says why this construction and not another.
"""

from __future__ import annotations

import torch
from torch import Tensor


def set_log_mass(logp: Tensor, sets: Tensor, code: Tensor) -> Tensor:  # [N, V], [K, V] bool, [N] -> [N]
    """log of the mass the normalised log-probs ``logp`` put on token set ``code`` per row (a
    1-based row of ``sets``); 0 where ``code`` is 0 (the whole vocabulary)."""
    mask = sets[(code.long() - 1).clamp_min(0)]
    mass = logp.masked_fill(~mask, float("-inf")).logsumexp(-1)
    return torch.where(code > 0, mass, 0.0)


def switch_codes(states: int, state: Tensor, switched: Tensor, free: Tensor | None,
                 ended_senior: Tensor) -> tuple[Tensor, Tensor]:
    """(start code, end code) per row at a step: the token drawn after a switch comes from start
    set ``1 + state``; where the senior's span ended there, its candidate was in end set
    ``1 + states + state``. ``free``: rows whose draw was forced by ``max_span`` (no restriction
    and no boundary to score); ``ended_senior``: rows the senior wrote until this step."""
    constrained = switched if free is None else switched & ~free
    start = torch.where(constrained, 1 + state, 0)
    end = torch.where(constrained & ended_senior, 1 + states + state, 0)
    return start, end
