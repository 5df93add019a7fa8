"""Paused sequences' caches kept in host memory over an update (``rollout.partial.keep_caches``).

FastEngine with a paged pool copies the pages of the paused sequences of the named models to host
memory when a ``StopRule`` ends a call (``StopRule.keep_caches``), and copies them back into the
pages a resumed sequence is admitted with, instead of prefilling that model again. The junior is
frozen, so its kept cache is the one a prefill would rebuild; a kept senior cache holds the keys of
the weights that wrote it."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import WordHandoff
from tandem_lit.rollout.record import StopRule
from tandem_lit.rollout.static import FastEngine
from tests.test_continuous_batching import JUNIOR_PROMPTS, queue_batch
from tests.test_partial_rollouts import SAMPLED, resumed, same_rollout_rows

pytestmark = pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode")
POLICY = WordHandoff(p=0.5)


@pytest.fixture(scope="module")
def tokenizer():
    from tandem_lit.models.tiny import char_tokenizer

    return char_tokenizer()


def pair(tokenizer):
    from tests.test_fast_engine import build

    return build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)


def paged_engine(senior, junior, tokenizer, pool_tokens: int = 240):
    # refills as rows free up, not when the timed rule says: where a call pauses, and so what the
    # runs compared here resume under moved weights, depends on the seeds only
    engine = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2, kv_cache="paged", kv_page_size=4,
                        kv_cache_tokens=pool_tokens, refill="eager")
    engine.setup(senior, junior, tokenizer, max_batch=3)
    return engine


def pause_then_resume(engine, prompts, keep: tuple[str, ...], between=None):
    """The first call ends at the first whole pair of rows, the paused rows resume in a second call
    (``between``: run after the first, as a training update would). Returns (paused rows, the
    first call's rollout, the second's, the second's timing, and the caches the first kept by row:
    the resume takes them from the paused sequences)."""
    stop = StopRule(group=[i // 2 for i in range(prompts.batch_size)], groups=1, keep_caches=keep)
    first = engine.generate(prompts, POLICY, SAMPLED, stop)
    paused = [i for i, p in enumerate(first.paused or []) if p is not None]
    assert paused and any(first.paused[i].written > 0 for i in paused)
    assert (engine.last_timing().keep_s > 0) == bool(keep)
    kept = {i: first.paused[i].caches for i in paused if first.paused[i].caches}
    engine.release()  # the update takes the pool's memory: kept pages must survive it
    if between is not None:
        between()
    again = engine.generate(resumed(prompts.select(paused), [first.paused[i] for i in paused]), POLICY, SAMPLED)
    return paused, first, again, engine.last_timing(), kept


@pytest.mark.parametrize("keep", [("junior",), ("senior", "junior")], ids=["junior", "both"])
def test_a_resumed_sequence_with_kept_caches_writes_what_an_uninterrupted_one_does(tokenizer, keep):
    senior, junior = pair(tokenizer)
    engine = paged_engine(senior, junior, tokenizer)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    want = engine.generate(prompts, POLICY, SAMPLED)
    # those in a slot at the stop keep their caches; one preempted before has no pages to keep
    paused, first, again, timing, kept = pause_then_resume(engine, prompts, keep)
    first_paused = [replace(first.paused[i], caches=kept[i]) for i in paused if i in kept]
    assert first_paused and all(set(p.caches) == set(keep) for p in first_paused)
    for p in first_paused:
        cache = p.caches["junior"]
        assert cache.positions > p.written and not cache.keys[0].is_cuda
        assert cache.keys[0].shape[0] == -(-cache.positions // 4)  # the pages holding its positions, no more
    for j, i in enumerate(paused):
        same_rollout_rows(again, j, want, i)
    assert all(first.paused[i].caches is None for i in paused), "restored caches are taken, so their host memory goes"
    preempted = sum(first.paused[i].written for i in paused if i not in kept)
    assert timing.restored_positions == sum(p.caches["junior"].positions for p in first_paused)
    if keep == ("senior", "junior"):
        assert timing.resumed_tokens == preempted, "nothing was prefilled again but what had no cache"
    else:
        assert timing.resumed_tokens == preempted + sum(p.written for p in first_paused), "the senior prefilled them"


def test_the_junior_kept_is_what_its_prefill_would_rebuild_after_the_senior_changed(tokenizer):
    """After an update of the senior, keeping the junior's cache resumes exactly as prefilling both
    models again; keeping the senior's too differs (its keys are the old weights')."""
    senior, junior = pair(tokenizer)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    runs = {}
    for keep in ((), ("junior",), ("senior", "junior")):
        moved = copy.deepcopy(senior)
        engine = paged_engine(moved, junior, tokenizer)

        def update(model=moved):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))

        runs[keep] = pause_then_resume(engine, prompts, keep, between=update)
    paused, _, prefilled, _, _ = runs[()]
    assert all(run[0] == paused for run in runs.values()), "each run paused the same rows"
    _, _, junior_kept, timing, _ = runs[("junior",)]
    assert timing.restored_positions > 0
    for j in range(len(paused)):
        same_rollout_rows(junior_kept, j, prefilled, j)
    both = runs[("senior", "junior")][2]
    resumed_rows = [j for j in range(len(paused)) if runs[()][1].paused[paused[j]].written > 0]
    gaps = [float((both.senior_logprobs[j] - prefilled.senior_logprobs[j]).abs().max()) for j in resumed_rows]
    assert max(gaps) > 1e-3, "a kept senior cache holds the old weights' keys: its log-probs differ from a prefill's"


def test_kept_caches_survive_a_pool_too_small_to_readmit_them_all(tokenizer):
    """Resumed sequences wait for pages like new ones, and one preempted after its pages came back
    prefills again: the result is the uninterrupted one either way."""
    senior, junior = pair(tokenizer)
    engine = paged_engine(senior, junior, tokenizer)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    want = engine.generate(prompts, POLICY, SAMPLED)

    def smaller_pool():
        engine.kv_cache_tokens = 60

    paused, _, again, timing, _ = pause_then_resume(engine, prompts, ("junior",), between=smaller_pool)
    for j, i in enumerate(paused):
        same_rollout_rows(again, j, want, i)
    assert timing.restored_positions > 0 and timing.preemptions > 0


def test_engines_and_pools_that_cannot_keep_caches_refuse_in_one_line(tokenizer):
    senior, junior = pair(tokenizer)
    prompts = queue_batch(tokenizer)
    stop = StopRule(group=[i // 2 for i in range(prompts.batch_size)], groups=1, keep_caches=("junior",))
    slots = FastEngine(kernels="torch", rollout_dtype="float32")
    hf = HFEngine(rollout_dtype="float32")
    for engine, message in ((slots, "paged pool only"), (hf, "HFEngine prefills a resumed sequence again")):
        engine.setup(senior, junior, tokenizer, max_batch=3)
        with pytest.raises(ConfigError, match=message):
            engine.generate(prompts, POLICY, SAMPLED, stop)


def test_tandem_lit_fit_keeps_the_juniors_cache_over_the_update(tmp_path):
    """The demo with partial rollouts (configs/demo_partial.yaml), ``keep_caches: junior`` on a paged
    pool, through the CLI: carried sequences resume with their junior pages copied back and only
    the senior prefilled again, and the run says so in its history."""
    from tandem_lit.cli import main
    from tests.test_cli import NO_EVAL, QUIET

    root = tmp_path / "run"
    main(args=["fit", "--config", "configs/demo_partial.yaml", "--trainer.default_root_dir", str(root), *QUIET, *NO_EVAL,
               "--trainer.max_steps", "3", "--model.init_args.logging.completions_every_n_steps", "0",
               "--model.init_args.rollout.partial.keep_caches", "junior",
               "--model.init_args.engine", '{"class_path": "FastEngine", "init_args": {"kv_cache": "paged"}}'])
    rows = [json.loads(line) for line in (root / "history.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert len(steps) == 3
    resumed = [row for row in steps if row["train/partial_resumed_sequences"] > 0]
    assert resumed, "a carried sequence resumed"
    assert all(row["train/rollout_restored_positions"] > 0 for row in resumed)
    assert all(row["train/rollout_kept_positions"] > 0 for row in steps if row["train/partial_paused_sequences"] > 0)


def test_bad_keep_caches_settings_fail_in_one_line():
    from tandem_lit.objectives import GRPO
    from tandem_lit.training.partial import use_correction
    from tandem_lit.training.settings import PartialRollouts
    from tests.test_partial_rollouts import ROWS_A, tiny_module

    with pytest.raises(ConfigError, match="keep_caches must be"):
        PartialRollouts(4, keep_caches="all")
    with pytest.raises(ConfigError, match="set objective.init_args.tis_cap"):
        use_correction(PartialRollouts(4, keep_caches="both"), GRPO())
    use_correction(PartialRollouts(4, keep_caches="both"), GRPO(tis_cap=2.0))
    module = tiny_module(HFEngine(rollout_dtype="float32"), PartialRollouts(in_flight_prompts=6, keep_caches="junior"))
    with pytest.raises(ConfigError, match="keep_caches: junior: HFEngine prefills"):
        module.rollouts.training_rollouts(ROWS_A, POLICY, key=7)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kept_caches_on_cuda_graphs_and_triton_kernels(tokenizer, kv_cache_dtype):
    """The GPU path: pinned host copies made without waiting, copied back into other pages of a
    re-allocated pool behind the captured decode (float32, or 8-bit pages; a rare near-tie may break
    the other way, so rows are compared whole and all but one must match)."""
    from tests.test_continuous_batching import cuda_pair

    senior, junior = cuda_pair(len(tokenizer), "plain")
    engine = FastEngine(rollout_dtype="float32", check_every=2, kv_cache="paged", kv_page_size=4, kv_cache_tokens=240,
                        kv_cache_dtype=kv_cache_dtype)
    engine.setup(senior, junior, tokenizer, max_batch=3)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS).to("cuda")
    want = engine.generate(prompts, POLICY, SAMPLED)
    paused, first, again, timing, kept = pause_then_resume(engine, prompts, ("senior", "junior"))
    assert kept and all(c["senior"].keys[0].is_pinned() for c in kept.values())
    assert timing.restored_positions > 0
    same = [j for j, i in enumerate(paused) if int(again.lengths[j]) == int(want.lengths[i])
            and torch.equal(again.completion_ids[j, : int(want.lengths[i])], want.completion_ids[i, : int(want.lengths[i])])]
    assert len(same) >= len(paused) - 1, f"only {same} of {paused} match"


def test_the_train_step_benchmark_runs_one_partial_arm_per_keep_caches_value(repo_root):
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--arms", "tandem", "--max-new-tokens", "24",
         "--lengths", "lognormal:median=8,sigma=0.8,cap=24", "--kv-cache", "paged", "--partial", "3", "--partial-only",
         "--keep-caches", "none", "junior", "--warmup-steps", "1", "--steps", "2"],
        cwd=repo_root, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ratio = next(line for line in run.stdout.splitlines() if line.startswith("tandem_partial_keep-junior_over_partial_rollout="))
    assert float(ratio.split("=")[1].split()[0]) > 0
    assert "tandem+partial+keep-junior step" in run.stdout and "positions' caches copied back" in run.stdout


def test_host_memory_running_out_while_keeping_caches_is_one_line(tokenizer, monkeypatch):
    """A pinned allocation that fails (cudaHostAlloc's out of memory, injected here) ends the call
    with the setting to change, not a traceback from deep in the copy."""
    from tandem_lit.errors import DeviceMemoryError
    from tandem_lit.rollout.static import plain

    def no_host_memory(pool, pages):
        raise RuntimeError("CUDA error: out of memory")

    senior, junior = pair(tokenizer)
    engine = paged_engine(senior, junior, tokenizer)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    monkeypatch.setattr(plain, "pages_to_host", no_host_memory)
    stop = StopRule(group=[i // 2 for i in range(prompts.batch_size)], groups=1, keep_caches=("junior",))
    with pytest.raises(DeviceMemoryError, match="host memory ran out keeping the paused sequences' junior caches .* "
                                                "set rollout.partial.keep_caches: junior"):
        engine.generate(prompts, POLICY, SAMPLED, stop)
