"""Evaluation: validation/test/predict steps, per-dataset tallies and pass@k, reports, rollout
metrics (jargon, log-prob gap), language share and the forced-token experiment."""

from tandem_lit.evaluation.metrics import JargonDetector, LogprobGap, PassAtK, pass_at_k, rollout_stats
from tandem_lit.evaluation.report import DatasetTally, markdown_table, summarize, write_report

__all__ = [
    "DatasetTally", "JargonDetector", "LogprobGap", "PassAtK", "markdown_table", "pass_at_k",
    "rollout_stats", "summarize", "write_report",
]


def __getattr__(name: str):
    if name == "RolloutResult":  # the step's record moved beside the other rollout records
        raise ImportError("tandem_lit.evaluation.RolloutResult moved to tandem_lit.rollout.RolloutResult "
                          "(tandem_lit.rollout.result)", name=name)
    raise AttributeError(f"module 'tandem_lit.evaluation' has no attribute {name!r}")
