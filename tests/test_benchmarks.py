"""The train-step benchmark runs end to end on the CPU with tiny models (its --tiny mode), so the
script the GPU numbers come from cannot rot unnoticed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest


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
    assert result["device"] == "cpu"  # the machine, not the last arm's name
    for arm in ("tandem", "grpo"):
        (step,) = result["arms"][arm]["steps"]
        assert step["rollout_seconds"] > 0 and step["update_seconds"] > 0 and step["decode_step_ms"] > 0
        assert step["response_length"] == 8  # EOS ignored: every rollout runs to the cap
        assert step["update_tflops"] > 0 and step["update_mfu"] > 0 and step["update_trained_tokens"] > 0
    assert "MFU of 790 TFLOP/s" in run.stdout
    assert result["arms"]["tandem"]["engine"] == "FastEngine"


def test_train_step_benchmark_with_lognormal_lengths_trains_on_each_rollouts_own_budget(repo_root, tmp_path):
    """--lengths: each rollout's length is a draw keyed by its seed, so responses are shorter than
    the cap on average and differ between rollouts, as real ones do (here decoded into a paged KV
    cache, trained in passes filled to the token bound)."""
    out = tmp_path / "train_step.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--arms", "grpo", "--max-new-tokens", "16",
         "--lengths", "lognormal:median=6,sigma=0.8,cap=16", "--json", str(out), "--dump-logprobs", str(tmp_path / "gap"),
         "--kv-cache", "paged", "--fill-passes", "--micro-batch-tokens", "512", "--profile-update", str(tmp_path / "prof")],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "grpo warm-up step 1: " in run.stdout and "logp gap mean 0.0000" in run.stdout
    # --profile-update: one more step, profiled and not reported; its tables name the update's ops
    assert "grpo profiled step: " in run.stdout
    profile = (tmp_path / "prof.grpo.txt").read_text()
    assert profile.startswith("update wall ") and "aten::" in profile
    arm = json.loads(out.read_text())["arms"]["grpo"]
    assert arm["kv_cache"] == "paged"  # --kv-cache reached FastEngine (the gap below: paged decoding is exact)
    (step,) = arm["steps"]
    assert 1 <= step["response_length"] < 12  # a median-6 draw capped at 16, not the fixed 16
    assert step["decode_steps"] >= step["response_length"] and 0 < step["kv_pool_peak_fraction"] <= 1  # the paged engine's own report
    assert " preempted, " in run.stdout and step["decode_seconds"] > 0
    # the dumped passes take the step's gap apart offline: float32 on the CPU, engine == forward
    report = subprocess.run([sys.executable, "benchmarks/gap_report.py", str(tmp_path / "gap.grpo.pt")],
                            cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    lines = report.stdout.splitlines()
    assert "gap mean 0.0000" in lines[0] and lines[1].startswith("engine - train: mean ")
    assert abs(float(lines[1].split()[4].rstrip(","))) < 1e-4
    passes = lines[2].split(": ", 1)[1].split("  ")  # the warm-up steps' passes and the measured one's
    assert lines[2].startswith("by update pass") and len(passes) >= 2 and all(p.split()[1] == "0.000" for p in passes)
    assert lines[3].startswith("by position in the completion: 0-128: 0.000")
    shifted = [float(line.split()[-1]) for line in lines if line.startswith("engine[t] vs train[t")]
    assert len(shifted) == 2 and min(shifted) > 0.01  # misaligned by a token, the two sides part
    assert not any(line.startswith("hint:") for line in lines)


def test_gap_report_points_at_positions_when_the_gap_grows_with_them(repo_root, tmp_path):
    """A dump whose gap grows along the rows (as a bf16 rotary table made it) gets the hint; the
    lognormal test above, with no gap, gets none."""
    import torch

    rows, width = 2, 1500
    engine = -10 + torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    drift = torch.linspace(0, 1.5, width).expand(rows, width)  # 0 at the first position, 1.5 nats at the last
    dump = {"arm": "grpo-vllm", "passes": [{
        "prompt_ids": torch.ones(rows, 8, dtype=torch.long), "prompt_mask": torch.ones(rows, 8, dtype=torch.long),
        "completion_ids": torch.ones(rows, width, dtype=torch.long), "author": torch.full((rows, width), 2, dtype=torch.int8),
        "engine_logprobs": engine, "train_logprobs": engine - drift, "temperature": None}]}
    torch.save(dump, tmp_path / "gap.pt")
    report = subprocess.run([sys.executable, "benchmarks/gap_report.py", str(tmp_path / "gap.pt")],
                            cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    assert report.stdout.splitlines()[-1].startswith("hint: the gap grows with the absolute position")


def test_train_step_benchmark_vllm_arm_without_vllm_is_one_line(repo_root):
    """--engine vllm (the GRPO arm decoded by VLLMEngine) where vLLM is not installed (CI): the
    script stops before building anything, with the line naming the extra."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--engine", "vllm"],
        cwd=repo_root, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("install it with: pip install 'tandem-lit[vllm]'")
    assert "Traceback" not in run.stderr


def test_activation_bytes_counts_what_each_layer_type_saves(repo_root, monkeypatch):
    """The calibration script behind the memory estimate's activation weights (dev/benchmarks/activation_bytes.py), on tiny Qwen3.5
    shapes: both layer types are measured, and what a layer saves grows with the tokens."""
    from transformers import Qwen3_5TextConfig

    monkeypatch.syspath_prepend(str(repo_root / "dev" / "benchmarks"))
    from activation_bytes import measure

    config = Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=256)
    short, long = measure("tiny", config, 128, 0), measure("tiny", config, 512, 0)
    assert set(short) == {"estimate", "linear_attention", "full_attention"}
    for kind in ("linear_attention", "full_attention"):
        assert short[kind] > 0
        # per token, a layer's saved tensors stay about the same as the sequence grows (no T^2 term saved)
        assert 0.5 < long[kind] / short[kind] < 1.5
    assert long["estimate"] == short["estimate"] > 0


def test_logp_gap_benchmark_tiny(repo_root, tmp_path):
    """dev/benchmarks/logp_gap.py on a tiny Qwen3.5 on the CPU: every score is made, the
    engine's teacher-forced decode step reproduces its own log-probs, and the training forward is
    closer to the engine than it was before the two sides rounded alike."""
    out = tmp_path / "gap.json"
    subprocess.run(
        [sys.executable, "dev/benchmarks/logp_gap.py", "--shape", "tiny-qwen35", "--rows", "2", "--tokens", "96",
         "--threads", "1", "--json", str(out)],
        cwd=repo_root, check=True, timeout=300,
    )
    gaps = json.loads(out.read_text())["gaps"]
    assert set(gaps) == {"engine", "engine-tf", "train", "fp32", "hf-bf16", "train[embeddings fp32]",
                         "train[delta rule autocast]", "train[both]"}
    assert gaps["engine-tf"]["engine"][1] < 1e-5
    assert 0 < gaps["train"]["engine"][0] < gaps["train[both]"]["engine"][0]


def tiny_lognormal_rollouts(repo_root, queue: int, *extra: str) -> subprocess.CompletedProcess:
    """benchmarks/rollout.py on the tiny models, batches of 2, lognormal budgets; it must succeed."""
    run = subprocess.run(
        [sys.executable, "benchmarks/rollout.py", "--device", "cpu", "--tiny", "--batches", "2", "--queue", str(queue),
         "--repeats", "1", "--lengths", "lognormal:median=4,sigma=0.8,cap=8", *extra],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def last_line_ratios(run: subprocess.CompletedProcess) -> dict[str, str]:
    return dict(part.split("=") for part in run.stdout.strip().splitlines()[-1].split())


def test_rollout_benchmark_long_tailed_lengths_tiny(repo_root):
    """Static vs continuous batching on lognormal budgets: both rows run every sequence to exactly
    its budget (the script asserts it) and the ratio line is printed."""
    run = tiny_lognormal_rollouts(repo_root, 2)
    last = run.stdout.strip().splitlines()[-1]
    assert last.startswith("continuous_over_static=") and " continuous_over_static_solo=" in last
    assert float(last.split()[0].split("=")[1]) > 0
    assert "FastEngine continuous, tandem" in run.stdout and "FastEngine static, tandem" in run.stdout
    assert "eager refill" not in run.stdout  # --refill: amortized (FastEngine's default) unless asked


def test_rollout_benchmark_times_both_refill_rules_in_one_run(repo_root):
    run = tiny_lognormal_rollouts(repo_root, 3, "--refill", "amortized", "eager", "--skip-static")
    assert "FastEngine continuous eager refill, solo" in run.stdout and "FastEngine continuous, solo" in run.stdout
    ratios = last_line_ratios(run)
    assert set(ratios) == {"amortized_over_eager_refill_b2", "amortized_over_eager_refill_solo_b2"}
    assert all(float(v) > 0 for v in ratios.values())


def test_rollout_benchmark_times_both_kv_cache_dtypes_in_one_run(repo_root):
    run = tiny_lognormal_rollouts(repo_root, 3, "--kv-cache", "paged", "--kv-cache-dtype", "auto", "fp8", "--skip-static")
    assert "FastEngine continuous paged fp8 KV, tandem" in run.stdout and "FastEngine continuous paged, tandem" in run.stdout
    ratios = last_line_ratios(run)
    assert set(ratios) == {"fp8_over_auto_kv_b2", "fp8_over_auto_kv_solo_b2"}
    assert all(float(v) > 0 for v in ratios.values())


def test_update_flops_by_hand():
    """``update_flops`` on numbers small enough to add up by hand: N = 10 body parameters, a
    head of V H = 6, attention width A = 2; sequences of (prompt, completion) = (3, 2) and (1, 4)."""
    from benchmarks.train_step import update_flops

    # forward: 2 N L + 2 V H c + 2 A L^2 = row 0: 100 + 24 + 100 = 224; row 1: 100 + 48 + 100 = 248
    # trained, all weights: 3 x (124 + 148) matmul FLOPs + 3 x (100 + 100) attention = 816 + 600
    assert update_flops(10, 6, 2, 1.0, [3, 1], [2, 4], []) == 1416
    # frozen weights (LoRA): no weight gradients, 2 x 272 + 600; plus an old-log-prob forward of row 1
    assert update_flops(10, 6, 2, 0.0, [3, 1], [2, 4], [1]) == 544 + 600 + 248


def test_a_4bit_weight_counts_as_the_matrix_it_stands_for():
    """bitsandbytes packs two 4-bit weights a byte (a [n m / 2, 1] uint8 tensor) and keeps the matrix's
    shape in the parameter's ``quant_state``: the FLOP count takes that shape (the QLoRA MFU of
    2026-12-05 was counted from the packed size, half the decoder)."""
    import types

    import torch

    from benchmarks.train_step import logical_numel

    packed = torch.nn.Parameter(torch.zeros(48, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = types.SimpleNamespace(shape=torch.Size([8, 12]))
    assert logical_numel(packed) == 96
    assert logical_numel(torch.nn.Parameter(torch.zeros(8, 12))) == 96


def test_train_step_estimate_only_sizes_a_paged_pool_as_an_h200_would(repo_root, tmp_path):
    """--estimate-only with --kv-cache paged: the pool gets what an H200 has free beside the rest of
    the rollout phase (as fit start sizes it), or --kv-cache-gib; shapes only, no weights."""
    from tandem_lit.models.tiny import char_tokenizer

    tokenizer = tmp_path / "tokenizer"  # the estimate reads shapes, not texts: any tokenizer folder does
    char_tokenizer().save_pretrained(tokenizer)

    def estimate(*extra: str) -> list[str]:
        run = subprocess.run(
            [sys.executable, "benchmarks/train_step.py", "--config", "configs/rlvr/qwen3_4b_tandem.yaml", "--estimate-only",
             "--tokenizer", str(tokenizer), "--kv-cache", "paged", "--rollout-batch-size", "128", *extra],
            cwd=repo_root, capture_output=True, text=True, timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout.splitlines()

    free = estimate()
    assert any(line.startswith("on an H200: paged KV pool: ") and "(what fits the GPU)" in line for line in free)
    assert "fits_h200=True" in free[-1]  # 128 rows of prompt + cap would need ~141 GiB of KV alone
    given = estimate("--kv-cache-gib", "64")
    assert any("64.0 GiB (engine.kv_cache_tokens / kv_cache_gib)" in line for line in given)


def test_delta_rule_cost_times_each_solve_and_the_scan_apart(repo_root):
    """dev/benchmarks/delta_rule_cost.py on the CPU: the rules (transformers' under autocast and in
    float32, ours, ours solving through inverses), the inverse's distance from ours, and the
    first phase / scan split the GPU run decides the default solve from."""
    pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    run = subprocess.run([sys.executable, "dev/benchmarks/delta_rule_cost.py", "--device", "cpu", "--tokens", "128"],
                         cwd=repo_root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    inverse = next(line for line in lines if line.startswith("inverse_over_ours "))
    assert float(inverse.split("output_relative_error=")[1]) < 1e-5
    split = dict(part.split("=") for part in lines[-1].split())
    assert set(split) == {"first_phase_triangular_ms", "first_phase_inverse_ms", "scan_torch_ms"}
    assert all(float(v) > 0 for v in split.values())


def test_train_step_switch_scoring_unrestricted_shows_the_mismatch_the_as_drawn_scoring_removes(repo_root, tmp_path):
    """--switch-scoring unrestricted trains as before switch tokens were scored as drawn (issue 51,
    item 1): against the engine's as-drawn log-probs, mismatch_kl is then the error that fix took
    out. Both scorings given: the arm runs twice in one process, as drawn and unrestricted. Float32
    on the CPU, so the as-drawn arm's mismatch is exactly 0."""
    out = tmp_path / "scorings.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--arms", "tandem", "--steps", "3",
         "--max-new-tokens", "24", "--switch-scoring", "as-drawn", "unrestricted", "--json", str(out)],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]
    assert set(arms) == {"tandem", "tandem+unrestricted"}
    kl = {arm: [step["mismatch_kl"] for step in result["steps"]] for arm, result in arms.items()}
    assert all(0 < step["mismatch_ess"] <= 1 for result in arms.values() for step in result["steps"])
    assert kl["tandem"] == [0.0, 0.0, 0.0]
    assert max(kl["tandem+unrestricted"]) > 0.01, kl  # (a step whose rollouts drew no restricted switch has none)
    line = next(line for line in run.stdout.splitlines() if line.startswith("tandem_mismatch_kl "))
    values = dict(part.split("=") for part in line.split()[1:3])
    assert float(values["as_drawn"]) == 0 and float(values["unrestricted"]) == pytest.approx(
        sum(kl["tandem+unrestricted"]) / 3, rel=1e-2)


def test_train_step_compares_the_attention_order_in_one_run(repo_root, tmp_path):
    """--compare-attention-order runs each arm again with FastEngine's decode attention in row
    order (attention_order: rows) and prints the ratios; on the CPU's torch path the order changes
    nothing, so the two arms write the same tokens."""
    out = tmp_path / "order.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--arms", "tandem", "--steps", "1",
         "--max-new-tokens", "8", "--compare-attention-order", "--json", str(out)],
        cwd=repo_root, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]
    assert {arm: result["attention_order"] for arm, result in arms.items()} == {
        "tandem": "longest_first", "tandem+rows-order": "rows"}
    line = next(line for line in run.stdout.splitlines() if line.startswith("tandem_rows_over_longest_first_decode_step="))
    assert float(line.split("rollout=")[1]) > 0


def test_attention_kernel_checks_each_variant_and_split_under_the_interpreter(repo_root):
    """benchmarks/attention_kernel.py's CPU check (Triton's interpreter): rows at the lognormal mix,
    every cache variant and split size run, and a split row's output is the unsplit one's."""
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "benchmarks/attention_kernel.py", "--device", "cpu", "--batch", "3", "--used", "40",
                          "--lengths", "lognormal", "--split-positions", "64", "128"],
                         cwd=repo_root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root)})
    assert run.returncode == 0, run.stderr[-3000:]
    splits = [line for line in run.stdout.splitlines() if "from unsplit" in line]
    assert len(splits) == 6  # 3 variants x 2 sizes
    for line in splits:  # float16 softmax weights round against each chunk's own maximum: a little apart
        assert float(line.rsplit(" ", 1)[1]) < (1e-3 if "f16dot" in line else 1e-5), line
    assert "lognormal positions: mean" in run.stdout and "fp8+f16dot output vs bf16's" in run.stdout
    reordered = [line for line in run.stdout.splitlines() if "from row order" in line]
    assert len(reordered) == 3 and all(float(line.rsplit(" ", 1)[1]) == 0 for line in reordered)  # a permutation of programs


def test_handoff_spans_counts_switches_on_real_text(repo_root):
    """dev/benchmarks/handoff_spans.py (the span S that decoding only the author is planned on)
    over a few solutions: a word handoff at p = 0.5 switches at about half its draws, and a sentence
    handoff draws far less often than a word handoff."""
    shared = repo_root.parent / "shared"
    if not (shared / "models/qwen3-tokenizer/tokenizer.json").is_file() or not (shared / "data/deepscaler").is_dir():
        pytest.skip("needs ../shared's Qwen3 tokenizer and DeepScaleR data")
    run = subprocess.run([sys.executable, "dev/benchmarks/handoff_spans.py", "--rows", "4", "--tokens", "60",
                          "--policies", "word", "sentence"], cwd=repo_root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo_root)})
    assert run.returncode == 0, run.stderr[-3000:]
    found = {line.split()[0]: [float(x) for x in re.findall(r"([\d.]+) (?:tokens a switch|a draw)", line)]
             for line in run.stdout.splitlines() if "tokens a switch" in line}
    (word_switch, word_draw), (_, sentence_draw) = found["word"], found["sentence"]
    assert 1.0 <= word_draw < word_switch and word_draw < sentence_draw
