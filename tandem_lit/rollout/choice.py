"""Which engine a run gets when its config names none."""

from __future__ import annotations

import logging

from torch import nn

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.engine import HFEngine, RolloutEngine
from tandem_lit.rollout.static import FastEngine, check_architecture, decoder_model
from tandem_lit.rollout.weights import plain_model

log = logging.getLogger(__name__)


def default_engine(senior: nn.Module, junior: nn.Module | None) -> RolloutEngine:
    """FastEngine where it supports both models; otherwise HFEngine, said loudly (never silently).

    The senior's architecture is what counts: FastEngine decodes its own bf16 copy of it (LoRA
    merged, a 4-bit QLoRA base dequantised), so its training weights may be of any kind. The
    frozen junior is decoded in place, so its weights must be plain too."""
    try:
        check_architecture(plain_model(senior).config)
        if junior is not None:
            decoder_model(junior)
    except ConfigError as reason:
        log.warning(
            "FALLING BACK to HFEngine, the per-token reference loop (rollouts many times slower than FastEngine's "
            "on a GPU: docs/performance.md): %s. Set model.engine to choose the engine yourself.", reason,
        )
        return HFEngine()
    return FastEngine()
