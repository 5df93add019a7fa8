"""docs/performance.md is what benchmarks/performance_page.py writes from docs/results/manifest.json,
every figure on it is read from a raw file that exists, and docs/results holds only what it cites."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest

from benchmarks import performance_page
from benchmarks.performance_page import MANIFEST, PAGE, RESULTS, ManifestError, cited_files, render


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def test_the_committed_page_is_the_generated_one(manifest):
    """Nobody appends to the page by hand: run `python benchmarks/performance_page.py` instead."""
    assert PAGE.read_text() == render(manifest), "docs/performance.md is stale: run python benchmarks/performance_page.py"
    assert performance_page.main(["--check"]) == 0


def test_every_cited_file_exists_and_results_hold_nothing_else(manifest):
    cited = cited_files(manifest)
    assert all((RESULTS / name).is_file() for name in cited), sorted(n for n in cited if not (RESULTS / n).is_file())
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name != MANIFEST.name and p.name not in cited)
    assert not uncited, f"docs/results keeps only what docs/performance.md cites; uncited: {uncited}"


def test_a_hand_transcribed_result_names_the_raw_text_it_came_from(manifest):
    for run in manifest["runs"].values():
        data = json.loads((RESULTS / run["file"]).read_text())
        if "transcribed_by_hand_from" in data:
            assert data["transcribed_by_hand_from"] in run.get("raw", []) and (RESULTS / data["transcribed_by_hand_from"]).is_file()


def test_every_row_has_its_card_date_commit_and_command(manifest, repo_root):
    listed = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=repo_root, capture_output=True, text=True, check=True)
    stages = {performance_page.STAGE_SCRIPT: set(listed.stdout.split(":", 1)[1].split())}
    # the main job's stages (scripts/gpu_mainjob.sh, the CLI's runs): its case labels
    mainjob = (repo_root / "scripts" / "gpu_mainjob.sh").read_text()
    stages["scripts/gpu_mainjob.sh"] = set(re.findall(r"^ {4}([a-z-]+)\)$", mainjob, flags=re.M))
    assert {"fit", "resume", "harness", "test"} <= stages["scripts/gpu_mainjob.sh"]
    for key, run in manifest["runs"].items():
        assert run["card"] in manifest["cards"], key
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]) and re.fullmatch(r"[0-9a-f]{7,40}", run["commit"]), key
        # (environment settings first, as a user would type them)
        assert re.match(r"([A-Z_]+=\S+ )*(python (dev/)?benchmarks/|tandem-lit )", run["command"]), key
        script = run.get("script", performance_page.STAGE_SCRIPT)
        assert run["stage"] in stages[script], f"{key}: {script} has no stage {run['stage']}"
    page = PAGE.read_text()
    for table in manifest["tables"]:
        assert f"## {table['question']}" in page
        for row in table["rows"]:
            assert manifest["runs"][row["run"]]["command"] in page


def test_a_missing_file_or_field_stops_the_page_with_its_name(manifest, tmp_path):
    broken = copy.deepcopy(manifest)
    key = next(iter(broken["runs"]))
    broken["runs"][key]["file"] = "no_such_run.json"
    with pytest.raises(ManifestError, match="no_such_run.json"):
        render(broken)
    broken = copy.deepcopy(manifest)
    row = next(row for table in broken["tables"] for row in table["rows"] if any(isinstance(c, list) for c in row["cells"]))
    cell = next(c for c in row["cells"] if isinstance(c, list))
    cell[-1] = "no_such_field"
    with pytest.raises(ManifestError, match="no_such_field"):
        render(broken)


def test_the_readme_quotes_only_figures_the_page_has(repo_root):
    """The README's results table takes each figure from docs/performance.md, with its card and date."""
    readme = (repo_root / "README.md").read_text()
    rows = [line for line in readme.split("<!-- results -->")[1].split("<!-- /results -->")[0].splitlines() if line.startswith("|")][2:]
    page = PAGE.read_text()
    assert rows, "no rows in the README's results table"
    for row in rows:
        card, date = row.strip(" |").rsplit("|", 1)[1].strip().split(", ")
        assert f"| {card} | {date} |" in page, f"no row of docs/performance.md was measured on {card} on {date}"
        for figure in re.findall(r"\d+(?:,\d{3})+(?:\.\d+)?|\d+\.\d+", row):
            assert re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d,]|\.\d)", page), f"README figure {figure} is not on docs/performance.md"
