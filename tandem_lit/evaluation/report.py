"""Solo and handoff evaluation: per-dataset tallies, pass@k, and the report files.

``tandem-lit test`` runs, for every problem of every eval set, ``n`` solo samples of the model
under test and ``n`` handoff samples (the model and its partner alternate spans, the model
writes first, one shared token budget), then reports per set and macro-averaged:

- solo and handoff pass@k (unbiased estimator) and their ratio,
- truncation rate and mean length of both,
- legibility: the partner's mean cross-entropy (nats) on the model's solo solutions, per partner
  token and per character (the one to compare pairs whose tokenizers differ),
- with ``test_forced_token``: success after one forced junior token (``forced_token_*``),
- the verifier's own labels for both (``solo_elegance_rate``, ``handoff_tests_passed_fraction``...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from tandem_lit.evaluation.metrics import pass_at_k


def forced_token_summary(forced: list[tuple[bool, bool, bool]]) -> dict[str, float]:
    """The one-forced-token experiment (tandem_lit/evaluation/forced_token.py) from per-sample (solo correct,
    correct after forcing, a token was forced): success after forcing, its change from solo,
    the share of solo-correct samples that stay correct, and how many samples had a position."""
    n = len(forced)
    solo = sum(s for s, _, _ in forced) / n
    after = sum(c for _, c, _ in forced) / n
    kept = [c for s, c, f in forced if s and f]
    return {
        "forced_token_accuracy": after,
        "forced_token_change": after - solo,
        "forced_token_kept_rate": sum(kept) / len(kept) if kept else float("nan"),
        "forced_token_position_rate": sum(f for _, _, f in forced) / n,
    }


@dataclass
class DatasetTally:
    """Everything measured on one eval set (lists grow batch by batch)."""

    solo_correct: list[int] = field(default_factory=list)  # per problem: correct samples of n
    handoff_correct: list[int] = field(default_factory=list)
    n: int = 0
    solo_lengths: list[int] = field(default_factory=list)  # per sample
    handoff_lengths: list[int] = field(default_factory=list)
    solo_truncated: list[bool] = field(default_factory=list)
    handoff_truncated: list[bool] = field(default_factory=list)
    partner_nll: float = 0.0  # summed over the solo solutions' tokens
    partner_tokens: int = 0  # in the partner's own tokens
    partner_chars: int = 0  # characters of those solutions' text
    # the verifier's labels (Grade.labels, e.g. elegance_rate): {name: [sum, count]}
    solo_labels: dict[str, list[float]] = field(default_factory=dict)
    # per solo sample with test_forced_token: (solo correct, correct after forcing, a token was forced)
    forced: list[tuple[bool, bool, bool]] = field(default_factory=list)
    handoff_labels: dict[str, list[float]] = field(default_factory=dict)

    def pass_at(self, k: int, handoff: bool) -> float:
        counts = self.handoff_correct if handoff else self.solo_correct
        return sum(pass_at_k(self.n, c, k) for c in counts) / len(counts) if counts else float("nan")


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(tallies: dict[str, DatasetTally], ks: list[int]) -> dict:
    """Per-dataset and macro-averaged numbers (nan where a number does not apply)."""
    report: dict = {"datasets": {}, "macro": {}}
    for name, tally in tallies.items():
        row: dict[str, float] = {"problems": len(tally.solo_correct), "n": tally.n}
        for k in ks:
            if k > tally.n:
                continue
            solo, handoff = tally.pass_at(k, False), tally.pass_at(k, True)
            row[f"solo_pass@{k}"] = solo
            row[f"handoff_pass@{k}"] = handoff if tally.handoff_correct else float("nan")
            row[f"handoff_solo_ratio@{k}"] = handoff / solo if tally.handoff_correct and solo > 0 else float("nan")
        row["solo_truncation_rate"] = _mean(tally.solo_truncated)
        row["handoff_truncation_rate"] = _mean(tally.handoff_truncated)
        row["solo_mean_length"] = _mean(tally.solo_lengths)
        row["handoff_mean_length"] = _mean(tally.handoff_lengths)
        row["legibility_nats"] = tally.partner_nll / tally.partner_tokens if tally.partner_tokens else float("nan")
        row["legibility_nats_per_char"] = tally.partner_nll / tally.partner_chars if tally.partner_chars else float("nan")
        if tally.forced:
            row.update(forced_token_summary(tally.forced))
        for mode, labels in (("solo", tally.solo_labels), ("handoff", tally.handoff_labels)):
            for label, (total, count) in sorted(labels.items()):
                row[f"{mode}_{label}"] = total / count if count else float("nan")
        report["datasets"][name] = row
    keys = sorted({k for row in report["datasets"].values() for k in row if k not in ("problems", "n")})
    for key in keys:
        values = [row[key] for row in report["datasets"].values() if key in row and not math.isnan(row[key])]
        report["macro"][key] = sum(values) / len(values) if values else float("nan")
    return report


def flat_metrics(report: dict, prefix: str = "test") -> dict[str, float]:
    """``test/<dataset>/<metric>`` and ``test/macro/<metric>`` for loggers."""
    out = {}
    for name, row in [*report["datasets"].items(), ("macro", report["macro"])]:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not math.isnan(value):
                out[f"{prefix}/{name}/{key.replace('@', '_at_')}"] = float(value)  # MLflow refuses '@'
    return out


def markdown_table(report: dict, ks: list[int]) -> str:
    """Pass@k in %, the handoff/solo ratio at the largest k measured, truncation in %, length in
    tokens, legibility in nats per partner token and per character."""
    measured = [k for k in ks if f"solo_pass@{k}" in report["macro"]]
    columns = [f"solo_pass@{k}" for k in measured] + [f"handoff_pass@{k}" for k in measured]
    if measured:
        columns.append(f"handoff_solo_ratio@{measured[-1]}")
    columns += ["solo_truncation_rate", "handoff_truncation_rate", "solo_mean_length", "legibility_nats",
                "legibility_nats_per_char"]
    columns += sorted(k for k in report["macro"] if k.startswith(("solo_", "handoff_")) and k not in columns
                      and not k.startswith(("solo_pass@", "handoff_pass@", "handoff_solo_ratio@", "handoff_truncation",
                                            "solo_mean_length", "handoff_mean_length")))  # the verifier's labels
    columns += [k for k in ("forced_token_accuracy", "forced_token_change", "forced_token_kept_rate") if k in report["macro"]]
    header = "| set | problems | " + " | ".join(columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 2)]
    rows = [*report["datasets"].items(), ("**macro**", {**report["macro"], "problems": ""})]
    for name, row in rows:
        cells = [_cell(row.get(c), c) for c in columns]
        lines.append(f"| {name} | {row.get('problems', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value, column: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if "pass@" in column or "rate" in column or column.startswith("forced_token"):
        return f"{100 * value:.1f}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def plot_pass_at_k(report: dict, ks: list[int], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*report["datasets"], "macro"]
    rows = [*report["datasets"].values(), report["macro"]]
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), sharey=True, squeeze=False)
    for ax, name, row in zip(axes[0], names, rows):
        usable = [k for k in ks if f"solo_pass@{k}" in row]
        ax.plot(usable, [100 * row[f"solo_pass@{k}"] for k in usable], marker="o", label="solo")
        if all(not math.isnan(row.get(f"handoff_pass@{k}", float("nan"))) for k in usable):
            ax.plot(usable, [100 * row[f"handoff_pass@{k}"] for k in usable], marker="s", label="handoff")
        ax.set_xscale("log", base=2)
        ax.set_xticks(usable, [str(k) for k in usable])
        ax.set_title(name)
        ax.set_xlabel("k")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("pass@k (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _strict_json(value):
    """``value`` with every nan/inf float replaced by None: results.json stays valid JSON (``NaN``
    is not JSON; strict parsers such as JavaScript's and jq refuse it)."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_report(report: dict, ks: list[int], folder: Path) -> list[Path]:
    """results.json (numbers that do not apply are null), results.md and pass_at_k.png in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "results.json"
    json_path.write_text(json.dumps(_strict_json(report), indent=2, default=float, allow_nan=False))
    md_path = folder / "results.md"
    md_path.write_text(markdown_table(report, ks))
    return [json_path, md_path, plot_pass_at_k(report, ks, folder / "pass_at_k.png")]


def merge_totals(totals: dict[str, list[float]]) -> dict[str, list[float]]:
    """{name: [sum, count]} added up over ranks (a rank whose share was empty has no names)."""
    every: list[dict[str, list[float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, totals)
    merged: dict[str, list[float]] = {}
    for part in every:
        for name, (total, count) in (part or {}).items():
            entry = merged.setdefault(name, [0.0, 0])
            entry[0] += total
            entry[1] += count
    return merged
