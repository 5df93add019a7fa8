"""The offline demo's data: synthetic arithmetic word problems (``tandem_lit.data.world``).

Rows carry ``answer`` (for ``GSM8KVerifier``) and the reference solution in both styles. The
validation and test problems come from the held-out slice of the question space, which the demo
models never trained on.
"""

from __future__ import annotations

from typing import Any

from tandem_lit.data.base import PromptDataModule, Split
from tandem_lit.errors import ConfigError


class SyntheticArithmeticDataModule(PromptDataModule):
    """Word problems of one or two calculations, answer after ``####``, generated from a seed.

    Args:
        train_size: Training problems (drawn from the part of the world the demo models trained on).
        val_size: Held-out problems for validation.
        test_size: Held-out problems for test (disjoint from validation).
        world_seed: Seed of the problem generator (the demo recipe's seed: same world).
        templates: Problem templates to use (None: all; see ``tandem_lit.data.world.TEMPLATES``).
        batch_size: Prompts per training step.
        eval_batch_size: Prompts per validation/test batch.
        seed: Seed of the training order.
    """

    def __init__(
        self,
        train_size: int = 2000,
        val_size: int = 200,
        test_size: int = 200,
        world_seed: int = 0,
        templates: list[str] | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, seed=seed)
        if min(train_size, val_size, test_size) < 0:
            raise ConfigError(f"split sizes must be >= 0, got {train_size}, {val_size}, {test_size}")
        self.train_size = train_size
        self.val_size = val_size
        self.test_size = test_size
        self.world_seed = world_seed
        self.templates = tuple(templates) if templates else None

    def load_split(self, split: Split) -> list[dict[str, Any]]:
        from tandem_lit.data.world import problems

        try:
            if split == "train":
                chosen = problems(self.world_seed, self.train_size, "train", self.templates)
            else:
                held = problems(self.world_seed, self.val_size + self.test_size, "held_out", self.templates)
                chosen = held[: self.val_size] if split == "val" else held[self.val_size :]
        except ValueError as err:
            raise ConfigError(str(err)) from err
        return [
            {
                "prompt": p.prompt,
                "question": p.question,
                "answer": str(p.answer),
                "solution": p.solution("plain"),
                "jargon_solution": p.solution("jargon"),
                "template": p.template,
            }
            for p in chosen
        ]
