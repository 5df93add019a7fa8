"""Side-by-side curves of a demo run and its control (the figures in docs/demo.md).

    python -m tandem_lit.demo.figures runs/demo runs/demo_control docs/img

Reads each run's metric history (``history.jsonl``, written at the end of fit) and draws the
senior's jargon rate and the three accuracies over optimiser updates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem_lit.callbacks import metric_series

ACCURACIES = {"eval/senior_accuracy": "senior alone", "eval/tandem_accuracy": "tandem", "eval/junior_accuracy": "junior alone"}


def load_history(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines() if line]


def draw(demo: Path, control: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {"tandem (word handoff, p=0.5)": load_history(demo), "control (no handoff)": load_history(control)}
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for (label, history), color in zip(runs.items(), ("tab:blue", "tab:gray")):
        ax.plot(*metric_series(history, "eval/senior_jargon_rate"), marker="o", markersize=3, color=color, label=label)
    ax.set_title("Senior's jargon rate (greedy, held-out problems)", fontsize=10)
    ax.set_xlabel("optimiser updates")
    ax.set_ylabel("solutions with <<...>>")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "demo_jargon.png")
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
    written.append(out / "demo_accuracy.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def table(run: Path) -> list[dict[str, float]]:
    """The evaluation rows of a run (step, jargon, accuracies), for docs and reports."""
    keys = ["eval/senior_jargon_rate", "eval/tandem_jargon_rate", *ACCURACIES]
    return [{"step": row["step"], **{k: round(row[k], 3) for k in keys if k in row}} for row in load_history(run) if keys[0] in row]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw the demo's curves from a run and its control.")
    parser.add_argument("demo", type=Path)
    parser.add_argument("control", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    for path in draw(args.demo, args.control, args.out):
        print(path)
    for run in (args.demo, args.control):
        print(run, json.dumps(table(run), indent=None))


if __name__ == "__main__":
    main()
