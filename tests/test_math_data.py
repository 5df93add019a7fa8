"""Math DataModules: eval suites (one dataloader per set) and DeepScaleR-style training data.

Most tests use tiny files written to tmp_path; the ones marked ``shared_data`` read the real
sets in ../shared/data and skip when it is absent (CI may not have it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem_lit.data import DeepScaleRDataModule, MathEvalDataModule
from tandem_lit.data.base import EvalBatches
from tandem_lit.data.math import BOXED_INSTRUCTION, EVAL_SETS, math_row, normalize_answer_field
from tandem_lit.errors import ConfigError, DataError

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TANDEM_LIT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"real eval data not found at {SHARED_DATA}")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def all_rows(loader: EvalBatches) -> list[dict]:
    return [row for batch in loader for row in batch]


# -- normalisation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, multiple, expected",
    [
        (27.0, False, "27"),  # AMC floats
        (0.5, False, "0.5"),
        (12, False, "12"),
        ("70", False, "70"),
        (["9.6\n"], False, "9.6"),  # one-element lists unwrapped, newline stripped
        (["0.01\n", "0.02\n"], False, ["0.01", "0.02"]),  # alternatives
        (["$69$,$84$"], True, "69,84"),  # OlympiadBench: $-delimited multiple answer in one string
        (["69", "84"], True, "69, 84"),  # split over entries: all of them are required
        ([r"\$5"], False, r"\$5"),
        ([], False, None),
        (None, False, None),
        ("  ", False, None),
    ],
)
def test_normalize_answer_field(value, multiple, expected):
    assert normalize_answer_field(value, multiple) == expected


def test_math_row_layouts():
    amc = math_row({"problem": "P?", "answer": 27.0}, "amc23", "f", 0, BOXED_INSTRUCTION)
    assert amc == {"prompt": f"P?\n\n{BOXED_INSTRUCTION}", "answer": "27", "dataset": "amc23", "problem": "P?"}
    aime25 = math_row({"question": "Q?", "answer": "70"}, "aime25", "f", 0, "")
    assert aime25["prompt"] == "Q?" and aime25["answer"] == "70"
    minerva = math_row(
        {"problem": "M?", "solution": r"so $\boxed{1}$ first, then \boxed{\frac{1}{2}}"}, "minerva", "f", 0, "go"
    )
    assert minerva["answer"] == r"\frac{1}{2}"
    olympiad = math_row(
        {"question": "O?", "final_answer": ["$1,3$"], "is_multiple_answer": True, "context": "Let n be odd."},
        "olympiadbench",
        "f",
        0,
        "go",
    )
    assert olympiad["answer"] == "1,3" and olympiad["problem"] == "Let n be odd.\n\nO?"


def test_a_record_without_an_answer_names_the_file_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "note": "x"}])
    with pytest.raises(DataError, match=r"bad\.jsonl: record 1 has no usable answer: no 'answer'"):
        MathEvalDataModule([str(path)]).test_dataloader()
    nosolution = write_jsonl(tmp_path / "nobox.jsonl", [{"problem": "1+1?", "solution": "it is two"}])
    with pytest.raises(DataError, match="nobox.jsonl.*'solution'"):
        MathEvalDataModule([str(nosolution)]).test_dataloader()
    noproblem = write_jsonl(tmp_path / "noproblem.jsonl", [{"text": "1+1?", "answer": "2"}])
    with pytest.raises(DataError, match="noproblem.jsonl: record 0 has no problem text in 'problem' or 'question'"):
        MathEvalDataModule([str(noproblem)]).test_dataloader()


# -- MathEvalDataModule -------------------------------------------------------------------------


def test_eval_module_on_local_files(tmp_path):
    first = write_jsonl(tmp_path / "mini.jsonl", [{"problem": f"{i}+1?", "answer": float(i + 1)} for i in range(5)])
    second = tmp_path / "other.json"
    second.write_text(json.dumps([{"question": "x?", "answer": ["7\n"]}]))
    dm = MathEvalDataModule([str(first), "mine"], sources={"mine": str(second)}, limit=3, eval_batch_size=2)
    assert dm.dataset_names == ["mini", "mine"]
    loaders = dm.test_dataloader()
    assert isinstance(loaders, list) and [len(x) for x in loaders] == [2, 1]  # 3 rows in batches of 2; 1 row
    rows = all_rows(loaders[0])
    assert [r["answer"] for r in rows] == ["1", "2", "3"]
    assert {r["dataset"] for r in rows} == {"mini"}
    assert rows[0]["prompt"].endswith(BOXED_INSTRUCTION) and rows[0]["problem"] == "0+1?"
    assert all_rows(loaders[1])[0] | {"prompt": None} == {
        "prompt": None,
        "answer": "7",
        "dataset": "mine",
        "problem": "x?",
    }
    assert len(dm.rows("test")) == 4
    assert len(dm.predict_dataloader()) == 2
    with pytest.raises(ConfigError, match="only has a test split"):
        dm.train_dataloader()


def test_unknown_dataset_name_lists_the_known_ones():
    with pytest.raises(
        DataError, match="unknown math eval dataset 'aime2030'.*aime24, aime25, amc23, math500, minerva"
    ):
        MathEvalDataModule(["aime24", "aime2030"])


def test_bad_eval_settings():
    with pytest.raises(ConfigError, match="at least one dataset"):
        MathEvalDataModule([])
    with pytest.raises(ConfigError, match="same set twice"):
        MathEvalDataModule(["aime24", "aime24"])
    with pytest.raises(ConfigError, match="limit"):
        MathEvalDataModule(["aime24"], limit=0)


def test_root_without_the_file_and_hub_only_when_no_root(tmp_path):
    with pytest.raises(DataError, match=r"no file for eval set 'aime25' under .*aime25/test.jsonl"):
        MathEvalDataModule(["aime25"], root=str(tmp_path)).test_dataloader()
    with pytest.raises(DataError, match="has no hub copy; pass `root`"):
        MathEvalDataModule(["deepscaler_amc"]).test_dataloader()


def test_known_sets_load_from_the_hub_through_datasets(monkeypatch):
    calls = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        if name == "Hothan/OlympiadBench":
            return [{"question": "Q", "final_answer": ["$2$"], "is_multiple_answer": False}]
        return [{"problem": "P", "answer": "5"}]

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = MathEvalDataModule(["aime24", "olympiadbench", "math500"])
    answers = [all_rows(loader)[0]["answer"] for loader in dm.test_dataloader()]
    assert answers == ["5", "2", "5"]
    assert calls == [
        ("HuggingFaceH4/aime_2024", None, "train"),
        ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
        ("HuggingFaceH4/MATH-500", None, "test"),
    ]


@shared_data
def test_every_known_eval_set_loads_from_the_shared_folder():
    dm = MathEvalDataModule(list(EVAL_SETS), root=str(SHARED_DATA), limit=4, eval_batch_size=3)
    assert dm.dataset_names == list(EVAL_SETS)
    loaders = dm.test_dataloader()
    assert len(loaders) == len(EVAL_SETS)
    for name, loader in zip(dm.dataset_names, loaders):
        rows = all_rows(loader)
        assert len(rows) == 4 and len(loader) == 2, name
        for row in rows:
            assert set(row) == {"prompt", "answer", "dataset", "problem"} and row["dataset"] == name
            assert row["problem"] and row["prompt"].endswith(BOXED_INSTRUCTION)
            answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
            assert answers and all(isinstance(a, str) and a and a == a.strip() and "$" not in a for a in answers)


@shared_data
def test_shared_data_quirks_are_normalised():
    def rows(name, limit=None):
        return all_rows(MathEvalDataModule([name], root=str(SHARED_DATA), limit=limit).test_dataloader()[0])

    assert rows("amc23", 1)[0]["answer"] == "27"  # 27.0 in the file
    assert rows("aime25", 1)[0]["answer"] == "70"  # `question`, not `problem`
    minerva = rows("minerva")
    assert len(minerva) == 272 and minerva[0]["answer"] == "1.6"  # last \boxed{} of the solution
    assert rows("deepscaler_minerva", 1)[0]["answer"] == "9.6"  # ["9.6\n"]
    olympiad = {r["problem"]: r["answer"] for r in rows("olympiadbench")}
    assert len(olympiad) == 675 and "69,84" in olympiad.values()  # "$69$,$84$"
    assert len(rows("math500")) == 500 and len(rows("aime24")) == 30 and len(rows("deepscaler_amc")) == 83


# -- DeepScaleRDataModule -----------------------------------------------------------------------


@pytest.fixture
def train_folder(tmp_path):
    folder = tmp_path / "train"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([{"problem": f"p{i}", "answer": str(i)} for i in range(30)]))
    records = [{"problem": f"q{i}", "answer": str(i), "solution": "..."} for i in range(10)]
    records += [{"problem": "p3", "answer": "3"}, {"problem": "no answer", "answer": None}]  # a repeat; no answer
    write_jsonl(folder / "b.jsonl", records)
    return folder


def test_deepscaler_training_rows_and_seeded_held_out_slice(train_folder, tmp_path):
    evalfile = write_jsonl(tmp_path / "evalset.jsonl", [{"problem": "e", "answer": "1"}])
    dm = DeepScaleRDataModule(str(train_folder), val_size=5, seed=3, eval_datasets=[str(evalfile)], batch_size=4)
    with pytest.warns(UserWarning, match="skipped 1 record"):
        train = dm.rows("train")
    val = dm.rows("val")
    assert len(train) + len(val) == 40 and len(val) == 5  # 30 + 10; the repeat and the unanswered one dropped
    assert not {r["problem"] for r in train} & {r["problem"] for r in val}
    assert all(r["dataset"] == "deepscaler" and r["prompt"].endswith(BOXED_INSTRUCTION) for r in train)
    again = DeepScaleRDataModule(str(train_folder), val_size=5, seed=3)
    with pytest.warns(UserWarning):
        assert [r["problem"] for r in again.rows("val")] == [r["problem"] for r in val]
    other = DeepScaleRDataModule(str(train_folder), val_size=5, seed=4)
    with pytest.warns(UserWarning):
        assert [r["problem"] for r in other.rows("val")] != [r["problem"] for r in val]
    assert dm.dataset_names == ["evalset"]
    tests = dm.test_dataloader()
    assert isinstance(tests, list) and all_rows(tests[0])[0]["answer"] == "1"
    assert len(dm.train_dataloader()) == 35 // 4


def test_deepscaler_files_limit_and_no_test_split(train_folder):
    dm = DeepScaleRDataModule(str(train_folder), files=["a.json"], val_size=0, train_limit=7)
    assert len(dm.rows("train")) == 7 and dm.rows("val") == []
    assert dm.dataset_names == []
    with pytest.raises(ConfigError, match="set eval_datasets"):
        dm.test_dataloader()
    single = DeepScaleRDataModule(str(train_folder / "a.json"), val_size=2)
    assert len(single.rows("train")) == 28


def test_deepscaler_bad_sources(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .json/.jsonl files"):
        DeepScaleRDataModule(str(tmp_path / "empty")).rows("train")
    with pytest.raises(DataError, match="does not exist"):
        DeepScaleRDataModule(str(tmp_path / "missing" / "x.json")).rows("train")


def test_deepscaler_from_the_hub_goes_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, data_files=None, split=None, **kwargs):
        calls.append((name, data_files, split))
        return [{"problem": f"p{i}", "answer": str(i), "solution": "s"} for i in range(10)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = DeepScaleRDataModule("agentica-org/DeepScaleR-Preview-Dataset", val_size=2)
    assert len(dm.rows("train")) == 8 and len(dm.rows("val")) == 2
    assert calls == [("agentica-org/DeepScaleR-Preview-Dataset", None, "train")]  # read once for both splits


@shared_data
def test_deepscaler_local_training_folder():
    dm = DeepScaleRDataModule(str(SHARED_DATA / "deepscaler" / "train"), files=["aime.json"], val_size=16, seed=0)
    train, val = dm.rows("train"), dm.rows("val")
    assert len(train) + len(val) == 975 and len(val) == 16
    assert all(isinstance(r["answer"], str) and r["answer"] for r in train + val)
