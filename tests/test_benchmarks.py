"""The train-step benchmark runs end to end on the CPU with tiny models (its --tiny mode), so the
script the GPU numbers come from cannot rot unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys


def test_train_step_benchmark_tiny(repo_root, tmp_path):
    out = tmp_path / "train_step.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--json", str(out)],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("tandem_over_grpo_step=") and " ideal=" in last and " peak_gb=" in last
    result = json.loads(out.read_text())
    for arm in ("tandem", "grpo"):
        (step,) = result["arms"][arm]["steps"]
        assert step["rollout_seconds"] > 0 and step["update_seconds"] > 0 and step["decode_step_ms"] > 0
        assert step["response_length"] == 8  # EOS ignored: every rollout runs to the cap
    assert result["arms"]["tandem"]["engine"] == "FastEngine"
