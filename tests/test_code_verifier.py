"""CodeVerifier: extraction, the tests column built from APPS and DeepCoder rows, comparison rules,
rewards (all / fraction) on hand-written programs, and real reference solutions."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers.base import MissingColumnError
from tandem_lit.verifiers.code import (
    CodeVerifier,
    apps_tests,
    deepcoder_tests,
    extract_program,
    stdout_matches,
    values_equal,
)

pytestmark = pytest.mark.usefixtures("machine_can_sandbox")  # (tests/conftest.py)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if not DATA.exists():
    DATA = Path("/work/shared/data")
LIMITS = dict(timeout_s=2.0, completion_timeout_s=20.0)


@pytest.fixture(scope="module")
def all_verifier():
    with CodeVerifier(reward="all", **LIMITS) as verifier:
        yield verifier


@pytest.fixture(scope="module")
def fraction_verifier():  # short cases: fraction mode runs every case, even after a timeout
    with CodeVerifier(reward="fraction", timeout_s=0.5, completion_timeout_s=10.0) as verifier:
        yield verifier


def block(program: str, tag: str = "python") -> str:
    return f"Here is my solution.\n\n```{tag}\n{program}\n```\n"


# -- extraction -------------------------------------------------------------------------------------


def test_last_python_block_wins_and_other_languages_are_skipped():
    text = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```text\nnot code\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program(text, "last_block") == "not code\n"


def test_bare_block_counts_as_python_and_indented_fences_are_dedented():
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("1. Code:\n   ```python\n   x = 1\n   print(x)\n   ```") == "x = 1\nprint(x)\n"


def test_no_block_unclosed_block_and_empty_block_mean_no_program():
    assert extract_program("print(1)") is None
    assert extract_program("```python\nprint(1)\n") is None  # truncated: no credit
    assert extract_program("```python\n\n```") is None
    assert extract_program("print(1)", "whole_text") == "print(1)"
    assert extract_program("  \n", "whole_text") is None
    with pytest.raises(ConfigError):
        extract_program("x", "first_block")


# -- comparison -------------------------------------------------------------------------------------


def test_stdout_comparison_is_token_wise_with_numeric_tolerance():
    assert stdout_matches("1 2 \n3\n\n", "1 2\n3")
    assert stdout_matches("0.3333333\r\n", "0.333333333\n")
    assert stdout_matches("1e-7", "0")  # absolute tolerance 1e-6
    assert not stdout_matches("0.3334", "0.3333")
    assert not stdout_matches("12345678901234567891", "12345678901234567890")  # integers exactly
    assert not stdout_matches("YES", "Yes")
    assert not stdout_matches("1 2", "1 2 3")
    assert not stdout_matches("inf", "1e999")  # words are compared as words, not as floats


def test_value_comparison():
    assert values_equal([1, [2, 3]], [1, [2, 3]])
    assert values_equal(0.1 + 0.2, 0.3)
    assert not values_equal(1, True) and not values_equal(True, 1)
    assert values_equal(3, 3.0000001) and not values_equal(3, 4)
    assert values_equal({"a": [1.0]}, {"a": [1]})
    assert not values_equal("1", 1) and not values_equal(None, 0)


# -- the tests column -------------------------------------------------------------------------------


def apps_rows() -> dict[int, dict]:
    rows = {}
    with open(DATA / "apps" / "test.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            rows.setdefault(row["id"], row)
    return rows


def test_apps_call_based_arguments_are_recovered():
    rows = apps_rows()
    pin = apps_tests(rows[4440])  # 'a234' is not a literal, so every pin is a string, '1234' too
    assert pin["kind"] == "call" and pin["fn_name"] == "validate_pin"
    assert {"args": ["1234"], "kwargs": {}, "expected": True, "expected_any": [True, [True]]} in pin["cases"]
    markers = apps_tests(rows[1613])  # a string argument that spans lines, then a list
    assert markers["cases"][0]["args"] == ["apples, pears # and bananas\ngrapes\nbananas !apples", ["#", "!"]]
    stdio = apps_tests(rows[1607])
    assert stdio["kind"] == "stdio" and stdio["cases"][0] == {"input": "QAQAQYSYIOIWIN\n", "output": "4\n"}


def test_apps_hub_layout(all_verifier):
    """The hub's APPS rows: ``input_output`` is JSON text; call-based when it names fn_name."""
    call = apps_tests({"problem_id": 7, "starter_code": "def add(a, b):", "input_output": json.dumps(
        {"fn_name": "add", "inputs": [[1, 2], [[1], [2]]], "outputs": [[3], [[1, 2]]]})})
    assert call["fn_name"] == "add" and call["cases"][0]["args"] == [1, 2]
    add = block("def add(a, b):\n    return a + b")
    assert all_verifier.grade(add, tests=call).correct  # 3 for [3], and [1, 2] for [[1, 2]]
    stdio = apps_tests({"input_output": '{"inputs": ["1\\n"], "outputs": ["2\\n"]}'})
    assert stdio == {"kind": "stdio", "cases": [{"input": "1\n", "output": "2\n"}]}
    with pytest.raises(DataError, match="input_output"):
        apps_tests({"problem_id": 8, "input_output": "{not json"})


def test_rows_without_tests_raise_data_errors_naming_the_field():
    with pytest.raises(DataError, match="test_list"):
        apps_tests({"id": 1, "starter_code": "", "test_list": []})
    with pytest.raises(DataError, match="'tests'"):
        deepcoder_tests({"problem": "p"}, "codeforces")
    with pytest.raises(DataError, match="kind must be"):
        deepcoder_tests({"tests": [{"input": "1", "output": "1"}]}, "leetcode")


def test_deepcoder_kinds():
    assert deepcoder_tests({"tests": [{"input": "1\n", "output": "2\n"}]}, "codeforces")["kind"] == "stdio"
    contests = deepcoder_tests({"tests": {"inputs": ["a", "b"], "outputs": ["1", "2"]}}, "code_contests")
    assert contests["cases"][1] == {"input": "b", "output": "2"}
    literal = "def check(candidate):\n    assert candidate(nums = [2,7], target = 9) == [0,1]\n\ncheck(Solution().twoSum)\n"
    call = deepcoder_tests({"tests": {"functional": literal}}, "leetcode")
    assert call == {"kind": "call", "fn_name": "Solution().twoSum",
                    "cases": [{"args": [], "kwargs": {"nums": [2, 7], "target": 9}, "expected": [0, 1]}]}
    tree = "def check(candidate):\n    assert candidate(root = tree_node([1, None, 2])) == [1, 2]\n\ncheck(Solution().f)\n"
    functional = deepcoder_tests({"tests": {"functional": tree}})
    assert functional["kind"] == "functional" and functional["entry"] == "Solution().f"
    assert "check(Solution" not in functional["check"]


def test_bad_tests_value_raises_before_anything_runs(all_verifier):
    with pytest.raises(DataError, match="kind stdio, call or functional"):
        all_verifier.grade_batch([block("print(1)")], tests=[{"cases": []}])
    with pytest.raises(MissingColumnError, match="tests"):
        all_verifier.grade_batch([block("print(1)")], answer=["1"])


# -- grading hand-written programs ------------------------------------------------------------------

DOUBLE = {"kind": "stdio", "cases": [{"input": f"{n}\n", "output": f"{2 * n}\n"} for n in (1, 2, 3, 4)]}
# right for 1 and 2 only
HALF_RIGHT = "n = int(input())\nprint(2 * n if n < 3 else n)"
ADD = {"kind": "call", "fn_name": "add", "cases": [
    {"args": [1, 2], "expected": 3}, {"args": [2, 2], "expected": 4}, {"args": [0, 5], "expected": 5},
]}


def test_stdio_correct_wrong_and_partial(all_verifier, fraction_verifier):
    right = block("print(2 * int(input()))")
    grades = fraction_verifier.grade_batch([right, block(HALF_RIGHT), block("print(0)")], tests=[DOUBLE] * 3)
    assert [g.reward for g in grades] == [1.0, 0.5, 0.0]
    assert [g.correct for g in grades] == [True, False, False]
    assert grades[1].labels == {"tests_passed_fraction": 0.5, "program_timeout_rate": 0.0}
    assert [g.reward for g in all_verifier.grade_batch([right, block(HALF_RIGHT)], tests=[DOUBLE] * 2)] == [1.0, 0.0]


def test_call_based_correct_wrong_and_partial(fraction_verifier):
    programs = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b",  # right when a = b = 2
                "def add(a, b):\n    return (a + b,)",  # a tuple is not a number
                "class Solution:\n    def add(self, a, b):\n        return a + b"]  # APPS: a method of Solution
    grades = fraction_verifier.grade_batch([block(p) for p in programs], tests=[ADD] * 4)
    assert [g.reward for g in grades] == [1.0, pytest.approx(1 / 3), 0.0, 1.0]


def test_functional_check(all_verifier):
    check = "def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n    assert candidate([]) == []\n"
    tests = {"kind": "functional", "entry": "Solution().sort", "check": check}
    right = block("class Solution:\n    def sort(self, xs: List[int]) -> List[int]:\n        return sorted(xs)")
    wrong = block("class Solution:\n    def sort(self, xs):\n        return xs")
    assert [g.reward for g in all_verifier.grade_batch([right, wrong], tests=[tests] * 2)] == [1.0, 0.0]


def test_no_program_is_not_run(all_verifier, monkeypatch):
    monkeypatch.setattr(all_verifier.sandbox, "run", lambda *a, **k: pytest.fail("ran"))
    grade = all_verifier.grade("I would print 2.", tests=DOUBLE)
    assert grade.reward == 0.0 and grade.extracted is None


def test_syntax_error_and_timeout_labels(fraction_verifier):
    broken, slow = fraction_verifier.grade_batch(
        [block("print(2 *"), block("import time\ntime.sleep(5)")], tests=[DOUBLE, DOUBLE]
    )
    assert broken.reward == 0.0 and broken.labels["program_timeout_rate"] == 0.0
    assert slow.reward == 0.0 and slow.labels["program_timeout_rate"] == 1.0


def test_a_verifier_bug_raises_instead_of_rewarding_zero(all_verifier, monkeypatch):
    def broken(*args):
        raise KeyError("bug")

    monkeypatch.setattr(CodeVerifier, "_case_passed", staticmethod(broken))
    with pytest.raises(KeyError):
        all_verifier.grade_batch([block("print(2)")], tests=[DOUBLE])


def test_parallel_batch_keeps_order(fraction_verifier):
    programs = [block("print(2 * int(input()))"), block(HALF_RIGHT), "no code", block("while True: pass"),
                block("print(0)"), block("print(2 * int(input()))")]
    rewards = fraction_verifier(programs, tests=[json.dumps(DOUBLE)] * len(programs)).tolist()
    assert rewards == [1.0, 0.5, 0.0, 0.0, 0.0, 1.0]


def test_pickles_without_its_threads(fraction_verifier):
    fraction_verifier.grade(block("print(1)"), tests=DOUBLE)  # start the pool
    copy = pickle.loads(pickle.dumps(fraction_verifier))
    assert copy.grade(block("print(2 * int(input()))"), tests=DOUBLE).reward == 1.0
    copy.close()


def test_config_errors():
    with pytest.raises(ConfigError, match="reward"):
        CodeVerifier(reward="best")
    with pytest.raises(ConfigError, match="timeout_s"):
        CodeVerifier(timeout_s=10, completion_timeout_s=5)
    with pytest.raises(ConfigError, match="cannot be opted out"):
        CodeVerifier(allow_missing=["filesystem"])


# -- real data --------------------------------------------------------------------------------------

APPS_SOLUTIONS = {
    1607: "s = input()\nq = qa = qaq = 0\nfor ch in s:\n    if ch == 'Q':\n        qaq += qa\n        q += 1\n"
          "    elif ch == 'A':\n        qa += q\nprint(qaq)",
    4440: "def validate_pin(pin):\n    return len(pin) in (4, 6) and pin.isdigit()",
    3292: "def calc(x):\n    total = ''.join(str(ord(c)) for c in x)\n    return 6 * total.count('7')",
    4724: "def drop_cap(str_):\n    return ' '.join(w.capitalize() if len(w) > 2 else w for w in str_.split(' '))",
}


def test_apps_rows_with_hand_written_solutions(all_verifier):
    rows = apps_rows()
    ids = list(APPS_SOLUTIONS)
    tests = [apps_tests(rows[i]) for i in ids]
    grades = all_verifier.grade_batch([block(APPS_SOLUTIONS[i]) for i in ids], tests=tests)
    assert [g.correct for g in grades] == [True] * len(ids)
    wrong = all_verifier.grade(block("def calc(x):\n    return 6"), tests=tests[ids.index(3292)])
    assert not wrong.correct


def test_deepcoder_leetcode_reference_solutions_pass(all_verifier):
    rows = json.loads((DATA / "deepcoder_code" / "train" / "leetcode.json").read_text(encoding="utf-8"))
    calls = [r for r in rows[::120] if "sortedcontainers" not in r["solutions"]]
    functional = [r for r in rows if "tree_node(" in r["tests"]["functional"] or "list_node(" in r["tests"]["functional"]]
    sample = calls + functional[:: max(1, len(functional) // 5)][:5]
    tests = [deepcoder_tests(r, "leetcode") for r in sample]
    assert {t["kind"] for t in tests} == {"call", "functional"}
    grades = all_verifier.grade_batch([block(r["solutions"]) for r in sample], tests=tests)
    failed = [sample[i]["problem"][:60] for i, g in enumerate(grades) if not g.correct]
    assert failed == []
