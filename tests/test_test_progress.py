"""`tandem-lit test` over a long protocol: rollouts done and time left on the bar, results written
as each eval set finishes, a re-run that continues after the finished sets, a quick look
(``data.init_args.limit``)."""

from __future__ import annotations

import json

import pytest

from tandem_lit.cli import main
from tandem_lit.evaluation.steps import EvaluationSteps
from tandem_lit.evaluation.test_progress import EvalProgress, format_seconds
from tests.test_evaluation import math_eval_root, numbers, tiny_test_args

pytestmark = [pytest.mark.usefixtures("in_repo"), pytest.mark.filterwarnings("ignore:No seed found")]


def read(path):
    return json.loads(path.read_text())


def test_the_time_left_is_projected_from_the_rollouts_measured(monkeypatch):
    import tandem_lit.evaluation.test_progress as module

    clock = iter([100.0, 130.0])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    progress = EvalProgress(total=1000)  # started at 100 s
    assert progress.line() == "rollouts 0/1,000, time left unknown"
    progress.done, progress.measured = 250, 150  # 100 of them kept from an earlier run, 150 measured in 30 s
    assert progress.line() == f"rollouts 250/1,000, {format_seconds(30 / 150 * 750)} left" == "rollouts 250/1,000, 0:02:30 left"


def test_a_stopped_test_keeps_the_finished_sets_and_a_rerun_continues(tmp_path, monkeypatch):
    data = math_eval_root(tmp_path)  # aime24 (3 problems), then amc23 (2)
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    measured: list[str] = []
    test_batch = EvaluationSteps.test_batch

    def stopping(self, batch, name, key):
        if name == "amc23":
            raise KeyboardInterruptLike("stopped")
        measured.append(name)
        return test_batch(self, batch, name, key)

    monkeypatch.setattr(EvaluationSteps, "test_batch", stopping)
    with pytest.raises(KeyboardInterruptLike):
        main(args=tiny_test_args(run, data))
    saved = read(run / "eval" / "results.json")
    assert set(saved["datasets"]) == {"aime24"} and saved["datasets"]["aime24"]["problems"] == 3
    assert set(read(run / "eval" / "tallies.json")["sets"]) == {"aime24"}

    def counted(self, batch, name, key):
        measured.append(name)
        return test_batch(self, batch, name, key)

    monkeypatch.setattr(EvaluationSteps, "test_batch", counted)
    measured.clear()
    main(args=tiny_test_args(run, data))
    assert set(measured) == {"amc23"}  # aime24 was not measured again
    continued = read(run / "eval" / "results.json")
    main(args=tiny_test_args(fresh, data))  # the whole protocol in one go
    assert numbers(continued) == numbers(read(fresh / "eval" / "results.json"))
    measured.clear()
    main(args=tiny_test_args(run, data, "--model.init_args.evaluation.test_sampling.seed", "1"))
    assert set(measured) == {"aime24", "amc23"}  # other settings: nothing is kept


class KeyboardInterruptLike(RuntimeError):
    """A stop in the middle of a set (a real Ctrl-C would also stop pytest)."""


def test_the_bar_shows_rollouts_done_and_a_quick_look_limits_each_set(tmp_path, capsys):
    args = tiny_test_args(tmp_path / "run", math_eval_root(tmp_path), "--data.init_args.limit", "1")
    args[args.index("--trainer.enable_progress_bar") + 1] = "true"
    capsys.readouterr()
    main(args=args)
    err = capsys.readouterr().err
    # one problem of each of the two sets, n = 2 solo and 2 handoff samples each
    assert "rollouts 8/8" in err
    saved = read(tmp_path / "run" / "eval" / "results.json")
    assert {name: row["problems"] for name, row in saved["datasets"].items()} == {"aime24": 1, "amc23": 1}


def test_a_bfloat16_senior_is_tested_not_refused_as_if_trained(tmp_path):
    """configs/eval/math_handoff.yaml loads the model under test in bf16: nothing is trained, so the
    refusal of bf16 weights trained in place does not apply (fit still refuses them)."""
    args = tiny_test_args(tmp_path / "run", math_eval_root(tmp_path), "--data.init_args.limit", "1")
    args[args.index("--model.init_args.senior") + 1] = "{path: configs/tiny/senior, random_init: true, dtype: bfloat16}"
    main(args=args)
    assert read(tmp_path / "run" / "eval" / "results.json")["settings"]["senior"]["dtype"] == "bfloat16"
