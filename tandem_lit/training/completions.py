"""``completions.jsonl``: sample completions of a run, spans marked by author, for a person to read."""

from __future__ import annotations

import json
from pathlib import Path

from tandem_lit.rollout.result import RolloutResult
from tandem_lit.write_faults import appending


def append_sampled(trainer, settings, result: RolloutResult, tokenizer, split: str, run_id: str | None, step: int) -> None:
    """``append`` every ``completions_every_n_steps`` optimiser updates (``LoggingSettings``), on rank 0."""
    every = settings.completions_every_n_steps
    if not every or trainer is None or step % every or not trainer.is_global_zero:
        return
    append(trainer.default_root_dir, result, tokenizer, split, run_id, step, settings.completions_per_log)


def append(folder: str | Path, result: RolloutResult, tokenizer, split: str, run_id: str | None, step: int, count: int) -> None:
    """Append the first ``count`` rollouts of ``result`` to ``<folder>/completions.jsonl``."""
    path = Path(folder) / "completions.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rollout = result.rollout
    with appending(path) as f:  # a full disk leaves no half line
        for i in range(min(count, len(result.grades))):
            spans = rollout.spans(i, tokenizer)
            record = {
                "run_id": run_id,
                "step": step,
                "split": split,
                "prompt": tokenizer.decode(rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]),
                "reward": result.grades[i].reward,
                "correct": result.grades[i].correct,
                "extracted": result.grades[i].extracted,
                "spans": [{"author": a.name.lower(), "text": t} for a, t in spans],
                "marked": "".join(f"[{a.name[0]}]{t}" for a, t in spans),
            }
            f.write(json.dumps(record) + "\n")
