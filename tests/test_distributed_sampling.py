"""Dynamic sampling and ``max_prompt_tokens`` on two gloo processes (FSDP2, CPU), through the real
CLI, against the same run on one process: the ranks keep the groups one process keeps and train
equal shares of them, skip the same long prompts, and stop together with one line when no update
can happen (``distributed.Shares``; docs/distributed.md).

The task (``dynamic_sampling_task``) spells its rows by letters, in training order: ``n`` never
rewarded, ``a`` always (both groups agree), ``m`` rewarded on a vowel (random tiny models' groups
mostly disagree), capitals the same with a prompt over ``max_prompt_tokens``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import REPO, assert_same_weights, clean_env, fit_args, free_port

from tandem_lit.errors import ConfigError
from tandem_lit.training.callbacks import read_checkpoint

pytestmark = pytest.mark.multiprocess

TASK = ["--data", "dynamic_sampling_task.LetterRows", "--model.init_args.verifier", "dynamic_sampling_task.LetterVerifier",
        "--trainer.callbacks+", "dynamic_sampling_task.TrainedGroups", "--model.init_args.rollout.max_prompt_tokens", "40",
        "--model.init_args.update.max_idle_steps", "1"]
# batch 1: the pool of 9 prompts that fit (Q3 is too long), 4 to keep in at most 3 rounds; batch 2:
# every group agrees, so the run stops there
DYNAMIC = [*TASK, "--data.init_args.letters", "nmaMmmnmmm" + "nnnnnaaaaa", "--data.init_args.batch_size", "10",
           "--model.init_args.rollout.dynamic_sampling", "{prompts_per_step: 4, max_rounds: 3}"]
# batch 1: both long prompts are in rank 0's half of the batch; batch 2: three prompts fit;
# batch 3: none does, so the run stops there
LONG_PROMPTS = [*TASK, "--data.init_args.letters", "MmMm" + "mmmM" + "MMMM", "--data.init_args.batch_size", "4"]
STOPPED = "tandem-lit: error: "


def launch(root: Path, devices: int, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``tandem-lit fit`` on ``devices`` processes (Lightning starts the second one) with the task's
    module importable; a run still going after ``timeout`` seconds (ranks waiting on each other) is
    killed with every process it started, and fails the test."""
    strategy = ["--trainer.strategy", "fsdp"] if devices > 1 else []
    command = [sys.executable, "-m", "tandem_lit", *fit_args(root, 100, "--trainer.devices", str(devices), *strategy, *extra)]
    env = clean_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{devices} process(es) still running after {timeout} s: the ranks hang")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def trained(root: Path, rank: int) -> list[dict]:
    """The groups rank ``rank``'s updates trained, in its order (``TrainedGroups``)."""
    return [json.loads(line) for line in (root / f"trained-{rank}.jsonl").read_text().splitlines()]


def train_rows(root: Path) -> list[dict]:
    """The logged rows of the steps before the run stopped (kept in its last checkpoint)."""
    rows = read_checkpoint(root / "checkpoints" / "last.ckpt")["tandem_lit"]["history"]
    return [row for row in rows if "train/loss" in row]


def stop_lines(process: subprocess.CompletedProcess) -> list[str]:
    return [line for line in process.stderr.splitlines() if line.startswith(STOPPED)]


def numbers(groups: list[dict]) -> list[str]:
    return [group["prompt"].split(":")[0] for group in groups]


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory):
    base = tmp_path_factory.mktemp("dynamic")
    return base, launch(base / "one", 1, *DYNAMIC), launch(base / "two", 2, *DYNAMIC)


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    base = tmp_path_factory.mktemp("long_prompts")
    return base, launch(base / "one", 1, *LONG_PROMPTS), launch(base / "two", 2, *LONG_PROMPTS)


def test_two_processes_keep_the_groups_one_process_keeps_and_train_equal_shares(dynamic):
    base, one, two = dynamic
    (one_row,), (two_row,) = train_rows(base / "one"), train_rows(base / "two")
    # what makes this a test of the refill: 3 rounds, 4 groups dropped (never, always, an m that
    # agreed, never), the long prompt skipped
    counts = ("train/kept_groups", "train/dropped_groups", "train/sampling_rounds", "train/skipped_long_prompts")
    assert [one_row[name] for name in counts] == [4.0, 4.0, 3.0, 1.0]
    assert [two_row[name] for name in counts] == [4.0, 4.0, 3.0, 1.0] and two_row["train/balance_dropped_groups"] == 0.0
    kept = trained(base / "one", 0)
    assert numbers(kept) == ["Q4", "Q5", "Q7", "Q8"]
    # rank r trains its part of each mini-batch of 2 groups (one process's order). Rank 1 rolled out
    # Q4 (round 1: Q0 Q1 | Q2 Q4), Q7 (round 2: Q5 | Q6 Q7) and Q8 (round 3: | Q8): the groups travel
    ranks = [trained(base / "two", rank) for rank in (0, 1)]
    assert [numbers(share) for share in ranks] == [["Q4", "Q7"], ["Q5", "Q8"]]
    assert [ranks[0][0], ranks[1][0], ranks[0][1], ranks[1][1]] == kept  # same prompts, rewards, completions
    assert two_row["train/loss"] == pytest.approx(one_row["train/loss"], rel=1e-5, abs=1e-7)
    assert_same_weights(read_checkpoint(base / "one" / "checkpoints" / "last.ckpt")["state_dict"],
                        read_checkpoint(base / "two" / "checkpoints" / "last.ckpt")["state_dict"])


def test_when_no_group_has_reward_spread_every_rank_stops_with_the_same_line(dynamic):
    _, one, two = dynamic
    assert one.returncode == two.returncode == 2
    assert "Traceback" not in one.stderr + two.stderr
    (line,) = stop_lines(one)
    assert "dynamic sampling found no prompt whose rollouts got different rewards in 1 consecutive steps" in line
    lines = stop_lines(two)
    assert len(lines) == 2 and lines[0] == lines[1], lines  # one line per rank, the same
    assert lines[0].startswith(line) and lines[0].endswith("(On 2 processes a step needs at least 2 such prompts.)")


def test_ranks_skip_the_same_long_prompts_and_train_equal_shares(long_prompts):
    base, one, two = long_prompts
    one_rows, two_rows = train_rows(base / "one"), train_rows(base / "two")
    # the whole batch's count on every rank (not a sum over ranks)
    assert [row["train/skipped_long_prompts"] for row in one_rows] == [row["train/skipped_long_prompts"] for row in two_rows] == [2.0, 1.0]
    assert [row["train/balance_dropped_groups"] for row in two_rows] == [0.0, 1.0]
    ones, ranks = trained(base / "one", 0), [trained(base / "two", rank) for rank in (0, 1)]
    assert numbers(ones) == ["Q1", "Q3", "Q4", "Q5", "Q6"]
    # batch 1: rank 0's half of the batch (Q0 Q2) is all long prompts; the ranks split what fits.
    # batch 2: of the three that fit, the last is left out so that both ranks train one
    assert [numbers(share) for share in ranks] == [["Q1", "Q4"], ["Q3", "Q5"]]
    assert [ranks[0][0], ranks[1][0], ranks[0][1], ranks[1][1]] == ones[:4]
    assert two_rows[0]["train/loss"] == pytest.approx(one_rows[0]["train/loss"], rel=1e-5, abs=1e-7)


def test_when_every_prompt_is_too_long_every_rank_stops_with_the_same_line(long_prompts):
    _, one, two = long_prompts
    assert one.returncode == two.returncode == 2
    assert "Traceback" not in one.stderr + two.stderr
    expected = [f"{STOPPED}every prompt of the last 1 batches is longer than rollout.max_prompt_tokens=40, so no update can "
                "happen: raise it or use shorter prompts."]
    assert stop_lines(one) == expected and stop_lines(two) == expected * 2


def _shares_worker(rank: int, world: int, port: int, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from tandem_lit.models import ModelSource, load_causal_lm
        from tandem_lit.training.distributed import Shares, check_several_processes, shard_model

        shares = Shares(world, rank, prompts_per_update=2)
        rounds = [shares.of_round(3), shares.of_round(1)]  # a round of 3 rows, then of 1
        spread = [0.0, 0.0, 0.0]
        for i in rounds[0]:  # each rank fills in its own rows: row 1 has no spread
            spread[i] = float(i != 1)
        # 5 groups kept, every one on rank 1; a step trains 4
        kept = {place: torch.tensor([place]) for place in range(5)} if rank == 1 else {}
        dealt = [int(part) for part in shares.deal(kept, shares.balanced(5))]
        source = ModelSource(str(REPO / "configs/tiny/senior"), random_init=True, init_seed=1, dtype="float32")
        model = shard_model(load_causal_lm(source), init_device_mesh("cpu", (world,)), bf16_compute=False)
        trainer = SimpleNamespace(world_size=world, default_root_dir=folder, strategy=None,
                                  datamodule=SimpleNamespace(batch_size=3))
        check_several_processes(model, trainer, 2, prompts_per_step=4)  # the batch is only the pool
        try:
            check_several_processes(model, trainer, 2, prompts_per_step=3)
            refused = None
        except ConfigError as err:
            refused = str(err)
        results[rank] = (rounds, shares.total(spread), dealt, refused)
    finally:
        dist.destroy_process_group()


def test_shares_split_rounds_add_up_flags_and_deal_kept_groups_from_any_rank(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_shares_worker, args=(2, free_port(), str(tmp_path), results), nprocs=2)
        outcome = dict(results)
    refused = ("rollout.dynamic_sampling.prompts_per_step 3 in mini-batches of 2 prompts does not split over 2 "
               "processes: make every mini-batch a multiple of 2 prompts")
    assert outcome[0] == ([[0], []], [1.0, 0.0, 1.0], [0, 2], refused)
    assert outcome[1] == ([[1, 2], [0]], [1.0, 0.0, 1.0], [1, 3], refused)
