"""Rollout weights: the engine's bf16 copy of the senior (LoRA merged), the load_weights seam,
its refresh after every optimiser update inside Lightning's loop, and the rollout-vs-train
log-prob gap."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from conftest import tiny_tandem_module
from peft import LoraConfig, get_peft_model

from tandem_lit.data import GSM8KDataModule
from tandem_lit.models import LoraSettings
from tandem_lit.models.tiny import tiny_llama_config
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import FastEngine, HFEngine, SamplingConfig
from tandem_lit.rollout.weights import (
    WeightSyncError,
    build_rollout_copy,
    load_named_tensors,
    rollout_named_tensors,
)
from tandem_lit.verifiers.base import Grade, Verifier

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]


def lora_llama(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(100, hidden=64, layers=2))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():  # LoRA B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model


def test_named_tensors_are_the_merged_plain_model():
    model = lora_llama()
    merged = copy.deepcopy(model).merge_and_unload()
    expected = dict(merged.named_parameters())
    produced = dict(rollout_named_tensors(model))
    assert produced.keys() == expected.keys()  # plain names: no base_layer, no lora_A/B
    for name, tensor in produced.items():
        torch.testing.assert_close(tensor.float(), expected[name].detach().float(), atol=1e-5, rtol=1e-5)
    changed = [n for n in produced if "q_proj" in n and not torch.equal(produced[n], model.get_base_model().get_submodule(n.removesuffix(".weight")).base_layer.weight)]
    assert changed, "the adapters should change the merged q_proj weights"


def test_copy_is_a_frozen_bf16_plain_model_and_loading_checks_names():
    model = lora_llama()
    rollout = build_rollout_copy(model, torch.bfloat16)
    assert not hasattr(rollout, "peft_config") and all(p.dtype == torch.bfloat16 for p in rollout.parameters())
    assert all(not p.requires_grad for p in rollout.parameters()) and not rollout.training
    assert load_named_tensors(rollout, rollout_named_tensors(model)) == len(dict(rollout.named_parameters()))
    for name, tensor in rollout_named_tensors(model):
        assert torch.equal(dict(rollout.named_parameters())[name], tensor.to(torch.bfloat16))
    with pytest.raises(WeightSyncError, match="not a parameter"):
        load_named_tensors(rollout, [("model.nonsense.weight", torch.zeros(1))])
    with pytest.raises(WeightSyncError, match="shape"):
        load_named_tensors(rollout, [("model.norm.weight", torch.zeros(3))])
    with pytest.raises(WeightSyncError, match="unset"):
        load_named_tensors(rollout, [("model.norm.weight", torch.ones(64))])


@pytest.mark.parametrize("engine_class", [FastEngine, HFEngine])
def test_engines_decode_a_copy_only_when_the_weights_need_converting(char_tok, engine_class):
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM(tiny_llama_config(len(char_tok), hidden=64, layers=2)).eval()
    engine = engine_class()  # auto: the weights' own dtype on CPU
    engine.setup(plain, None, char_tok)
    assert not engine.decodes_copy and engine.senior is plain
    with pytest.raises(Exception, match="nothing to load"):
        engine.load_weights(rollout_named_tensors(plain))
    engine = engine_class(rollout_dtype="bfloat16")
    engine.setup(plain, None, char_tok)
    assert engine.decodes_copy and next(engine.senior.parameters()).dtype == torch.bfloat16
    assert engine.trained_senior is plain
    lora = lora_llama()
    engine = engine_class()
    engine.setup(lora, None, char_tok)
    assert engine.decodes_copy, "adapters are merged into a copy"
    with pytest.raises(Exception, match="rollout_dtype"):
        engine_class(rollout_dtype="int8")


class SpaceVerifier(Verifier):
    """Reward 1 when the completion has a space: random tiny models get mixed groups."""

    def grade(self, completion: str, **columns) -> Grade:
        return Grade(correct=" " in completion, reward=float(" " in completion))


class CheckingEngine(FastEngine):
    """A FastEngine that records, at every rollout, whether its copy equals the bf16 cast of the
    trained weights at that moment."""

    def generate(self, prompts, policy, sampling):
        rollout_params = dict(self.senior.named_parameters())
        self.checks.append(all(
            torch.equal(rollout_params[name], tensor.to(torch.bfloat16)) for name, tensor in rollout_named_tensors(self.trained_senior)
        ))
        self.versions.append(self.weights_version)
        return super().generate(prompts, policy, sampling)


@pytest.mark.parametrize("lora", [False, True])
def test_every_rollout_after_an_update_decodes_the_updated_weights(tmp_path, lora):
    engine = CheckingEngine(rollout_dtype="bfloat16")
    engine.checks, engine.versions = [], []
    module = tiny_tandem_module(
        verifier=SpaceVerifier(),
        objective=GRPO(),
        engine=engine,
        lora=LoraSettings(r=4, alpha=8, dropout=0.0) if lora else None,
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=12),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        mini_batch_size=1,  # two updates per step: the copy follows the last one
        rollout_batch_size=3,  # 3 of a step's 8 rollouts at once, the rest refilled as they finish
    )
    trainer = L.Trainer(
        max_steps=6, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    assert trainer.global_step == 6 and len(engine.checks) == 3
    assert all(engine.checks), "a rollout decoded weights older than the last update"
    assert engine.versions == [0, 1, 2], "one load per rollout phase after updates"
    assert all(not p.requires_grad and p.grad is None for p in engine.senior.parameters())
    assert all(p.grad is None for p in module.senior.parameters()), "gradients are freed after the update"
    steps = [row for row in module.history if "train/loss" in row]
    # the bf16 copy and the float32 training model differ a little, never by much, never by 0
    assert all(0 < row["train/rollout_logp_gap_mean"] < 0.1 for row in steps)
    assert all(row["train/rollout_logp_gap_max"] >= row["train/rollout_logp_gap_mean"] for row in steps)
    assert all(row["train/rollout_setup_seconds"] > 0 for row in steps), "caches are released and re-allocated"
    assert all(0 < row["train/rollout_busy_slot_fraction"] <= 1 for row in steps)
    assert all(0 < row["train/rollout_mean_live_rows"] <= 3 for row in steps), "rows writing a token in a mean decode step, of 3 at once"
    assert all(row["train/rollout_refilled_sequences"] == 8 - 3 and row["train/rollout_refills"] >= 1 for row in steps)
