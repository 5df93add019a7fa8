"""DataModules serving prompt rows."""

from tandem_lit.data.apps import APPSDataModule
from tandem_lit.data.base import PromptDataModule, PromptRows, SeededBatches
from tandem_lit.data.gsm8k import GSM8KDataModule
from tandem_lit.data.harp import HARPDataModule
from tandem_lit.data.math import DeepScaleRDataModule, MathEvalDataModule
from tandem_lit.data.synthetic import SyntheticArithmeticDataModule

__all__ = [
    "APPSDataModule",
    "DeepScaleRDataModule",
    "GSM8KDataModule",
    "HARPDataModule",
    "MathEvalDataModule",
    "PromptDataModule",
    "PromptRows",
    "SeededBatches",
    "SyntheticArithmeticDataModule",
]
