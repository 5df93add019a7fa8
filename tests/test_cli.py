"""`tandem-lit` end to end: real configs, real tiny models, real Lightning, a real MLflow store."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
import yaml

from tandem_lit.cli import main
from tandem_lit.models.tiny import char_tokenizer, tiny_llama_config, write_model_dir

TRAIN_METRICS = [
    "train/reward_mean", "train/reward_std", "train/accuracy", "train/zero_variance_groups",
    "train/junior_token_share", "train/handoffs_per_sequence", "train/response_length",
    "train/truncation_rate", "train/jargon_rate", "train/loss", "train/step_seconds",
]
EVAL_METRICS = [
    f"eval/{mode}_{metric}" for mode in ("senior", "tandem", "junior")
    for metric in ("accuracy", "jargon_rate", "response_length", "truncation_rate")
] + ["eval/tandem_junior_token_share"]

QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
NO_EVAL = ["--trainer.limit_val_batches", "0", "--model.init_args.evaluation.at_start", "false"]
SMALL = ["--data.init_args.batch_size", "2", "--model.init_args.rollout.sampling.n", "2",
         "--model.init_args.rollout.sampling.max_new_tokens", "16"]


pytestmark = [pytest.mark.filterwarnings("ignore:No seed found"), pytest.mark.usefixtures("in_repo")]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A fresh run folder holding an empty MLflow sqlite store. Making the schema runs ~70 alembic
    migrations (seconds), so it is made once and copied; the CLI must find and use
    ``<run folder>/mlflow.db`` (a run logged anywhere else leaves it empty and the test fails)."""
    from mlflow.tracking import MlflowClient

    template = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()

    def make(path):
        path.mkdir(parents=True)
        shutil.copy(template, path / "mlflow.db")
        return path

    return make


def fit(root, *extra: str) -> None:
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *QUIET, *extra])


def mlflow_run(root):
    from mlflow.tracking import MlflowClient

    db = root / "mlflow.db"
    assert db.exists(), "no MLflow store in the run folder"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("tandem-lit")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def history(client, run, metric) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}


def test_the_evaluation_before_training_runs_the_batches_a_validation_runs(tmp_path):
    """trainer.limit_val_batches bounds the evaluation at the start as it bounds each validation:
    both write the same number of eval completions (2 problems of the 4 held out)."""
    root = tmp_path / "run"
    fit(root, *SMALL, "--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
        "--data.init_args.val_size", "4", "--data.init_args.eval_batch_size", "2",
        "--model.init_args.evaluation.sampling.max_new_tokens", "8", "--model.init_args.logging.completions_per_log", "64")
    records = [json.loads(line) for line in (root / "completions.jsonl").read_text().splitlines()]
    evaluated = Counter(r["step"] for r in records if r["split"] == "eval_tandem")
    assert set(evaluated) == {0, 1} and evaluated[0] == evaluated[1], evaluated


def test_fit_grpo_tiny_config_logs_everything(tmp_path, run_folder):
    root = run_folder(tmp_path / "run")
    fit(root, "--trainer.max_steps", "2", "--data.init_args.batch_size", "2", "--data.init_args.eval_batch_size", "2")
    client, run = mlflow_run(root)
    logged = set(run.data.metrics)
    missing = [m for m in TRAIN_METRICS + EVAL_METRICS if m not in logged]
    assert not missing, f"not logged: {missing}"
    # one train row per optimiser step; evaluation before training (step 0) and after step 2
    assert len(history(client, run, "train/reward_mean")) == 2
    evaluations = history(client, run, "eval/senior_accuracy")
    assert len(evaluations) == 2 and min(evaluations) == 0
    share = history(client, run, "train/junior_token_share")
    assert all(0.0 < v < 1.0 for v in share.values()), share  # a real tandem (p=0.5) at train time
    for metric in ("train/accuracy", "train/truncation_rate", "train/zero_variance_groups", "train/jargon_rate"):
        assert all(0.0 <= v <= 1.0 for v in history(client, run, metric).values())
    assert all(0 < v <= 24 for v in history(client, run, "train/response_length").values())
    # the resolved config is saved with the run and as an artifact
    config = yaml.safe_load((root / "config.yaml").read_text())
    assert config["model"]["init_args"]["objective"]["class_path"].endswith("GRPO")
    assert config["model"]["init_args"]["handoff"]["init_args"]["p"] == 0.5
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "completions.jsonl"} <= artifacts
    # sample completions with each span marked by author
    records = [json.loads(line) for line in (root / "completions.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert {r["step"] for r in train} == {1, 2}  # written after each update
    authors = {span["author"] for r in train for span in r["spans"]}
    assert authors == {"senior", "junior"}
    for r in records:
        assert r["prompt"].startswith("Question: ")
        assert r["marked"] == "".join(f"[{span['author'][0].upper()}]{span['text']}" for span in r["spans"])
        assert all(a["author"] != b["author"] for a, b in zip(r["spans"], r["spans"][1:]))  # maximal spans
    # the checkpoint holds the senior's trainable weights only, never the frozen junior
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert checkpoint["state_dict"] and all(k.startswith("senior.") for k in checkpoint["state_dict"])
    assert (root / "summary.json").exists() and list((root / "plots").glob("*.png"))


@pytest.mark.parametrize("objective,init_args", [
    ("Reinforce", {"failed_weight": 0.0, "junior_weight": 1.0}),
    ("SoftMaskedReinforce", {"failed_weight": -0.5, "junior_weight": 0.2}),
])
def test_fit_reinforce_objectives(tmp_path, objective, init_args, run_folder):
    root = run_folder(tmp_path / objective)
    spec = json.dumps({"class_path": objective, "init_args": init_args})
    fit(root, "--trainer.max_steps", "1", "--model.init_args.objective", spec, *NO_EVAL, *SMALL)
    client, run = mlflow_run(root)
    missing = [m for m in TRAIN_METRICS if m not in run.data.metrics]
    assert not missing, f"not logged: {missing}"
    config = yaml.safe_load((root / "config.yaml").read_text())
    assert config["model"]["init_args"]["objective"] == {
        "class_path": f"tandem_lit.objectives.{objective}",
        "init_args": {**init_args, "aggregation": "token-mean", "tis_cap": None, "tis_level": "token", "geo_mask": None},
    }
    # random tiny models never answer correctly: positive-only REINFORCE has nothing to learn
    # from (loss 0, no rollout included); soft-masked REINFORCE pushes the failures down (c=-0.5)
    accuracy = history(client, run, "train/accuracy")
    loss = history(client, run, "train/loss")
    included = history(client, run, "train/included_fraction")
    assert set(accuracy.values()) == {0.0}
    if init_args["failed_weight"] == 0:
        assert set(loss.values()) == {0.0} and set(included.values()) == {0.0}
    else:
        assert all(v < 0 for v in loss.values()) and set(included.values()) == {1.0}


def test_print_config(capsys):
    with pytest.raises(SystemExit) as info:
        main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]["init_args"]
    assert model["handoff"]["class_path"] == "tandem_lit.rollout.WordHandoff"
    assert model["objective"]["class_path"] == "tandem_lit.objectives.GRPO"
    assert model["rollout"]["sampling"]["max_new_tokens"] == 24
    assert printed["data"]["class_path"] == "tandem_lit.data.GSM8KDataModule"
    assert printed["trainer"]["max_steps"] == 4


def junior_with_other_alphabet(tmp_path):
    tokenizer = char_tokenizer("0123456789+-*/=. \n")
    return write_model_dir(tmp_path / "odd_junior", tiny_llama_config(len(tokenizer)), tokenizer)


def bad_data(tmp, lines: list[str]) -> str:
    folder = tmp / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(line + "\n" for line in lines))
    return str(folder)


GOOD_ROW = json.dumps({"question": "What is 1+1?", "answer": "1+1=2\n#### 2"})


def make_file(path):
    path.write_text("a file, not a folder")
    return path


def truncated_checkpoint(tmp):
    path = tmp / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:300])
    return path


BAD_INPUT = {
    "missing_field": (lambda tmp: ["--data.init_args.answer_field", "nope"], "no field 'nope'"),
    "missing_model": (lambda tmp: ["--model.init_args.senior.path", str(tmp / "no_such_model")], "does not exist"),
    "tokenizer_mismatch": (lambda tmp: ["--model.init_args.junior.path", str(junior_with_other_alphabet(tmp))],
                           "tokenizers differ"),
    "p_above_1": (lambda tmp: ["--model.init_args.handoff.init_args.p", "1.5"], "must be in [0, 1], got 1.5"),
    "p_below_0": (lambda tmp: ["--model.init_args.handoff.init_args.p", "-0.1"], "must be in [0, 1], got -0.1"),
    "dataset_path_typo": (lambda tmp: ["--data.init_args.source", "data/gsm8k-sampl"], "Did you mean 'data/gsm8k-sample'"),
    "malformed_jsonl": (lambda tmp: ["--data.init_args.source", bad_data(tmp, [GOOD_ROW, GOOD_ROW, '{"question": "x",'])],
                        "train.jsonl, line 3: not valid JSON"),
    "empty_dataset": (lambda tmp: ["--data.init_args.source", bad_data(tmp, [])], "holds no records"),
    "val_size_too_large": (lambda tmp: ["--data.init_args.val_size", "1000"], "leaves no training rows"),
    "grpo_with_one_rollout": (lambda tmp: ["--model.init_args.rollout.sampling.n", "1"], "Set rollout.sampling.n >= 2"),
    "unwritable_run_folder": (lambda tmp: ["--trainer.default_root_dir", str(make_file(tmp / "file") / "run")],
                              "cannot create the run folder"),
    "missing_ckpt_path": (lambda tmp: ["--ckpt_path", str(tmp / "nope.ckpt")], "does not exist"),
    "truncated_checkpoint": (lambda tmp: ["--ckpt_path", str(truncated_checkpoint(tmp))], "cannot be read"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, case):
    make_args, expected = BAD_INPUT[case]
    args = make_args(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        fit(tmp_path / "run", "--trainer.logger", "false", "--trainer.max_steps", "1", *NO_EVAL, *args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert len(errors) == 1, err
    assert expected in errors[0]
    assert err.rstrip().splitlines()[-1] == errors[0]
    assert "Traceback" not in err


def test_predict_writes_graded_completions_of_every_mode(tmp_path, run_folder):
    root = run_folder(tmp_path / "run")
    main(args=["predict", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *QUIET,
               "--data.init_args.test_limit", "3"])
    records = [json.loads(line) for line in (root / "predictions.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in records] == ["senior"] * 3 + ["tandem"] * 3 + ["junior"] * 3
    for record in records:
        assert record["reward"] in (0.0, 1.0) and "Question:" in record["prompt"]
        joined = "".join(span["text"] for span in record["spans"]).replace("</s>", "")
        assert joined == record["completion"]
    senior_only = {span["author"] for r in records if r["mode"] == "senior" for span in r["spans"]}
    assert senior_only == {"senior"}
