"""What a user sees on the terminal: our progress bar with short names, one line on the models,
one results table for `tandem-lit test`, and none of the libraries' noise."""

from __future__ import annotations

import subprocess
import sys

NOISE = ["💡", "LeafSpec", "No seed found", "Creating initial MLflow", "Updating database tables", "v_num",
         "Epoch 0", "not found. Creating it", "Total FLOPs", "Traceback"]
SMALL = ["--data.init_args.batch_size", "2", "--model.init_args.rollout.sampling.n", "2",
         "--model.init_args.rollout.sampling.max_new_tokens", "12", "--data.init_args.test_limit", "4"]


def tandem_lit(repo_root, *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "tandem_lit.cli", *args], cwd=repo_root, capture_output=True, text=True,
                         timeout=600)
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
    shown = fit.stdout + fit.stderr  # (Lightning's bars write to stdout)
    assert "update/s" in shown and "senior acc=" in shown and "accura…" not in shown
    assert test.stdout.count("| set | problems |") == 1, test.stdout
    assert "Test metric" not in test.stdout + test.stderr  # Lightning's own per-dataloader tables
