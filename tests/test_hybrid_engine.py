"""FastEngine on Qwen3.5's hybrid attention (Gated DeltaNet + gated full attention): the same
rollouts as the reference HFEngine (hybrid with hybrid, hybrid with a plain transformer), tandem
with identical models equal to the model alone, log-probs equal to teacher forcing, the Triton
recurrence equal to the torch one, and the rollout-weights seam (live weights after an update)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5ForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from tandem_lit.models.tiny import char_tokenizer
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import SoloHandoff, WordHandoff
from tandem_lit.rollout.logprobs import completion_logprobs
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.rollout.static import FastEngine
from tandem_lit.rollout.static.hybrid import HybridDecoderModel
from tandem_lit.rollout.weights import rollout_named_tensors
from tests.test_fast_engine import DEVICES, assert_same_rollouts, build, prompt_batch

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24)
SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def hybrid(vocab: int, seed: int, hidden: int = 64, layers: int = 4) -> Qwen3_5ForCausalLM:
    """A tiny Qwen3.5 text model (3 linear-attention layers per full-attention layer), with
    random norm weights so the zero-centred norms matter."""
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config.initializer_range = 0.3
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def models(tokenizer):
    vocab = len(tokenizer)
    return {"hybrid": hybrid(vocab, 0), "small_hybrid": hybrid(vocab, 1, hidden=32), "llama": build("llama", vocab, 32, 1, seed=1)}


def engine(kind, senior, junior, tokenizer, kernels="torch"):
    made = HFEngine(rollout_dtype="float32") if kind == "hf" else FastEngine(kernels=kernels, rollout_dtype="float32")
    made.setup(senior, junior, tokenizer)
    return made


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [("hybrid", "small_hybrid"), ("hybrid", "llama"), ("llama", "hybrid")])
def test_fast_engine_matches_the_reference_on_hybrid_models(tokenizer, models, pair, device):
    senior, junior = (models[name].to(device) for name in pair)
    prompts = prompt_batch(tokenizer, device)
    fast = engine("fast", senior, junior, tokenizer, kernels="auto")
    assert any(isinstance(m, HybridDecoderModel) for m in fast.models.values())
    for sampling in (GREEDY, SAMPLED):
        reference = engine("hf", senior, junior, tokenizer).generate(prompts, WordHandoff(p=0.5), sampling)
        rollout = fast.generate(prompts, WordHandoff(p=0.5), sampling)
        assert_same_rollouts(reference, rollout)
        assert 0 < int((rollout.author == 2).sum()) < int(rollout.lengths.sum())  # both wrote
        torch.testing.assert_close(rollout.senior_logprobs, reference.senior_logprobs, rtol=1e-4, atol=1e-4)


def test_greedy_tandem_with_identical_models_is_the_model_alone(tokenizer, models):
    model = models["hybrid"]
    prompts = prompt_batch(tokenizer, "cpu")
    fast = engine("fast", model, model, tokenizer)
    tandem = fast.generate(prompts, WordHandoff(p=0.5), GREEDY)
    alone = fast.generate(prompts, SoloHandoff("senior"), GREEDY)
    assert tandem.texts == alone.texts and torch.equal(tandem.completion_ids, alone.completion_ids)
    assert int((tandem.author == 2).sum()) > 0  # the junior did write


def test_engine_logprobs_equal_teacher_forced_logprobs(tokenizer, models):
    model = models["hybrid"]
    rollout = engine("fast", model, None, tokenizer).generate(prompt_batch(tokenizer, "cpu"), SoloHandoff("senior"), SAMPLED)
    with torch.no_grad():
        forced = completion_logprobs(model, rollout, temperature=SAMPLED.temperature)
    mask = rollout.completion_mask
    torch.testing.assert_close(rollout.senior_logprobs[mask], forced[mask], rtol=1e-4, atol=1e-4)


def test_the_rollout_copy_follows_live_weights_after_an_update(tokenizer, models):
    import copy

    senior = copy.deepcopy(models["hybrid"]).float()
    prompts = prompt_batch(tokenizer, "cpu")
    fast = FastEngine(kernels="torch", rollout_dtype="bfloat16")  # decodes its own copy
    fast.setup(senior, models["small_hybrid"], tokenizer)
    assert fast.decodes_copy
    before = fast.generate(prompts, WordHandoff(p=0.5), GREEDY)
    with torch.no_grad():  # "an optimiser update"
        for p in senior.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fast.load_weights(rollout_named_tensors(senior))
    after = fast.generate(prompts, WordHandoff(p=0.5), GREEDY)
    fresh = FastEngine(kernels="torch", rollout_dtype="bfloat16")
    fresh.setup(senior, models["small_hybrid"], tokenizer)
    assert_same_rollouts(after, fresh.generate(prompts, WordHandoff(p=0.5), GREEDY))
    assert after.texts != before.texts


def test_default_engine_is_the_fast_engine_for_qwen35(models):
    from tandem_lit.rollout.choice import default_engine

    assert isinstance(default_engine(models["hybrid"], models["small_hybrid"]), FastEngine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a GPU")
def test_the_triton_step_equals_the_torch_step(tokenizer, models):
    """A linear-attention layer's two Triton kernels (convolution; normalisation, recurrence, gated
    norm) and a full-attention layer's kernel against their torch steps, states and caches
    included; then whole rollouts on both paths."""
    from tandem_lit.rollout.static import kernels
    from tandem_lit.rollout.static.hybrid import _DeltaLayer

    senior, junior = models["hybrid"].cuda(), models["small_hybrid"].cuda()
    model = HybridDecoderModel(senior)
    model.allocate(3, 8)
    layer = next(m for _, m, _ in model.blocks if isinstance(m, _DeltaLayer))
    torch.manual_seed(0)
    layer.conv_state.normal_()
    layer.state.normal_()
    states = layer.conv_state.clone(), layer.state.clone()
    h = torch.randn(3, senior.config.hidden_size, device="cuda")
    expected = layer.step(h)
    expected_states = layer.conv_state.clone(), layer.state.clone()
    layer.conv_state.copy_(states[0])
    layer.state.copy_(states[1])
    layer.fuse(share=False)  # the four input projections as one GEMM, as the engine runs them
    torch.testing.assert_close(layer.step_fused(h), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.conv_state, expected_states[0])
    torch.testing.assert_close(layer.state, expected_states[1], rtol=1e-4, atol=1e-4)
    # a gated full-attention layer: the one-kernel step against the torch step, caches included
    index, attention = next((i, m) for i, (_, m, _) in enumerate(model.blocks) if not isinstance(m, _DeltaLayer))
    slot, kv_len = torch.tensor([5, 5, 5], device="cuda"), 6  # each row its own cache slot (here the same)
    position = torch.tensor([5, 3, 4], device="cuda")
    valid = torch.ones(3, 8, dtype=torch.bool, device="cuda")
    valid[1, :2] = False  # a left-padded row
    valid[:, 6:] = False
    for cache in (model.k_cache[index], model.v_cache[index]):
        cache.normal_()
    caches = model.k_cache[index].clone(), model.v_cache[index].clone()
    mask = torch.zeros(3, kv_len, device="cuda").masked_fill_(~valid[:, :kv_len], torch.finfo(torch.float32).min)
    cos, sin = model.cos[position].unsqueeze(1), model.sin[position].unsqueeze(1)
    expected = model._attend(index, attention, h, cos, sin, slot, mask[:, None, None, :], kv_len)
    expected_caches = model.k_cache[index].clone(), model.v_cache[index].clone()
    model.k_cache[index].copy_(caches[0])
    model.v_cache[index].copy_(caches[1])
    attention.fuse(share=False)
    module = attention.module
    attended = kernels.gated_attention(
        *attention.project(h), module.q_norm.weight, module.k_norm.weight, module.q_norm.eps, model.cos, model.sin,
        position, slot, model.k_cache[index], model.v_cache[index], valid, attention.scaling, model.heads,
        model.kv_heads, model.head_dim,
    )
    torch.testing.assert_close(attention.o(attended), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.k_cache[index], expected_caches[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.v_cache[index], expected_caches[1])
    # whole rollouts: the Triton path (CUDA graph) samples what the torch path samples
    prompts = prompt_batch(tokenizer, "cuda")
    torch_path = engine("fast", senior, junior, tokenizer, kernels="torch").generate(prompts, WordHandoff(p=0.5), SAMPLED)
    triton_path = engine("fast", senior, junior, tokenizer, kernels="triton").generate(prompts, WordHandoff(p=0.5), SAMPLED)
    assert_same_rollouts(torch_path, triton_path)
