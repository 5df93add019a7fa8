"""Fields of the wrong type end the load with one line naming the file, the row and the field, for
every shipped data module and for the columns each verifier grades. Before these checks a
question that was a number trained as its printed form ("12"), a dict answer became the string
"{'a': 1}", and a code problem whose statement was a number was dropped with a warning."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from tandem_lit.data import (
    APPSDataModule,
    DeepScaleRDataModule,
    GSM8KDataModule,
    HARPDataModule,
    MathEvalDataModule,
    PromptDataModule,
    SyntheticArithmeticDataModule,
)
from tandem_lit.data.sft_data import GSM8KSolutionsDataModule, SFTDataModule
from tandem_lit.errors import DataError
from tandem_lit.verifiers import ArithmeticVerifier, GSM8KVerifier, MissingColumnError
from tandem_lit.verifiers.code import CodeVerifier
from tandem_lit.verifiers.math import MathVerifier

# a wrong value of each kind, and how the error line says what was found
WRONG = {
    "number": (12, "a number (12)"),
    "list": (["a", "b"], "a list (['a', 'b'])"),
    "dict": ({"a": 1}, "an object ({'a': 1})"),
    "null": (None, "null"),
}
BAD_ROW = 2  # the bad record's place in every file below (rows count from 0)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def with_bad(good: list[dict], field: str, value) -> list[dict]:
    records = [dict(r) for r in good]
    records[BAD_ROW][field] = value
    return records


def assert_one_line(error: pytest.ExceptionInfo, path: Path | str, field: str, found: str, expected: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: row {BAD_ROW} field {field!r} is {found}, expected {expected}"), message


def gsm8k_records(n: int = 6) -> list[dict]:
    return [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(n)]


@pytest.mark.parametrize("field,kind", [("question", "number"), ("question", "list"), ("answer", "dict"), ("question", "null")])
def test_gsm8k(tmp_path, field, kind):
    value, found = WRONG[kind]
    path = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", with_bad(gsm8k_records(), field, value))
    with pytest.raises(DataError) as error:
        GSM8KDataModule(source=str(path.parent)).rows("test")
    assert_one_line(error, path, field, found, "a string")


def test_gsm8k_prompt_template_fields_are_text_too(tmp_path):
    records = [{**r, "topic": "sums"} for r in gsm8k_records()]
    path = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", with_bad(records, "topic", ["sums"]))
    data = GSM8KDataModule(source=str(path.parent), prompt_template="{topic}: {question}\nAnswer:")
    with pytest.raises(DataError) as error:
        data.rows("test")
    assert_one_line(error, path, "topic", "a list (['sums'])", "a string")


@pytest.mark.parametrize("kind", ["number", "list", "dict", "null"])
def test_sft_template_fields(tmp_path, kind):
    value, found = WRONG[kind]
    good = [{"prompt": f"p{i}", "target": f"t{i}"} for i in range(6)]
    path = write_jsonl(tmp_path / "rows.jsonl", with_bad(good, "target", value))
    with pytest.raises(DataError) as error:
        SFTDataModule(source=str(path), batch_size=2).rows("train")
    assert_one_line(error, path, "target", found, "a string")


def test_gsm8k_solutions_sft(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", with_bad(gsm8k_records(), "question", 12))
    with pytest.raises(DataError) as error:
        GSM8KSolutionsDataModule(source=str(path.parent), val_size=0).rows("train")
    assert_one_line(error, path, "question", "a number (12)", "a string")


def math_records(n: int = 6) -> list[dict]:
    return [{"problem": f"Find {i} + 1.", "answer": str(i + 1)} for i in range(n)]


MATH_ANSWER = "a string, a number, a list of strings or numbers or null"


@pytest.mark.parametrize("field,kind,expected", [
    ("problem", "number", "a string or null"),
    ("problem", "list", "a string or null"),
    ("answer", "dict", MATH_ANSWER),
])
def test_deepscaler_training_file(tmp_path, field, kind, expected):
    """Before: a number problem was skipped with a warning, a dict answer graded as "{'a': 1}"."""
    value, found = WRONG[kind]
    path = write_jsonl(tmp_path / "train.jsonl", with_bad(math_records(), field, value))
    with pytest.raises(DataError) as error:
        DeepScaleRDataModule(source=str(path), val_size=1, batch_size=2).rows("train")
    assert_one_line(error, path, field, found, expected)


def test_deepscaler_null_answer_is_still_a_skipped_record(tmp_path):
    """null is how DeepScaleR's own file marks a problem without an answer: skipped loudly, as before."""
    path = write_jsonl(tmp_path / "train.jsonl", with_bad(math_records(), "answer", None))
    with pytest.warns(UserWarning, match="skipped 1 record"):
        rows = DeepScaleRDataModule(source=str(path), val_size=1, batch_size=2).rows("train")
    assert len(rows) == 4


@pytest.mark.parametrize("field,kind,expected", [
    ("question", "number", "a string or null"),
    ("answer", "dict", MATH_ANSWER),
    ("answer", "list", None),  # a list of strings is a list of alternatives: fine
])
def test_math_eval_file(tmp_path, field, kind, expected):
    value, found = WRONG[kind]
    records = [{"question": r["problem"], "answer": r["answer"]} for r in math_records()]
    path = write_jsonl(tmp_path / "evalset.jsonl", with_bad(records, field, value))
    data = MathEvalDataModule(datasets=[str(path)])
    if expected is None:
        assert data.rows("test")[BAD_ROW]["answer"] == ["a", "b"]
        return
    with pytest.raises(DataError) as error:
        data.rows("test")
    assert_one_line(error, path, field, found, expected)


def harp_records(n: int = 6) -> list[dict]:
    return [{"year": str(2000 + i), "contest": "AIME_I", "number": i, "level": 5, "problem": f"Find {i}.",
             "answer": str(i), "num_solutions": 2, "solution_1": "...", "solution_2": "..."} for i in range(n)]


@pytest.mark.parametrize("field,value,found,expected", [
    ("problem", 12, "a number (12)", "a string or null"),
    ("num_solutions", "3", "a string ('3')", "an integer"),
    ("year", ["2001"], "a list (['2001'])", "a string or an integer"),
    ("answer", {"a": 1}, "an object ({'a': 1})", MATH_ANSWER),
])
def test_harp(tmp_path, field, value, found, expected):
    records = with_bad(harp_records(), field, value)
    path = tmp_path / "HARP.jsonl.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("HARP.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DataError) as error:
        HARPDataModule(str(path), val_size=1).rows("train")
    assert_one_line(error, path, field, found, expected)


def apps_records(n: int = 6) -> list[dict]:
    return [{"id": i, "description": f"Print {i}.", "starter_code": "", "difficulty": "introductory",
             "test_list": [{"input": "", "output": str(i)}]} for i in range(n)]


@pytest.mark.parametrize("field,value,found,expected", [
    ("description", 12, "a number (12)", "a string or null"),
    ("description", ["Print 2."], "a list (['Print 2.'])", "a string or null"),
    ("test_list", "print 2", "a string ('print 2')", "a list of objects with 'input' and 'output'"),
    ("test_list", [["", "2"]], "a list ([['', '2']])", "a list of objects with 'input' and 'output'"),
    ("starter_code", {"a": 1}, "an object ({'a': 1})", "a string or null"),
])
def test_apps(tmp_path, field, value, found, expected):
    """Before: a number statement was dropped with a warning; a string test_list ended in a traceback."""
    path = write_jsonl(tmp_path / "apps.jsonl", with_bad(apps_records(), field, value))
    with pytest.raises(DataError) as error:
        APPSDataModule(source=str(path), val_size=1, batch_size=2).rows("train")
    assert_one_line(error, path, field, found, expected)


def test_deepcoder_tests_field(tmp_path):
    records = [{"problem": f"Print {i}.", "tests": [{"input": "", "output": str(i)}]} for i in range(6)]
    path = tmp_path / "train" / "codeforces.json"  # DeepCoder's files are JSON arrays
    path.parent.mkdir()
    path.write_text(json.dumps(with_bad(records, "tests", 7)))
    with pytest.raises(DataError) as error:
        APPSDataModule(source=str(path.parent), val_size=1, batch_size=2).rows("train")
    assert_one_line(error, path, "tests", "a number (7)",
                    "a list of objects with 'input' and 'output' or an object")


class Generated(PromptDataModule):
    """A module that builds its rows in code (as the synthetic one does): its prompts are checked too."""

    def __init__(self, prompt):
        super().__init__(batch_size=1)
        self.prompt = prompt

    def load_split(self, split):
        return [{"prompt": "fine", "answer": "1"}, {"prompt": "fine", "answer": "1"}, {"prompt": self.prompt, "answer": "1"}]


@pytest.mark.parametrize("kind", ["number", "list", "null"])
def test_every_module_serves_text_prompts(kind):
    value, found = WRONG[kind]
    with pytest.raises(DataError) as error:
        Generated(value).rows("train")
    assert_one_line(error, "Generated train rows", "prompt", found, "a string")


def test_the_synthetic_module_serves_typed_rows():
    """The demo's generated data passes the same checks: prompt and answer are text."""
    data = SyntheticArithmeticDataModule(train_size=8, val_size=2, test_size=2)
    rows = data.rows("train")
    assert all(isinstance(r["prompt"], str) and isinstance(r["answer"], str) for r in rows)
    GSM8KVerifier().check_rows(rows, "synthetic train rows")


def test_real_shipped_data_still_loads(repo_root):
    shared = repo_root.parent / "shared" / "data"
    if not shared.is_dir():
        pytest.skip(f"no shared data folder at {shared}")
    assert len(GSM8KDataModule(source=str(shared / "gsm8k")).rows("test")) == 1319
    evals = MathEvalDataModule(datasets=["amc23", "olympiadbench", "deepscaler_minerva"], root=str(shared))
    rows = evals.rows("test")  # AMC's float answers, OlympiadBench's lists, DeepScaleR's Minerva lists
    assert len(rows) == 40 + 675 + 272
    assert all(MathVerifier.column_types["answer"].accepts(r["answer"]) for r in rows)
    code = APPSDataModule(source=str(shared / "apps" / "test.jsonl"), val_size=8)
    CodeVerifier.__new__(CodeVerifier).check_rows(code.rows("train"), "APPS train rows")  # (no sandbox needed)


# -- the columns a verifier grades -----------------------------------------------------------------


def grade_rows(field: str, value) -> list[dict]:
    rows = [{"prompt": "p", field: good} for good in ("1", "2", "3")]
    rows[BAD_ROW][field] = value
    return rows


@pytest.mark.parametrize("make,kind,expected", [
    (GSM8KVerifier, "list", "a string or a number"),
    (ArithmeticVerifier, "null", "a string or a number"),
    (MathVerifier, "dict", "a string, a number or a list of strings or numbers"),
])
def test_verifier_answer_columns(make, kind, expected):
    value, found = WRONG[kind]
    verifier = make()
    with pytest.raises(DataError) as error:
        verifier.check_rows(grade_rows("answer", value), "MyData train rows")
    assert_one_line(error, "MyData train rows", "answer", found, expected)
    assert f"{make.__name__} grades this column" in str(error.value)


def test_code_verifier_tests_column():
    code = CodeVerifier.__new__(CodeVerifier)  # the column check needs no sandbox
    good = {"kind": "stdio", "cases": [{"input": "", "output": "1"}]}
    rows = [{"prompt": "p", "tests": good}, {"prompt": "p", "tests": json.dumps(good)}, {"prompt": "p", "tests": 5}]
    with pytest.raises(DataError) as error:
        code.check_rows(rows, "MyData train rows")
    assert_one_line(error, "MyData train rows", "tests", "a number (5)", "a tests object of kind stdio")
    rows[BAD_ROW]["tests"] = {"kind": "stdio", "cases": [{"stdin": "1"}]}  # the wrong shape, not only the wrong type
    with pytest.raises(DataError, match=re.escape("row 2 field 'tests' is an object")):
        code.check_rows(rows, "MyData train rows")


def test_a_missing_verifier_column_is_named_before_the_first_step():
    rows = [{"prompt": "p", "answer": "1"}, {"prompt": "p", "solution": "1"}]
    with pytest.raises(MissingColumnError, match=r"MyData val rows: row 1 has no field 'answer', which GSM8KVerifier"):
        GSM8KVerifier().check_rows(rows, "MyData val rows")


def test_a_wrong_type_in_a_batch_is_named_when_graded():
    """Rows that bypass the load-time check (a hand-built batch) meet the same check per batch."""
    with pytest.raises(DataError, match=r"the batch GSM8KVerifier grades: row 1 field 'answer' is a list"):
        GSM8KVerifier().grade_batch(["#### 1", "#### 2"], answer=["1", ["2"]])


# -- through the CLI --------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:No seed found")
def test_the_cli_ends_with_one_line_naming_file_row_and_field(tmp_path, capsys, in_repo):
    from tandem_lit.cli import main

    path = write_jsonl(tmp_path / "data" / "train.jsonl", with_bad(gsm8k_records(8), "question", 12))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
                   "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                   "--trainer.logger", "false", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
                   "--model.init_args.evaluation.at_start", "false", "--data.init_args.val_size", "1",
                   "--data.init_args.batch_size", "2", "--data.init_args.source", str(path.parent)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert errors == [err.rstrip().splitlines()[-1]], err
    assert f"{path}: row {BAD_ROW} field 'question' is a number (12), expected a string" in errors[0]
    assert "Traceback" not in err


@pytest.mark.filterwarnings("ignore:No seed found")
def test_a_verifier_column_of_the_wrong_type_ends_the_run_before_the_first_step(tmp_path, capsys, in_repo):
    """The data module accepts a list answer (a math set's alternatives); GSM8KVerifier cannot grade
    one: the run ends before its first batch, naming the rows, the row and the field."""
    from tandem_lit.cli import main

    records = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    path = write_jsonl(tmp_path / "alternatives.jsonl", with_bad(records, "answer", ["3", "three"]))
    data = json.dumps({"class_path": "MathEvalDataModule", "init_args": {"datasets": [str(path)], "batch_size": 4}})
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args=["test", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
                   "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                   "--trainer.logger", "false", "--data", data])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert errors == [err.rstrip().splitlines()[-1]], err
    assert ("MathEvalDataModule test rows: row 2 field 'answer' is a list (['3', 'three']), expected a string or "
            "a number. GSM8KVerifier grades this column") in errors[0]
