"""Evaluation: validation/test/predict steps, per-dataset tallies and pass@k, reports, rollout
metrics (jargon, log-prob gap), language share and the forced-token experiment."""

from tandem_lit.evaluation.metrics import JargonDetector, LogprobGap, PassAtK, pass_at_k, rollout_stats
from tandem_lit.evaluation.report import DatasetTally, markdown_table, summarize, write_report
from tandem_lit.evaluation.results import RolloutResult

__all__ = [
    "DatasetTally", "JargonDetector", "LogprobGap", "PassAtK", "RolloutResult", "markdown_table", "pass_at_k",
    "rollout_stats", "summarize", "write_report",
]
