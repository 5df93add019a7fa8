"""Liger-Kernel's compiled kernels on a GPU against the PyTorch path (``memory.fused_kernels``).

Skipped without CUDA and liger-kernel. The log-probs of a Qwen3-architecture model with the real
vocabulary (151,936 rows: several head chunks) over ragged rows, padded and packed, normalised over
all the head's rows and over the tokenizer's 151,669 (the engine's sampled vocabulary, which the
fused head masks rather than slices):
- float32 (no autocast): equal to float32 rounding;
- bf16-mixed over float32 weights (Lightning's autocast, no cast cache): within bf16 tolerance,
  measured as no further from the float32 log-probs than the PyTorch bf16 path is, and gradients
  pointing the same way;
then one Lightning step of the tiny tandem pair with ``fused_kernels: liger`` (the update moves the
senior as ``off`` does; the junior and the engine's rollout copy keep transformers' code).

    pip install --no-deps liger-kernel==0.8.5 && pytest tests/test_liger_gpu.py
"""

from __future__ import annotations

import copy
import importlib.util
import logging

import lightning as L
import pytest
import torch

from tandem_lit.models import ModelSource, liger
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import SamplingConfig, WordHandoff
from tandem_lit.rollout.logprobs import completion_logprobs
from tandem_lit.training.module import TandemModule
from tandem_lit.training.settings import MemorySettings
from tests.conftest import grouped_settings, ragged_rollout
from tests.test_gpu_training import HasSpaceVerifier, Rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel"),
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
]

VOCAB = 151_936
SAMPLED_VOCAB = 151_669  # Qwen3's tokenizer: the engine samples from these; the head's other rows are padding
TEMPERATURE = 0.6


def qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, initializer_range=0.05,
                         rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.train()


def logprobs_and_grad(model, rollout, packed: bool, fused: bool, autocast: bool, vocab: int | None = None):
    """Completion log-probs and the flattened gradient of a weighted sum of them."""
    written = rollout.completion_mask
    weights = torch.linspace(-1, 1, written.numel(), device="cuda").view_as(written) * written
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
        logp = completion_logprobs(model, rollout, TEMPERATURE, packed=packed, fused=fused, vocab=vocab)
        grads = torch.autograd.grad((logp * weights).sum(), list(model.parameters()))
    return logp.detach()[written], torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("vocab", [None, SAMPLED_VOCAB], ids=["all-rows", "sampled-rows"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_liger_equals_pytorch_in_float32_and_within_bf16_tolerance(packed, vocab):
    plain, rollout = qwen3(), ragged_rollout(vocab or VOCAB, (17, 40, 5, 63), (700, 33, 1500, 250), seed=1).to("cuda")
    fused = copy.deepcopy(plain)
    liger.apply_liger(fused, liger.ARCHITECTURES["qwen3"].kernels)
    truth, truth_grad = logprobs_and_grad(plain, rollout, packed, fused=False, autocast=False, vocab=vocab)
    logp, grad = logprobs_and_grad(fused, rollout, packed, fused=True, autocast=False, vocab=vocab)
    torch.testing.assert_close(logp, truth, rtol=1e-5, atol=1e-4)
    # the gradient as a whole: the two paths sum in different orders (Liger's head chunks, its
    # RMSNorm weight-gradient blocks), so an element that is a near-cancelling sum (a tied
    # embedding row) can differ by float32 rounding of its terms, not of itself; a wrong kernel
    # is off by orders of magnitude more than 1e-5 of the gradient's norm
    error = float((grad - truth_grad).norm() / truth_grad.norm())
    print(f"float32 gradient: relative error {error:.2e}, max |difference| {(grad - truth_grad).abs().max():.2e} "
          f"of max |gradient| {truth_grad.abs().max():.2e}")
    assert error <= 1e-5

    bf16, bf16_grad = logprobs_and_grad(plain, rollout, packed, fused=False, autocast=True, vocab=vocab)
    liger_bf16, liger_grad = logprobs_and_grad(fused, rollout, packed, fused=True, autocast=True, vocab=vocab)
    plain_error, liger_error = (bf16 - truth).abs(), (liger_bf16 - truth).abs()
    print(f"|bf16 - fp32| mean {plain_error.mean():.2e} max {plain_error.max():.2e}; "
          f"liger {liger_error.mean():.2e} max {liger_error.max():.2e}; |liger - bf16| max {(liger_bf16 - bf16).abs().max():.2e}")
    assert plain_error.mean() > 0  # (bf16 does round)
    # Liger's q/k norms return bf16 where transformers' return float32 (float32 weights): one more
    # rounding before the rotary; a wrong kernel would be orders of magnitude off, not 2x
    assert liger_error.mean() <= 2 * plain_error.mean() and liger_error.max() <= 3 * plain_error.max()
    relative = lambda g: float((g - truth_grad).norm() / truth_grad.norm())  # noqa: E731
    print(f"gradient relative error: bf16 {relative(bf16_grad):.2e}, liger {relative(liger_grad):.2e}")
    assert relative(liger_grad) <= 2 * relative(bf16_grad) + 1e-3


def tandem_module(fused_kernels: str) -> TandemModule:
    return TandemModule(**grouped_settings(
        senior=ModelSource("configs/tiny/senior", random_init=True, init_seed=1, dtype="float32"),
        junior=ModelSource("configs/tiny/junior", random_init=True, init_seed=2, dtype="float32"),
        verifier=HasSpaceVerifier(), objective=GRPO(), handoff=WordHandoff(p=0.5),
        sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=24), eval_modes=["senior"], evaluate_at_start=False,
        completions_every_n_steps=0, max_grad_norm=None, optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        memory=MemorySettings(fused_kernels=fused_kernels),
    ))


def one_update(tmp_path, fused_kernels: str, precision: str):
    torch.manual_seed(0)
    module = tandem_module(fused_kernels)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.senior.named_parameters()}
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="gpu",
                        devices=1, precision=precision, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path / fused_kernels))
    trainer.fit(module, datamodule=Rows(batch_size=2))
    return module, {n: p.detach().cpu() - before[n].cpu() for n, p in module.senior.named_parameters()}


def test_a_step_with_liger_updates_the_senior_as_pytorch_does(tmp_path, caplog):
    _, plain_delta = one_update(tmp_path, "off", "32-true")
    with caplog.at_level(logging.INFO, logger=liger.__name__):
        module, delta = one_update(tmp_path, "liger", "32-true")
    assert any("in the senior's training forward: rms_norm, swiglu, rope, logprobs" in r.getMessage() for r in caplog.records)
    assert module.updates.fused_logprobs
    assert any("forward" in m.__dict__ for m in module.senior.modules())
    for model in (module.junior, module.engine.senior):  # transformers' code: rollouts do not change
        assert model is not module.senior and not any("forward" in m.__dict__ for m in model.modules())
    assert any(float(d.abs().max()) > 0 for d in plain_delta.values())
    for name, d in plain_delta.items():  # same rollouts (same engine), same update to float32 rounding
        torch.testing.assert_close(delta[name], d, rtol=1e-3, atol=1e-5, msg=name)
    _, mixed = one_update(tmp_path / "mixed", "liger", "bf16-mixed")
    assert all(torch.isfinite(d).all() for d in mixed.values())
