"""Side-by-side curves of a demo run and its control (the figures in docs/demo.md).

    python -m tandem_lit.demo.figures runs/demo runs/demo_control docs/img
    python -m tandem_lit.demo.figures runs/demo_language runs/demo_language_control docs/img --setting language

Reads each run's metric history (``history.jsonl``, written at the end of fit) and draws the
senior's jargon rate (skill gap) or French share (language gap) and the three accuracies over
optimiser updates.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from tandem_lit.training.callbacks import metric_series

ACCURACIES = {"eval/senior_accuracy": "senior alone", "eval/tandem_accuracy": "tandem", "eval/junior_accuracy": "junior alone"}


@dataclass(frozen=True)
class Setting:
    """What one demo's figures show: the senior's drifting metric and the file names."""

    metric: str  # greedy, held-out: the solid line
    train_metric: str | None  # of the senior's own words in training rollouts: the dashed line
    title: str
    ylabel: str
    files: tuple[str, str]  # (the metric's figure, the accuracies' figure)
    run_label: str


SETTINGS = {
    "jargon": Setting(
        "eval/senior_jargon_rate", None, "Senior's jargon rate (greedy, held-out problems)", "solutions with <<...>>",
        ("demo_jargon.png", "demo_accuracy.png"), "tandem (word handoff, p=0.5)",
    ),
    "language": Setting(
        "eval/senior_language_share", "train/senior_language_share", "Senior's French share", "French words / listed words",
        ("demo_language_share.png", "demo_language_accuracy.png"), "tandem (word handoff, p=0.5)",
    ),
}


def load_history(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines() if line]


def draw(demo: Path, control: Path, out: Path, setting: str = "jargon") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = SETTINGS[setting]
    runs = {chosen.run_label: load_history(demo), "control (no handoff)": load_history(control)}
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for (label, history), color in zip(runs.items(), ("tab:blue", "tab:gray")):
        ax.plot(*metric_series(history, chosen.metric), marker="o", markersize=3, color=color, label=f"{label}: greedy, held-out")
        if chosen.train_metric:
            steps, values = metric_series(history, chosen.train_metric)
            ax.plot(steps, values, linestyle="--", linewidth=1, alpha=0.7, color=color, label=f"{label}: its words in training rollouts")
    ax.set_title(chosen.title, fontsize=10)
    ax.set_xlabel("optimiser updates")
    ax.set_ylabel(chosen.ylabel)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7 if chosen.train_metric else 8)
    fig.tight_layout()
    written.append(out / chosen.files[0])
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, (label, history) in zip(axes, runs.items()):
        for metric, name in ACCURACIES.items():
            steps, values = metric_series(history, metric)
            if steps:
                ax.plot(steps, values, marker="o", markersize=3, label=name)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("optimiser updates")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (greedy, held-out)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    written.append(out / chosen.files[1])
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def table(run: Path, setting: str = "jargon") -> list[dict[str, float]]:
    """The evaluation rows of a run (step, jargon rate or language share, accuracies), for docs
    and reports."""
    first = SETTINGS[setting].metric
    keys = [first, first.replace("senior", "tandem"), *ACCURACIES]
    return [{"step": row["step"], **{k: round(row[k], 3) for k in keys if k in row}} for row in load_history(run) if first in row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw the demo's curves from a run and its control.")
    parser.add_argument("demo", type=Path)
    parser.add_argument("control", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="jargon", help="skill gap (jargon) or language gap")
    args = parser.parse_args(argv)
    for path in draw(args.demo, args.control, args.out, args.setting):
        print(path)
    for run in (args.demo, args.control):
        print(run, json.dumps(table(run, args.setting), indent=None))


if __name__ == "__main__":
    main()
