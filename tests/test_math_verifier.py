"""MathVerifier: boxed-answer extraction, math-verify equivalence, the known false negatives,
the worker-process timeouts, threads, pickling, the hard dependency, and the real-data sanity
figures on a sample of every eval set in ../shared/data."""

from __future__ import annotations

import copy
import os
import pickle
import random
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem_lit.errors import ConfigError, DataError
from tandem_lit.verifiers import MathVerifier, MissingColumnError, MissingDependencyError
from tandem_lit.verifiers.math import require_math_verify
from tandem_lit.verifiers.math_grader import extract_boxed, normalize_answer, normalize_references
from tandem_lit.verifiers.workers import WorkerPool, WorkerStartError
from tests.conftest import load_script

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TANDEM_LIT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(workers=2, timeout_s=10.0) as v:
        yield v


def boxed(answer: str) -> str:
    return f"Some reasoning... so the answer is $\\boxed{{{answer}}}$."


# -- extraction and normalisation (no worker processes) -----------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed{5}", "5"),
        (r"first \boxed{3} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last box
        (r"\boxed{\frac{a}{b^{2}}} done", r"\frac{a}{b^{2}}"),  # balanced braces
        (r"\fbox{7}", "7"),
        (r"\boxed {  x+1 }", "x+1"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are content
        (r"\boxed{x = \boxed{4}}", r"x = \boxed{4}"),  # the box that closes last
        (r"$\boxed 9$", "9"),
        ("no box, answer 5", None),
        (r"\boxed{}", None),
        (r"\boxed{3} and finally \boxed{\frac{1}{", None),  # the final box was cut off
        (r"\boxedx{3}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@given(st.text(alphabet="{}\\boxed $x1", max_size=60))
def test_extract_boxed_never_raises_and_returns_balanced_content(text):
    content = extract_boxed(text)
    if content is not None:
        depth = 0
        for i, ch in enumerate(content):
            if ch in "{}" and (i == 0 or content[i - 1] != "\\"):
                depth += 1 if ch == "{" else -1
        assert content.strip() == content and content


def test_extraction_is_linear_on_a_hostile_completion():
    text = r"\boxed{" * 20000 + "1" + "}" * 20000
    start = time.perf_counter()
    assert extract_boxed(text) is not None
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("2.55e-10", r"2.55\times10^{-10}"),
        ("4.5E+33", r"4.5\times10^{33}"),
        ("1e9", r"1\times10^{9}"),
        ("$5$", "5"),
        (r"(-\infty, 0) \cup\{1\}.", r"(-\infty, 0) \cup\{1\}"),
        ("10^-3", "10^{-3}"),
        ("52_8", "42"),
        ("2516_{8}", "1358"),
        ("19_8", "19_8"),  # not a base-8 numeral: unchanged
        (r"x_1 + \rho_{0}", r"x_1 + \rho_{0}"),  # subscripted names stay names
        ("np.arcsin(10/13)", r"\arcsin(10/13)"),
        ("-1./3", "-1/3"),
        (r"1950^\circ C", r"1950^\circ"),
        (r"0.003^{\prime \prime}", "0.003"),
        ("y''+y'=0", r"y^{\prime\prime}+y^{\prime}=0"),
        (r"864 \mbox{ inches}^2", "864"),
        (r"15000 \text{ kcal m}^{-2} \text{yr}^{-1}", "15000"),
        (r"\text{Evelyn}", r"\text{Evelyn}"),  # nothing before it: an answer, not a unit
        ("10 sq ft", "10"),
        ("x cm", "x cm"),  # unit words only after a plain number
        (r"\frac{37}{4} m", r"\frac{37}{4} m"),
        ("e-1", "e-1"),
        (r"2e^{-1}", r"2e^{-1}"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_references_types():
    assert normalize_references(27.0) == ("27",)
    assert normalize_references(0.5) == ("0.5",)
    assert normalize_references(7) == ("7",)
    assert normalize_references(["9.6\n"]) == ("9.6",)
    assert normalize_references(["0.01\n", "0.02\n", "0.01"]) == ("0.01", "0.02")
    with pytest.raises(ValueError):
        normalize_references(["", None])


def test_empty_reference_and_missing_column_are_data_errors(verifier):
    with pytest.raises(DataError, match="'answer' field"):
        verifier.grade_batch([boxed("1")], answer=[""])
    with pytest.raises(MissingColumnError, match="answer"):
        verifier.grade_batch([boxed("1")], solution=["1"])


# -- equivalence --------------------------------------------------------------------------------

# The false negatives the reference implementation had (../shared/REFERENCES.md): a bare
# left-hand side must not make a correct answer wrong, and scientific notation is a number.
KNOWN_FALSE_NEGATIVES = [
    (r"p(s)=s^2+\omega^2", r"s^2+\omega^2"),
    (r"s^2+\omega^2", r"p(s)=s^2+\omega^2"),
    ("b=m", "m"),
    ("m", "b=m"),
    (r"Y(s)=\frac{1}{s+a}", r"\frac{1}{s+a}"),
    (r"\frac{1}{s+a}", r"Y(s)=\frac{1}{s+a}"),
    ("2.55e-10", "2.55e-10"),
    ("2.55e-10", r"2.55\times10^{-10}"),
    (r"2.55 \times 10^{-10}", "2.55e-10"),
    ("2.55E-10", r"2.55\cdot 10^{-10}"),
]

EQUIVALENT = [
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac{3}{4}", "0.75"),
    ("27.0", 27.0),
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),
    (r"0.7071068", r"\frac{\sqrt{2}}{2}"),  # a decimal within rel_tol of an exact value
    (r"\{2, 1\}", r"\{1,2\}"),  # sets
    ("84, 69", "69,84"),  # OlympiadBench multiple answers, any order
    (r"(1, 2]", r"(1,2]"),  # intervals
    (r"(-\infty, 0) \cup \{1\}", r"(-\infty, 0) \cup\{1\}."),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)"),  # tuples
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),  # matrices
    (r"864 \text{ inches}^2", r"864 \mbox{ inches}^2"),  # units
    ("864", r"864 \mbox{ inches}^2"),
    (r"\text{Evelyn}", r"\text{Evelyn}"),  # text answers
    (r"90^\circ", "90"),
    (r"50\%", "50"),
    ("x=5", "5"),
    ("42", "52_8"),  # base subscripts are their value
    ("52_8", "52_8"),
    ("7.353e14", r"7.353 \times 10^{14}"),
    ("7.353000001e14", "7.353e14"),  # equal within rel_tol=1e-6 (math-verify's rounding says no)
    (r"x^2-1", r"(x-1)(x+1)"),
    (r"6 - 5i", r"6-5i"),
    (r"\frac{1}{3} E_{1}+\frac{2}{3} E_{2}", r"\frac{1}{3} E_{1}+\frac{2}{3} E_{2}"),  # unparseable: same string
    ("0.01", ["0.01\n", "0.02\n"]),  # a list of alternatives
    # forms found by cross-grading the two Minerva copies in ../shared/data (docs/math.md)
    (r"-\frac{1}{3}", "-1./3"),
    (r"\arcsin{\frac{10}{13}}", "np.arcsin(10/13)"),
    (r"1950^\circ C", "1950"),
    (r"0.003^{\prime \prime}", "0.003"),
    (r"x' + \frac{r}{V}x - rc = 0", r"x^{\prime}+\frac{r}{V} x-r c=0"),
    (r"\frac{4A}{3+3i}e^{it}", r"\frac{4 A}{3+3 i} e^{i t}"),  # real vs complex symbols
    (r"\frac{t}{m}", r"\frac{1}{m} t"),
    (r"\frac{c}{\sqrt{2}}", r"\frac{1}{\sqrt{2}}c"),
    ("E_1, E_2", "E_{1},E_{2}"),  # sympy cannot parse it; the same LaTeX up to spacing
    (r"6.43 \times 10^{16} \text{ cm}^{-3}", "6.43e16"),
    ("5 cm", "5"),
    ("0.02", ["0.01\n", "0.02\n"]),
]

NOT_EQUIVALENT = [
    ("2.56e-10", "2.55e-10"),  # math-verify alone rounds both to 0.000000
    ("2.55", "2.55e-10"),
    ("7.4e14", "7.353e14"),
    (r"\frac{1}{3}", "0.33"),
    ("3", 27.0),
    (r"\{1, 3\}", r"\{1,2\}"),
    ("69", "69,84"),  # all of a multiple answer is needed
    (r"(1, 2)", r"(1,2]"),
    ("43", "52_8"),
    ("52_9", "52_8"),
    ("N=n+1", "N=n"),  # read as n = n + 1 vs n = n: math-verify alone says equal
    (r"\frac{1}{3} E_{1}+\frac{2}{3} E_{3}", r"\frac{1}{3} E_{1}+\frac{2}{3} E_{2}"),  # both read as 2/3 before
    (r"\hbar\omega-\frac{1}{\omega^{3}}", r"\hbar\omega-\frac{1}{\omega^{2}}"),
    (r"p(s)=s^2+\omega", r"s^2+\omega^2"),
    ("0.03", ["0.01\n", "0.02\n"]),
    ("v", "v t"),  # math-verify's unit rule alone reads "v t" as "v"
    (r"\frac{1}{m}", r"\frac{1}{m} t"),
    (r"1950^\circ C", "1951"),
    (r"\frac{37}{4}", r"\frac{37}{4} m"),  # a trailing letter is a variable, not a unit
    (r"\text{Eve}", r"\text{Evelyn}"),
]


def test_known_false_negatives_are_graded_correct(verifier):
    answers = [a for a, _ in KNOWN_FALSE_NEGATIVES]
    references = [r for _, r in KNOWN_FALSE_NEGATIVES]
    verdicts = verifier.evaluate([boxed(a) for a in answers], answer=references)
    assert [pair for pair, ok in zip(KNOWN_FALSE_NEGATIVES, verdicts) if not ok] == []


def test_equivalent_answers(verifier):
    verdicts = verifier.evaluate([boxed(a) for a, _ in EQUIVALENT], answer=[r for _, r in EQUIVALENT])
    assert [pair for pair, ok in zip(EQUIVALENT, verdicts) if not ok] == []


def test_different_answers(verifier):
    verdicts = verifier.evaluate([boxed(a) for a, _ in NOT_EQUIVALENT], answer=[r for _, r in NOT_EQUIVALENT])
    assert [pair for pair, ok in zip(NOT_EQUIVALENT, verdicts) if ok] == []


def test_rewards_grades_and_no_box_means_no_credit(verifier):
    completions = [boxed("204"), "The answer is 204.", r"\boxed{205}", r"\fbox{204}"]
    rewards = verifier(completions, answer=["204"] * 4)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    grade = verifier.grade(r"so $\boxed{2.55e-10}$", answer="2.55e-10")
    assert grade.correct and grade.reward == 1.0 and grade.extracted == r"2.55\times10^{-10}"
    assert verifier.grade("no box", answer="1").extracted is None


def test_grades_are_cached_by_version_answer_and_reference(verifier):
    verifier.grade(boxed(r"\frac{10}{4}"), answer="2.5")
    key = (verifier.grader_version, r"\frac{10}{4}", ("2.5",))
    assert verifier._cache[key] is True
    verifier._cache[key] = False  # a cached verdict is served without grading again
    assert verifier.grade(boxed(r"\frac{10}{4}"), answer="2.5").correct is False
    verifier._cache[key] = True


def test_grading_from_threads(verifier):
    results: dict[int, list[bool]] = {}

    def work(i: int) -> None:
        results[i] = verifier.evaluate([boxed(str(i)), boxed(f"{i}.0"), boxed("-1")], answer=[str(i)] * 3)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {i: [True, True, False] for i in range(3)}


def test_pickle_and_deepcopy_carry_no_processes(verifier):
    verifier.grade(boxed("1"), answer="1")  # the pool is running
    assert verifier._pool is not None and verifier._pool.alive > 0
    clone = pickle.loads(pickle.dumps(verifier))
    assert clone._pool is None and clone.grader_version == verifier.grader_version
    assert clone.timeout_s == verifier.timeout_s and clone.workers == verifier.workers
    assert copy.deepcopy(verifier)._pool is None
    assert verifier._pool.alive > 0  # the original keeps its workers


# -- timeouts and the worker pool ---------------------------------------------------------------


def test_a_hanging_grade_costs_one_reward_and_the_next_grade_works():
    # 9^(9^(9^9)) makes sympy's comparison run for hours; the worker is killed at the limit.
    with MathVerifier(workers=2, timeout_s=3.0) as v:
        start = time.monotonic()
        verdicts = v.evaluate([boxed("9^{9^{9^{9}}}"), boxed("5"), boxed("6")], answer=["5", "5", "6"])
        assert verdicts == [False, True, True]
        assert time.monotonic() - start < 60
        assert v.timeouts == 1 and v.recent_timeouts[-1] == ("9^{9^{9^{9}}}", ("5",))
        assert v.grade(boxed("7"), answer="7").correct  # the pool recovered
        assert v._pool.timeouts == 1 and v._pool.alive == 2
        pids = v._pool.pids()
    assert all(not _alive(pid) for pid in pids)  # closing the context stops the workers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except OSError:
        return False


@pytest.fixture
def helper_module(tmp_path, monkeypatch):
    """A worker factory in a throwaway module: sleeps, exits, raises or doubles."""
    (tmp_path / "pool_helpers.py").write_text(
        textwrap.dedent(
            """
            import os, time

            def factory():
                def work(kind, value):
                    if kind == "sleep":
                        time.sleep(value)
                    elif kind == "exit":
                        os._exit(3)
                    elif kind == "raise":
                        raise ValueError("boom")
                    return value * 2
                return work

            def broken_factory():
                raise ImportError("no such backend")
            """
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_pool_timeout_crash_and_error_cost_only_their_call(helper_module):
    pool = WorkerPool("pool_helpers:factory", size=2, timeout_s=1.0)
    try:
        results = pool.run([("double", 1), ("sleep", 30), ("exit", 0), ("raise", 0), ("double", 4)])
        assert [r.status for r in results] == ["ok", "timeout", "crashed", "error", "ok"]
        assert results[0].value == 2 and results[4].value == 8
        assert "boom" in results[3].error
        assert pool.timeouts == 1 and pool.crashes == 1
        assert [r.value for r in pool.run([("double", i) for i in range(6)])] == [0, 2, 4, 6, 8, 10]
    finally:
        pool.close()
    assert pool.alive == 0


def test_a_pool_whose_workers_keep_dying_stops_in_one_line(helper_module):
    """A crash here and there costs its call; calls that all lose their worker (killed from
    outside, e.g. by the out-of-memory killer) stop the run rather than reward 0 from then on."""
    from tandem_lit.errors import TandemLitError
    from tandem_lit.verifiers.workers import WorkersLostError

    pool = WorkerPool("pool_helpers:factory", size=1, timeout_s=5.0, crash_limit=3)
    try:
        statuses = [r.status for r in pool.run([("exit", 0), ("exit", 0), ("double", 1), ("exit", 0), ("exit", 0)])]
        assert statuses == ["crashed", "crashed", "ok", "crashed", "crashed"]
        with pytest.raises(WorkersLostError) as stopped:
            pool.run([("exit", 0)] * 4)
        assert isinstance(stopped.value, TandemLitError) and "\n" not in str(stopped.value)
        assert str(stopped.value).startswith("the worker processes of pool_helpers:factory keep dying: the last 3 calls "
                                             "each lost theirs (the last exit code 3;")
        assert pool.alive == 0
    finally:
        pool.close()


def test_pool_works_from_a_thread_and_by_file_path(helper_module):
    pool = WorkerPool(f"{helper_module / 'pool_helpers.py'}:factory", size=1, timeout_s=5.0)
    out = []
    thread = threading.Thread(target=lambda: out.extend(pool.run([("double", 21)])))
    thread.start()
    thread.join(timeout=60)
    pool.close()
    assert out[0].value == 42


def test_pool_start_failure_raises_with_the_cause(helper_module):
    pool = WorkerPool("pool_helpers:broken_factory", size=1, timeout_s=5.0)
    with pytest.raises(WorkerStartError, match="no such backend"):
        pool.run([("double", 1)])
    assert pool.alive == 0


# -- the hard dependency ------------------------------------------------------------------------


def test_missing_math_verify_raises_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'tandem-lit\[math\]'") as info:
        MathVerifier()
    assert isinstance(info.value, ImportError)


def test_another_math_verify_version_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="pinned to math-verify==0.0.1"):
        require_math_verify("0.0.1")
    assert require_math_verify(None) == require_math_verify("0.9.0") == "0.9.0"


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="timeout_s"):
        MathVerifier(timeout_s=0)
    with pytest.raises(ConfigError, match="workers"):
        MathVerifier(workers=0)


# -- real data: own reference correct, perturbed answer wrong ------------------------------------


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"real eval data not found at {SHARED_DATA}")
def test_sanity_on_a_sample_of_every_eval_set(verifier):
    from tandem_lit.data.math import EVAL_SETS, load_eval_rows

    sanity = load_script("grader_sanity")
    reports = []
    for name in EVAL_SETS:
        rows = load_eval_rows(name, root=str(SHARED_DATA))
        sample = random.Random(0).sample(rows, min(12, len(rows)))
        reports.append(sanity.check_set(verifier, name, sample))
    summary = sanity.markdown_table(reports)
    assert all(r.correct_pct >= 99.0 for r in reports), summary + "\n" + "\n".join(m for r in reports for m in r.misses)
    assert all(r.perturbed_pct <= 1.0 for r in reports), (
        summary + "\n" + "\n".join(m for r in reports for m in r.misses)
    )


def test_perturbation_changes_the_value():
    perturb = load_script("grader_sanity").perturb
    assert perturb("204") == "205"
    assert perturb(r"864 \mbox{ inches}^2") == r"865 \mbox{ inches}^2"
    assert perturb(r"\text{Evelyn}") == r"\text{EvelynX}"
    assert perturb(r"p - q") == "p - q+1"


def test_a_batch_of_hostile_tasks_costs_the_budget_not_n_timeouts(helper_module):
    """8 tasks that each overrun, 2 workers, 1 s each: without a budget that is 4 s of waiting in
    sequence; the 1.5 s budget stops the batch, every task is a counted timeout."""
    pool = WorkerPool("pool_helpers:factory", size=2, timeout_s=1.0)
    try:
        pool.run([("double", 0)])  # workers started: measure the batch alone
        start = time.monotonic()
        results = pool.run([("sleep", 30)] * 8, budget_s=1.5)
        assert time.monotonic() - start < 3.0
        assert [r.status for r in results] == ["timeout"] * 8
        assert sum("budget" in r.error for r in results) >= 4  # most never started
        assert pool.timeouts == 8
        assert [r.value for r in pool.run([("double", 1), ("double", 2)], budget_s=1.5)] == [2, 4]
    finally:
        pool.close()


def nested_frac(depth: int) -> str:
    """\\frac{\\frac{...\\frac{2}{1}...}{1}}{1}: the value 2, ``depth`` fractions deep."""
    return "\\frac{" * depth + "2" + "}{1}" * depth


def test_deep_valid_answers_are_graded_right_or_counted_never_silently_wrong():
    with MathVerifier(workers=1, timeout_s=20.0) as v:
        deep, absurd = v.grade_batch([boxed(nested_frac(200)), boxed(nested_frac(20_000))], answer=["2", "2"])
        assert deep.correct  # 200 levels parse with the worker's raised recursion limit
        # 20,000 levels: right, or a counted failure (too deep, timed out or crashed), never a silent 0
        assert (absurd.correct and v.timeouts == 0) or (not absurd.correct and v.timeouts == 1)
