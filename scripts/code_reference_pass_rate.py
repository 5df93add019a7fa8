"""How many reference solutions pass CodeVerifier: a check of the harness, not of the data.

Every row that ships a reference solution is graded through the sandbox, exactly as a model's
program would be (``reward: all``). A harness that is too strict (a missing import, a comparison
rule, a time limit) shows up as failing references; the failures are grouped by cause, with a
few examples each. Data with tests but no solutions is listed as such.

    python scripts/code_reference_pass_rate.py --root ../shared/data
    python scripts/code_reference_pass_rate.py --root ../shared/data --limit 50 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem_lit.verifiers.code import CodeVerifier, deepcoder_tests
from tandem_lit.verifiers.sandbox import RunResult

# (file, the field holding the reference, the normaliser)
SOURCES = [
    ("deepcoder_code/train/leetcode.json", "solutions", lambda row: deepcoder_tests(row, "leetcode")),
    ("deepcoder_code/test/leetcode.json", "solutions", lambda row: deepcoder_tests(row, "leetcode")),
]
WITHOUT_SOLUTIONS = ["apps/test.jsonl", "deepcoder_code/test/codeforces.json", "deepcoder_code/test/code_contests.json"]


def load(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def category(passed: list[bool], result: RunResult) -> str:
    """Why a reference failed, in a few words."""
    if result.status == "compile_error":
        return "syntax error"
    first = next((c for c, ok in zip(result.cases, passed) if not ok), None)
    if first is None or first.status == "not_run":
        return f"sandbox: {result.status}"
    if first.status == "error":
        module = re.search(r"No module named '([^']+)'", first.stderr)
        if module:
            return f"missing module {module.group(1)}"
        last = first.stderr.strip().splitlines()[-1:] or ["?"]
        return "exception " + last[0].split(":")[0]
    if first.status == "ok":
        return "wrong answer"
    return first.status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("../shared/data"))
    parser.add_argument("--limit", type=int, default=None, help="rows per file (default: all)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--timeout-s", type=float, default=4.0)
    parser.add_argument("--examples", type=int, default=3, help="failures shown per cause")
    args = parser.parse_args(argv)

    verifier = CodeVerifier(reward="all", timeout_s=args.timeout_s, workers=args.workers)
    pool = ThreadPoolExecutor(max_workers=args.workers or min(4, os.cpu_count() or 1))
    total_start = time.monotonic()
    for name in WITHOUT_SOLUTIONS:
        path = args.root / name
        if path.exists():
            rows = load(path)
            fields = sorted({k for row in rows for k in row})
            print(f"{name}: {len(rows)} rows, no reference solutions (fields: {', '.join(fields)})")
    for name, field, normalise in SOURCES:
        path = args.root / name
        rows = load(path)[: args.limit]
        start = time.monotonic()

        outcomes = list(pool.map(lambda row, f=field, n=normalise: verifier.run_tests(row[f], n(row)), rows))
        seconds = time.monotonic() - start
        causes: Counter[str] = Counter()
        examples: dict[str, list[str]] = defaultdict(list)
        passed_rows = 0
        for row, (passed, result) in zip(rows, outcomes):
            if all(passed):
                passed_rows += 1
                continue
            cause = category(passed, result)
            causes[cause] += 1
            if len(examples[cause]) < args.examples:
                title = re.sub(r"\s+", " ", row.get("problem", ""))[101:181]
                failing = next((c for c, ok in zip(result.cases, passed) if not ok), None)
                detail = (failing.stderr.strip().splitlines() or [""])[-1][:160] if failing else result.detail
                examples[cause].append(f"{title!r}: {detail}")
        share = passed_rows / len(rows) if rows else 0.0
        print(f"\n{name}: {passed_rows}/{len(rows)} references pass ({share:.1%}) in {seconds:.0f} s")
        for cause, count in causes.most_common():
            print(f"  {count:5d}  {cause}")
            for example in examples[cause]:
                print(f"         - {example}")
    print(f"\ntotal wall time {time.monotonic() - total_start:.0f} s; sandbox crashes: {verifier.sandbox_crashes}")
    pool.shutdown()
    verifier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
