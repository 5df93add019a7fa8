"""HARP for the elegance experiment: read zipped in place, the extension's filters (several solution
paths, AIME level, no eval-set years), and clear errors for a file that is not HARP."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest

from tandem_lit.data import HARPDataModule
from tandem_lit.data.harp import harp_year
from tandem_lit.data.math import BOXED_INSTRUCTION
from tandem_lit.errors import DataError

HARP_ZIP = Path(__file__).resolve().parents[2] / "shared" / "data" / "harp" / "HARP.jsonl.zip"


def record(year, contest, solutions, level=5, answer="$12$", number=1):
    return {"year": year, "contest": contest, "number": number, "level": level, "subject": "algebra",
            "multiple_choice_only": False, "problem": f"{contest} {year} problem {number}: find $x$.",
            "answer": answer, "num_solutions": solutions, **{f"solution_{i + 1}": "..." for i in range(solutions)}}


def harp_zip(folder: Path, records: list[dict]) -> Path:
    path = folder / "HARP.jsonl.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("HARD-Math.jsonl", "\n".join(json.dumps(r) for r in records) + "\n")
    return path


def all_rows(data: HARPDataModule) -> list[dict]:
    return data.rows("train") + data.rows("val")


def test_filters_keep_exactly_the_aime_problems_with_several_paths_outside_the_eval_years(tmp_path):
    records = [
        record("2010", "AIME_I", 3, number=1),          # kept
        record("2021_Fall", "AIME_II", 2, number=2),    # kept: the year reads as 2021
        record("2015", "AIME", 1, number=3),            # one solution path
        record("2024", "AIME_I", 4, number=4),          # AIME 2024 is an eval set
        record("2023", "AIME_II", 2, number=5),         # 2023 is excluded by default too
        record("2012", "AMC_12A", 5, number=6),         # not AIME
    ]
    data = HARPDataModule(str(harp_zip(tmp_path, records)), val_size=1)
    rows = all_rows(data)
    assert sorted(r["problem"] for r in rows) == sorted([records[0]["problem"], records[1]["problem"]])
    assert all(r["answer"] == "12" and r["dataset"] == "harp" for r in rows)  # $...$ stripped
    assert all(r["prompt"] == f"{r['problem']}\n\n{BOXED_INSTRUCTION}" for r in rows)
    wider = HARPDataModule(str(harp_zip(tmp_path, records)), contests=["AIME", "AMC"], min_solutions=1,
                           exclude_years=[2024], val_size=1)
    assert len(all_rows(wider)) == 5  # only AIME 2024 left out


def test_levels_filter(tmp_path):
    records = [record("2010", "AIME_I", 2, level=5, number=1), record("2011", "AIME_I", 2, level=6, number=2),
               record("2012", "AIME_I", 2, level=6, number=3)]
    data = HARPDataModule(str(harp_zip(tmp_path, records)), levels=[6], val_size=1)
    assert sorted(r["problem"][:14] for r in all_rows(data)) == ["AIME_I 2011 pr", "AIME_I 2012 pr"]


def test_filters_that_keep_nothing_and_files_that_are_not_harp_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no HARP problem passes the filters.*loosen them"):
        all_rows(HARPDataModule(str(harp_zip(tmp_path, [record("2024", "AIME_I", 3)])), val_size=0))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"is not HARP: its records lack \['year', 'contest', 'num_solutions'\]"):
        all_rows(HARPDataModule(str(other), val_size=0))


def test_year_parsing():
    assert harp_year({"year": "2021_Fall"}) == 2021 and harp_year({"year": "1950"}) == 1950
    with pytest.raises(DataError, match="has no year"):
        harp_year({"year": "", "contest": "AIME", "number": 3})


@pytest.mark.skipif(not HARP_ZIP.exists(), reason="../shared/data/harp is not on this machine")
def test_the_real_harp_file_read_zipped_with_the_default_filters():
    data = HARPDataModule(str(HARP_ZIP), val_size=32)
    train, val = data.rows("train"), data.rows("val")
    assert len(train) + len(val) == 694 and len(val) == 32  # the count docs/elegance.md states
    problems = [r["problem"] for r in train + val]
    assert len(set(problems)) == len(problems)
    assert all(isinstance(r["answer"], str) and r["answer"] and "$" not in r["answer"] for r in train + val)
    with zipfile.ZipFile(HARP_ZIP) as archive:  # check the filter against the raw file
        raw = [json.loads(line) for line in archive.read("HARD-Math.jsonl").decode().splitlines() if line.strip()]
    by_problem = {r["problem"].strip(): r for r in raw}
    for problem in problems:
        source = by_problem[problem]
        assert source["contest"].startswith("AIME") and source["num_solutions"] >= 2
        assert int(re.match(r"\d{4}", source["year"]).group()) not in (2023, 2024, 2025)
    assert not list(HARP_ZIP.parent.glob("*.jsonl"))  # read in place, never unzipped
