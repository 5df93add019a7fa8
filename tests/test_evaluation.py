"""Evaluation: pass@k against the closed form and brute force, the per-set and macro report,
`tandem-lit test` reproducibility, and the clear one-line errors of a bad evaluation setup."""

from __future__ import annotations

import itertools
import json
import math
import sys

import pytest
import torch

from tandem_lit.cli import main
from tandem_lit.evaluation.metrics import PassAtK, pass_at_k
from tandem_lit.evaluation.report import DatasetTally, flat_metrics, markdown_table, summarize, write_report

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]

NAN = float("nan")


def strict_json(path) -> dict:
    """Parse a JSON file refusing NaN/Infinity (not JSON; JavaScript's parser and jq reject them)."""

    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


# -------------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize("n,c,k,expected", [
    (8, 0, 1, 0.0),
    (8, 8, 8, 1.0),
    (4, 1, 1, 1 / 4),
    (4, 1, 2, 1 - 3 / 6),        # 1 - C(3,2)/C(4,2)
    (5, 2, 3, 1 - 1 / 10),       # 1 - C(3,3)/C(5,3)
    (8, 2, 4, 1 - 15 / 70),      # 1 - C(6,4)/C(8,4)
    (8, 5, 4, 1.0),              # n - c < k: every 4-subset holds a correct sample
    (10, 3, 1, 0.3),             # pass@1 is the plain accuracy
])
def test_pass_at_k_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_brute_force_on_every_small_case():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_metric_accumulates_problems_across_updates():
    metric = PassAtK(ks=(1, 2, 4))
    metric.update(torch.tensor([[True, False, False, False], [False, False, False, False]]))
    metric.update(torch.tensor([[True, True, False, False]]))
    result = metric.compute()
    counts = [1, 0, 2]
    for k in (1, 2, 4):
        expected = sum(pass_at_k(4, c, k) for c in counts) / 3
        assert float(result[k]) == pytest.approx(expected, abs=1e-12)
    assert float(result[1]) == pytest.approx(3 / 12)  # 3 correct of 12 samples
    assert float(result[2]) == pytest.approx((0.5 + 0 + 1 - 1 / 6) / 3)
    with pytest.raises(ValueError, match="pass@4 needs at least 4 samples"):
        metric.update(torch.ones(1, 2, dtype=torch.bool))


# ------------------------------------------------------------------------------- summarize


def hand_tallies() -> dict[str, DatasetTally]:
    """Two eval sets measured with n = 4 and one with n = 2 and no handoff (no partner)."""
    return {
        "aime": DatasetTally(
            n=4, solo_correct=[0, 2], handoff_correct=[1, 0],
            solo_lengths=[10, 20, 30, 40, 50, 60, 70, 80], handoff_lengths=[100] * 8,
            solo_truncated=[True, False, False, False, False, False, False, True],
            handoff_truncated=[True] * 4 + [False] * 4,
            partner_nll=30.0, partner_tokens=20,
        ),
        "amc": DatasetTally(
            n=4, solo_correct=[4, 0, 0], handoff_correct=[4, 4, 0],
            solo_lengths=[5] * 12, handoff_lengths=[7] * 12,
            solo_truncated=[False] * 12, handoff_truncated=[False] * 12,
            partner_nll=10.0, partner_tokens=40,
        ),
        "small": DatasetTally(n=2, solo_correct=[0, 0], solo_lengths=[3, 3, 3, 3], solo_truncated=[False] * 4),
    }


def test_summarize_per_set_values_equal_the_closed_form():
    report = summarize(hand_tallies(), [1, 2, 4, 8])
    aime, amc, small = (report["datasets"][name] for name in ("aime", "amc", "small"))
    assert aime["problems"] == 2 and aime["n"] == 4
    assert aime["solo_pass@1"] == pytest.approx((0 + 0.5) / 2)
    assert aime["solo_pass@2"] == pytest.approx((0 + 1 - 1 / 6) / 2)
    assert aime["solo_pass@4"] == pytest.approx(0.5)
    assert aime["handoff_pass@1"] == pytest.approx((0.25 + 0) / 2)
    assert aime["handoff_pass@4"] == pytest.approx(0.5)
    assert aime["handoff_solo_ratio@1"] == pytest.approx(0.125 / 0.25)
    assert aime["handoff_solo_ratio@4"] == pytest.approx(1.0)
    assert aime["solo_truncation_rate"] == pytest.approx(2 / 8)
    assert aime["handoff_truncation_rate"] == pytest.approx(0.5)
    assert aime["solo_mean_length"] == pytest.approx(45.0)
    assert aime["handoff_mean_length"] == pytest.approx(100.0)
    assert aime["legibility_nats"] == pytest.approx(1.5)  # 30 nats over 20 tokens
    assert amc["solo_pass@1"] == pytest.approx(1 / 3)
    assert amc["handoff_pass@1"] == pytest.approx(2 / 3)
    assert amc["handoff_solo_ratio@1"] == pytest.approx(2.0)
    assert amc["legibility_nats"] == pytest.approx(0.25)
    assert "solo_pass@8" not in aime  # k > n is not measured
    # a set without a partner: handoff numbers are nan, never 0
    assert small["solo_pass@2"] == 0.0 and "solo_pass@4" not in small
    for key in ("handoff_pass@1", "handoff_pass@2", "handoff_solo_ratio@1", "handoff_truncation_rate",
                "handoff_mean_length", "legibility_nats"):
        assert math.isnan(small[key]), key


def test_summarize_macro_is_the_mean_over_sets_that_measured_the_number():
    report = summarize(hand_tallies(), [1, 2, 4, 8])
    sets, macro = report["datasets"], report["macro"]
    for key in ("solo_pass@1", "solo_pass@2", "solo_mean_length", "solo_truncation_rate"):
        assert macro[key] == pytest.approx(sum(row[key] for row in sets.values()) / 3), key
    # only aime and amc have n >= 4 and a partner; the nan of `small` is left out, not averaged in
    for key in ("solo_pass@4", "handoff_pass@1", "handoff_pass@4", "legibility_nats", "handoff_truncation_rate"):
        assert macro[key] == pytest.approx((sets["aime"][key] + sets["amc"][key]) / 2), key
    # the macro ratio is the mean of the per-set ratios (aime 0.5, amc 2.0)
    assert macro["handoff_solo_ratio@1"] == pytest.approx(1.25)
    assert "solo_pass@8" not in macro


def test_ratio_is_nan_when_solo_never_succeeds_and_macro_of_nothing_is_nan():
    tally = DatasetTally(n=2, solo_correct=[0, 0], handoff_correct=[1, 2], solo_lengths=[1] * 4,
                         handoff_lengths=[1] * 4, solo_truncated=[False] * 4, handoff_truncated=[False] * 4)
    report = summarize({"hard": tally}, [1, 2])
    row = report["datasets"]["hard"]
    assert row["handoff_pass@2"] == 1.0 and math.isnan(row["handoff_solo_ratio@2"])
    assert math.isnan(report["macro"]["handoff_solo_ratio@2"])
    assert math.isnan(report["macro"]["legibility_nats"])
    empty = summarize({"none": DatasetTally(n=4)}, [1])
    assert math.isnan(empty["datasets"]["none"]["solo_pass@1"])


def test_report_files_logger_names_and_table(tmp_path):
    report = summarize(hand_tallies(), [1, 2, 4])
    flat = flat_metrics(report)
    assert flat["test/aime/solo_pass_at_1"] == pytest.approx(0.25)
    assert flat["test/macro/handoff_solo_ratio_at_1"] == pytest.approx(1.25)
    assert "test/small/handoff_pass_at_1" not in flat  # nan is not logged
    assert all("@" not in key for key in flat)  # MLflow refuses '@'
    table = markdown_table(report, [1, 2, 4]).splitlines()
    assert table[0].startswith("| set | problems | solo_pass@1 | solo_pass@2 | solo_pass@4 | handoff_pass@1")
    small = next(line for line in table if line.startswith("| small |"))
    assert "| - |" in small  # nan shows as '-'
    aime = next(line for line in table if line.startswith("| aime |"))
    assert "| 25.0 |" in aime  # pass@k in percent
    paths = write_report(report, [1, 2, 4], tmp_path / "eval")
    assert [p.name for p in paths] == ["results.json", "results.md", "pass_at_k.png"]
    assert all(p.stat().st_size > 0 for p in paths)
    saved = strict_json(tmp_path / "eval" / "results.json")
    assert saved["datasets"]["aime"]["solo_pass@2"] == pytest.approx(report["datasets"]["aime"]["solo_pass@2"])
    assert saved["datasets"]["small"]["handoff_pass@1"] is None  # nan is written as null
    assert saved["macro"]["handoff_solo_ratio@1"] == pytest.approx(1.25)
    assert (tmp_path / "eval" / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ `tandem-lit test` end to end


def math_eval_root(tmp_path):
    """Two eval sets in the ../shared/data layout, with answers a random model might box."""
    root = tmp_path / "data"
    for name, answers in (("aime24", ["1", "2", "3"]), ("amc23", [4.0, 5.0])):
        (root / name).mkdir(parents=True)
        lines = [json.dumps({"problem": f"Compute {a} + 0.", "answer": a}) for a in answers]
        (root / name / "test.jsonl").write_text("\n".join(lines) + "\n")
    return root


def tiny_test_args(root, data_root, *extra):
    return [
        "test", "--config", "configs/eval/math_handoff.yaml",
        "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--model.init_args.senior", "{path: configs/tiny/senior, random_init: true, init_seed: 1, dtype: float32}",
        "--model.init_args.junior", "{path: configs/tiny/junior, random_init: true, init_seed: 2, dtype: float32}",
        "--model.init_args.rollout.prompt_format.chat_template", "false",  # the tiny tokenizer has no template
        "--model.init_args.evaluation.test_sampling.temperature", "1.0",
        "--model.init_args.evaluation.test_sampling.n", "2", "--model.init_args.evaluation.test_sampling.max_new_tokens", "24",
        "--model.init_args.verifier.init_args.workers", "1",
        "--data.init_args.datasets", "[aime24, amc23]", "--data.init_args.root", str(data_root),
        "--data.init_args.batch_size", "2",
        *extra,
    ]


def numbers(report: dict) -> dict:
    return {"datasets": report["datasets"], "macro": report["macro"]}


def test_handoff_evaluation_is_reproducible_for_a_fixed_seed(tmp_path):
    data_root = math_eval_root(tmp_path)
    runs = {}
    for name, seed in (("first", "0"), ("again", "0"), ("other_seed", "1")):
        main(args=tiny_test_args(tmp_path / name, data_root, "--model.init_args.evaluation.test_sampling.seed", seed))
        runs[name] = strict_json(tmp_path / name / "eval" / "results.json")
    first = numbers(runs["first"])
    assert set(first["datasets"]) == {"aime24", "amc23"}
    assert first["datasets"]["aime24"]["problems"] == 3 and first["datasets"]["amc23"]["problems"] == 2
    assert first == numbers(runs["again"])  # identical numbers (those that do not apply are null)
    # the sampled text depends on the seed, so the check above has teeth
    assert first != numbers(runs["other_seed"])
    assert runs["first"]["settings"]["sampling"]["seed"] == 0
    assert "ParagraphHandoff" in runs["first"]["settings"]["handoff"]


def one_line_error(capsys, args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args=args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert len(errors) == 1, err
    assert err.rstrip().splitlines()[-1] == errors[0] and "Traceback" not in err
    return errors[0]


def test_missing_math_verify_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails
    error = one_line_error(capsys, tiny_test_args(tmp_path / "run", math_eval_root(tmp_path)))
    assert "math-verify" in error and "pip install 'tandem-lit[math]'" in error


def test_eval_file_without_an_answer_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "mine.jsonl"
    bad.write_text(json.dumps({"problem": "What is 1 + 1?", "solution": "It is two."}) + "\n")
    args = tiny_test_args(tmp_path / "run", math_eval_root(tmp_path), "--data.init_args.datasets", "[mine]",
                          "--data.init_args.sources", json.dumps({"mine": str(bad)}))
    error = one_line_error(capsys, args)
    assert "record 0 has no usable answer" in error and str(bad) in error


def test_unknown_eval_set_is_a_one_line_error(tmp_path, capsys):
    args = tiny_test_args(tmp_path / "run", math_eval_root(tmp_path), "--data.init_args.datasets", "[aime2099]")
    error = one_line_error(capsys, args)
    assert "unknown math eval dataset 'aime2099'" in error and "aime24" in error
