"""What a user sees on the terminal: our progress bar with short names, one line on the models,
one results table for `tandem-lit test`, and none of the libraries' noise."""

from __future__ import annotations

import os
import re
import subprocess
import sys

NOISE = ["💡", "LeafSpec", "No seed found", "Creating initial MLflow", "Updating database tables", "v_num",
         "Epoch 0", "not found. Creating it", "Total FLOPs", "Traceback"]
SMALL = ["--data.init_args.batch_size", "2", "--model.init_args.rollout.sampling.n", "2",
         "--model.init_args.rollout.sampling.max_new_tokens", "12", "--data.init_args.test_limit", "4"]


# A warning on stderr, in any of the forms it takes: Python's ("file.py:12: UserWarning: ..."),
# Lightning's ("file.py:12: message"), a logger's ("WARNING ...", "...Warning: ...").
WARNING = re.compile(r"^\S+\.py:\d+: |warn", re.IGNORECASE | re.MULTILINE)


def tandem_lit(repo_root, *args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, in an environment that does not depend on the machine: no
    GPU (Lightning warns about one it does not use), no PYTHONWARNINGS or TANDEM_LIT_* of the
    caller's (which would show or hide warnings the command's own filters decide about)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS" and not k.startswith("TANDEM_LIT_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([sys.executable, "-m", "tandem_lit.cli", *args], cwd=repo_root, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_fit_and_test_print_what_matters_and_no_noise(repo_root, tmp_path):
    root = str(tmp_path / "run")
    fit = tandem_lit(repo_root, "fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", root,
                     "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar",
                     "true", *SMALL)
    test = tandem_lit(repo_root, "test", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", root,
                      "--ckpt_path", f"{root}/checkpoints/last.ckpt", *SMALL)
    for run in (fit, test):
        shown = run.stdout + run.stderr
        assert not [n for n in NOISE if n in shown], [n for n in NOISE if n in shown]
    assert "senior 0.13 M parameters (0.13 M trained, float32); junior 18.7 K (frozen)" in fit.stderr
    for run in (fit, test):  # no warning, ours or a library's, on a plain run
        assert not WARNING.findall(run.stderr), run.stderr
    # one bar for training; validation adds one clean line above it, no bar of its own
    frames = [frame.strip() for frame in fit.stdout.replace("\r", "\n").splitlines() if frame.strip()]
    validations = [frame for frame in frames if frame.startswith("validation after")]
    assert len(validations) == 1 and validations[0].startswith("validation after update 2 ("), frames
    assert "senior acc 0." in validations[0] and "tandem acc 0." in validations[0]
    assert "DataLoader" not in fit.stdout and "\x1b[A" not in fit.stdout
    shown = fit.stdout + fit.stderr  # (Lightning's bars write to stdout)
    assert "update/s" in shown and "senior acc=" in shown and "accura…" not in shown
    assert test.stdout.count("| set | problems |") == 1, test.stdout
    assert "Test metric" not in test.stdout + test.stderr  # Lightning's own per-dataloader tables
