"""Training features of the RLVR runs with real tiny models: dynamic sampling (keep groups whose
rewards differ, refill, log, stop when there is never a signal), overlong masking and penalty,
the prompt-length filter, the handoff span limit, and checkpoint selection by held-out pass@k."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import tiny_tandem_module

from tandem_lit.cli import build_cli, main
from tandem_lit.data.base import PromptDataModule
from tandem_lit.errors import ConfigError, TandemLitError, TrainingStalledError
from tandem_lit.models import LoraSettings, ModelSource
from tandem_lit.objectives import GRPO, ObjectiveInputs
from tandem_lit.rollout import Author, SamplingConfig, TokenHandoff, WordHandoff
from tandem_lit.rollout.handoff import TokenClasses
from tandem_lit.rollout.static import FastEngine
from tandem_lit.training import DynamicSampling, OverlongPolicy, TandemModule
from tandem_lit.verifiers.base import Grade, Verifier

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization"),
    pytest.mark.filterwarnings("ignore:No seed found"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
]

VOWELS = "aeiou"


class AnyCharVerifier(Verifier):
    """Reward 1 when the completion contains one of the row's ``chars`` (or, without that column,
    of ``chars`` given here); ``*`` rewards everything. The reward depends on the text, so the
    rollouts of random tiny models form groups with and without reward spread: ``chars=""`` is
    never rewarded, ``*`` always, and a completion of 16 tokens over 100 characters contains a vowel
    about half the time (8 such rollouts all agree with probability ~1%)."""

    def __init__(self, chars: str = VOWELS):
        self.chars = chars

    def grade(self, completion: str, **columns: Any) -> Grade:
        chars = columns.get("chars", self.chars)
        hit = chars == "*" or any(c in completion for c in chars)
        return Grade(correct=hit, reward=float(hit))


class AlwaysVerifier(Verifier):
    """Reward 1 for every completion: all groups agree."""

    def grade(self, completion: str, **columns: Any) -> Grade:
        return Grade(correct=True, reward=1.0)


class SpyGRPO(GRPO):
    """GRPO that records what the module hands the objective."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[ObjectiveInputs] = []
        self.advantage_rewards: list[torch.Tensor] = []

    def advantages(self, rewards, group, over_ranks=None):
        self.advantage_rewards.append(rewards.detach().clone())
        return super().advantages(rewards, group, over_ranks)

    def loss_and_metrics(self, inputs, scale=None):
        self.calls.append(inputs)
        return super().loss_and_metrics(inputs, scale)


class RowsDataModule(PromptDataModule):
    """Fixed rows for training and validation (the training order is still the seeded shuffle)."""

    def __init__(self, train: list[dict[str, Any]], val: list[dict[str, Any]] | None = None, batch_size: int = 4):
        super().__init__(batch_size=batch_size)
        self.train, self.val = train, val or train[:2]

    def load_split(self, split):
        return self.train if split == "train" else self.val


def tandem_module(**overrides) -> TandemModule:
    settings = dict(
        verifier=AnyCharVerifier(),
        objective=SpyGRPO(),
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=16),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return tiny_tandem_module(**{**settings, **overrides})


def fit(module: TandemModule, data: PromptDataModule, root, steps: int = 1, **trainer_args) -> L.Trainer:
    settings = dict(
        max_steps=steps, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
        devices=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
    )
    settings.update(trainer_args)
    trainer = L.Trainer(**settings)
    trainer.fit(module, datamodule=data)
    return trainer


def train_rows(module: TandemModule) -> list[dict[str, float]]:
    return [row for row in module.history if any(k.startswith("train/") for k in row)]


def row(prompt: str, chars: str) -> dict[str, str]:
    return {"prompt": prompt, "chars": chars}


NEVER, MIXED, ALWAYS = "", VOWELS, "*"
GROUP = 8  # rollouts per prompt in the dynamic-sampling tests


# ------------------------------------------------------------------------------ dynamic sampling


def test_dynamic_sampling_keeps_groups_with_spread_and_refills_from_the_pool():
    module = tandem_module(dynamic_sampling=DynamicSampling(prompts_per_step=2, max_rounds=4),
                           sampling=SamplingConfig(temperature=1.0, n=GROUP, max_new_tokens=16))
    module.configure_model()
    pool = [row("Q: one?", NEVER), row("Q: two?", ALWAYS), row("Q: three?", MIXED),
            row("Q: four?", NEVER), row("Q: five?", MIXED), row("Q: six?", MIXED)]
    result, stats = module.rollouts.informative(pool, module.handoff, key=0)
    # round 1: NEVER, ALWAYS (both dropped); round 2: MIXED (kept), NEVER (dropped); round 3: one more MIXED
    assert stats == {"sampling_rounds": 3.0, "dropped_groups": 3.0, "kept_groups": 2.0}
    assert result.group.tolist() == [0] * GROUP + [1] * GROUP  # renumbered from 0
    assert sorted(result.groups_with_spread()) == [0, 1]
    assert set(result.columns["chars"]) == {MIXED}
    prompts = [module.tokenizer.decode(result.rollout.prompt_ids[i][result.rollout.prompt_mask[i].bool()])
               for i in (0, GROUP)]
    assert prompts == ["Q: three?", "Q: five?"]
    assert len(result.rollout.texts) == result.rollout.completion_ids.shape[0] == 2 * GROUP

    # the bound on rounds: a single round of two uninformative prompts gives nothing to train on
    module.rollout_settings.dynamic_sampling = DynamicSampling(prompts_per_step=2, max_rounds=1)
    result, stats = module.rollouts.informative(pool, module.handoff, key=0)
    assert result is None and stats == {"sampling_rounds": 1.0, "dropped_groups": 2.0, "kept_groups": 0.0}


def test_dynamic_sampling_step_trains_on_informative_groups_and_logs_the_counts(tmp_path):
    objective = SpyGRPO()
    module = tandem_module(objective=objective, dynamic_sampling=DynamicSampling(prompts_per_step=2, max_rounds=3),
                           sampling=SamplingConfig(temperature=1.0, n=GROUP, max_new_tokens=16))
    rows = [row(f"Q: number {i}?", chars) for i, chars in enumerate([NEVER, MIXED, ALWAYS, MIXED, MIXED, NEVER])]
    trainer = fit(module, RowsDataModule(rows, batch_size=6), tmp_path)
    assert trainer.global_step == 1
    (logged,) = train_rows(module)
    assert logged["train/kept_groups"] == 2.0
    assert logged["train/sampling_rounds"] >= 1.0
    assert logged["train/dropped_groups"] >= 0.0
    # kept + dropped = the prompts generated for (the seeded order puts both kept ones within 3 rounds)
    assert 2 <= logged["train/kept_groups"] + logged["train/dropped_groups"] <= len(rows)
    # every trained group has reward spread
    assert logged["train/zero_variance_groups"] == 0.0
    assert 0.0 < logged["train/reward_mean"] < 1.0
    trained = objective.advantage_rewards[-1]
    assert trained.numel() == 2 * GROUP
    for group in trained.view(2, GROUP):
        assert group.unique().numel() > 1


def test_no_signal_stops_the_run_after_max_idle_steps(tmp_path):
    module = tandem_module(verifier=AlwaysVerifier(), max_idle_steps=3,
                           dynamic_sampling=DynamicSampling(prompts_per_step=2, max_rounds=2))
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.senior.named_parameters()}
    rows = [row(f"Q: {i}?", ALWAYS) for i in range(8)]
    with pytest.raises(TrainingStalledError, match="3 consecutive steps") as info:
        fit(module, RowsDataModule(rows, batch_size=4), tmp_path, steps=10)
    assert isinstance(info.value, TandemLitError)
    steps = train_rows(module)
    assert len(steps) == 2  # the third idle step raised before logging
    for logged in steps:
        assert logged["train/skipped_update"] == 1.0 and logged["train/kept_groups"] == 0.0
        assert logged["train/dropped_groups"] == 4.0 and logged["train/sampling_rounds"] == 2.0
    assert all(torch.equal(p, before[n]) for n, p in module.senior.named_parameters())


def test_stalled_training_is_a_one_line_cli_error(tmp_path, capsys):
    """Random tiny models never answer GSM8K right: every group is all-wrong, no update can happen."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(args=[
            "fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "3",
            "--trainer.limit_val_batches", "0", "--model.init_args.evaluation.at_start", "false",
            "--model.init_args.rollout.sampling.max_new_tokens", "8", "--data.init_args.batch_size", "2",
            "--model.init_args.rollout.dynamic_sampling", "{prompts_per_step: 1, max_rounds: 1}",
            "--model.init_args.update.max_idle_steps", "2",
        ])
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("tandem-lit: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "dynamic sampling found no prompt whose rollouts got different rewards in 2 consecutive steps" in errors[0]
    assert "turn dynamic_sampling off" in errors[0]


# --------------------------------------------------------------------------- overlong completions


def test_objective_mask_leaves_rows_out_of_the_loss_and_its_normaliser():
    """GRPO with a per-sequence mask equals GRPO on the unmasked rows alone; masked rows get no gradient."""
    torch.manual_seed(0)
    logp = torch.randn(4, 5)
    author = torch.tensor([[Author.SENIOR] * 5, [Author.SENIOR] * 3 + [Author.PAD] * 2,
                           [Author.JUNIOR, Author.SENIOR, Author.SENIOR, Author.SENIOR, Author.SENIOR],
                           [Author.SENIOR] * 5], dtype=torch.int8)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mask = torch.tensor([True, False, True, False])
    objective = GRPO()

    def run(rows, with_mask):
        leaf = logp[rows].clone().requires_grad_()
        inputs = ObjectiveInputs(logp=leaf, author=author[rows], rewards=torch.zeros(len(rows)),
                                 group=torch.zeros(len(rows), dtype=torch.long), advantages=advantages[rows],
                                 mask=mask[rows] if with_mask else None)
        loss, metrics = objective(inputs)
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss, grad, metrics

    loss, grad, metrics = run([0, 1, 2, 3], with_mask=True)
    kept_loss, kept_grad, _ = run([0, 2], with_mask=False)
    assert torch.allclose(loss, kept_loss)
    assert torch.allclose(grad[[0, 2]], kept_grad)
    assert torch.count_nonzero(grad[[1, 3]]) == 0
    assert metrics["included_fraction"] == 0.5
    scale = objective.loss_scale(author, advantages, max_tokens=5, mask=mask)
    assert scale.sequences == 2 and scale.weight_sum == 5 + 4  # junior token of row 2 weighs 0


def overlong_rows():
    return [row(f"Question {i}: say something.", MIXED) for i in range(4)]


def spy_on_optimise(module: TandemModule) -> dict[str, Any]:
    """Record the graded rollouts each update is computed from."""
    captured: dict[str, Any] = {}
    run = module.updates.run

    def spy(result, *args, **kwargs):
        captured["result"] = result
        return run(result, *args, **kwargs)

    module.updates.run = spy
    return captured


def test_overlong_mask_keeps_truncated_rollouts_out_of_the_update(tmp_path):
    objective = SpyGRPO()
    # 60 tokens over a 100-character vocabulary: some rollouts draw the end token, some run out
    module = tandem_module(objective=objective, overlong=OverlongPolicy(mode="mask"),
                           sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=60))
    captured = spy_on_optimise(module)
    fit(module, RowsDataModule(overlong_rows(), batch_size=4), tmp_path)
    (logged,) = train_rows(module)
    truncated = captured["result"].rollout.truncated
    assert truncated.any() and not truncated.all(), "the test needs both finished and truncated rollouts"
    (inputs,) = objective.calls
    assert torch.equal(inputs.mask.cpu(), ~truncated)
    assert logged["train/included_fraction"] == pytest.approx(1.0 - logged["train/truncation_rate"])
    assert logged["train/included_fraction"] == pytest.approx(1.0 - truncated.float().mean().item())


def test_overlong_keep_includes_every_rollout(tmp_path):
    objective = SpyGRPO()
    module = tandem_module(objective=objective, sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=60))
    fit(module, RowsDataModule(overlong_rows(), batch_size=4), tmp_path)
    (logged,) = train_rows(module)
    assert 0.0 < logged["train/truncation_rate"] < 1.0
    assert logged["train/included_fraction"] == 1.0
    assert objective.calls[0].mask is None


def test_overlong_penalty_replaces_the_reward_of_truncated_rollouts(tmp_path):
    objective = SpyGRPO()
    module = tandem_module(objective=objective, overlong=OverlongPolicy(mode="penalty", penalty=-1.0),
                           sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=60))
    captured = spy_on_optimise(module)
    fit(module, RowsDataModule(overlong_rows(), batch_size=4), tmp_path)
    result = captured["result"]
    truncated = result.rollout.truncated
    assert truncated.any() and not truncated.all()
    used = objective.advantage_rewards[-1].cpu()
    assert torch.all(used[truncated] == -1.0)
    assert torch.equal(used[~truncated], result.rewards[~truncated])
    assert (result.rewards[~truncated] >= 0).all()  # the verifier's own rewards, untouched
    assert objective.calls[0].mask is None  # penalised, not masked


def test_soft_overlong_punishment_hand_computed():
    """DAPO's soft overlong punishment, cap 10, buffer 4, factor 0.5: no change up to 6 tokens,
    then (6 - length) / 4 * 0.5: 7 tokens -0.125, 9 tokens -0.375, 10 (the cap, truncated) -0.5.
    ``penalty`` replaces a truncated row's reward; ``keep`` and ``mask`` change none."""
    rewards, lengths = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([4, 7, 9, 10])
    truncated = torch.tensor([False, False, False, True])
    soft = OverlongPolicy(mode="soft", buffer=4, penalty_factor=0.5)
    assert soft.rewards(rewards, lengths, truncated, max_tokens=10).tolist() == [1.0, 0.875, -0.375, 0.5]
    penalty = OverlongPolicy(mode="penalty", penalty=-1.0)
    assert penalty.rewards(rewards, lengths, truncated, max_tokens=10).tolist() == [1.0, 1.0, 0.0, -1.0]
    for mode in ("keep", "mask"):
        assert OverlongPolicy(mode=mode).rewards(rewards, lengths, truncated, max_tokens=10).equal(rewards)
    with pytest.raises(ConfigError, match="overlong.buffer"):
        OverlongPolicy(mode="soft")
    with pytest.raises(ConfigError, match=r"overlong.buffer \(12\) must be at most"):
        OverlongPolicy(mode="soft", buffer=12).rewards(rewards, lengths, truncated, max_tokens=10)


def test_dynamic_sampling_filters_on_the_rewards_the_objective_sees():
    """Every completion is rewarded 1 (no group has spread in the verifier's rewards), but under
    the soft overlong punishment over the whole budget the rewards fall with length: the groups
    whose lengths differ have advantages, and dynamic sampling keeps them. Under ``penalty`` with
    the verifier's own reward as the penalty, nothing differs and every group is dropped."""
    rows = [row(f"Q: {i}?", ALWAYS) for i in range(2)]
    sampling = SamplingConfig(temperature=1.0, n=GROUP, max_new_tokens=60)
    soft = tandem_module(dynamic_sampling=DynamicSampling(prompts_per_step=2, max_rounds=1), sampling=sampling,
                         overlong=OverlongPolicy(mode="soft", buffer=60))
    soft.configure_model()
    result, stats = soft.rollouts.informative(rows, soft.handoff, key=0)
    assert stats["kept_groups"] == 2.0 and result.groups_with_spread() == []  # kept on the trained rewards alone
    assert sorted(result.groups_with_spread(soft.rollouts.trained_rewards(result))) == [0, 1]
    flat = tandem_module(dynamic_sampling=DynamicSampling(prompts_per_step=2, max_rounds=1), sampling=sampling,
                         overlong=OverlongPolicy(mode="penalty", penalty=1.0))
    flat.configure_model()
    assert flat.rollouts.informative(rows, flat.handoff, key=0) == (None, {"sampling_rounds": 1.0, "dropped_groups": 2.0,
                                                                           "kept_groups": 0.0})


def test_overlong_policy_rejects_unknown_modes():
    with pytest.raises(ConfigError, match="overlong.mode"):
        OverlongPolicy(mode="drop")


# ------------------------------------------------------------------------------ prompt length


def test_max_prompt_tokens_skips_long_prompts_and_counts_them(tmp_path):
    objective = SpyGRPO()
    short = [row(f"Q: {i}?", MIXED) for i in range(2)]
    long = [row("Q: " + "a very long question indeed " * 4 + f"{i}?", MIXED) for i in range(2)]
    module = tandem_module(objective=objective, max_prompt_tokens=20)  # one character per token
    fit(module, RowsDataModule(short + long, batch_size=4), tmp_path)
    (logged,) = train_rows(module)
    assert logged["train/skipped_long_prompts"] == 2.0
    (inputs,) = objective.calls
    assert inputs.group.unique().numel() == 2  # only the two short prompts were rolled out
    assert inputs.logp.shape[0] == 2 * 4


def test_a_run_whose_prompts_are_all_too_long_stops_with_an_error(tmp_path):
    long = [row("Q: " + "a very long question indeed " * 4 + f"{i}?", MIXED) for i in range(4)]
    module = tandem_module(max_prompt_tokens=20, max_idle_steps=2)
    with pytest.raises(TrainingStalledError, match="max_prompt_tokens=20"):
        # max_epochs bounds the test; a user's run (max_steps only) would never end
        fit(module, RowsDataModule(long, batch_size=4), tmp_path, steps=1, max_epochs=3)


def test_fewer_fitting_prompts_than_processes_is_an_idle_step_with_its_own_error():
    """On W processes a step trains a multiple of W of the prompts that fit (docs/distributed.md);
    the two-process runs of tests/test_distributed_sampling.py reach the other stop lines."""
    module = tandem_module(max_prompt_tokens=20, max_idle_steps=2)
    module.idle_steps.count(True, fitting=1, world=2)  # the first idle step passes
    with pytest.raises(TrainingStalledError, match="fewer than 2 prompts of each of the last 2 batches fit "
                                                   "rollout.max_prompt_tokens=20, and the 2 processes train equal shares"):
        module.idle_steps.count(True, fitting=1, world=2)


# ------------------------------------------------------------------------------- span limit


@pytest.fixture(scope="module")
def small_alphabet_dir(tmp_path_factory):
    """A tiny model folder over 8 characters: a random model writes a space every few tokens."""
    from tandem_lit.models.tiny import char_tokenizer, tiny_llama_config, write_model_dir

    tokenizer = char_tokenizer("abcde .\n")
    return write_model_dir(tmp_path_factory.mktemp("small") / "model", tiny_llama_config(len(tokenizer)), tokenizer)


@pytest.mark.parametrize("policy_class,limit", [(WordHandoff, 3), (TokenHandoff, 5)])
def test_max_spans_ends_a_rollout_as_truncated_after_that_many_spans(small_alphabet_dir, policy_class, limit):
    module = tandem_module(
        senior=ModelSource(str(small_alphabet_dir), random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource(str(small_alphabet_dir), random_init=True, init_seed=2, dtype="float32"),
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=32),
    )
    module.configure_model()
    rows = [{"prompt": "a bad cab.", "chars": MIXED}, {"prompt": "dead bead", "chars": MIXED}]
    free = module.rollouts.generate(rows, policy_class(p=0.5), module.sampling, key=3).rollout
    limited = module.rollouts.generate(rows, policy_class(p=0.5, max_spans=limit), module.sampling, key=3).rollout
    classes = TokenClasses.from_tokenizer(module.tokenizer)
    cut = 0
    for i in range(len(free.texts)):
        n_free, n_lim = int(free.lengths[i]), int(limited.lengths[i])
        tokens = free.completion_ids[i, :n_free]
        # a span starts at the first token and at each later boundary: every token, or a word start
        # (a token that begins with whitespace and is not a special token)
        word_start = classes.starts_ws[tokens] & ~classes.special[tokens]
        starts = [0] + [t for t in range(1, n_free) if policy_class is TokenHandoff or bool(word_start[t])]
        assert torch.equal(limited.completion_ids[i, :n_lim], tokens[:n_lim])  # same seeds: a prefix
        assert torch.equal(limited.author[i, :n_lim], free.author[i, :n_lim])
        assert int(limited.decisions[i]) <= limit
        if len(starts) > limit:  # it would start one span too many: it ends right before it, truncated
            assert n_lim == starts[limit]
            assert bool(limited.truncated[i]) and not bool(limited.finished[i])
            cut += 1
        else:
            assert n_lim == n_free and bool(limited.truncated[i]) == bool(free.truncated[i])
    assert cut > 0, f"the test needs rollouts with more than {limit} spans"


# -------------------------------------------------------------------- checkpoint selection


CHECKPOINT_RUN = [
    "fit", "--config", "configs/gsm8k_tiny.yaml", "--trainer.logger", "false",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.max_steps", "3", "--trainer.val_check_interval", "1", "--trainer.limit_val_batches", "1",
    "--data.init_args.batch_size", "2", "--data.init_args.eval_batch_size", "4",
    "--model.init_args.rollout.sampling.n", "2", "--model.init_args.rollout.sampling.max_new_tokens", "12",
    "--model.init_args.evaluation.sampling", "{temperature: 1.0, n: 2, max_new_tokens: 16, seed: 0}",
    "--model.init_args.evaluation.modes", "[senior]", "--model.init_args.evaluation.at_start", "false",
    # a text-dependent reward, so that held-out pass@2 is neither 0 nor 1 and moves between steps
    "--model.init_args.verifier", "test_training_features.AnyCharVerifier",
    "--model.init_args.objective", "{class_path: GRPO}",
    "--best_checkpoint.monitor", "eval/senior_pass_at_2",
]


def checkpoint_callback_state(checkpoint: dict) -> dict:
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("ModelCheckpoint")]
    return checkpoint["callbacks"][key]


def eval_history(module: TandemModule, metric: str) -> dict[int, float]:
    return {row["step"]: row[metric] for row in module.history if metric in row}


def test_checkpoint_selection_by_held_out_pass_at_k(tmp_path):
    root = tmp_path / "run"
    cli = build_cli([*CHECKPOINT_RUN, "--trainer.default_root_dir", str(root),
                     "--best_checkpoint.filename", "best-step{step}-pass2={eval/senior_pass_at_2:.4f}"])
    scores = eval_history(cli.model, "eval/senior_pass_at_2")
    assert sorted(scores) == [1, 2, 3]  # validated after every update
    assert 0.0 < max(scores.values()), scores
    folder = root / "checkpoints"
    best = list(folder.glob("best-*.ckpt"))
    assert len(best) == 1, sorted(p.name for p in folder.iterdir())  # save_top_k: 1
    callback = cli.trainer.checkpoint_callback
    assert Path(callback.best_model_path) == best[0]
    best_score = max(scores.values())
    best_step = min(step for step, value in scores.items() if value == best_score)  # ties keep the first
    assert float(callback.best_model_score) == pytest.approx(best_score)
    assert best[0].name == f"best-step{best_step}-pass2={best_score:.4f}.ckpt"
    saved = torch.load(best[0], weights_only=False, map_location="cpu")
    assert saved["global_step"] == best_step  # the weights that were validated, not later ones
    state = checkpoint_callback_state(saved)
    assert float(state["current_score"]) == pytest.approx(best_score)
    assert state["monitor"] == "eval/senior_pass_at_2"
    assert set(saved["state_dict"]) and all(k.startswith("senior.") for k in saved["state_dict"])


def test_checkpoint_monitor_alone_selects_the_best_validation(tmp_path):
    cli = build_cli([*CHECKPOINT_RUN, "--trainer.default_root_dir", str(tmp_path / "run")])
    callback = cli.trainer.checkpoint_callback
    scores = eval_history(cli.model, "eval/senior_pass_at_2")
    assert callback.best_model_path, "no best checkpoint was written"
    assert float(callback.best_model_score) == pytest.approx(max(scores.values()))


# ---------------------------------------------------------------------------- precision


def test_a_bfloat16_full_weight_senior_is_refused_unless_allowed():
    """AdamW on bf16 weights at lr 1e-6 loses most updates to rounding: fail closed, say why."""
    bf16 = dict(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="bfloat16"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="bfloat16"),
    )
    with pytest.raises(ConfigError, match="float32"):
        tandem_module(**bf16).configure_model()
    tandem_module(**bf16, allow_low_precision_weights=True).configure_model()  # a deliberate choice
    with_lora = tandem_module(**bf16, lora=LoraSettings(r=4, alpha=8))
    with_lora.configure_model()  # the adapters train in float32 (peft upcasts them)
    trainable = [p for p in with_lora.senior.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)


def test_bf16_mixed_precision_runs_a_tandem_step(tmp_path):
    module = tandem_module()
    trainer = fit(module, RowsDataModule([row(f"Q: {i}?", MIXED) for i in range(4)], batch_size=4), tmp_path,
                  precision="bf16-mixed")
    assert trainer.global_step == 1


def test_dynamic_sampling_settings_are_checked():
    with pytest.raises(ConfigError, match="prompts_per_step"):
        DynamicSampling(prompts_per_step=0)
    assert json.dumps(DynamicSampling(prompts_per_step=2).__dict__)  # plain, loggable settings


def test_a_large_rollout_logp_gap_warns_once_per_run_naming_tis_cap(caplog):
    """A mean gap past update.logp_gap_warning means importance ratios far outside the clip range:
    said once (not every step), with the setting that corrects for it; a normal gap says nothing."""
    from tandem_lit.objectives import GRPO
    from tandem_lit.rollout.sampling import SamplingConfig
    from tandem_lit.training.settings import MemorySettings, UpdateSettings
    from tandem_lit.training.update_phase import UpdatePhase

    phase = UpdatePhase(UpdateSettings(logp_gap_warning=0.2), MemorySettings(), GRPO(), SamplingConfig())
    with caplog.at_level("WARNING", logger="tandem_lit.training.update_phase"):
        phase.check_logp_gap({"rollout_logp_gap_mean": 0.06})
        assert not caplog.records
        phase.check_logp_gap({"rollout_logp_gap_mean": 0.51})
        phase.check_logp_gap({"rollout_logp_gap_mean": 0.7})
        quiet = UpdatePhase(UpdateSettings(logp_gap_warning=None), MemorySettings(), GRPO(), SamplingConfig())
        quiet.check_logp_gap({"rollout_logp_gap_mean": 5.0})
    (record,) = caplog.records
    assert "0.510 nats" in record.getMessage() and "tis_cap" in record.getMessage()


class OffByTwoEngine(FastEngine):
    """An engine that reports each token's log-prob 2 nats too low: what a broken weight sync or
    engine looks like from the update's side."""

    def generate(self, prompts, policy, sampling):
        rollout = super().generate(prompts, policy, sampling)
        return dataclasses.replace(rollout, senior_logprobs=rollout.senior_logprobs - 2.0)


def test_a_logp_gap_past_the_limit_stops_the_run_before_its_first_update(tmp_path):
    """update.logp_gap_limit (1 nat by default): the run stops with one line before the step's
    first optimizer update, so the weights are the ones it started from; a normal gap trains."""
    from tandem_lit.errors import LogprobGapError

    data = RowsDataModule([row(f"q{i} ", VOWELS) for i in range(4)], batch_size=2)
    broken = tandem_module(engine=OffByTwoEngine(rollout_dtype="float32"), mini_batch_size=1)
    broken.configure_model()
    start = {name: p.detach().clone() for name, p in broken.senior.named_parameters()}
    with pytest.raises(LogprobGapError, match=r"2\.0\d\d nats .* update\.logp_gap_limit=1\): .* was not applied"):
        fit(broken, data, tmp_path / "broken")
    assert all(torch.equal(p, start[name]) for name, p in broken.senior.named_parameters())

    healthy = tandem_module(engine=FastEngine(rollout_dtype="float32"), mini_batch_size=1)
    fit(healthy, data, tmp_path / "healthy")
    assert 0 <= train_rows(healthy)[-1]["train/rollout_logp_gap_mean"] < 1e-3


def test_a_head_with_rows_past_the_tokenizer_is_scored_over_what_the_engine_samples(tmp_path):
    """The head has 64 rows more than the tokenizer has tokens (as Qwen3's 151,936 rows for
    151,669 tokens, or a Qwen3.5 head read by another tokenizer in a benchmark). The engine draws
    among the tokenizer's tokens; the update normalises over the same ones, so the float32 gap
    stays 0 instead of ~log(164 / 100) = 0.49 nats on random weights, whose padding rows carry mass."""
    import shutil

    folder = tmp_path / "padded_head"
    shutil.copytree(Path(__file__).resolve().parents[1] / "configs/tiny/senior", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    data = RowsDataModule([row(f"q{i} ", VOWELS) for i in range(4)], batch_size=2)
    module = tandem_module(engine=FastEngine(rollout_dtype="float32"), mini_batch_size=1,
                           senior=ModelSource(str(folder), random_init=True, init_seed=1, dtype="float32"),
                           junior=ModelSource(str(folder), random_init=True, init_seed=2, dtype="float32"))
    fit(module, data, tmp_path / "run")
    assert 0 <= train_rows(module)[-1]["train/rollout_logp_gap_mean"] < 1e-3
    assert module.updates.vocab == len(module.tokenizer) == config["vocab_size"]
    assert module.senior.get_output_embeddings().weight.shape[0] == config["vocab_size"] + 64


def test_update_passes_run_without_lora_dropout(tmp_path):
    """LoRA dropout 0.5 (SFT's setting) on the tiny senior: the update's passes must not draw
    dropout masks. Two no-grad passes (old log-probs) give identical log-probs in train mode, and at
    lr 0 the later mini-batch's training forward equals its old log-probs computed before the first
    update (ratio 1 at its first pass, not e^(mask noise))."""
    objective = SpyGRPO()
    module = tandem_module(objective=objective, lora=LoraSettings(r=4, alpha=8, dropout=0.5), mini_batch_size=1,
                           optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    module.configure_model()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters as after some training (peft starts B at 0: no dropout would show)
        for name, p in module.senior.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    captured = spy_on_optimise(module)
    fit(module, RowsDataModule([row(f"q{i} ", VOWELS) for i in range(2)], batch_size=2), tmp_path, steps=2)
    # (the first mini-batch's old log-probs are its own forward's, detached: the same storage)
    later = [call for call in objective.calls if call.old_logp.data_ptr() != call.logp.data_ptr()]
    assert later, "the second mini-batch's passes take their old log-probs from the no-grad pass"
    for call in later:
        senior = call.author == Author.SENIOR
        ratio = torch.exp(call.logp.detach() - call.old_logp)[senior]
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), ratio
    module.senior.train()
    rollout = captured["result"].rollout
    first = module.updates.behaviour_logprobs(rollout, module.device)
    assert torch.equal(first, module.updates.behaviour_logprobs(rollout, module.device))
    dropouts = [m for m in module.senior.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)


class OffByTwoOddRowsEngine(FastEngine):
    """An engine that reports the log-probs of every other row 2 nats too low: those rows look
    drawn from another policy."""

    def generate(self, prompts, policy, sampling):
        rollout = super().generate(prompts, policy, sampling)
        shift = torch.zeros_like(rollout.senior_logprobs)
        shift[1::2] = 2.0
        return dataclasses.replace(rollout, senior_logprobs=rollout.senior_logprobs - shift)


def test_mismatch_metrics_and_geometric_sequence_masking_in_a_step(tmp_path):
    """A float32 engine agrees with the trainer: mismatch_kl 0, mismatch_ess 1, no row masked. An
    engine off by 2 nats on every other row: geo_mask leaves exactly those rows (the ones with a
    senior token) out of the loss, and the metrics see the mismatch (per such token the weight is
    e^2, its k3 e^2 - 3)."""
    data = RowsDataModule([row(f"q{i} ", VOWELS) for i in range(4)], batch_size=2)
    healthy = tandem_module(engine=FastEngine(rollout_dtype="float32"), objective=SpyGRPO(geo_mask=1.5))
    fit(healthy, data, tmp_path / "healthy")
    logged = train_rows(healthy)[-1]
    assert logged["train/mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert logged["train/mismatch_ess"] == pytest.approx(1.0, abs=1e-6)
    assert logged["train/geo_masked_fraction"] == 0.0 and logged["train/included_fraction"] == 1.0

    objective = SpyGRPO(geo_mask=1.5)
    broken = tandem_module(engine=OffByTwoOddRowsEngine(rollout_dtype="float32"), objective=objective,
                           logp_gap_limit=None, logp_gap_warning=None)
    captured = spy_on_optimise(broken)
    fit(broken, data, tmp_path / "broken")
    logged = train_rows(broken)[-1]
    author = captured["result"].rollout.author
    has_senior = (author == Author.SENIOR).any(-1)
    shifted = torch.zeros_like(has_senior)
    shifted[1::2] = True
    masked = (shifted & has_senior).float().mean().item()
    assert masked > 0
    assert logged["train/geo_masked_fraction"] == pytest.approx(masked)
    assert logged["train/included_fraction"] == pytest.approx(1 - masked)
    (inputs,) = objective.calls
    assert torch.equal(inputs.mask.cpu(), ~(shifted & has_senior))
    senior = author == Author.SENIOR
    share = (senior & shifted.unsqueeze(-1)).sum().item() / senior.sum().item()  # tokens at weight e^2
    assert logged["train/mismatch_kl"] == pytest.approx(share * (math.exp(2) - 3), rel=1e-3)
    ess = (share * math.exp(2) + 1 - share) ** 2 / (share * math.exp(4) + 1 - share)
    assert logged["train/mismatch_ess"] == pytest.approx(ess, rel=1e-3)


def test_logp_gap_limit_must_be_positive():
    from tandem_lit.training.settings import UpdateSettings

    with pytest.raises(ConfigError, match="logp_gap_limit must be > 0"):
        UpdateSettings(logp_gap_limit=0.0)
    assert UpdateSettings(logp_gap_limit=None).logp_gap_limit is None


# ------------------------------------------------------------------------------ host reads


class CountingReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what would make the host wait for a CUDA device: scalar reads (``item``, ``bool``,
    ``int``, ``float``: ``_local_scalar_dense``), ``nonzero`` (boolean indexing), and ``tolist``
    (counted by ``reading_tolist``, which reads memory without an op)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("_local_scalar_dense", "nonzero"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


def update_reads(tmp_path, monkeypatch, micro_batch_size: int) -> int:
    module = tandem_module(micro_batch_size=micro_batch_size)
    run, counter = module.updates.run, CountingReads()
    tolist = torch.Tensor.tolist

    def reading_tolist(tensor):
        counter.reads += 1
        return tolist(tensor)

    def counting(*args, **kwargs):
        with counter, monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "tolist", reading_tolist)
            return run(*args, **kwargs)

    module.updates.run = counting
    fit(module, RowsDataModule([row("p", ALWAYS)] * 4), tmp_path / str(micro_batch_size))
    return counter.reads


def test_an_update_reads_back_per_update_not_per_pass(tmp_path, monkeypatch):
    """On a GPU each read of a device value waits for every pass queued before it: an update of
    16 rows in 16 passes must read as often as in 4 (tests/test_gpu_training.py counts CUDA's
    syncs on a real device; this is the CPU guard of the same property)."""
    few, many = update_reads(tmp_path, monkeypatch, 4), update_reads(tmp_path, monkeypatch, 1)
    assert 0 < few == many, (few, many)
