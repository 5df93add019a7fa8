"""Code verifier: run the program in a completion against the problem's tests, in a sandbox.

DESIGN.md decision 6: model-written programs are untrusted. Each completion's program runs in
``tandem_lit.verifiers.sandbox`` (namespaces, a read-only minimal root, no network, resource
limits, wall-clock kills; docs/security.md); a hostile program costs its rollout a zero reward,
nothing else. The trainer compares outputs itself: the expected outputs never enter the
sandbox, so a program cannot read them, and it can only print.

The ``tests`` column (built by ``apps_tests`` / ``deepcoder_tests``, or by hand) is a plain
JSON-able dict, or the same dict as a JSON string (Arrow cannot store mixed-type argument lists):

- ``{"kind": "stdio", "cases": [{"input": str, "output": str}, ...]}``: the program reads stdin
  and writes stdout (APPS standard-input problems, Codeforces, CodeContests).
- ``{"kind": "call", "fn_name": "name" | "Solution().method", "cases": [{"args": [...],
  "kwargs": {...}, "expected": value, "expected_any": [values] (optional: any one passes)}, ...]}``:
  the program defines a function (APPS call-based problems, LeetCode asserts of literals); a
  fresh ``Solution()`` per case; a bare name may also be a method of ``Solution``.
- ``{"kind": "functional", "entry": "Solution().method", "check": source}``: ``check(candidate)``
  runs in the sandbox with the program (LeetCode checks that build trees or lists). Weaker: a
  hostile program shares the interpreter with the check and could fake a pass; prefer ``call``.

Comparison rules (lenient like the APPS harness, never looser than a human judge would be):

- stdout: whitespace-separated tokens must match (so trailing spaces, blank lines and ``\\r``
  do not matter); two tokens that are numbers compare as integers exactly, or, when either has a
  decimal point or exponent, within ``FLOAT_TOLERANCE`` (absolute or relative).
- return values: tuples equal lists, floats within ``FLOAT_TOLERANCE``, ints exactly, a bool
  only equals a bool, dicts and sets by content; anything else compares unequal.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import re
import textwrap
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tandem_lit.errors import ConfigError, DataError, SandboxRefusedError
from tandem_lit.verifiers.base import Grade, Verifier
from tandem_lit.verifiers.columns import FieldType
from tandem_lit.verifiers.sandbox import CaseResult, Limits, RunResult, Sandbox, SandboxUnavailableError

__all__ = [
    "CodeVerifier",
    "SandboxRefusedError",
    "apps_tests",
    "deepcoder_tests",
    "extract_program",
    "stdout_matches",
    "values_equal",
]

log = logging.getLogger(__name__)

FLOAT_TOLERANCE = 1e-6  # absolute or relative, as most judges state ("error at most 1e-6")
EXTRACT_RULES = ("last_python_block", "last_block", "whole_text")
REWARD_MODES = ("all", "fraction")
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\n`]*)\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

# Names LeetCode's judge (and the APPS harness) provide without an import; run before call and
# functional programs. Builtin pow is kept (math's and operator's would shadow its 3-argument form).
PRELUDE = '''\
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
from string import *
from operator import *
import bisect, collections, copy, datetime, functools, heapq, itertools, math, operator, random, re, string, sys
del pow
inf = float("inf")


class ListNode:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val, self.left, self.right = val, left, right


def list_node(values):
    head = None
    for value in reversed(list(values)):
        head = ListNode(value, head)
    return head


def is_same_list(a, b):
    while a is not None and b is not None:
        if a.val != b.val:
            return False
        a, b = a.next, b.next
    return a is None and b is None


def tree_node(values):
    values = list(values)
    if not values or values[0] is None:
        return None
    root = TreeNode(values[0])
    level, i = deque([root]), 1
    while level and i < len(values):
        node = level.popleft()
        for side in ("left", "right"):
            if i < len(values) and values[i] is not None:
                child = TreeNode(values[i])
                setattr(node, side, child)
                level.append(child)
            i += 1
    return root


def is_same_tree(a, b):
    if a is None or b is None:
        return a is b
    return a.val == b.val and is_same_tree(a.left, b.left) and is_same_tree(a.right, b.right)
'''


# -- extraction -------------------------------------------------------------------------------------


def extract_program(completion: str, rule: str = "last_python_block") -> str | None:
    """The program in a completion, or None.

    ``last_python_block``: the last fenced block tagged python/py/python3 or untagged;
    ``last_block``: the last fenced block, any tag; ``whole_text``: the completion itself.
    A fence that is never closed (a truncated completion) is not a block.
    """
    if rule == "whole_text":
        program = completion
    else:
        blocks = [(tag.strip().lower(), body) for tag, body in _FENCE.findall(completion)]
        if rule == "last_python_block":
            blocks = [(tag, body) for tag, body in blocks if tag in _PYTHON_TAGS or tag == ""]
        elif rule != "last_block":
            raise ConfigError(f"extract must be one of {EXTRACT_RULES}, got {rule!r}")
        if not blocks:
            return None
        program = textwrap.dedent(blocks[-1][1])
    return program if program.strip() else None


# -- comparison -------------------------------------------------------------------------------------


def stdout_matches(got: str, expected: str) -> bool:
    """Token-wise, with numeric tolerance (see the module docstring)."""
    if got == expected:
        return True
    mine, theirs = got.split(), expected.split()
    if len(mine) != len(theirs):
        return False
    return all(a == b or _numbers_equal(a, b) for a, b in zip(mine, theirs))


def _numbers_equal(a: str, b: str) -> bool:
    if _INTEGER.fullmatch(a) and _INTEGER.fullmatch(b):
        return int(a) == int(b)
    if _NUMBER.fullmatch(a) and _NUMBER.fullmatch(b):
        return _close(float(a), float(b))
    return False


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def values_equal(got: Any, expected: Any) -> bool:
    """Compare a (canonical) return value with a (canonical) expected value."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return isinstance(got, bool) and isinstance(expected, bool) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        return _close(float(got), float(expected)) or (math.isnan(got) and math.isnan(expected))
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(values_equal(a, b) for a, b in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k]) for k in got)
    if isinstance(got, frozenset) and isinstance(expected, frozenset):
        return got == expected
    if isinstance(got, str) and isinstance(expected, str):
        return got == expected
    return got is None and expected is None


def canonical(value: Any) -> Any:
    """Tuples become lists, sets frozensets, dict keys hashable: the form ``values_equal`` compares."""
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {_freeze(canonical(k)): canonical(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return frozenset(_freeze(canonical(v)) for v in value)
    return value


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted(((k, _freeze(v)) for k, v in value.items()), key=repr))
    return value


def _from_wire(value: Any) -> Any:
    """Undo the sandbox's tagging of dicts and sets (``sandbox._encode``)."""
    if isinstance(value, list):
        return [_from_wire(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__dict__"} and isinstance(value["__dict__"], list):
            return {_freeze(_from_wire(k)): _from_wire(v) for k, v in value["__dict__"]}
        if set(value) == {"__set__"} and isinstance(value["__set__"], list):
            return frozenset(_freeze(_from_wire(v)) for v in value["__set__"])
        raise ValueError("not a value the sandbox encodes")
    return value


def decode_value(text: str | None) -> tuple[bool, Any]:
    """(ok, canonical value) from the sandbox's JSON; a program cannot make this raise."""
    if text is None:
        return False, None
    try:
        return True, canonical(_from_wire(json.loads(text)))
    except (ValueError, TypeError, RecursionError):
        return False, None


# -- the tests column -------------------------------------------------------------------------------


def apps_tests(record: dict) -> dict:
    """The ``tests`` value for an APPS row: the hub layout (``input_output``, a JSON string of
    {inputs, outputs, fn_name?}) or MapCoder's "selected150" (``test_list``, ../shared/data/apps).

    Rows with a function name (``fn_name``; in MapCoder's layout, a ``starter_code``) are
    call-based, the others stdin/stdout. MapCoder stored the arguments ``str()``-ed one per line,
    so strings lost their quotes: lines are read back with ``ast.literal_eval``, a line that is
    not a literal is a string, and a parameter that is a string in any case is a string in all.
    APPS's expected output is often a one-element list around the value; as in the APPS
    harness, both the list and its element are accepted (``expected_any``).
    The MapCoder file repeats some problems: de-duplicate on ``id``.
    """
    ident = record.get("id", record.get("problem_id", record.get("name", "?")))
    if not record.get("test_list") and record.get("input_output"):
        return _apps_hub_tests(record, ident)
    rows = record.get("test_list")
    if not rows:
        raise DataError(
            f"APPS row {ident} has no test cases in 'test_list' (or 'input_output'); apps_tests needs a "
            f"non-empty list of {{input, output}}. Drop the row or fill its tests."
        )
    starter = (record.get("starter_code") or "").strip()
    if not starter:
        return {"kind": "stdio", "cases": [{"input": _text(t["input"]), "output": _text(t["output"])} for t in rows]}
    fn_name, params = _starter_signature(starter, ident)
    split = [_split_args(_text(t["input"]), params) for t in rows]
    raw_positions = {i for args in split for i, arg in enumerate(args) if _literal(arg)[0] is False}
    cases = []
    for args, test in zip(split, rows):
        values = [arg if i in raw_positions else _literal(arg)[1] for i, arg in enumerate(args)]
        cases.append({"args": values, "kwargs": {}, **_expected(test["output"])})
    return {"kind": "call", "fn_name": fn_name, "cases": cases}


def _apps_hub_tests(record: dict, ident: Any) -> dict:
    spec = record["input_output"]
    try:
        spec = json.loads(spec) if isinstance(spec, str) else spec
        inputs, outputs = spec["inputs"], spec["outputs"]
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(
            f"APPS row {ident}: 'input_output' is not JSON with 'inputs' and 'outputs' ({err}); drop the row"
        ) from err
    if not inputs or len(inputs) != len(outputs):
        raise DataError(f"APPS row {ident}: 'input_output' needs as many outputs as inputs, and at least one")
    if spec.get("fn_name"):
        cases = [{"args": list(args), "kwargs": {}, **_expected(out)} for args, out in zip(inputs, outputs)]
        return {"kind": "call", "fn_name": spec["fn_name"], "cases": cases}
    return {"kind": "stdio", "cases": [{"input": _text(i), "output": _text(o)} for i, o in zip(inputs, outputs)]}


def _expected(output: Any) -> dict:
    if isinstance(output, list) and len(output) == 1:
        return {"expected": output[0], "expected_any": [output[0], output]}
    return {"expected": output}


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def _starter_signature(starter: str, ident: Any) -> tuple[str, int]:
    found = re.findall(r"def\s+(\w+)\s*\(([^)]*)\)", starter)
    if not found:
        raise DataError(f"APPS row {ident}: 'starter_code' names no function ({starter[:80]!r}); fix or drop the row.")
    name, params = found[-1]
    count = len([p for p in params.split(",") if p.strip() and p.strip() != "self"])
    if re.search(r"^\s*class\s+Solution\b", starter, re.MULTILINE):
        return f"Solution().{name}", count
    return name, count


def _split_args(text: str, params: int) -> list[str]:
    lines = text.split("\n")
    if params <= 1 or len(lines) <= params:
        return [text] if params <= 1 else lines
    extra = len(lines) - params  # a string argument spanning lines: the first one, as in APPS
    return ["\n".join(lines[: extra + 1]), *lines[extra + 1 :]]


def _literal(text: str) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, text


def deepcoder_tests(record: dict, kind: str | None = None) -> dict:
    """The ``tests`` value for a rLLM/DeepCoder row (../shared/data/deepcoder_code).

    ``kind``: ``codeforces`` (``tests`` = [{input, output}]), ``code_contests`` (``tests`` =
    {inputs, outputs}) or ``leetcode`` (``tests`` = {functional: "def check(candidate): ..."});
    None infers it from the row. A LeetCode check made only of ``assert candidate(literals) ==
    literal`` becomes a ``call`` test compared by the trainer; any other check stays ``functional``.
    """
    tests = record.get("tests")
    if not tests:
        raise DataError(
            "DeepCoder row has no 'tests' field (or it is empty); deepcoder_tests needs the row's test "
            "cases. Drop the row, or build its 'tests' column by hand (see tandem_lit.verifiers.code)."
        )
    if kind is None:
        kind = "leetcode" if isinstance(tests, dict) and "functional" in tests else (
            "code_contests" if isinstance(tests, dict) else "codeforces"
        )
    if kind == "codeforces" and isinstance(tests, list):
        return {"kind": "stdio", "cases": [{"input": _text(t["input"]), "output": _text(t["output"])} for t in tests]}
    if kind == "code_contests" and isinstance(tests, dict) and "inputs" in tests:
        if len(tests["inputs"]) != len(tests.get("outputs", ())) or not tests["inputs"]:
            raise DataError("code_contests row: 'tests.inputs' and 'tests.outputs' must be non-empty and of equal length")
        return {"kind": "stdio", "cases": [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]}
    if kind == "leetcode" and isinstance(tests, dict) and tests.get("functional"):
        return _leetcode_tests(tests["functional"], record.get("problem", ""))
    raise DataError(
        f"deepcoder_tests(kind={kind!r}) cannot read this row's 'tests' ({type(tests).__name__} with "
        f"{sorted(tests) if isinstance(tests, dict) else len(tests)}); kind must be codeforces, code_contests "
        f"or leetcode and match the file the row came from."
    )


def _leetcode_tests(source: str, problem: str) -> dict:
    try:
        module = ast.parse(source)
    except SyntaxError as err:
        raise DataError(f"LeetCode row: 'tests.functional' is not valid Python ({err}); drop the row") from err
    entry = None
    kept = []
    for node in module.body:
        call = node.value if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) else None
        if call is not None and getattr(call.func, "id", None) == "check" and len(call.args) == 1:
            entry = ast.unparse(call.args[0])
        else:
            kept.append(node)
    if entry is None:
        methods = re.findall(r"def\s+(\w+)\s*\(\s*self", problem)
        if not methods:
            raise DataError("LeetCode row: neither 'tests.functional' nor 'problem' names the method to test; drop the row")
        entry = f"Solution().{methods[-1]}"
    check = next((n for n in kept if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or len(check.args.args) != 1:
        raise DataError("LeetCode row: 'tests.functional' defines no check(candidate); drop the row")
    cases = _literal_asserts(check) if len(kept) == 1 else None
    if cases:
        return {"kind": "call", "fn_name": entry, "cases": cases}
    return {"kind": "functional", "entry": entry, "check": ast.unparse(ast.Module(body=kept, type_ignores=[]))}


def _literal_asserts(check: ast.FunctionDef) -> list[dict] | None:
    """Cases from ``assert candidate(...) == literal`` lines, or None if any line is something else."""
    candidate = check.args.args[0].arg
    cases = []
    for statement in check.body:
        test = statement.test if isinstance(statement, ast.Assert) else None
        if not (
            isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.left, ast.Call) and getattr(test.left.func, "id", None) == candidate
        ):
            return None
        try:
            args = [ast.literal_eval(a) for a in test.left.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in test.left.keywords}
            expected = ast.literal_eval(test.comparators[0])
        except (ValueError, SyntaxError, TypeError):
            return None
        if None in kwargs:  # **mapping
            return None
        cases.append({"args": args, "kwargs": kwargs, "expected": expected})
    return cases or None


def _spec(tests: Any) -> dict:
    """Validate one row's ``tests`` value (a dict or its JSON text)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as err:
            raise DataError(f"the 'tests' field is a string but not JSON ({err}); build it with apps_tests/deepcoder_tests") from err
    if not isinstance(tests, dict) or tests.get("kind") not in ("stdio", "call", "functional"):
        raise DataError(
            "each row's 'tests' field must be a dict with kind stdio, call or functional (see "
            "tandem_lit.verifiers.code); build it with apps_tests(row) or deepcoder_tests(row, kind)"
        )
    kind = tests["kind"]
    if kind == "functional":
        if not tests.get("check") or not tests.get("entry"):
            raise DataError("a functional 'tests' value needs 'check' (source) and 'entry' (e.g. Solution().f)")
        return tests
    cases = tests.get("cases")
    if not cases:
        raise DataError(f"the {kind} 'tests' value has no 'cases'; drop the row or add its test cases")
    need = ("input", "output") if kind == "stdio" else ("args", "expected")
    for case in cases:
        if not isinstance(case, dict) or any(k not in case for k in need):
            raise DataError(f"every {kind} test case needs the fields {need}; got {str(case)[:120]}")
    if kind == "call" and not tests.get("fn_name"):
        raise DataError("a call 'tests' value needs 'fn_name' (a function name or Solution().method)")
    return tests


def _is_spec(tests: Any) -> bool:
    try:
        _spec(tests)
    except DataError:
        return False
    return True


TESTS = FieldType(
    "a tests object of kind stdio, call or functional, or its JSON text (see tandem_lit.verifiers.code; "
    "build it with apps_tests or deepcoder_tests)", _is_spec,
)


# -- the verifier -----------------------------------------------------------------------------------


class CodeVerifier(Verifier):
    """Runs the program in each completion against its row's tests, in the sandbox.

    Needs the ``tests`` column (see the module docstring). Reward ``all``: 1.0 if every test
    passes, else 0.0 (stops at the first failing test); ``fraction``: the share of tests passed.
    Each grade carries the labels ``tests_passed_fraction`` (in ``all`` mode counted up to the
    first failure) and, when a program ran, ``program_timeout_rate`` (1.0 if it hit a time limit).

    Args:
        reward: ``all`` or ``fraction``.
        extract: Where the program is: ``last_python_block`` (the last ```python or bare ```
            block), ``last_block`` or ``whole_text``.
        timeout_s: Wall clock (and CPU seconds) of one test case.
        completion_timeout_s: Wall clock of all the tests of one program.
        memory_mb: Address-space limit of each process of the program.
        max_processes: Processes and threads the program may have at once.
        max_open_files: Open file descriptors per process.
        max_file_mb: Largest file, and total size of the program's /tmp.
        max_output_bytes: Stdout (or return value) of one test case; more fails the case.
        workers: Programs run at once (threads driving sandboxes); default min(4, CPU count).
        allow_missing: Protections the sandbox may run without where this machine lacks them:
            only ``[network]`` (programs could then reach the network). DANGEROUS; a warning is
            logged. Default: none.
        unprivileged_uid: uid the programs run as when the trainer runs as root.
    """

    required_columns = ("tests",)
    column_types = {"tests": TESTS}

    def __init__(
        self,
        reward: str = "all",
        extract: str = "last_python_block",
        timeout_s: float = 4.0,
        completion_timeout_s: float = 30.0,
        memory_mb: int = 1024,
        max_processes: int = 16,
        max_open_files: int = 64,
        max_file_mb: int = 16,
        max_output_bytes: int = 1 << 20,
        workers: int | None = None,
        allow_missing: Sequence[str] = (),
        unprivileged_uid: int = 65534,
    ):
        if reward not in REWARD_MODES:
            raise ConfigError(f"reward must be one of {REWARD_MODES}, got {reward!r}")
        if extract not in EXTRACT_RULES:
            raise ConfigError(f"extract must be one of {EXTRACT_RULES}, got {extract!r}")
        if workers is not None and workers < 1:
            raise ConfigError(f"workers must be >= 1 (or null for the default), got {workers}")
        try:
            limits = Limits(
                timeout_s=timeout_s, completion_timeout_s=completion_timeout_s, memory_mb=memory_mb,
                max_processes=max_processes, max_open_files=max_open_files, max_file_mb=max_file_mb,
                max_output_bytes=max_output_bytes,
            )
        except ValueError as err:
            raise ConfigError(f"CodeVerifier: {err}") from err
        self.reward = reward
        self.extract = extract
        self.workers = workers
        self.allow_missing = tuple(allow_missing)
        self.unprivileged_uid = unprivileged_uid
        try:
            self.sandbox = Sandbox(limits, allow_missing=self.allow_missing, unprivileged_uid=unprivileged_uid)
        except ValueError as err:
            raise ConfigError(f"CodeVerifier: {err}") from err
        except SandboxUnavailableError as err:
            raise SandboxRefusedError(str(err)) from err
        if self.allow_missing:
            log.warning(
                "CodeVerifier: allow_missing=%s: untrusted programs may run WITHOUT these protections "
                "where this machine lacks them (docs/security.md)", list(self.allow_missing),
            )
        self._setup_runtime()
        self.check_sandbox()  # fail closed at construction, not in the middle of training

    @property
    def limits(self) -> Limits:
        return self.sandbox.limits

    def _setup_runtime(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.sandbox_crashes = 0  # runs whose sandbox died without a report (not the program's output)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_executor", "_lock", "sandbox_crashes")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup_runtime()

    def __enter__(self) -> CodeVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def check_sandbox(self) -> list[str]:
        """Run the sandbox's self-test; raise SandboxRefusedError if a protection is missing."""
        try:
            return self.sandbox.check()
        except SandboxUnavailableError as err:
            raise SandboxRefusedError(str(err)) from err

    @property
    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                size = self.workers or min(4, os.cpu_count() or 1)
                self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="code-verifier")
            return self._executor

    def extract_program(self, completion: str) -> str | None:
        return extract_program(completion, self.extract)

    def grade(self, completion: str, tests: Any = None, **columns: Any) -> Grade:
        return self.grade_batch([completion], tests=[tests])[0]

    def grade_batch(self, completions: Sequence[str], **columns: Sequence[Any]) -> list[Grade]:
        self.check_columns(columns, len(completions))
        specs = [_spec(tests) for tests in columns["tests"]]  # bad data raises before anything runs
        futures = [self.executor.submit(self._grade_one, c, spec) for c, spec in zip(completions, specs)]
        return [future.result() for future in futures]  # a verifier bug raises here

    def _grade_one(self, completion: str, spec: dict) -> Grade:
        program = self.extract_program(completion)
        if program is None:
            return Grade(correct=False, reward=0.0, extracted=None, labels={"tests_passed_fraction": 0.0})
        passed, result = self.run_tests(program, spec)
        fraction = sum(passed) / len(passed)
        correct = all(passed)
        labels = {"tests_passed_fraction": fraction, "program_timeout_rate": float(result.timed_out)}
        return Grade(correct=correct, reward=fraction if self.reward == "fraction" else float(correct),
                     extracted=program, labels=labels)

    def run_tests(self, program: str, tests: Any) -> tuple[list[bool], RunResult]:
        """Run one program against one row's tests: (passed per test, the sandbox's report)."""
        spec = _spec(tests)
        passed = [False] * (1 if spec["kind"] == "functional" else len(spec["cases"]))

        def on_case(index: int, case: CaseResult) -> bool:
            passed[index] = case.status == "ok" and self._case_passed(spec, index, case)
            return passed[index] or self.reward == "fraction"

        result = self.sandbox.run(self._job(program, spec), on_case)
        if result.status == "crashed":
            with self._lock:
                self.sandbox_crashes += 1
            log.warning("CodeVerifier: a sandbox ended without reporting (%s); reward 0", result.detail)
        return passed, result

    def _job(self, program: str, spec: dict) -> dict:
        stop = self.reward == "all"
        if spec["kind"] == "stdio":
            cases = [{"stdin": case["input"]} for case in spec["cases"]]
            return {"kind": "stdio", "program": program, "cases": cases, "stop_on_failure": stop}
        if spec["kind"] == "call":
            cases = [{"args": case["args"], "kwargs": case.get("kwargs") or {}} for case in spec["cases"]]
            return {"kind": "call", "program": program, "entry": spec["fn_name"], "cases": cases,
                    "prelude": PRELUDE, "stop_on_failure": stop}
        return {"kind": "functional", "program": program, "entry": spec["entry"], "check": spec["check"],
                "cases": [{}], "prelude": PRELUDE, "stop_on_failure": stop}

    @staticmethod
    def _case_passed(spec: dict, index: int, case: CaseResult) -> bool:
        if spec["kind"] == "stdio":
            return stdout_matches(case.stdout, spec["cases"][index]["output"])
        if spec["kind"] == "functional":
            return case.value == "true"
        ok, value = decode_value(case.value)
        expected = spec["cases"][index]
        return ok and any(values_equal(value, canonical(e)) for e in expected.get("expected_any") or [expected["expected"]])

    def __repr__(self) -> str:
        return (
            f"CodeVerifier(reward={self.reward!r}, extract={self.extract!r}, limits={self.limits}, "
            f"workers={self.workers}, allow_missing={list(self.allow_missing)})"
        )

