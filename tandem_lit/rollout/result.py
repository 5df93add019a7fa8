"""The step's record: a batch of graded rollouts, what a rollout phase hands to the update, to the
step's metrics and to evaluation. It sits beside ``PromptBatch`` and ``Rollout`` (``record.py``):
the prompts go in, the rollouts come out, and the grades join them here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from tandem_lit.rollout.record import Rollout, concat_rollouts
from tandem_lit.verifiers.base import Grade


@dataclass
class RolloutResult:
    """A batch of rollouts with their grades."""

    rollout: Rollout
    grades: list[Grade]
    group: Tensor  # [N] long, prompt index within the batch
    columns: dict[str, list[Any]]  # dataset columns, one value per rollout

    @property
    def rewards(self) -> Tensor:  # [N] float
        return torch.tensor([g.reward for g in self.grades], dtype=torch.float32)

    @property
    def correct(self) -> list[bool]:
        return [g.correct for g in self.grades]

    def to(self, device: torch.device | str) -> RolloutResult:
        """The same result with its rollout on ``device`` (group ids and grades stay on the host)."""
        return replace(self, rollout=self.rollout.to(device))

    def groups_with_spread(self, rewards: Tensor | None = None) -> list[int]:
        """Prompt indices whose rollouts did not all get the same reward (``rewards``: these
        instead of the verifier's, e.g. with an overlong penalty applied)."""
        rewards = self.rewards if rewards is None else rewards.cpu()
        return [int(g) for g in self.group.unique() if rewards[self.group == g].unique().numel() > 1]

    def keep_groups(self, groups: list[int], offset: int) -> RolloutResult:
        """The rollouts of these prompts, renumbered from ``offset``."""
        rows = [i for i, g in enumerate(self.group.tolist()) if g in set(groups)]
        renumber = {g: offset + i for i, g in enumerate(groups)}
        return RolloutResult(
            rollout=self.rollout.select(rows),
            grades=[self.grades[i] for i in rows],
            group=torch.tensor([renumber[int(self.group[i])] for i in rows], dtype=torch.long),
            columns={name: [values[i] for i in rows] for name, values in self.columns.items()},
        )


def concat_results(parts: list[RolloutResult], pad_token_id: int) -> RolloutResult:
    return RolloutResult(
        rollout=concat_rollouts([p.rollout for p in parts], pad_token_id),
        grades=[g for p in parts for g in p.grades],
        group=torch.cat([p.group for p in parts]),
        columns={name: [v for p in parts for v in p.columns[name]] for name in parts[0].columns},
    )
