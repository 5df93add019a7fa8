"""APPSDataModule: APPS (MapCoder file, hub layout) and the DeepCoder files as prompt rows whose
``tests`` column the CodeVerifier grades; de-duplication, filters and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem_lit.data import APPSDataModule
from tandem_lit.data.apps import CODE_INSTRUCTION, STDIN_NOTE
from tandem_lit.errors import DataError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "apps").is_dir(), reason="../shared/data is not on this machine")


@needs_data
def test_the_mapcoder_apps_file_gives_its_128_distinct_problems_with_prompts_that_fit_their_tests():
    data = APPSDataModule(source=str(DATA / "apps" / "test.jsonl"), val_size=8)
    rows = data.rows("train") + data.rows("val")
    assert len(rows) == 128  # 150 rows, 21 ids twice and one three times (SOURCE.md)
    kinds = {row["tests"]["kind"] for row in rows}
    assert kinds == {"stdio", "call"}
    for row in rows:
        assert row["prompt"].startswith(row["problem"]) and row["prompt"].endswith(CODE_INSTRUCTION)
        assert (STDIN_NOTE in row["prompt"]) == (row["tests"]["kind"] == "stdio")
        if row["tests"]["kind"] == "call":  # the starter code is in the prompt (in its own block, or in the statement)
            assert f"def {row['tests']['fn_name'].split('.')[-1]}(" in row["prompt"], row["tests"]["fn_name"]


@needs_data
def test_deepcoder_files_are_eval_sets_named_as_configured():
    sources = {name: str(DATA / "deepcoder_code" / "test" / f"{name}.json") for name in ("leetcode", "codeforces")}
    data = APPSDataModule(source=str(DATA / "apps" / "test.jsonl"), val_size=8, eval_sources=sources, eval_limit=5)
    assert data.dataset_names == ["leetcode", "codeforces"]
    loaders = data.test_dataloader()
    assert [sum(len(b) for b in loader) for loader in loaders] == [5, 5]
    rows = data.rows("test")
    assert [r["dataset"] for r in rows] == ["leetcode"] * 5 + ["codeforces"] * 5
    assert {r["tests"]["kind"] for r in rows[5:]} == {"stdio"}


def write(path: Path, records: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_hub_layout_difficulty_filter_and_rows_the_verifier_grades(tmp_path):
    from tandem_lit.verifiers import CodeVerifier

    records = [
        {"problem_id": 1, "question": "Read n, print n + 1.", "difficulty": "introductory", "starter_code": "",
         "input_output": json.dumps({"inputs": ["1\n", "41\n"], "outputs": ["2\n", "42\n"]})},
        {"problem_id": 2, "question": "Return a + b.", "difficulty": "interview", "starter_code": "def add(a, b):",
         "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})},
        {"problem_id": 3, "question": "Hard one.", "difficulty": "competition", "starter_code": "",
         "input_output": json.dumps({"inputs": ["x\n"], "outputs": ["y\n"]})},
        {"problem_id": 1, "question": "Read n, print n + 1.", "difficulty": "introductory", "starter_code": "",
         "input_output": json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})},  # a repeat of problem 1
    ]
    data = APPSDataModule(source=write(tmp_path / "apps.jsonl", records), val_size=0,
                          difficulties=["introductory", "interview"])
    rows = data.rows("train")
    assert [r["problem"] for r in rows] == ["Read n, print n + 1.", "Return a + b."]
    solutions = ["```python\nprint(int(input()) + 1)\n```", "```python\ndef add(a, b):\n    return a + b\n```"]
    with CodeVerifier(reward="all", workers=1) as verifier:
        grades = verifier.grade_batch(solutions, tests=[r["tests"] for r in rows])
        assert [g.correct for g in grades] == [True, True]
        wrong = verifier.grade_batch(solutions[::-1], tests=[r["tests"] for r in rows])
        assert [g.correct for g in wrong] == [False, False]


def test_problems_without_tests_are_left_out_loudly_and_a_file_of_them_is_an_error(tmp_path):
    good = {"problem": "Print 1.", "tests": [{"input": "", "output": "1\n"}]}
    bad = {"problem": "No tests here."}
    data = APPSDataModule(source=write(tmp_path / "mixed.jsonl", [good, bad]), val_size=0)
    with pytest.warns(UserWarning, match="skipped 1 problem"):
        assert len(data.rows("train")) == 1
    with pytest.raises(DataError, match="no usable code problems"):
        APPSDataModule(source=write(tmp_path / "bad.jsonl", [bad]), val_size=0).rows("train")
