"""The first hour of a user: runs never mix, a signal or a kill loses nothing, the grader's
give-ups are counted (bad inputs that end in one line: test_cli.BAD_INPUT).

Everything goes through ``main(args=[...])``, the path of the ``tandem-lit`` command."""

from __future__ import annotations

import json
import math
import os
import signal

import lightning as L
import pytest
import torch

from tandem_lit.cli import main

pytestmark = [pytest.mark.filterwarnings("ignore:No seed found"), pytest.mark.usefixtures("in_repo")]

FAST = [
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
    "--trainer.limit_val_batches", "0", "--model.init_args.evaluation.at_start", "false",
    "--data.init_args.batch_size", "2", "--model.init_args.rollout.sampling.n", "2",
    "--model.init_args.rollout.sampling.max_new_tokens", "12", "--model.init_args.logging.completions_every_n_steps", "1",
    "--checkpoint.every_n_train_steps", "2",
]


def fit(root, *extra: str) -> None:
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *FAST, *extra])


def test_a_second_run_into_a_used_folder_gets_its_own(tmp_path, capsys):
    root = tmp_path / "run"
    fit(root, "--trainer.max_steps", "1")
    first = json.loads((root / "run.json").read_text())["run_id"]
    capsys.readouterr()
    fit(root, "--trainer.max_steps", "1")
    assert f"{root} holds an earlier run; this run writes to {root}-2" in capsys.readouterr().err
    second = json.loads((tmp_path / "run-2" / "run.json").read_text())["run_id"]
    assert first != second
    for folder, run_id in ((root, first), (tmp_path / "run-2", second)):
        completions = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines()]
        assert completions and {c["run_id"] for c in completions} == {run_id}
        assert [c["step"] for c in completions] == [1] * len(completions)  # one run's steps, once
        history = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
        assert {row["run_id"] for row in history} == {run_id}
        # the step's wall time is its two phases' (the CLI's step, set beside the harness's)
        steps = [row for row in history if "train/step_seconds" in row]
        assert steps and all(math.isclose(row["train/step_seconds"], row["train/rollout_seconds"] + row["train/update_seconds"],
                                          rel_tol=1e-9) for row in steps)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["last.ckpt"]


def test_a_resume_continues_the_same_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "run"
    at = FAST.index("--trainer.logger")
    with_mlflow = FAST[:at] + FAST[at + 2 :]  # the default logger: MLflow in the run folder
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *with_mlflow,
               "--trainer.max_steps", "2"])
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *with_mlflow,
               "--trainer.max_steps", "3", "--ckpt_path", str(root / "checkpoints" / "last.ckpt")])
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "tandem-lit"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3]
    assert json.loads((root / "run.json").read_text())["run_id"] == run.info.run_id


class SignalAtStep(L.Callback):
    """Sends ``signum`` to this process when training step ``step`` (0-based) begins: the first
    Ctrl-C / SIGTERM of a user, delivered mid-step."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_saves_it_and_resume_continues_exactly(tmp_path, capsys, signum):
    straight = tmp_path / "straight"
    fit(straight, "--trainer.max_steps", "4")
    root = tmp_path / "stopped"
    callback = json.dumps([{"class_path": "test_reliability.SignalAtStep", "init_args": {"step": 2, "signum": int(signum)}}])
    with pytest.raises(SystemExit) as info:
        fit(root, "--trainer.max_steps", "4", "--trainer.callbacks", callback)
    assert info.value.code == 128 + signum
    assert "stopped by a signal after update 3; the run is saved" in capsys.readouterr().err
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 3, "the interrupted step finished and was saved"
    assert [row["step"] for row in map(json.loads, (root / "history.jsonl").read_text().splitlines())] == [1, 2, 3]
    assert (root / "summary.json").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "Ctrl-C is the user's again"
    capsys.readouterr()
    fit(root, "--trainer.max_steps", "4", "--ckpt_path", str(root / "checkpoints" / "last.ckpt"))
    # the summary counts the resumed run's own updates and says where it went on from
    assert "tandem-lit: 1 update (resumed at update 3, 4 in all) in " in capsys.readouterr().out
    assert json.loads((root / "summary.json").read_text())["resumed_at"] == 3
    assert "resumed_at" not in json.loads((straight / "summary.json").read_text())
    a = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grades_the_grader_gave_up_on_are_counted_per_step(tmp_path):
    """A verifier that keeps a ``timeouts`` count (MathVerifier does): each step logs how many of
    its rewards were zeros for lack of a verdict, not for a wrong answer."""
    from conftest import tiny_tandem_module

    from tandem_lit.data import GSM8KDataModule
    from tandem_lit.objectives import GRPO
    from tandem_lit.rollout import SamplingConfig
    from tandem_lit.verifiers.base import Grade, Verifier

    class GivesUpOnce(Verifier):
        timeouts = 0

        def grade(self, completion: str, **columns) -> Grade:
            return Grade(correct=False, reward=0.0)

        def grade_batch(self, completions, **columns):
            self.timeouts += 1  # one grade per batch ran out of time
            return super().grade_batch(completions, **columns)

    module = tiny_tandem_module(verifier=GivesUpOnce(), objective=GRPO(), sampling=SamplingConfig(n=2, max_new_tokens=8),
                                optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    assert [row["train/grader_timeouts"] for row in module.history if "train/loss" in row] == [1.0, 1.0]


class KillDuringValidation(L.Callback):
    """SIGKILL (no handler can run) when the validation after update ``step`` starts."""

    def __init__(self, step: int):
        self.step = step

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_run_killed_during_validation_redoes_that_validation_on_resume(tmp_path, repo_root):
    import subprocess
    import sys

    root = tmp_path / "run"
    validate = ["--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2", "--checkpoint.every_n_train_steps", "1"]
    callback = json.dumps([{"class_path": "test_reliability.KillDuringValidation", "init_args": {"step": 2}}])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo_root / "tests"), os.environ.get("PYTHONPATH", "")]))
    killed = subprocess.run(
        [sys.executable, "-m", "tandem_lit.cli", "fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir",
         str(root), *FAST, *validate, "--trainer.max_steps", "4", "--trainer.callbacks", callback],
        cwd=repo_root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # the step-2 checkpoint waits for its validation, which never finished: the last one is step 1's
    assert torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 1
    fit(root, *validate, "--trainer.max_steps", "4", "--ckpt_path", str(root / "checkpoints" / "last.ckpt"))
    history = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in history if "eval/senior_accuracy" in r] == [2, 4]


# -- bad inputs of the second pass: each ends in one line naming the input and the fix -----------------


def junior_with_vocabulary(tmp, rows: int) -> str:
    """configs/tiny/junior (the senior's character tokenizer) with ``rows`` embedding rows."""
    import shutil

    folder = tmp / f"junior_{rows}"
    shutil.copytree("configs/tiny/junior", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return str(folder)


def latin1_data(tmp) -> str:
    folder = tmp / "latin1"
    folder.mkdir()
    good = json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"})
    (folder / "train.jsonl").write_bytes((good + "\n" + good.replace("What", "Caf\u00e9: what") + "\n").encode("latin-1"))
    return str(folder)


def folder_for_a_file(tmp) -> str:
    (tmp / "data" / "train.jsonl").mkdir(parents=True)
    return str(tmp / "data")


NEW_KINDS = {
    "budget_past_context": (lambda tmp: ["--model.init_args.rollout.sampling.max_new_tokens", "5000"],
                            "rollout.sampling.max_new_tokens 5000 plus the longest training prompt"),
    "validation_budget_past_context": (lambda tmp: ["--model.init_args.evaluation.sampling.max_new_tokens", "3000",
                                                    "--model.init_args.evaluation.at_start", "true"],
                                       "evaluation.sampling.max_new_tokens 3000 plus the longest validation prompt"),
    "junior_vocabulary_short_of_the_tokenizer": (lambda tmp: ["--model.init_args.junior.path", junior_with_vocabulary(tmp, 80)],
                                                 "has 80 vocabulary rows (vocab_size) but its tokenizer has 100 tokens"),
    "dataset_not_utf8": (lambda tmp: ["--data.init_args.source", latin1_data(tmp), "--data.init_args.val_size", "0"],
                         "train.jsonl, line 2: not valid UTF-8 (byte 0xe9"),
    "dataset_file_is_a_folder": (lambda tmp: ["--data.init_args.source", folder_for_a_file(tmp)], "cannot be read"),
    "optimizer_refuses_its_settings": (lambda tmp: ["--model.init_args.optimizer.init_args.lr", "-1"],
                                       "the optimizer refused its settings: Invalid learning rate: -1.0"),
    "trainer_refuses_devices": (lambda tmp: ["--trainer.devices", "0"], "the trainer settings (accelerator='cpu', devices='0'"),
}


def assert_one_error_line(err: str, expected: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert len(errors) == 1, err
    assert expected in errors[0], errors[0]
    assert err.rstrip().splitlines()[-1] == errors[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("case", sorted(NEW_KINDS))
def test_a_bad_input_of_a_new_kind_is_one_line_and_exit_code_2(tmp_path, capsys, case):
    make_args, expected = NEW_KINDS[case]
    args = make_args(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        fit(tmp_path / "run", "--trainer.max_steps", "1", *args)
    assert info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, expected)


def test_tandem_lit_test_refuses_a_budget_past_the_context_and_a_checkpoint_of_another_model(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    test = ["test", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"), *FAST[:6]]
    with pytest.raises(SystemExit) as info:
        main(args=[*test, "--model.init_args.evaluation.test_sampling.max_new_tokens", "3000"])
    assert info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "evaluation.test_sampling.max_new_tokens 3000 plus the longest test prompt")

    def checkpoint_of(config, name: str):
        other = AutoModelForCausalLM.from_config(config)
        state = {f"senior.{key}": p.detach() for key, p in other.named_parameters()}
        torch.save({"state_dict": state, "pytorch-lightning_version": L.__version__,
                    "tandem_lit": {"trainable_keys": sorted(state), "history": [], "run_id": None}}, tmp_path / name)
        return str(tmp_path / name)

    wider = AutoConfig.from_pretrained("configs/tiny/senior")
    wider.intermediate_size *= 2
    for path, expected in (
        (checkpoint_of(AutoConfig.from_pretrained("configs/tiny/junior"), "junior.ckpt"), "9 trainable tensors missing"),
        (checkpoint_of(wider, "wider.ckpt"), "senior.model.layers.0.mlp.gate_proj.weight is ["),
    ):
        with pytest.raises(SystemExit) as info:
            main(args=[*test, "--ckpt_path", path])
        assert info.value.code == 2
        assert_one_error_line(capsys.readouterr().err, f"checkpoint does not match this model: {expected}")


def test_a_pair_sharing_a_tokenizer_may_differ_only_in_rows_never_sampled(caplog):
    """Checkpoints pad their embeddings (Qwen2.5's 0.5B and 7B: 151,936 and 152,064 rows over one
    tokenizer of 151,665 tokens); the rows past the tokenizer are said once and never sampled."""
    import logging

    from conftest import tiny_llama

    from tandem_lit.models.tiny import char_tokenizer
    from tandem_lit.training import preflight

    tokenizer = char_tokenizer("abcde .\n")
    senior, junior = tiny_llama(len(tokenizer), seed=0), tiny_llama(len(tokenizer) + 64, seed=1)
    with caplog.at_level(logging.INFO, logger="tandem_lit"):
        preflight.check_vocabularies(senior, junior, tokenizer, tokenizer, {"senior": "s", "junior": "j"})
    assert f"rows past id {len(tokenizer) - 1} are never sampled" in caplog.text
    with pytest.raises(preflight.ConfigError, match=f"has {len(tokenizer) - 1} vocabulary rows"):
        preflight.check_vocabularies(senior, tiny_llama(len(tokenizer) - 1, seed=1), tokenizer, tokenizer,
                                     {"senior": "s", "junior": "j"})


def test_a_real_bug_keeps_its_traceback_and_lightning_refusals_under_our_code_are_bugs(tmp_path, monkeypatch):
    """The boundary turns dependencies' refusals of a setting into one line only where no code of
    ours ran under the call: a MisconfigurationException raised inside a tandem_lit hook is our
    misuse of Lightning, and keeps its traceback."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from tandem_lit import cli
    from tandem_lit.training import preflight

    def refuse(*args, **kwargs):
        raise MisconfigurationException("you called self.optimizers() wrongly")

    monkeypatch.setattr(preflight, "check", refuse)
    with pytest.raises(MisconfigurationException):
        main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path), *FAST,
                   "--trainer.max_steps", "1"])
    try:
        raise MisconfigurationException("`val_check_interval` (9) must be less than or equal to the number of batches")
    except MisconfigurationException as err:
        assert cli.refused_by_dependency(err).startswith("Lightning refused a setting: `val_check_interval` (9)")
