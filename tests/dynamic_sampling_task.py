"""A task for the several-process tests of dynamic sampling and ``max_prompt_tokens``, chosen in
their configs by class path (``tests`` on the processes' ``PYTHONPATH``).

Rows are spelled by letters, one per row in training order (no shuffle): ``n`` a prompt never
rewarded, ``a`` always rewarded (both groups agree), ``m`` rewarded when the completion holds a
vowel (random tiny models' groups then have reward spread); a capital letter is the same row with a
long prompt (for ``max_prompt_tokens``). ``TrainedGroups`` writes what each rank trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L

from tandem_lit.data.base import PromptDataModule, SeededBatches
from tandem_lit.verifiers.base import Grade, Verifier

CHARS = {"n": "", "a": "*", "m": "aeiou"}


class LetterRows(PromptDataModule):
    """Training rows spelled by ``letters``, in that order every epoch; validation: the first two.

    Args:
        letters: One letter per row (``n``, ``a``, ``m``; capital: a long prompt).
    """

    def __init__(self, letters: str, batch_size: int = 4):
        super().__init__(batch_size=batch_size)
        self.letters = letters

    def load_split(self, split) -> list[dict[str, Any]]:
        rows = []
        for i, letter in enumerate(self.letters):
            question = "a very long question indeed " * 4 if letter.isupper() else ""
            rows.append({"prompt": f"Q{i}: {question}number {i}?", "chars": CHARS[letter.lower()]})
        return rows if split == "train" else rows[:2]

    def train_dataloader(self) -> SeededBatches:
        if self._train_batches is None:
            self._train_batches = SeededBatches(self.rows("train"), self.batch_size, self.seed, shuffle=False)
        return self._train_batches


class LetterVerifier(Verifier):
    """Reward 1 when the completion holds one of the row's ``chars`` (``*``: always)."""

    def grade(self, completion: str, chars: str = "", **columns: Any) -> Grade:
        hit = chars == "*" or any(c in completion for c in chars)
        return Grade(correct=hit, reward=float(hit))


class TrainedGroups(L.Callback):
    """Appends, per rank, every group its updates trained to ``<run folder>/trained-<rank>.jsonl``:
    the prompt, the rewards and the completions, in the order the rank holds them."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        run = pl_module.updates.run

        def recorded(result, *args, **kwargs):
            rollout, rewards = result.rollout, result.rewards.tolist()
            lines = []
            for group in range(int(result.group.max()) + 1):
                rows = [i for i, g in enumerate(result.group.tolist()) if g == group]
                prompt = rollout.prompt_ids[rows[0]][rollout.prompt_mask[rows[0]].bool()]
                lines.append(json.dumps({"prompt": pl_module.tokenizer.decode(prompt.tolist()),
                                         "rewards": [rewards[i] for i in rows], "texts": [rollout.texts[i] for i in rows]}))
            with open(Path(trainer.default_root_dir) / f"trained-{trainer.global_rank}.jsonl", "a") as out:
                out.write("".join(line + "\n" for line in lines))
            return run(result, *args, **kwargs)

        pl_module.updates.run = recorded
