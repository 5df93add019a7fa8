"""DataModules serving prompt rows."""

from tandem_lit.data.base import PromptDataModule, PromptRows, SeededBatches
from tandem_lit.data.gsm8k import GSM8KDataModule

__all__ = ["GSM8KDataModule", "PromptDataModule", "PromptRows", "SeededBatches"]
