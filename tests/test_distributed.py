"""Several processes: FSDP2 on two gloo processes (CPU), through the real CLI and Lightning's launcher.

A step on two processes must equal the same step in one (loss and updated weights), resume
exactly, and leave a checkpoint that one process can continue; files are written once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from tandem_lit.training.distributed import balance, rank_rows, reduce_metrics

REPO = Path(__file__).resolve().parents[1]
TANDEM_LIT = Path(sys.executable).with_name("tandem-lit")

# the tiny GSM8K run, made exact enough to compare: SGD with momentum (state to restore; Adam's
# first step is sign-like, so round-off in near-zero gradients would decide it); soft-masked
# REINFORCE (random tiny models never answer right: GRPO would get no signal); two PPO
# mini-batches per step, so max_steps (updates) is twice the steps; no evaluation
SETTINGS = {
    "trainer": {"limit_val_batches": 0, "enable_progress_bar": False},
    "checkpoint": {"every_n_train_steps": 1},
    "model": {"init_args": {
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}},
        "mini_batch_size": 2,
        "objective": {"class_path": "SoftMaskedReinforce"},
        "evaluate_at_start": False,
        "completions_every_n_steps": 1,
    }},
}


LORA = ("--model.init_args.lora", "{r: 4, alpha: 8, dropout: 0.0}")


def run(root: Path, devices: int, updates: int, *extra: str) -> subprocess.CompletedProcess:
    settings = root.parent / "settings.yaml"
    settings.write_text(yaml.safe_dump(SETTINGS))
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TANDEM_LIT_RUN_FOLDER")}
    strategy = ["--trainer.strategy", "fsdp"] if devices > 1 else []
    command = [
        str(TANDEM_LIT), "fit", "--config", "configs/gsm8k_tiny.yaml", "--config", str(settings),
        "--trainer.default_root_dir", str(root), "--trainer.devices", str(devices), "--trainer.max_steps", str(updates),
        *strategy, *extra,
    ]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def history(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]


def losses(root: Path) -> list[float]:
    return [row["train/loss"] for row in history(root) if "train/loss" in row]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process for 2 steps (4 updates); two processes for 1 step, resumed to 2 steps on two
    processes and, from the same checkpoint, on one; LoRA on one process and on two, 1 step each.
    (No uninterrupted two-process run: every two-process result must equal the one-process run,
    which the uninterrupted run would have to equal as well.)"""
    base = tmp_path_factory.mktemp("distributed")
    done = {
        "one": run(base / "one", 1, 4),
        "two_first": run(base / "two_first", 2, 2),
        # LoRA without dropout (dropout draws differ per process): one step each
        "one_lora": run(base / "one_lora", 1, 2, *LORA),
        "two_lora": run(base / "two_lora", 2, 2, *LORA),
    }
    checkpoint = base / "after_step_1.ckpt"  # (the resume in place replaces last.ckpt)
    if (base / "two_first" / "checkpoints" / "last.ckpt").exists():
        shutil.copy(base / "two_first" / "checkpoints" / "last.ckpt", checkpoint)
        first = losses(base / "two_first")
        done["two"] = run(base / "two_first", 2, 4, "--ckpt_path", str(checkpoint))
        done["one_resumed"] = run(base / "one_resumed", 1, 4, "--ckpt_path", str(checkpoint))
        (base / "two").symlink_to(base / "two_first")  # the two-process run, 2 steps with a resume between
        (base / "two_first_losses.json").write_text(json.dumps(first))
    for name, process in done.items():
        assert process.returncode == 0, f"{name}: {process.stderr[-3000:]}"
    return base, done


def test_a_two_process_fsdp_step_equals_the_one_process_step(runs):
    base, _ = runs
    one, two = losses(base / "one"), losses(base / "two")
    assert len(one) == len(two) == 2
    assert two == pytest.approx(one, rel=1e-5, abs=1e-7)
    assert all(loss != 0 for loss in one) and one[1] != one[0]  # the steps did something
    assert_same_weights(weights(base / "one" / "checkpoints" / "last.ckpt"), weights(base / "two" / "checkpoints" / "last.ckpt"))


def test_a_two_process_lora_step_equals_the_one_process_step(runs):
    base, _ = runs
    assert losses(base / "two_lora") == pytest.approx(losses(base / "one_lora"), rel=1e-5)
    one = weights(base / "one_lora" / "checkpoints" / "last.ckpt")
    assert all(".lora_" in name for name in one)  # adapters only
    assert_same_weights(one, weights(base / "two_lora" / "checkpoints" / "last.ckpt"))


def test_a_two_process_checkpoint_resumes_exactly_on_two_and_on_one(runs):
    base, done = runs
    first = json.loads((base / "two_first_losses.json").read_text())
    assert len(first) == 1 and losses(base / "two")[:1] == first  # the resume kept step 1's row
    assert "Restored all states" in done["two"].stderr + done["two"].stdout
    # on one process, from the two-process checkpoint (a different world size)
    assert losses(base / "one_resumed") == pytest.approx(losses(base / "one"), rel=1e-5)
    assert_same_weights(weights(base / "one_resumed" / "checkpoints" / "last.ckpt"), weights(base / "one" / "checkpoints" / "last.ckpt"))


def test_files_are_written_once(runs):
    base, done = runs
    for name in ("one", "two"):
        steps = [row["step"] for row in history(base / name)]
        assert steps == sorted(set(steps)), f"{name}: history rows repeat: {steps}"
    one = (base / "one" / "completions.jsonl").read_text().splitlines()
    two = (base / "two" / "completions.jsonl").read_text().splitlines()
    assert len(two) == len(one) > 0
    assert len({json.loads(line)["run_id"] for line in two}) == 1
    assert not (base / "two-2").exists(), "rank 1 chose a run folder of its own"


def test_a_batch_that_does_not_split_over_the_processes_is_refused(tmp_path):
    process = run(tmp_path / "odd", 2, 1, "--data.init_args.batch_size", "3")
    assert process.returncode == 2
    assert "data batch_size 3 in mini-batches of 2 prompts does not split over 2 processes" in process.stderr
    assert "Traceback" not in process.stderr


def test_rank_rows_give_every_rank_its_share_of_every_mini_batch():
    shares = [rank_rows(8, 2, rank, prompts_per_update=4) for rank in range(2)]
    assert shares == [[0, 1, 4, 5], [2, 3, 6, 7]]  # update 0: prompts 0-3, update 1: prompts 4-7
    assert rank_rows(6, 3, 2, None) == [4, 5]
    assert rank_rows(12, 2, 1, prompts_per_update=8) == [4, 5, 6, 7, 10, 11]  # a shorter last mini-batch
    assert rank_rows(2, 2, 1, prompts_per_update=8) == [1]  # a mini-batch larger than the step
    with pytest.raises(ValueError, match="do not split over 2"):
        rank_rows(8, 2, 0, prompts_per_update=3)


def test_balance_splits_the_largest_batches_until_the_counts_match():
    batches = [torch.arange(5), torch.arange(5, 7)]
    balanced = balance(batches, 4)
    assert len(balanced) == 4
    assert torch.equal(torch.cat(balanced), torch.arange(7))  # same rows, same order
    with pytest.raises(ValueError):
        balance([torch.arange(1)], 2)


def _gathered_copy_worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoTokenizer

        from tandem_lit.models import ModelSource, load_causal_lm
        from tandem_lit.rollout import FastEngine
        from tandem_lit.rollout.weights import gathered, rollout_named_tensors
        from tandem_lit.training.distributed import shard_model

        source = ModelSource(str(REPO / "configs/tiny/senior"), random_init=True, init_seed=1, dtype="float32")
        model = shard_model(load_causal_lm(source), init_device_mesh("cpu", (world,)), bf16_compute=False)
        tokenizer = AutoTokenizer.from_pretrained(REPO / "configs/tiny/senior")
        engine = FastEngine(rollout_dtype="bfloat16")
        with gathered(model):
            engine.setup(model, None, tokenizer)
        with torch.no_grad():  # an update changes the shards; the copy follows after a reload
            for p in model.parameters():
                p.add_(0.25)
        with gathered(model):
            engine.load_weights(rollout_named_tensors(model))
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
        copy = dict(engine.senior.named_parameters())
        results[rank] = (
            engine.decodes_copy,
            type(engine.senior).__name__,
            all(torch.equal(copy[name], full[name].to(torch.bfloat16)) for name in full),
            type(next(model.parameters())).__name__,
            reduce_metrics({"loss": rank + 1.0, "reward_mean": float(rank), "logp_gap_max": 3.0 * rank,
                            "peak_memory_gb": 10.0 + rank, **({"only_on_1": 7.0} if rank else {})}),
        )
    finally:
        dist.destroy_process_group()


def test_the_rollout_copy_on_each_rank_equals_the_gathered_weights_and_metrics_reduce():
    with mp.Manager() as manager:
        results = manager.dict()
        port = 29_000 + os.getpid() % 1000
        mp.spawn(_gathered_copy_worker, args=(2, port, results), nprocs=2)
        outcome = dict(results)
    # the loss adds up (each rank holds its part of the batch-wide loss); rates are means;
    # maxima and peak memory take the largest
    reduced = {"loss": 3.0, "reward_mean": 0.5, "logp_gap_max": 3.0, "peak_memory_gb": 11.0, "only_on_1": 7.0}
    assert outcome == {r: (True, "LlamaForCausalLM", True, "DTensor", reduced) for r in range(2)}


def test_export_writes_a_plain_hugging_face_folder_of_the_trained_senior(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from tandem_lit.cli import main
    from tandem_lit.models import ModelSource, load_causal_lm

    base, _ = runs
    trained = weights(base / "two" / "checkpoints" / "last.ckpt")  # written by two processes
    main(["export", str(base / "two"), "--out", str(tmp_path / "full")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
    for name, tensor in trained.items():
        assert torch.equal(exported[name.removeprefix("senior.")], tensor), name

    main(["export", str(base / "two_lora"), "--out", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    adapters = weights(base / "two_lora" / "checkpoints" / "last.ckpt")
    frozen = load_causal_lm(ModelSource(str(REPO / "configs/tiny/senior"), random_init=True, init_seed=1, dtype="float32")).state_dict()
    prefix, scaling = "senior.base_model.model.", 8 / 4  # LoRA alpha / r
    merged_layers = 0
    for name, weight in frozen.items():
        a, b = (adapters.get(prefix + name.replace(".weight", f".lora_{x}.default.weight")) for x in "AB")
        expected = weight if a is None else weight + scaling * b @ a
        merged_layers += a is not None
        torch.testing.assert_close(merged[name], expected, rtol=1e-6, atol=1e-6, msg=name)
    assert merged_layers > 0 and merged.keys() == frozen.keys()
    assert (tmp_path / "merged" / "tokenizer_config.json").exists()


def _checkpointed_worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from tandem_lit.models import ModelSource, load_causal_lm
        from tandem_lit.training.distributed import shard_model

        source = ModelSource(str(REPO / "configs/tiny/senior"), random_init=True, init_seed=1, dtype="float32")
        reference, model = load_causal_lm(source), load_causal_lm(source)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        shard_model(model, init_device_mesh("cpu", (world,)), bf16_compute=False)
        ids = torch.arange(3, 27).view(2, 12) % 90 + 3
        mine = ids[rank : rank + 1]  # each rank its row; FSDP averages, so the loss is scaled by world / rows
        (model(input_ids=mine).logits.log_softmax(-1).mean() * world / 2).backward()
        reference(input_ids=ids).logits.log_softmax(-1).mean(dim=(1, 2)).sum().div(2).backward()
        results[rank] = max(
            float((p.grad.full_tensor() - reference.get_parameter(name).grad).abs().max())
            for name, p in model.named_parameters()
        )
    finally:
        dist.destroy_process_group()


def test_activation_checkpointing_under_fsdp_gives_the_one_process_gradient():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_checkpointed_worker, args=(2, 29_000 + (os.getpid() + 500) % 1000, results), nprocs=2)
        outcome = dict(results)
    assert set(outcome) == {0, 1} and max(outcome.values()) < 1e-6, outcome
