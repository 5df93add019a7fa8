"""Training: the LightningModule (hooks and the step), its rollout and update phases, the memory
plan, several processes (FSDP2), supervised fine-tuning, callbacks, run records and export."""

from tandem_lit.training.module import TandemModule
from tandem_lit.training.settings import (
    DynamicSampling,
    EvaluationSettings,
    LoggingSettings,
    MemorySettings,
    OverlongPolicy,
    PromptFormat,
    RolloutSettings,
    UpdateSettings,
)
from tandem_lit.training.sft import SFTModel

__all__ = [
    "DynamicSampling", "EvaluationSettings", "LoggingSettings", "MemorySettings", "OverlongPolicy", "PromptFormat",
    "RolloutSettings", "SFTModel", "TandemModule", "UpdateSettings",
]
