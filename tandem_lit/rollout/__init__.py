"""Rollouts: the Rollout record, handoff policies, sampling and engines."""

from tandem_lit.rollout.engine import EngineTiming, HFEngine, KVBudget, RolloutEngine, TokenizerMismatchError
from tandem_lit.rollout.handoff import (
    HandoffPolicy,
    LineHandoff,
    ParagraphHandoff,
    SentenceHandoff,
    SoloHandoff,
    TokenHandoff,
    WordHandoff,
)
from tandem_lit.rollout.record import Author, PromptBatch, Rollout
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tandem_lit.rollout.text_handoff import TextHandoffEngine
from tandem_lit.rollout.vllm_engine import VLLMEngine  # imports vllm only when one is built

__all__ = [
    "Author", "EngineTiming", "FastEngine", "HFEngine", "HandoffPolicy", "KVBudget", "LineHandoff", "ParagraphHandoff",
    "PromptBatch", "Rollout", "RolloutEngine", "RolloutResult", "SamplingConfig", "SentenceHandoff", "SoloHandoff",
    "TextHandoffEngine", "TokenHandoff", "TokenizerMismatchError", "VLLMEngine", "WordHandoff",
]
