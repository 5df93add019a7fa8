"""Partial rollouts on two gloo processes (FSDP2, CPU), through the real CLI: each rank keeps its own
groups in flight, the ranks agree every step on how many groups train (``partial.InFlight.step``
decides it with collectives, so a rank that decided alone would leave the other waiting), and no
trained senior token is older than ``max_staleness`` counts: the 2 updates a step makes included.
"""

from __future__ import annotations

import pytest
from test_distributed_sampling import launch, train_rows

pytestmark = pytest.mark.multiprocess

# the tiny config's batches of 4 prompts in PPO mini-batches of 2 (2 updates a step), 8 groups in
# flight over 2 ranks: each keeps 4 and carries 2 from step to step
PARTIAL = ["--model.init_args.rollout.partial", "{in_flight_prompts: 8, max_staleness: 2}"]


def test_two_ranks_carry_their_own_groups_train_alike_and_keep_the_bound(tmp_path):
    root = tmp_path / "two"
    run = launch(root, 2, *PARTIAL, "--trainer.max_steps", "6")  # 6 updates
    assert run.returncode == 0, run.stderr[-3000:]
    rows = train_rows(root)
    # the carry fills up over the first steps (a rank trains 1 group, 1 update, while its 2 carried
    # groups gather), then a batch's worth: 2 groups a rank, 2 updates a step
    assert [row["step"] for row in rows] == [1, 2, 4, 6]
    assert [row["train/partial_trained_groups"] for row in rows] == [1.0, 1.0, 2.0, 2.0]
    assert [row["train/partial_carried_groups"] for row in rows] == [1.0, 2.0, 2.0, 2.0]
    assert all(row.get("train/stale_token_max_age", 0.0) <= 2.0 for row in rows)
    assert any(row.get("train/stale_token_max_age", 0.0) == 2.0 for row in rows), "no carried token trained a step's 2 updates old"
