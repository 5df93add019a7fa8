"""Objectives: REINFORCE (positive-only and soft-masked) and GRPO."""

from tandem_lit.objectives.base import AuthorshipError, LossScale, Objective, ObjectiveInputs, token_weights
from tandem_lit.objectives.grpo import GRPO
from tandem_lit.objectives.reinforce import Reinforce, SoftMaskedReinforce

__all__ = [
    "GRPO", "AuthorshipError", "LossScale", "Objective", "ObjectiveInputs", "Reinforce",
    "SoftMaskedReinforce", "token_weights",
]
