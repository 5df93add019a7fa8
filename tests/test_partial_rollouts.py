"""Partial rollouts (``rollout.partial``): a rollout phase ends once a step's groups are complete,
pauses the sequences still running, and resumes them first in the next phase.

The engines' side: a sequence paused at a ``StopRule`` and resumed (``PromptBatch.resume``) with
unchanged weights writes exactly the tokens, authors and log-probs of an uninterrupted run with the
same seed (HFEngine, FastEngine's torch path with slot caches and with a paged pool)."""

from __future__ import annotations

import pytest
import torch

from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.record import PromptBatch, StopRule
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tests.test_continuous_batching import JUNIOR_PROMPTS, queue_batch
from tests.test_fast_engine import build

SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3)
pytestmark = pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode")  # the frozen junior, on purpose


@pytest.fixture(scope="module")
def tokenizer():
    from tandem_lit.models.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def plain_pair(tokenizer):
    return build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)


def make_engine(kind: str, senior, junior, tokenizer):
    if kind == "hf":
        engine, batch = HFEngine(rollout_dtype="float32", check_every=2), None
    elif kind == "fast":
        engine, batch = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2), 3
    else:
        engine, batch = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2, kv_cache="paged",
                                   kv_page_size=4, kv_cache_tokens=60), 3
    engine.setup(senior, junior, tokenizer, max_batch=batch)
    return engine


def resumed(prompts: PromptBatch, paused) -> PromptBatch:
    return PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts.partner,
                       prompts.max_new_tokens, resume=paused)


@pytest.mark.parametrize("policy", [WordHandoff(p=0.5), SoloHandoff()], ids=["word", "solo"])
@pytest.mark.parametrize("kind", ["hf", "fast", "paged"])
def test_a_paused_and_resumed_sequence_writes_what_an_uninterrupted_one_does(tokenizer, plain_pair, kind, policy):
    senior, junior = plain_pair
    engine = make_engine(kind, senior, junior, tokenizer)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS if kind == "paged" else None)
    want = engine.generate(prompts, policy, SAMPLED)
    rows = prompts.batch_size
    stop = StopRule(group=[i // 2 for i in range(rows)], groups=1)  # pairs of rows: end at the first whole pair
    first = engine.generate(prompts, policy, SAMPLED, stop)
    assert first.paused is not None, "the rule should end the call before every row ended"
    paused = [i for i, p in enumerate(first.paused) if p is not None]
    ended = [i for i in range(rows) if i not in paused]
    assert any(first.paused[i].written > 0 for i in paused)  # some were paused mid-sequence
    groups = [g for g in range(rows // 2) if {2 * g, 2 * g + 1} <= set(ended)]
    assert groups, "at least one whole group ended"
    for i in ended:  # rows that ended are the uninterrupted ones
        n = int(want.lengths[i])
        assert first.completion_ids[i, :n].tolist() == want.completion_ids[i, :n].tolist()
    for i in paused:  # what a paused row wrote is a prefix of the uninterrupted row
        p = first.paused[i]
        assert p.tokens.tolist() == want.completion_ids[i, : p.written].tolist()
        assert p.authors.tolist() == want.author[i, : p.written].tolist()
        assert not first.finished[i] and not first.truncated[i]
    again = engine.generate(resumed(prompts.select(paused), [first.paused[i] for i in paused]), policy, SAMPLED)
    assert again.paused is None
    if kind != "hf":  # the busy share counts the tokens decoded in this call, not the resumed ones
        assert 0 < engine.last_timing().busy_slot_fraction <= 1
    for j, i in enumerate(paused):
        n = int(want.lengths[i])
        assert int(again.lengths[j]) == n
        assert again.completion_ids[j, :n].tolist() == want.completion_ids[i, :n].tolist()
        assert again.author[j, :n].tolist() == want.author[i, :n].tolist()
        assert bool(again.finished[j]) == bool(want.finished[i]) and bool(again.truncated[j]) == bool(want.truncated[i])
        assert again.texts[j] == want.texts[i]
        for name in ("handoffs", "decisions", "junior_draws"):
            assert int(getattr(again, name)[j]) == int(getattr(want, name)[i]), name
        torch.testing.assert_close(again.senior_logprobs[j, :n], want.senior_logprobs[i, :n], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the rollout phase

def tiny_module(engine, partial=None, objective=None, **settings):
    from tandem_lit.models import ModelSource
    from tandem_lit.objectives import GRPO
    from tandem_lit.training.module import TandemModule
    from tandem_lit.verifiers import GSM8KVerifier
    from tests.conftest import grouped_settings

    module = TandemModule(**grouped_settings(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
        verifier=GSM8KVerifier(), objective=objective or GRPO(), handoff=WordHandoff(0.5), engine=engine,
        sampling=SamplingConfig(temperature=1.0, n=2, max_new_tokens=20, ignore_eos=True), partial=partial,
        **settings,
    ))
    module.configure_model()
    # long-tailed lengths on random weights: each sequence's budget from its seed
    module.rollouts.token_budgets = lambda seeds: (seeds.abs() % 19) + 2
    return module


ENGINES = {
    "hf": lambda: HFEngine(rollout_dtype="float32", check_every=2),
    "fast": lambda: FastEngine(kernels="torch", rollout_dtype="float32", check_every=2),
}
ROWS_A = [{"prompt": f"Q: {i}+{i}?", "answer": str(2 * i)} for i in range(4)]
ROWS_B = [{"prompt": f"Q: {i}*3+100?", "answer": str(3 * i + 100)} for i in range(4)]


def rows_of(result, group: int) -> list[int]:
    return [i for i, g in enumerate(result.group.tolist()) if g == group]


def same_rollout_rows(got, i: int, want, j: int) -> None:
    n = int(want.lengths[j])
    assert int(got.lengths[i]) == n
    assert got.completion_ids[i, :n].tolist() == want.completion_ids[j, :n].tolist()
    assert got.author[i, :n].tolist() == want.author[j, :n].tolist()
    torch.testing.assert_close(got.senior_logprobs[i, :n], want.senior_logprobs[j, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_step_trains_complete_groups_and_carries_the_rest_to_resume_first(kind):
    """in_flight 6 over batches of 4: the first step trains 2 groups and carries 2 (paused
    mid-sequence); the next step resumes them first, and with unchanged weights they end with the
    tokens an uninterrupted rollout writes."""
    from tandem_lit.training.settings import PartialRollouts

    module = tiny_module(ENGINES[kind](), PartialRollouts(in_flight_prompts=6, max_staleness=2))
    phase = module.rollouts
    want = phase.generate(ROWS_A, WordHandoff(0.5), phase.settings.sampling, key=7).rollout  # uninterrupted
    first, stats = phase.training_rollouts(ROWS_A, WordHandoff(0.5), key=7)
    assert stats["partial_trained_groups"] == 2 and stats["partial_carried_groups"] == 2
    assert stats["partial_in_flight_groups"] == 4 and stats["partial_paused_sequences"] > 0
    assert first.rollout.finished.logical_or(first.rollout.truncated).all()  # only ended rollouts train
    carried = [ROWS_A.index(g.row) for g in phase.in_flight.groups]
    trained = [i for i in range(4) if i not in carried]
    for place, group in enumerate(trained):  # a trained group is the uninterrupted one
        for i, j in zip(rows_of(first, place), (2 * group, 2 * group + 1)):
            same_rollout_rows(first.rollout, i, want, j)
    assert stats["stale_token_fraction"] == 0.0
    second, stats = phase.training_rollouts(ROWS_B, WordHandoff(0.5), key=8)
    assert stats["partial_carried_in_groups"] == 2 and stats["partial_in_flight_groups"] == 6
    assert stats["partial_resumed_sequences"] > 0 and stats["partial_trained_groups"] == 4
    assert second.columns["answer"][:4] == [ROWS_A[g]["answer"] for g in carried for _ in range(2)]  # carried first
    for place, group in enumerate(carried):
        for i, j in zip(rows_of(second, place), (2 * group, 2 * group + 1)):
            same_rollout_rows(second.rollout, i, want, j)
    assert stats["stale_token_fraction"] == 0.0  # the weights did not move between the steps


@pytest.mark.parametrize("kind", ENGINES)
def test_stale_tokens_are_counted_and_bounded_in_both_modes(kind):
    from tandem_lit.training.settings import PartialRollouts

    # correct: carried once at max_staleness 1, a group must finish and train in the next phase
    module = tiny_module(ENGINES[kind](), PartialRollouts(in_flight_prompts=6, max_staleness=1, stale="correct"))
    phase = module.rollouts
    phase.training_rollouts(ROWS_A, WordHandoff(0.5), key=7)
    carried = list(phase.in_flight.groups)
    phase.policy_moved()  # an update (the weights are the same: the rollouts stay comparable)
    result, stats = phase.training_rollouts(ROWS_B, WordHandoff(0.5), key=8)
    holding = [g for g in carried if g.oldest_senior() is not None]
    assert holding and stats["partial_finished_stale_sequences"] > 0
    assert all(g not in phase.in_flight.groups for g in holding)  # they trained: none is carried further
    assert 0 < stats["stale_token_fraction"] < 1 and stats["stale_token_mean_age"] == 1.0
    senior = result.rollout.author.long() == 2
    assert int(result.rollout.staleness[~senior].abs().sum()) == 0  # junior tokens are never stale
    # redraw: two updates later, what the carried sequences wrote is dropped, drawn again from the prompt
    module = tiny_module(ENGINES[kind](), PartialRollouts(in_flight_prompts=6, max_staleness=1, stale="redraw"))
    phase = module.rollouts
    want = phase.generate(ROWS_A, WordHandoff(0.5), phase.settings.sampling, key=7).rollout
    phase.training_rollouts(ROWS_A, WordHandoff(0.5), key=7)
    carried = list(phase.in_flight.groups)
    phase.policy_moved(2)
    result, stats = phase.training_rollouts(ROWS_B, WordHandoff(0.5), key=8)
    assert stats["partial_redrawn_sequences"] > 0
    assert stats["stale_token_fraction"] == 0.0  # a redrawn sequence is written by the new weights only
    trained = [g for g in carried if g not in phase.in_flight.groups]  # carried groups train first
    assert trained
    for place, group in enumerate(ROWS_A.index(g.row) for g in trained):
        for i, j in zip(rows_of(result, place), (2 * group, 2 * group + 1)):
            same_rollout_rows(result.rollout, i, want, j)  # same seed, same (unchanged) weights


def test_a_steps_updates_are_one_per_ppo_mini_batch_of_this_ranks_groups():
    from tandem_lit.training.distributed import Shares

    assert Shares(1, 0, prompts_per_update=8).updates(16) == 2  # the paper config: 16 prompts, mini-batches of 8
    assert Shares(1, 0, prompts_per_update=8).updates(17) == 3  # a step with a group more than its batch
    assert Shares(2, 1, prompts_per_update=8).updates(8) == 2  # each of 2 ranks holds 4 of every mini-batch
    assert Shares(1, 0).updates(16) == 1 and Shares(1, 0, prompts_per_update=8).updates(0) == 0


def test_staleness_counts_every_update_of_a_step_not_one_per_step():
    """PPO mini-batches of 2 groups: the first step trains 2 groups (1 update) and carries 2, the
    next trains 4 (2 updates). At max_staleness 2 (stale: correct) a carried group is 1 update old
    in the second phase; carried past its 2 updates it would be 3, so it must finish and train now
    (counting one update a step, it went on). max_staleness 1 is below a full step's 2 updates:
    no carried token could meet it, and it is refused in one line."""
    from tandem_lit.errors import ConfigError
    from tandem_lit.training.distributed import Shares
    from tandem_lit.training.settings import PartialRollouts

    mini_batches_of_2 = Shares(1, 0, prompts_per_update=2)
    module = tiny_module(ENGINES["fast"](), PartialRollouts(in_flight_prompts=6, max_staleness=2, stale="correct"))
    phase = module.rollouts
    _, stats = phase.training_rollouts(ROWS_A, WordHandoff(0.5), key=7, shares=mini_batches_of_2)
    assert stats["partial_trained_groups"] == 2 and stats["partial_carried_groups"] == 2
    carried = [g for g in phase.in_flight.groups if g.oldest_senior() is not None]
    assert carried
    phase.policy_moved(mini_batches_of_2.updates(2))  # the first step's one update
    result, stats = phase.training_rollouts(ROWS_B, WordHandoff(0.5), key=8, shares=mini_batches_of_2)
    assert stats["partial_trained_groups"] >= 4 and stats["partial_finished_stale_sequences"] > 0
    assert all(g not in phase.in_flight.groups for g in carried)
    assert stats["stale_token_max_age"] == 1.0

    module = tiny_module(ENGINES["fast"](), PartialRollouts(in_flight_prompts=6, max_staleness=1))
    with pytest.raises(ConfigError, match=r"max_staleness is 1, but a step makes 2 optimiser updates .* set max_staleness >= 2"):
        module.rollouts.training_rollouts(ROWS_A, WordHandoff(0.5), key=7, shares=mini_batches_of_2)


@pytest.mark.parametrize("kind", ENGINES)
def test_with_nothing_to_carry_partial_rollouts_train_token_for_token_as_today(kind, tmp_path):
    """``rollout.partial`` whose in-flight groups are just the batch ends each phase when every
    group is complete: two training steps give the rollouts and the weights of the setting absent
    (today's path), bit for bit."""
    import lightning as L

    from tandem_lit.data import GSM8KDataModule
    from tandem_lit.training.settings import PartialRollouts

    def run(partial):
        module = tiny_module(ENGINES[kind](), partial, optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
        seen = []
        original = module.rollouts.training_rollouts

        def recorded(*args, **kwargs):
            result, stats = original(*args, **kwargs)
            seen.append(result)
            return result, stats

        module.rollouts.training_rollouts = recorded
        trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
                            devices=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
        return module, seen

    today, today_rollouts = run(None)
    partial, partial_rollouts = run(PartialRollouts(in_flight_prompts=2))
    assert len(today_rollouts) == len(partial_rollouts) == 2
    for a, b in zip(today_rollouts, partial_rollouts):
        assert a.rollout.texts == b.rollout.texts and a.group.tolist() == b.group.tolist()
        for name in ("completion_ids", "author", "senior_logprobs", "finished", "truncated"):
            assert torch.equal(getattr(a.rollout, name), getattr(b.rollout, name)), name
        assert int(b.rollout.staleness.abs().sum()) == 0
    for (name, p), q in zip(today.senior.named_parameters(), partial.senior.parameters()):
        assert torch.equal(p, q), name
    assert [row["train/loss"] for row in today.history] == [row["train/loss"] for row in partial.history]


def test_the_decoupled_correction_weights_stale_senior_tokens_by_hand():
    """Stale senior tokens: min(exp(old - behaviour), cap); fresh and junior tokens keep the
    objective's factor (1 without tis_cap, its own truncated weight with it)."""
    from tandem_lit.objectives import GRPO
    from tandem_lit.objectives.base import ObjectiveInputs

    S, J = 2, 3
    author = torch.tensor([[S, S, S, J]])
    old = torch.log(torch.tensor([[0.6, 0.9, 0.3, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.4, 0.3, 0.3, 0.1]]))  # weights 1.5, 3, 1, (junior)
    stale = torch.tensor([[True, True, False, True]])
    inputs = ObjectiveInputs(logp=old.clone(), author=author, rewards=torch.ones(1), group=torch.zeros(1, dtype=torch.long),
                             old_logp=old, rollout_logp=behaviour, stale=stale)
    counted = author > 0
    objective = GRPO()
    objective.stale_cap = 2.0
    factor, metrics = objective.importance_correction(inputs, counted)
    torch.testing.assert_close(factor, torch.tensor([[1.5, 2.0, 1.0, 1.0]]))
    torch.testing.assert_close(metrics["stale_weight_mean"], torch.tensor(1.75))
    torch.testing.assert_close(metrics["stale_capped_fraction"], torch.tensor(0.5))
    with_tis = GRPO(tis_cap=1.2)  # the objective's factor on fresh tokens, the decoupled one on stale ones
    with_tis.stale_cap = 2.0
    factor, _ = with_tis.importance_correction(inputs, counted)
    torch.testing.assert_close(factor, torch.tensor([[1.5, 2.0, 1.0, 1.0]]))
    fresh = ObjectiveInputs(**{**vars(inputs), "stale": torch.zeros_like(stale)})
    factor, _ = with_tis.importance_correction(fresh, counted)
    torch.testing.assert_close(factor, torch.tensor([[1.2, 1.2, 1.0, 1.0]]))
    objective.stale_cap = None  # correction: tis (or none): the stale mask changes nothing
    assert objective.importance_correction(inputs, counted)[0] == 1.0


def test_bad_partial_settings_and_engines_that_cannot_pause_fail_in_one_line(tokenizer):
    from tandem_lit.errors import ConfigError
    from tandem_lit.objectives import GRPO
    from tandem_lit.rollout.text_handoff import TextHandoffEngine
    from tandem_lit.training.partial import use_correction
    from tandem_lit.training.settings import DynamicSampling, PartialRollouts, RolloutSettings

    with pytest.raises(ConfigError, match="max_staleness must be >= 1"):
        PartialRollouts(in_flight_prompts=4, max_staleness=0)
    with pytest.raises(ConfigError, match="stale must be"):
        PartialRollouts(in_flight_prompts=4, stale="drop")
    with pytest.raises(ConfigError, match="cannot be combined"):
        RolloutSettings(partial=PartialRollouts(4), dynamic_sampling=DynamicSampling(2))
    with pytest.raises(ConfigError, match="tis_cap"):
        use_correction(PartialRollouts(4, correction="tis"), GRPO())
    module = tiny_module(TextHandoffEngine(rollout_dtype="float32"), PartialRollouts(in_flight_prompts=6))
    with pytest.raises(ConfigError, match="TextHandoffEngine does not"):
        module.rollouts.training_rollouts(ROWS_A, WordHandoff(0.5), key=7)


def test_carried_groups_are_saved_and_redrawn_on_resume_so_no_row_is_lost():
    from tandem_lit.training.settings import PartialRollouts

    settings = PartialRollouts(in_flight_prompts=6)
    module = tiny_module(ENGINES["fast"](), settings)
    phase = module.rollouts
    want = phase.generate(ROWS_A, WordHandoff(0.5), phase.settings.sampling, key=7).rollout
    first, _ = phase.training_rollouts(ROWS_A, WordHandoff(0.5), key=7)
    state = phase.in_flight.state_dict()
    carried = [ROWS_A.index(g.row) for g in phase.in_flight.groups]
    assert len(carried) == 2 and [g["row"] for g in state["groups"]] == [ROWS_A[i] for i in carried]
    resumed = tiny_module(ENGINES["fast"](), settings)  # a new process, from the checkpoint
    resumed.rollouts.in_flight.load_state_dict(state)
    assert all(m.written == 0 for g in resumed.rollouts.in_flight.groups for m in g.members)
    second, stats = resumed.rollouts.training_rollouts(ROWS_B, WordHandoff(0.5), key=8)
    assert stats["partial_carried_in_groups"] == 2 and stats["partial_resumed_sequences"] == 0
    left = [ROWS_A.index(g.row) for g in resumed.rollouts.in_flight.groups if g.row in ROWS_A]
    answers = first.columns["answer"][::2] + second.columns["answer"][::2]
    for i, row in enumerate(ROWS_A):  # every row of the first batch trained once, or is still in flight
        assert answers.count(row["answer"]) + left.count(i) == 1, row
    for place, group in enumerate(g for g in carried if g not in left):  # carried groups train first
        for i, j in zip(rows_of(second, place), (2 * group, 2 * group + 1)):
            same_rollout_rows(second.rollout, i, want, j)  # redrawn from its seed: the uninterrupted rollout


def test_the_train_step_benchmark_prints_the_partial_over_today_rollout_ratio(repo_root):
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--device", "cpu", "--tiny", "--arms", "grpo", "--max-new-tokens", "16",
         "--lengths", "lognormal:median=6,sigma=0.8,cap=16", "--partial", "3", "--warmup-steps", "1", "--steps", "2"],
        cwd=repo_root, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    ratio = next(line for line in lines if line.startswith("grpo_partial_over_today_rollout="))
    assert float(ratio.split("=")[1].split()[0]) > 0
    assert "grpo+partial partial: 3 groups in flight, 2 trained, 1 carried" in run.stdout
    assert lines[-1].startswith("grpo_step_seconds=")  # today's arm is still reported as before


def test_an_engine_without_a_queue_decodes_whole_groups_per_call_and_leaves_the_rest_unstarted():
    """HFEngine with rollout.batch_size 4 (two groups a call): the first call completes the step's
    two groups, the next is not started; its groups are carried with nothing written, and train
    first in the next step, as an uninterrupted rollout writes them."""
    from tandem_lit.training.settings import PartialRollouts

    module = tiny_module(ENGINES["hf"](), PartialRollouts(in_flight_prompts=6), rollout_batch_size=4)
    phase = module.rollouts
    want = phase.generate(ROWS_A, WordHandoff(0.5), phase.settings.sampling, key=7).rollout
    first, stats = phase.training_rollouts(ROWS_A, WordHandoff(0.5), key=7)
    assert stats["partial_trained_groups"] == 2 and stats["partial_paused_sequences"] == 0
    assert [ROWS_A.index(g.row) for g in phase.in_flight.groups] == [2, 3]
    assert all(m.written == 0 and m.done is None for g in phase.in_flight.groups for m in g.members)
    second, stats = phase.training_rollouts(ROWS_B, WordHandoff(0.5), key=8)
    assert stats["partial_trained_groups"] == 4
    for place, group in enumerate((2, 3)):
        for i, j in zip(rows_of(second, place), (2 * group, 2 * group + 1)):
            same_rollout_rows(second.rollout, i, want, j)


def test_training_with_partial_rollouts_measures_the_engine_gap_on_fresh_tokens_and_saves_the_carry(tmp_path):
    """Three Lightning steps that move the weights a lot (SGD, lr 0.5): stale tokens train, their
    gap to the moved policy is corrected, not reported as an engine-vs-trainer gap (float32 on the
    CPU: that gap is ~0); a checkpoint holds the carried groups' rows."""
    import lightning as L

    from tandem_lit.data import GSM8KDataModule
    from tandem_lit.objectives import SoftMaskedReinforce
    from tandem_lit.training.settings import PartialRollouts

    # random tiny models never answer right: failed rollouts' weight -0.5 still gives a gradient
    module = tiny_module(ENGINES["fast"](), PartialRollouts(in_flight_prompts=3, max_staleness=2),
                         objective=SoftMaskedReinforce(), optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
                        devices=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    rows = module.history
    assert [r["train/partial_trained_groups"] for r in rows] == [1.0, 2.0, 2.0]  # the carry fills first
    assert max(r["train/stale_token_fraction"] for r in rows) > 0
    stale = [r for r in rows if r["train/stale_token_fraction"] > 0]
    assert all(r["train/stale_token_max_age"] <= 2 for r in rows)
    assert all(r["train/rollout_logp_gap_mean"] < 1e-3 for r in rows)
    assert all("train/stale_weight_mean" in r for r in stale)
    path = tmp_path / "step.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["tandem_lit_partial"]
    assert len(saved["groups"]) == len(module.rollouts.in_flight.groups) == 1
    assert saved["groups"][0]["row"]["prompt"] == module.rollouts.in_flight.groups[0].row["prompt"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_pause_and_resume_on_cuda_graphs_and_triton_kernels(tokenizer, kv_cache):
    """The GPU path: paused rows saved from the captured decode's buffers, resumed through the
    refill prefill and the graphs again (float32: exact up to kernel order; a rare near-tie may
    break the other way, so rows are compared whole and all but one must match)."""
    from tests.test_continuous_batching import cuda_pair

    senior, junior = cuda_pair(len(tokenizer), "plain")
    pool = dict(kv_cache="paged", kv_page_size=4, kv_cache_tokens=60) if kv_cache == "paged" else {}
    engine = FastEngine(rollout_dtype="float32", check_every=2, **pool)
    engine.setup(senior, junior, tokenizer, max_batch=3)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS).to("cuda")
    for policy in (SoloHandoff("senior"), WordHandoff(p=0.5)):
        want = engine.generate(prompts, policy, SAMPLED)
        stop = StopRule(group=[i // 2 for i in range(prompts.batch_size)], groups=1)
        first = engine.generate(prompts, policy, SAMPLED, stop)
        paused = [i for i, p in enumerate(first.paused or []) if p is not None]
        assert paused and any(first.paused[i].written for i in paused)
        again = engine.generate(resumed(prompts.select(paused), [first.paused[i] for i in paused]), policy, SAMPLED)
        same = [j for j, i in enumerate(paused) if torch.equal(again.completion_ids[j, : int(want.lengths[i])],
                                                                want.completion_ids[i, : int(want.lengths[i])])
                and int(again.lengths[j]) == int(want.lengths[i])]
        assert len(same) >= len(paused) - 1, f"only {same} of {paused} match"
