"""TandemModule with real tiny models and a real Lightning Trainer: what moves and what must not,
LoRA, micro-batching, teacher-forced log-probs, failing closed on authorship, and resume."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from conftest import tiny_tandem_module

from tandem_lit.cli import build_cli
from tandem_lit.data import GSM8KDataModule
from tandem_lit.errors import ConfigError, NonFiniteGradientError
from tandem_lit.models import LoraSettings, ModelSource
from tandem_lit.objectives import AuthorshipError, SoftMaskedReinforce
from tandem_lit.rollout import Author, Rollout, SamplingConfig, SoloHandoff, WordHandoff
from tandem_lit.training.module import TandemModule
from tandem_lit.verifiers import GSM8KVerifier
from tests.conftest import grouped_settings

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),  # the frozen junior, on purpose
    pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]


def tandem_module(**overrides) -> TandemModule:
    settings = dict(
        verifier=GSM8KVerifier(),
        # random tiny models never answer right: c = -0.5 still gives a learning signal
        objective=SoftMaskedReinforce(),
        sampling=SamplingConfig(temperature=1.0, n=2, max_new_tokens=12),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )
    return tiny_tandem_module(**{**settings, **overrides})


def fit(module: TandemModule, root, steps: int = 1) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=steps, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu",
        devices=1, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
    )
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    return trainer


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_step_moves_the_senior_and_never_the_junior(tmp_path):
    module = tandem_module()
    module.configure_model()
    senior_before, junior_before = snapshot(module.senior), snapshot(module.junior)
    trainer = fit(module, tmp_path)
    assert trainer.global_step == 1
    changed = [n for n, p in module.senior.named_parameters() if not torch.equal(p, senior_before[n])]
    assert len(changed) > len(senior_before) // 2, changed
    for name, p in module.junior.named_parameters():
        assert torch.equal(p, junior_before[name]), f"junior weight {name} moved"
        assert not p.requires_grad and p.grad is None
    assert not module.junior.training
    optimised = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimised & {id(p) for p in module.junior.parameters()}
    assert optimised == {id(p) for p in module.senior.parameters()}
    path = tmp_path / "step.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["state_dict"]
    assert set(saved) == {f"senior.{n}" for n in senior_before}


def test_a_nonfinite_gradient_is_never_applied_and_stops_the_run(tmp_path):
    module = tandem_module(max_grad_norm=None)  # the check must not depend on clipping being on
    module.configure_model()
    before = snapshot(module.senior)
    # one NaN in one weight's gradient, as cuDNN's attention backward gave on an H200 (pytorch#196678)
    weight = module.senior.get_output_embeddings().weight
    weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("nan")))
    with pytest.raises(NonFiniteGradientError, match="gradient norm is nan at step 0: this update was not applied"):
        fit(module, tmp_path)
    for name, p in module.senior.named_parameters():
        assert torch.equal(p, before[name]), f"{name} moved"
        assert p.grad is None


def test_lora_trains_adapters_only(tmp_path):
    module = tandem_module(lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    module.configure_model()
    before = snapshot(module.senior)
    trainable = {n for n, p in module.senior.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    trainer = fit(module, tmp_path)
    for name, p in module.senior.named_parameters():
        if name in trainable:
            continue
        assert torch.equal(p, before[name]), f"frozen base weight {name} moved"
    assert any(not torch.equal(p, before[n]) for n, p in module.senior.named_parameters() if n in trainable)
    path = tmp_path / "lora.ckpt"
    trainer.save_checkpoint(path)
    assert set(torch.load(path, weights_only=False)["state_dict"]) == {f"senior.{n}" for n in trainable}


def test_micro_batching_does_not_change_the_update(tmp_path):
    """One update from 4 rollouts: accumulated over micro-batches of 1 it equals one pass of 4."""
    results = []
    for micro in (1, 4):
        module = tandem_module(micro_batch_size=micro, max_grad_norm=None)
        fit(module, tmp_path / str(micro))
        results.append(snapshot(module.senior))
    for name, value in results[0].items():
        assert torch.allclose(value, results[1][name], atol=1e-6, rtol=1e-5), name


def test_teacher_forced_logprobs_ignore_padding():
    """Log-probs of a batch (left-padded prompts, right-padded completions) equal each row's own
    unpadded forward pass, divided by the sampling temperature."""
    module = tandem_module(sampling=SamplingConfig(temperature=0.7, n=2, max_new_tokens=10))
    module.configure_model()
    rows = [{"prompt": "Question: 1+1?\nAnswer:", "answer": "2"},
            {"prompt": "Q: how many legs do three spiders have?\nA:", "answer": "24"}]
    result = module.rollouts.generate(rows, module.handoff, module.sampling, key=0)
    rollout = result.rollout
    assert result.group.tolist() == [0, 0, 1, 1] and result.columns["answer"] == ["2", "2", "24", "24"]
    with torch.no_grad():
        batched = module.updates.sequence_logprobs(module.senior, rollout)
        for i in range(4):
            prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()]
            n = int(rollout.lengths[i])
            completion = rollout.completion_ids[i, :n]
            ids = torch.cat([prompt, completion]).unsqueeze(0)
            logits = module.senior(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7
            alone = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(batched[i, :n], alone, atol=1e-4), i


def fake_rollout(author: list[list[int]], decisions: list[int], junior_draws: list[int]) -> Rollout:
    author_t = torch.tensor(author, dtype=torch.int8)
    rows, width = author_t.shape
    return Rollout(
        prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        completion_ids=torch.full((rows, width), 5), author=author_t,
        finished=torch.zeros(rows, dtype=torch.bool), truncated=torch.ones(rows, dtype=torch.bool),
        handoffs=torch.zeros(rows, dtype=torch.long), decisions=torch.tensor(decisions),
        junior_draws=torch.tensor(junior_draws), texts=[""] * rows,
    )


def test_check_authorship_fails_closed():
    module = tandem_module()
    S, J = int(Author.SENIOR), int(Author.JUNIOR)
    fine = fake_rollout([[S, S, J, J]] * 30, decisions=[2] * 30, junior_draws=[1] * 30)
    module.rollouts.check_authorship(fine, WordHandoff(p=0.5))
    with pytest.raises(AuthorshipError, match="all-senior"):
        module.rollouts.check_authorship(fake_rollout([[S, J]], [1], [0]), SoloHandoff("senior"))
    with pytest.raises(AuthorshipError, match="not following"):  # 0 of 60 draws with p=0.5
        module.rollouts.check_authorship(fake_rollout([[S, S, S, S]] * 30, [2] * 30, [0] * 30), WordHandoff(p=0.5))
    with pytest.raises(AuthorshipError, match="wrote no token"):
        module.rollouts.check_authorship(fake_rollout([[S, S, S, S]] * 2, [1, 1], [1, 0]), WordHandoff(p=0.5))
    missing = fake_rollout([[S, S]], [1], [0])
    missing.author = None
    with pytest.raises(AuthorshipError):
        module.rollouts.check_authorship(missing, WordHandoff(p=0.5))


def test_tandem_without_a_junior_is_refused():
    with pytest.raises(ConfigError, match="junior"):
        tandem_module(junior=None)
    with pytest.raises(ConfigError, match="junior"):
        tandem_module(junior=None, handoff=SoloHandoff("senior"), eval_modes=["senior", "tandem"])
    tandem_module(junior=None, handoff=SoloHandoff("senior"), eval_modes=["senior"])  # plain RL: fine


# ------------------------------------------------------------------------------------- resume

RESUME_ARGS = [
    "--config", "configs/gsm8k_tiny.yaml", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
    "--trainer.limit_val_batches", "0", "--model.init_args.evaluation.at_start", "false",
    "--model.init_args.objective", '{"class_path": "SoftMaskedReinforce"}',
    "--checkpoint.every_n_train_steps", "2", "--model.init_args.logging.completions_every_n_steps", "0",
    "--data.init_args.batch_size", "2", "--model.init_args.rollout.sampling.n", "2",
    "--model.init_args.rollout.sampling.max_new_tokens", "12",
]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, repo_root):
    """4 steps straight, and 2 steps then a resume from last.ckpt to step 4."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo_root)
        mp.setattr("sys.argv", ["tandem-lit"])
        straight_root = tmp_path_factory.mktemp("straight")
        straight = build_cli(["fit", *RESUME_ARGS, "--trainer.default_root_dir", str(straight_root), "--trainer.max_steps", "4"])
        root = tmp_path_factory.mktemp("resumed")
        build_cli(["fit", *RESUME_ARGS, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "2"])
        checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
        resumed = build_cli(["fit", *RESUME_ARGS, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "4",
                             "--ckpt_path", str(root / "checkpoints" / "last.ckpt")])
    return straight, checkpoint, resumed


def test_resume_restores_step_optimizer_and_loader_state(resume_runs):
    straight, checkpoint, resumed = resume_runs
    assert checkpoint["global_step"] == 2
    (loader_state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["epoch"] == 0 and loader_state["position"] >= 1  # the loader's place is saved
    assert all(k.startswith("senior.") for k in checkpoint["state_dict"])
    assert resumed.trainer.global_step == straight.trainer.global_step == 4
    adam_steps = {float(state["step"]) for state in resumed.trainer.optimizers[0].state.values()}
    assert adam_steps == {4.0}  # AdamW's moments came back from the checkpoint (else 2)
    assert len(resumed.model.history) == len(straight.model.history) == 4  # metric history carried over


def test_resume_is_bit_identical_to_an_uninterrupted_run(resume_runs):
    straight, checkpoint, resumed = resume_runs
    (loader_state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["position"] == 2  # two batches finished before the step-2 checkpoint
    a, b = straight.model.senior.state_dict(), resumed.model.senior.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_rollouts_in_engine_sized_chunks_equal_one_engine_call():
    from tandem_lit.objectives import GRPO

    def module(**settings):
        m = TandemModule(**grouped_settings(
            senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
            junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
            verifier=GSM8KVerifier(), objective=GRPO(), handoff=WordHandoff(0.5), **settings,
        ))
        m.configure_model()
        return m

    rows = [{"prompt": f"Q: {i}+{i}?", "answer": str(2 * i)} for i in range(5)]
    sampling = SamplingConfig(temperature=1.0, n=3, max_new_tokens=20)
    whole = module().rollouts.generate(rows, WordHandoff(0.5), sampling, key=7)
    chunked = module(rollout_batch_size=4).rollouts.generate(rows, WordHandoff(0.5), sampling, key=7)  # one prompt per call
    assert chunked.rollout.texts == whole.rollout.texts
    assert chunked.group.tolist() == whole.group.tolist() == [g for g in range(5) for _ in range(3)]
    assert torch.equal(chunked.rollout.author[:, :5], whole.rollout.author[:, :5])


def test_language_share_is_logged_for_training_rollouts_and_each_eval_mode(tmp_path):
    pytest.importorskip("py3langid")
    from tandem_lit.evaluation.language import LanguageShare

    module = tandem_module(
        language=LanguageShare(language="fr", languages=["en", "fr"], min_chars=1),
        sampling=SamplingConfig(temperature=1.0, n=2, max_new_tokens=40), eval_modes=["senior", "tandem"],
        eval_sampling=SamplingConfig(temperature=1.0, max_new_tokens=40),
    )
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, accelerator="cpu", devices=1, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), limit_val_batches=1, val_check_interval=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    train = next(row for row in module.history if "train/loss" in row)
    assert 0.0 <= train["train/language_share"] <= 1.0 and 0.0 <= train["train/senior_language_share"] <= 1.0
    evaluated = next(row for row in module.history if "eval/senior_accuracy" in row)
    assert 0.0 <= evaluated["eval/senior_language_share"] <= 1.0 and 0.0 <= evaluated["eval/tandem_language_share"] <= 1.0


def test_the_update_reports_the_time_of_each_of_its_parts(tmp_path, monkeypatch):
    """train/update_{logprob,passes,optimizer}_seconds: each part charged with its own time. The
    old-log-prob forward (two PPO mini-batches: the second's) is slowed by 0.3 s, so it must show
    under logprob and nowhere else, and the parts add up to the update's time."""
    from tandem_lit.objectives import GRPO
    from tandem_lit.training.update_phase import UpdatePhase

    behaviour = UpdatePhase.behaviour_logprobs

    def slow_behaviour(self, *args, **kwargs):
        time.sleep(0.3)
        return behaviour(self, *args, **kwargs)

    monkeypatch.setattr(UpdatePhase, "behaviour_logprobs", slow_behaviour)
    module = tandem_module(objective=GRPO(), mini_batch_size=1)
    fit(module, tmp_path, steps=2)  # one rollout step of 2 prompts = two updates
    row = module.history[-1]
    logprob, passes, optimizer = (row[f"train/update_{part}_seconds"] for part in ("logprob", "passes", "optimizer"))
    assert row["train/updates"] == 2.0
    assert 0.3 <= logprob < 0.3 + passes and passes > 0 and optimizer > 0
    assert logprob + passes + optimizer <= row["train/update_seconds"] <= logprob + passes + optimizer + 0.5
