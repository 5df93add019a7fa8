"""FastEngine(kv_cache_dtype="fp8"): keys and values cached in 8 bits.

The cache really is 8-bit (its tensors, its bytes per position, the memory plan's pool), the
log-probs the engine records stay close to the exact model's over the tokens it wrote, though not
equal (the rounding is there), the torch path (CPU) and the Triton kernels (CUDA) round alike, and
what it cannot do fails in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.handoff import SoloHandoff
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tandem_lit.rollout.static.blocks import FP8_CACHE, to_cache
from tests.conftest import teacher_forced
from tests.test_fast_engine import DEVICES, PROMPTS, build, prompt_batch
from tests.test_fast_engine import tokenizer as tokenizer  # noqa: F401 (the fixture)

SENIOR_ONLY = SoloHandoff(author="senior")


def fp8_engine(model, tokenizer, kv_cache: str, kernels: str = "auto") -> FastEngine:
    engine = FastEngine(kernels=kernels, rollout_dtype="float32", kv_cache_dtype="fp8", kv_cache=kv_cache,
                        kv_page_size=8)
    engine.setup(model, None, tokenizer)
    return engine


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
@pytest.mark.parametrize("device", DEVICES)
def test_an_8_bit_cache_scores_its_tokens_close_to_the_exact_model_but_not_equal(tokenizer, device, kv_cache):
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0).to(device)
    engine = fp8_engine(senior, tokenizer, kv_cache)
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=48)
    out = engine.generate(prompt_batch(tokenizer, device, PROMPTS * 2), SENIOR_ONLY, sampling)
    assert engine.models["senior"].k_cache[0].dtype == FP8_CACHE and engine.models["senior"].v_cache[0].dtype == FP8_CACHE
    written = out.completion_mask
    gap = (out.senior_logprobs - teacher_forced(senior, out, sampling.temperature)[0])[written].abs()
    assert gap.mean() > 1e-4, "the recorded log-probs are the exact model's: the cache does not round"
    assert gap.mean() < 0.02 and gap.max() < 0.1, f"an 8-bit cache moved the log-probs by {gap.mean():.3f} on average"
    exact = FastEngine(kernels="auto", rollout_dtype="float32", kv_cache=kv_cache, kv_page_size=8)
    exact.setup(senior, None, tokenizer)
    out_exact = exact.generate(prompt_batch(tokenizer, device, PROMPTS * 2), SENIOR_ONLY, sampling)
    exact_gap = (out_exact.senior_logprobs - teacher_forced(senior, out_exact, sampling.temperature)[0])[out_exact.completion_mask]
    assert exact_gap.abs().max() < 1e-4  # the same engine with the model's own dtype: exact


def test_an_8_bit_cache_holds_a_position_in_a_quarter_of_float32s_bytes_and_the_plan_counts_it(tokenizer):
    from conftest import tiny_tandem_module

    from tandem_lit.objectives import GRPO
    from tandem_lit.training.memory import ModelShape
    from tests.test_memory import SpaceVerifier

    senior = build("qwen3", len(tokenizer), 64, 2, seed=0)
    exact = FastEngine(kernels="torch", rollout_dtype="float32")
    exact.setup(senior, None, tokenizer)
    assert fp8_engine(senior, tokenizer, "slots").models["senior"].kv_bytes_per_token() * 4 == \
        exact.models["senior"].kv_bytes_per_token()
    module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), sampling=SamplingConfig(n=4, max_new_tokens=100),
                                max_prompt_tokens=28, rollout_batch_size=8)
    module.configure_model()
    shapes = ModelShape.of(module.senior), ModelShape.of(module.junior)
    module.engine = FastEngine(kv_cache="paged", kv_cache_tokens=5000, kv_cache_dtype="fp8")
    estimate = module.memory_estimate(prompts_per_step=4)
    assert estimate.rollout["KV caches"] == 5000 * sum(shape.kv_bytes_per_token(1) for shape in shapes)
    module.engine = FastEngine(kv_cache="paged", kv_cache_gib=0.01, kv_cache_dtype="fp8")  # a GiB holds 4x the positions
    per_token = sum(shape.kv_bytes_per_token(1) for shape in shapes)
    assert module.memory_estimate(prompts_per_step=4).rollout["KV caches"] == int(0.01 * 1024**3) // per_token * per_token


def test_entries_past_the_8_bit_range_are_clamped_not_made_nan():
    cache = torch.zeros(3, dtype=FP8_CACHE)
    stored = to_cache(torch.tensor([1000.0, -1000.0, 0.3]), cache).float()
    assert stored.tolist()[:2] == [448.0, -448.0] and abs(stored[2].item() - 0.3) < 0.02
    same = torch.zeros(2, dtype=torch.bfloat16)
    assert to_cache(torch.tensor([1000.0, 0.3]), same).dtype == torch.bfloat16  # a model-dtype cache: no clamp
    assert to_cache(torch.tensor([1000.0]), same).item() == 1000.0


def test_a_bad_cache_dtype_and_a_hybrid_model_fail_in_one_line(tokenizer):
    from tests.test_hybrid_engine import hybrid

    with pytest.raises(ConfigError, match="kv_cache_dtype must be 'auto' or 'fp8', got 'int4'"):
        FastEngine(kv_cache_dtype="int4")
    engine = FastEngine(kernels="torch", rollout_dtype="float32", kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="caches plain attention layers only; the senior is qwen3_5"):
        engine.setup(hybrid(len(tokenizer), seed=0), None, tokenizer)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_the_triton_kernels_round_the_cache_as_the_torch_path_does(tokenizer, kv_cache):
    """Greedy rollouts of a bf16 model through an 8-bit cache: the Triton decode step and the
    torch one write the same tokens, with log-probs within bf16 kernel noise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0).to("cuda", torch.bfloat16)
    runs = []
    for kernels in ("triton", "torch"):
        engine = FastEngine(kernels=kernels, rollout_dtype="bfloat16", kv_cache_dtype="fp8", kv_cache=kv_cache, kv_page_size=8)
        engine.setup(senior, None, tokenizer)
        runs.append(engine.generate(prompt_batch(tokenizer, "cuda", PROMPTS * 2), SENIOR_ONLY,
                                    SamplingConfig(temperature=0.0, max_new_tokens=32)))
    triton, plain = runs
    assert torch.equal(triton.completion_ids, plain.completion_ids)
    written = triton.completion_mask
    torch.testing.assert_close(triton.senior_logprobs[written], plain.senior_logprobs[written], atol=2e-2, rtol=0)


FP8_ENGINE = ('{"class_path": "FastEngine", "init_args": {"kernels": "torch", "rollout_dtype": "float32", '
              '"kv_cache_dtype": "fp8"}}')


@pytest.mark.usefixtures("in_repo")
@pytest.mark.filterwarnings("ignore:No seed found")
def test_tandem_lit_fit_trains_with_an_8_bit_cache_and_logs_its_gap(tmp_path):
    """``engine: {class_path: FastEngine, init_args: {kv_cache_dtype: fp8}}`` through the CLI, with
    the objective's ``tis_cap`` it requires: the step trains, and the engine-vs-trainer gap it logs
    is the rounding's (above 0, still small)."""
    from tandem_lit.cli import main
    from tests.test_cli import NO_EVAL, QUIET, SMALL

    root = tmp_path / "run"
    main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(root), *QUIET, *NO_EVAL,
               *SMALL, "--trainer.max_steps", "1", "--model.init_args.rollout.batch_size", "4",
               "--model.init_args.objective.init_args.tis_cap", "2.0", "--model.init_args.engine", FP8_ENGINE])
    rows = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    (step,) = [row for row in rows if "train/loss" in row]
    assert 0 < step["train/rollout_logp_gap_mean"] < 0.05 and step["train/mismatch_kl"] > 0


@pytest.mark.usefixtures("in_repo")
def test_fit_with_an_8_bit_cache_and_no_correction_is_refused_in_one_line(tmp_path, capsys):
    """The rounded cache widens the engine-vs-trainer gap (about twelvefold on the H100): training
    without the objective's ``tis_cap`` stops before the first step, as keep_caches: both does."""
    from tandem_lit.cli import main
    from tests.test_cli import NO_EVAL, QUIET, SMALL
    from tests.test_reliability import assert_one_error_line

    with pytest.raises(SystemExit) as stopped:
        main(args=["fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
                   *QUIET, *NO_EVAL, *SMALL, "--trainer.max_steps", "1", "--model.init_args.engine", FP8_ENGINE])
    assert stopped.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "engine.kv_cache_dtype: fp8 draws the senior's tokens from keys and "
                                                   "values rounded to 8 bits")
    assert not (tmp_path / "run" / "history.jsonl").exists()  # no step ran


def test_the_triton_kernel_writes_reads_and_widens_an_8_bit_cache_under_the_interpreter(repo_root):
    """The decode attention kernel over 8-bit slot and paged caches, run by Triton's CPU interpreter
    (tests/interpret_fp8_attention.py): the new token stored where and as torch stores it, the
    output that of attention written out in torch. A GPU compiles the same kernel
    (test_the_triton_kernels_round_the_cache_as_the_torch_path_does)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "tests/interpret_fp8_attention.py"], cwd=repo_root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo_root)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split("largest error")[1].splitlines()[0]) < 1e-5
    # q in float16 (the reference's q too) and the softmax weights rounded to float16 (not in the reference)
    assert float(run.stdout.split("float16 products: largest error")[1]) < 2e-3


def test_the_train_step_benchmark_runs_each_arm_again_with_the_8_bit_cache(repo_root):
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--arms", "grpo", "--max-new-tokens", "16",
         "--warmup-steps", "1", "--steps", "1", "--compare-fp8"],
        cwd=repo_root, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "grpo+fp8 step 1:" in run.stdout
    ratio = next(line for line in run.stdout.splitlines() if line.startswith("grpo_fp8_over_auto_rollout="))
    kl = ratio.split("mismatch_kl ")[1].split(" -> ")
    assert float(kl[0]) == 0 and float(kl[1]) > 0  # float32 rollouts on the CPU: exact, then the rounding's


def test_the_triton_step_takes_float16_products_over_an_8_bit_cache_of_a_16_bit_model_only(tokenizer):
    """Widened to bf16 the 8-bit cache made the kernel slower than a bf16 cache (docs/performance.md):
    a 16-bit model's Triton step widens it to float16; a float32 model keeps float32 products, and
    a cache of the model's own dtype is read as it is."""
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0)
    for dtype, kv_cache_dtype, expected in ((torch.bfloat16, "fp8", True), (torch.float16, "fp8", True),
                                            (torch.float32, "fp8", False), (torch.bfloat16, "auto", False)):
        engine = FastEngine(kernels="torch", rollout_dtype="auto", kv_cache_dtype=kv_cache_dtype)  # (auto: the model's dtype here)
        engine.setup(senior.to(dtype), None, tokenizer)
        assert engine.models["senior"].f16_products is expected, (dtype, kv_cache_dtype)
