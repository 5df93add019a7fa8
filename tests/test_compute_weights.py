"""ComputeWeights: bf16 copies of the linear weights cast once per update give the gradients that
autocast's cast in every forward gives (memory.cast_weights_once)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import grouped_settings
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tandem_lit.models import ModelSource
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import SamplingConfig, WordHandoff
from tandem_lit.training import TandemModule
from tandem_lit.training.compute_weights import ComputeWeights, autocast_dtype
from tandem_lit.training.settings import MemorySettings
from tests.test_gpu_training import HasSpaceVerifier, Rows


def tiny_llama(tied: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).float()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def same(actual: torch.Tensor, expected: torch.Tensor, device: str, name: str) -> None:
    """Bit for bit on the CPU; on a GPU within float32 rounding (its attention backward adds with atomics)."""
    if device == "cpu":
        assert torch.equal(actual, expected), name
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-8, msg=name)


def gradients(model: nn.Module, batches: list[torch.Tensor], once: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and the summed gradients of ``batches`` as passes of one update under bf16 autocast."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    losses = []
    with torch.autocast(device.type, dtype=torch.bfloat16):
        with ComputeWeights(model, autocast_dtype(device) if once else None):
            for ids in batches:
                ids = ids.to(device)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(float(loss.detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batches(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, 12), generator=generator) for _ in range(3)]


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_equal_autocasts_bit_for_bit_and_the_float32_weights_come_back(device):
    model = tiny_llama(tied=False).to(device)
    masters = {n: p for n, p in model.named_parameters()}
    plain_losses, plain = gradients(model, batches(), once=False)
    once_losses, once = gradients(model, batches(), once=True)
    assert once_losses == plain_losses
    assert set(once) == set(plain) == set(masters)  # every weight got its gradient, in its master
    for name, grad in plain.items():
        assert once[name].dtype == torch.float32
        same(once[name], grad, device, name)
    for name, p in model.named_parameters():  # the same float32 parameters, in place again
        assert p is masters[name] and p.dtype == torch.float32


def test_inside_the_linear_weights_are_bf16_copies_and_norms_and_embeddings_stay_float32():
    model = tiny_llama(tied=False)
    master = model.model.layers[0].self_attn.q_proj.weight
    with ComputeWeights(model, torch.bfloat16):
        layer = model.model.layers[0]
        assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.bfloat16
        assert layer.input_layernorm.weight.dtype == torch.float32
        assert model.model.embed_tokens.weight.dtype == torch.float32
        assert torch.equal(layer.self_attn.q_proj.weight, master.detach().to(torch.bfloat16))  # autocast's rounding
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_a_tied_head_gets_both_its_gradients_and_stays_tied(device):
    model = tiny_llama(tied=True).to(device)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _, plain = gradients(model, batches(), once=False)
    _, once = gradients(model, batches(), once=True)
    for name, grad in plain.items():  # the head's and the embedding's parts add in another order
        torch.testing.assert_close(once[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_lora_adapters_train_through_copies_and_the_frozen_base_gets_no_gradient():
    def lora_model():
        return get_peft_model(tiny_llama(tied=False), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    plain_model, once_model = lora_model(), lora_model()
    _, plain = gradients(plain_model, batches(), once=False)
    _, once = gradients(once_model, batches(), once=True)
    assert set(once) == set(plain) and all("lora_" in name for name in once)
    for name, grad in plain.items():
        assert torch.equal(once[name], grad), name


def test_without_autocast_nothing_is_swapped():
    model = tiny_llama(tied=False)
    weight = model.lm_head.weight
    with ComputeWeights(model, autocast_dtype(torch.device("cpu"))):  # autocast is off here
        assert model.lm_head.weight is weight
    with ComputeWeights(model, torch.float32):
        assert model.lm_head.weight is weight


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "untied-head"])
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_a_bf16_mixed_step_updates_the_senior_as_autocasts_cast_per_forward_does(tmp_path, mini_batches, tied):
    """End to end on the CPU under Lightning's bf16-mixed, word handoff (switch terms read the head a
    second time in each pass): the same rollouts, the same update of every weight. A tied head
    stays under autocast (``ComputeWeights``): with a bf16 copy, the embedding's and the head's
    gradients met in bf16 and the tied weight's step differed by bf16 rounding."""
    senior = Path("configs/tiny/senior")
    if not tied:
        senior = tmp_path / "untied"
        shutil.copytree("configs/tiny/senior", senior)
        config = json.loads((senior / "config.json").read_text())
        (senior / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=False)))
    deltas = {}
    for once in (False, True):
        torch.manual_seed(0)
        module = TandemModule(**grouped_settings(
            senior=ModelSource(str(senior), random_init=True, init_seed=1, dtype="float32"),
            junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
            verifier=HasSpaceVerifier(), objective=GRPO(), handoff=WordHandoff(p=0.5),
            sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=24), eval_modes=["senior"],
            evaluate_at_start=False, completions_every_n_steps=0, max_grad_norm=None,
            mini_batch_size=2 // mini_batches, micro_batch_size=2,
            optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
            memory=MemorySettings(cast_weights_once=once),
        ))
        module.configure_model()
        seen = []  # the dtype of a linear weight in each training forward
        forward = module.updates.sequence_logprobs

        def spy(model, part, *args, seen=seen, forward=forward, **kwargs):
            seen.append(next(m for m in model.modules() if isinstance(m, nn.Linear)).weight.dtype)
            return forward(model, part, *args, **kwargs)

        module.updates.sequence_logprobs = spy
        before = {n: p.detach().clone() for n, p in module.senior.named_parameters()}
        L.Trainer(max_steps=mini_batches, logger=False, enable_checkpointing=False, limit_val_batches=0,
                  accelerator="cpu", devices=1, precision="bf16-mixed", enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=str(tmp_path / str(once))).fit(module, datamodule=Rows(batch_size=2))
        assert seen and set(seen) == {torch.bfloat16 if once else torch.float32}
        deltas[once] = {n: p.detach() - before[n] for n, p in module.senior.named_parameters()}
        assert all(p.dtype == torch.float32 for p in module.senior.parameters())
    assert any(float(d.abs().max()) > 0 for d in deltas[False].values())
    for name, delta in deltas[False].items():
        torch.testing.assert_close(deltas[True][name], delta, rtol=1e-5, atol=1e-7, msg=name)
