"""Several processes: FSDP2 on two gloo processes (CPU), through the real CLI, started by
Lightning's launcher, by torchrun (one node x 2 processes; two "nodes" x 1 process: two torchrun
launchers on 127.0.0.1) and as srun would start them (SLURM's variables).

A step on two processes must equal the same step in one (loss and updated weights), resume
exactly (from one-file and from sharded checkpoints), and leave a checkpoint that one process can
continue; files are written once.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from tandem_lit.errors import ConfigError
from tandem_lit.training.callbacks import check_checkpoint, read_checkpoint
from tandem_lit.training.distributed import balance, check_run_folder, rank_rows, reduce_metrics

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
SHARDED = ("--checkpoint.sharded", "true")

# the tiny GSM8K run, made exact enough to compare: SGD with momentum (state to restore; Adam's
# first step is sign-like, so round-off in near-zero gradients would decide it); soft-masked
# REINFORCE (random tiny models never answer right: GRPO would get no signal); two PPO
# mini-batches per step, so max_steps (updates) is twice the steps; no evaluation
SETTINGS = {
    "trainer": {"limit_val_batches": 0, "enable_progress_bar": False},
    "checkpoint": {"every_n_train_steps": 1},
    "model": {"init_args": {
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}},
        "update": {"mini_batch_size": 2},
        "objective": {"class_path": "SoftMaskedReinforce"},
        "evaluation": {"at_start": False},
        "logging": {"completions_every_n_steps": 1},
    }},
}


LORA = ("--model.init_args.lora", "{r: 4, alpha: 8, dropout: 0.0}")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without a launcher's variables; the processes import this checkout (and
    the callbacks of these tests)."""
    launcher = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TANDEM_LIT_RUN_FOLDER", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]), **extra}


def fit_args(root: Path, updates: int, *extra: str) -> list[str]:
    settings = root.parent / "settings.yaml"
    settings.write_text(yaml.safe_dump(SETTINGS))
    return ["fit", "--config", "configs/gsm8k_tiny.yaml", "--config", str(settings),
            "--trainer.default_root_dir", str(root), "--trainer.max_steps", str(updates), *extra]


def run(root: Path, devices: int, updates: int, *extra: str) -> subprocess.CompletedProcess:
    strategy = ["--trainer.strategy", "fsdp"] if devices > 1 else []
    command = [sys.executable, "-m", "tandem_lit", *fit_args(root, updates, "--trainer.devices", str(devices), *strategy, *extra)]
    return subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def together(commands: list[tuple[list[str], dict[str, str]]]) -> subprocess.CompletedProcess:
    """Start the processes of one launch at once (as the nodes of a cluster would); their outputs joined."""
    started = [subprocess.Popen(c, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c, e in commands]
    outputs = [p.communicate(timeout=600) for p in started]
    code = next((p.returncode for p in started if p.returncode), 0)
    return subprocess.CompletedProcess(commands[0][0], code, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


def torchrun(root: Path, nodes: int, per_node: int, updates: int, *extra: str) -> subprocess.CompletedProcess:
    """``torchrun ... python -m tandem_lit fit ...`` once per node (static rendezvous on 127.0.0.1)."""
    port = free_port()
    return together([(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
         "--nproc_per_node", str(per_node), "--master_addr", "127.0.0.1", "--master_port", str(port),
         "-m", "tandem_lit", *fit_args(root, updates, "--trainer.strategy", "fsdp", *extra)],
        clean_env(),
    ) for node in range(nodes)])


def slurm_env(rank: int, tasks: int, port: int) -> dict[str, str]:
    """The variables srun sets for task ``rank`` of a one-node job (what Lightning's SLURMEnvironment reads)."""
    return clean_env(SLURM_NTASKS=str(tasks), SLURM_NTASKS_PER_NODE=str(tasks), SLURM_NNODES="1", SLURM_PROCID=str(rank),
                     SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_JOB_ID="4242", SLURM_JOB_NAME="tandem",
                     SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port))


def srun(root: Path, tasks: int, updates: int, *extra: str) -> subprocess.CompletedProcess:
    port = free_port()
    command = [sys.executable, "-m", "tandem_lit", *fit_args(root, updates, "--trainer.strategy", "fsdp", *extra)]
    return together([(command, slurm_env(rank, tasks, port)) for rank in range(tasks)])


def history(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]


def losses(root: Path) -> list[float]:
    return [row["train/loss"] for row in history(root) if "train/loss" in row]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(path)["state_dict"]  # one file, or a folder of shards


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
    # torchrun, one node x 2 processes, sharded checkpoints: 1 step; resumed in place to 2 steps
    # as srun starts 2 tasks, and, from the same checkpoint, on one process (another world size)
    done["torchrun_first"] = torchrun(base / "torchrun", 1, 2, 2, *SHARDED)
    shards = base / "after_step_1_shards"
    if (base / "torchrun" / "checkpoints" / "last.ckpt").exists():
        shutil.copytree((base / "torchrun" / "checkpoints" / "last.ckpt").resolve(), shards)
        done["srun_resumed"] = srun(base / "torchrun", 2, 4, *SHARDED, "--ckpt_path", str(shards))
        done["one_from_shards"] = run(base / "one_from_shards", 1, 4, "--ckpt_path", str(shards))
    # two "nodes" x 1 process: two torchrun launchers, node ranks 0 and 1
    done["two_nodes"] = torchrun(base / "two_nodes", 2, 1, 4)
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


def test_torchrun_and_srun_launches_equal_the_one_process_run(runs):
    """torchrun 1 x 2 (sharded checkpoints) for step 1, resumed in place as srun's 2 tasks for step
    2; torchrun on two "nodes" for both steps: losses and weights are the one-process run's."""
    base, done = runs
    one = losses(base / "one")
    reference = weights(base / "one" / "checkpoints" / "last.ckpt")
    for name in ("torchrun", "two_nodes"):
        assert losses(base / name) == pytest.approx(one, rel=1e-5, abs=1e-7), name
        assert_same_weights(weights(base / name / "checkpoints" / "last.ckpt"), reference)
        rows = history(base / name)
        assert [row["step"] for row in rows] == [2, 4] and len({row["run_id"] for row in rows}) == 1, name
        assert not (base / f"{name}-2").exists(), f"{name}: a rank chose a run folder of its own"
    assert "Restored all states" in done["srun_resumed"].stderr + done["srun_resumed"].stdout
    # rank 0 alone writes: one summary line per run, not one per process
    assert (done["two_nodes"].stdout + done["two_nodes"].stderr).count("tandem-lit: 4 updates in") == 1


def test_a_sharded_checkpoint_is_a_folder_of_every_ranks_shards_behind_an_atomic_link(runs):
    base, _ = runs
    checkpoints = base / "torchrun" / "checkpoints"
    last = checkpoints / "last.ckpt"
    assert last.is_symlink() and last.resolve().parent == checkpoints
    assert sorted(p.name for p in last.resolve().glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", last.resolve().name]  # the step-1 folder is gone


def test_a_sharded_checkpoint_resumes_on_one_process_and_exports(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from tandem_lit.cli import main

    base, _ = runs
    assert losses(base / "one_from_shards") == pytest.approx(losses(base / "one"), rel=1e-5)
    assert_same_weights(weights(base / "one_from_shards" / "checkpoints" / "last.ckpt"),
                        weights(base / "one" / "checkpoints" / "last.ckpt"))
    main(["export", str(base / "torchrun"), "--out", str(tmp_path / "hf")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in weights(base / "torchrun" / "checkpoints" / "last.ckpt").items():
        assert torch.equal(exported[name.removeprefix("senior.")], tensor), name


LAUNCHES = {
    "srun_disagrees": ({"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "tandem"},
                       ["--trainer.devices", "3"], "the launcher started 2 process(es) on each of 1 node(s)"),
    "torchrun_disagrees": ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
                            "LOCAL_RANK": "0"}, ["--trainer.num_nodes", "3"], "trainer.num_nodes 3: leave them out"),
    "nodes_without_launcher": ({}, ["--trainer.num_nodes", "2"], "trainer.num_nodes is 2, but no launcher started"),
}


@pytest.mark.parametrize("case", sorted(LAUNCHES))
def test_a_launch_that_cannot_rendezvous_ends_in_one_line(case, tmp_path, monkeypatch, capsys):
    from tandem_lit.cli import main

    variables, extra, expected = LAUNCHES[case]
    for name, value in clean_env(**variables).items():
        monkeypatch.setenv(name, value)
    for name in set(os.environ) - set(clean_env(**variables)):
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as stopped:
        main(fit_args(tmp_path / "run", 1, "--trainer.strategy", "fsdp", *extra))
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tandem-lit")]
    assert len(lines) == 1 and expected in lines[0], lines


def _run_folder_worker(rank: int, world: int, port: int, root: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, folders in (("same", [root, root]), ("different", [root, root + "-2"])):
            Path(folders[rank]).mkdir(exist_ok=True)
            try:
                check_run_folder(folders[rank])
                results[(name, rank)] = "ok"
            except ConfigError as err:
                results[(name, rank)] = str(err)
    finally:
        dist.destroy_process_group()


def test_ranks_that_chose_different_run_folders_all_stop_with_the_same_line(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_run_folder_worker, args=(2, free_port(), str(tmp_path / "run"), results), nprocs=2)
        outcome = dict(results)
    assert outcome[("same", 0)] == outcome[("same", 1)] == "ok"
    assert outcome[("different", 0)] == outcome[("different", 1)]
    assert "the ranks chose different run folders" in outcome[("different", 0)]
    assert not list((tmp_path).glob("run/.rank0-*"))  # the probe file is removed


def _sharded_save_worker(rank: int, world: int, port: int, folder: str, results) -> None:
    """Saves 1 and 2 complete; rank 0 is SIGKILLed in save 3 after every shard is on disk, before
    the commit (the last moment a crash can hit)."""
    import signal
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from tandem_lit.models import ModelSource, load_causal_lm
    from tandem_lit.training import sharded
    from tandem_lit.training.distributed import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    source = ModelSource(str(REPO / "configs/tiny/senior"), random_init=True, init_seed=1, dtype="float32")
    model = shard_model(load_causal_lm(source), init_device_mesh("cpu", (world,)), bf16_compute=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = Path(folder) / "last.ckpt"

    def barrier():
        dist.barrier()

    def broadcast(value):
        box = [value]
        dist.broadcast_object_list(box)
        return box[0]

    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        if step == 3:
            def save_then_die(*args, **kwargs):
                dcp.save(*args, **kwargs)
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
            sharded.dcp = SimpleNamespace(save=save_then_die, load=dcp.load)
        checkpoint = {"global_step": step, "state_dict": get_model_state_dict(model),
                      "optimizer_states": [get_optimizer_state_dict(model, optimizer)], "tandem_lit": {}}
        sharded.save_sharded(checkpoint, path, rank, broadcast, barrier)
        results[rank] = step


def test_a_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    context = mp.get_context("spawn")
    with mp.Manager() as manager:
        results = manager.dict()
        port = free_port()
        workers = [context.Process(target=_sharded_save_worker, args=(r, 2, port, str(tmp_path), results)) for r in range(2)]
        for worker in workers:
            worker.start()
        workers[0].join(120)
        workers[1].join(40)  # its collective fails once rank 0 is gone (or times out)
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
        reached = dict(results)
    assert workers[0].exitcode == -9 and reached.get(0) == 2  # killed during save 3
    last = tmp_path / "last.ckpt"
    assert os.readlink(last).startswith("last.ckpt.2-")  # the link never moved to save 3
    checkpoint = read_checkpoint(last)
    assert checkpoint["global_step"] == 2 and checkpoint["state_dict"]
    assert all(torch.all(t == 2.0) for t in checkpoint["state_dict"].values())
    assert len(list(tmp_path.glob(".last.ckpt.3-*.partial"))) == 1  # save 3's shards, never committed
    assert not list(tmp_path.glob("last.ckpt.1-*"))  # save 2 replaced save 1 and removed it
    check_checkpoint(str(last))  # what --ckpt_path checks before a resume


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


# -- the documented multi-process commands not run above, and how a launch fails ---------------------


def test_the_train_step_benchmark_runs_on_two_processes(tmp_path):
    """``benchmarks/train_step.py --devices 2 --strategy fsdp`` (docs/distributed.md): every rank
    writes into one run folder, which the script never created (the run-folder check makes it)."""
    out = tmp_path / "train_step.json"
    process = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--devices", "2", "--strategy", "fsdp",
         "--arms", "grpo", "--json", str(out)], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    (step,) = json.loads(out.read_text())["arms"]["grpo"]["steps"]
    assert step["rollout_seconds"] > 0 and step["update_seconds"] > 0 and step["update_trained_tokens"] > 0


def test_tandem_lit_test_under_torchrun_and_srun_reports_what_one_process_reports(tmp_path):
    """``torchrun ... -m tandem_lit test`` and srun's tasks: the ranks split the problems and rank 0
    writes one report, the one-process report."""
    def report(root: Path) -> dict:
        return json.loads((root / "eval" / "results.json").read_text())["datasets"]

    settings = ["test", "--config", "configs/gsm8k_tiny.yaml", "--data.init_args.test_limit", "8",
                "--model.init_args.evaluation.test_sampling.max_new_tokens", "8", "--trainer.enable_progress_bar", "false"]
    one = subprocess.run([sys.executable, "-m", "tandem_lit", *settings, "--trainer.default_root_dir", str(tmp_path / "one")],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = together([(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "tandem_lit", *settings, "--trainer.strategy", "fsdp",
         "--trainer.default_root_dir", str(tmp_path / "two")], clean_env())])
    assert two.returncode == 0, two.stderr[-3000:]
    assert report(tmp_path / "two") == report(tmp_path / "one") and report(tmp_path / "one")["set0"]["problems"] == 8
    assert not (tmp_path / "two-2").exists()
    port = free_port()  # as srun starts 2 tasks
    tasks = together([([sys.executable, "-m", "tandem_lit", *settings, "--trainer.strategy", "fsdp", "--trainer.default_root_dir",
                        str(tmp_path / "srun")], slurm_env(rank, 2, port)) for rank in range(2)])
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    assert report(tmp_path / "srun") == report(tmp_path / "one")
    assert "sync_dist" not in two.stderr  # (Lightning's advice per metric: the ranks log totals already merged)


class DieOnRank(L.Callback):
    """Ends rank ``rank`` at once (no line, as a process killed for memory) when its training step
    ``step`` (0-based) begins."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and batch_idx == self.step:
            os._exit(3)


def stop_line(process: subprocess.CompletedProcess) -> str:
    lines = [line for line in process.stderr.splitlines() if line.startswith("tandem-lit: error:")]
    assert lines, process.stderr[-3000:]
    assert len(set(lines)) == 1, lines  # (every rank that says something says the same)
    assert "Traceback" not in process.stderr, process.stderr[-3000:]
    return lines[0]


def test_a_rank_that_dies_stops_rank_0_with_one_line_naming_the_checkpoint_to_resume(tmp_path):
    root = tmp_path / "run"
    die = json.dumps([{"class_path": "test_distributed.DieOnRank", "init_args": {"rank": 1, "step": 1}}])
    process = run(root, 2, 4, "--trainer.callbacks", die)
    assert process.returncode == 2, process.stderr[-3000:]
    line = stop_line(process)
    assert "another process of this run stopped, so this one (rank 0) cannot go on" in line
    assert line.endswith(f"{root / 'checkpoints' / 'last.ckpt'} (update 2) is intact: resume with --ckpt_path "
                         f"{root / 'checkpoints' / 'last.ckpt'}")


def test_a_port_in_use_is_one_line(tmp_path):
    """srun's tasks meet on MASTER_PORT (Lightning derives it from the job id when unset): another
    program listening there stops rank 0 at once, with one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "tandem_lit", *fit_args(tmp_path / "run", 2, "--trainer.strategy", "fsdp")]
        process = subprocess.run(command, cwd=REPO, env=slurm_env(0, 2, port), capture_output=True, text=True, timeout=300)
    assert process.returncode == 2, process.stderr[-3000:]
    assert stop_line(process).endswith(f"the port rank 0 listens on ({port}, MASTER_PORT) is in use (another run on this "
                                       "machine?): set MASTER_PORT to a free port, or (torchrun) pass another --master_port")


def test_ranks_started_with_different_configs_stop_with_one_line(tmp_path):
    """Two srun tasks, one given another learning rate (a config file edited on one node): without
    the check each would train on, each with its own settings."""
    port = free_port()
    command = [sys.executable, "-m", "tandem_lit", *fit_args(tmp_path / "run", 2, "--trainer.strategy", "fsdp")]
    process = together([(command + ["--model.init_args.optimizer.init_args.lr", "0.1"] * rank, slurm_env(rank, 2, port))
                        for rank in range(2)])
    assert process.returncode == 2, process.stderr[-3000:]
    line = stop_line(process)
    assert "the ranks were started with different configs (rank 1 has model.init_args.optimizer.init_args.lr=0.1 where " \
           "rank 0 has 0.5)" in line
    assert process.stderr.count("tandem-lit: error:") == 2  # each rank says it: neither waits for the other


def test_a_broken_pipe_outside_torch_distributed_is_not_taken_for_a_lost_rank():
    from tandem_lit.training.distributed import process_group_error

    try:
        raise RuntimeError("[Errno 32] Broken pipe")  # (a grader's or a sandbox's pipe, say)
    except RuntimeError as err:
        assert process_group_error(err) is None
