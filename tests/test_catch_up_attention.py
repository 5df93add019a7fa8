"""The catch-up attention kernel (several tokens of a row over its paged cache in one read: the first
piece of decoding only the author, dev/author_only_decode.md) in Triton's interpreter:
tests/catch_up_interpreted.py in a fresh process, since Triton reads ``TRITON_INTERPRET`` when the
kernels are defined."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("triton", reason="the Triton kernels need the triton package (dev extra, Linux)")


def test_a_catch_up_equals_the_reference_and_the_decode_steps_it_replaces():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.catch_up_interpreted"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["reference-h8-kv2", "reference-h4-kv2", "decode-steps", "ok"]


def test_the_gpu_benchmark_checks_each_case_against_the_reference_under_the_interpreter():
    """dev/benchmarks/catch_up_attention.py's CPU check: the decode-shaped, catch-up and author-only
    cases at the lognormal mix, each equal to the torch reference (the GPU times them)."""
    done = subprocess.run([sys.executable, "dev/benchmarks/catch_up_attention.py", "--device", "cpu", "--batch", "3",
                           "--used", "40"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    checks = [line for line in done.stdout.splitlines() if "from the reference" in line]
    assert len(checks) == 8  # catch-ups of 1, 2, 4 and 8 tokens a row; each model's step, spans of 4 and 8
    for line in checks:
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
