"""Memory of a training step: the estimate from shapes, its error message, token-bounded
micro-batches (same gradient), activation checkpointing (same gradient)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import tiny_tandem_module
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_lit.data import GSM8KDataModule
from tandem_lit.errors import ConfigError
from tandem_lit.objectives import GRPO
from tandem_lit.rollout import Author, Rollout, SamplingConfig
from tandem_lit.training.memory import (
    GIB,
    LOGIT_CHUNK_BYTES,
    MemoryBudgetError,
    MemoryEstimate,
    ModelShape,
    StepSettings,
    estimate_step_memory,
)
from tandem_lit.training.settings import MemorySettings
from tandem_lit.training.update_phase import HostRows, UpdatePhase
from tandem_lit.verifiers.base import Grade, Verifier

pytestmark = [
    pytest.mark.usefixtures("in_repo"),
    pytest.mark.filterwarnings(r"ignore:.*module\(s\) in eval mode"),
    pytest.mark.filterwarnings("ignore:No seed found"),
]

# Qwen3-4B: 36 layers, hidden 2560, MLP 9728, 32 query heads and 8 KV heads of 128
QWEN3_4B = ModelShape(
    params=4_022_468_096, trainable=4_022_468_096, param_bytes=4, trainable_bytes=4,
    layers=36, hidden=2560, intermediate=9728, q_width=4096, kv_width=1024,
)


def test_kv_and_training_state_hand_computed():
    """Self-paired 4B, float32 master, bf16 copy and junior, 64 sequences of 1024 + 3000 tokens.
    KV per token per model: 36 layers x (K and V) x 1024 x 2 bytes = 147,456 bytes."""
    settings = StepSettings(
        rollout_sequences=64, sequence_tokens=4024, micro_batch_tokens=8048, rollout_bytes=2, rollout_copy=True,
        junior_bytes=2,
    )
    junior = ModelShape(**{**vars(QWEN3_4B), "trainable": 0, "param_bytes": 2, "trainable_bytes": 0})
    estimate = estimate_step_memory(QWEN3_4B, junior, settings)
    assert estimate.rollout["KV caches"] == 2 * 64 * 4024 * 147_456
    assert estimate.rollout["senior weights"] == QWEN3_4B.params * 4
    assert estimate.rollout["optimizer state"] == QWEN3_4B.params * 8  # AdamW: two float32 moments
    assert estimate.rollout["rollout copy"] == estimate.rollout["junior"] == QWEN3_4B.params * 2
    assert estimate.update["gradients"] == QWEN3_4B.params * 4
    assert estimate.update["autocast weight cache"] == QWEN3_4B.params * 2
    assert "KV caches" not in estimate.update, "the caches are released before the update"
    offloaded = estimate_step_memory(QWEN3_4B, junior, StepSettings(**{**vars(settings), "offload_optimizer": True}))
    assert offloaded.rollout["optimizer state"] == 0 and offloaded.update["optimizer state"] == QWEN3_4B.params * 8
    checkpointed = estimate_step_memory(QWEN3_4B, junior, StepSettings(**{**vars(settings), "checkpointing": True}))
    assert checkpointed.update["activations"] < estimate.update["activations"] / 5


def test_a_paged_pool_is_counted_and_sized_to_what_fits():
    """A paged engine's KV caches are its pool; an unsized pool whose slot-sized default does not
    fit the GPU gets the positions that do (both models' K/V per position), a sized one is kept."""
    from tandem_lit.rollout.static import FastEngine
    from tandem_lit.training.memory import kv_budget

    settings = StepSettings(rollout_sequences=128, sequence_tokens=3128, micro_batch_tokens=8048, rollout_bytes=2,
                            rollout_copy=True, junior_bytes=2, offload_optimizer=True)
    junior = ModelShape(**{**vars(QWEN3_4B), "trainable": 0, "param_bytes": 2, "trainable_bytes": 0})
    slots = estimate_step_memory(QWEN3_4B, junior, settings)
    assert slots.kv_bytes_per_token == 2 * 147_456 and slots.rollout["KV caches"] == 128 * 3128 * 2 * 147_456
    pooled = estimate_step_memory(QWEN3_4B, junior, StepSettings(**{**vars(settings), "kv_pool_tokens": 100_000}))
    assert pooled.rollout["KV caches"] == 100_000 * 2 * 147_456
    assert FastEngine().plan_kv_cache(kv_budget(slots, 141 * GIB)) is None  # slot caches: nothing to plan
    engine = FastEngine(kv_cache="paged")
    assert engine.plan_kv_cache(kv_budget(slots, None)) is None  # no device to fit (a CPU run): left as set
    usable = int(141 * GIB * 0.95)  # 5% of the device left free: what the estimate does not count
    fit = (usable - (sum(slots.rollout.values()) - 128 * 3128 * 2 * 147_456)) // (2 * 147_456)
    line = engine.plan_kv_cache(kv_budget(slots, 141 * GIB))
    assert engine.kv_cache_tokens == fit < 128 * 3128 and "what fits the GPU" in line
    resized = estimate_step_memory(QWEN3_4B, junior, StepSettings(**{**vars(settings), "kv_pool_tokens": fit}))
    assert sum(resized.rollout.values()) <= usable  # the rollout phase now fits, with room to spare
    sized = FastEngine(kv_cache="paged", kv_cache_gib=20.0)
    assert "kv_cache_gib" in sized.plan_kv_cache(kv_budget(pooled, 141 * GIB)) and sized.kv_cache_tokens is None


def test_hybrid_layers_count_what_their_torch_fallback_saves():
    """Qwen3.5's Gated DeltaNet layers save ~3x a Llama block's bytes per token and its gated
    attention ~1.5x (dev/benchmarks/activation_bytes.py): the estimate weights each layer by its type,
    and under checkpointing the recomputed layer is the largest."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from tandem_lit.training.memory import HYBRID_LAYER_FACTORS

    config = Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=256)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with torch.device("meta"):
        shape = ModelShape.of(AutoModelForCausalLM.from_config(config))
    assert shape.layer_factors == (3.0, 3.0, 3.0, 1.5) == tuple(HYBRID_LAYER_FACTORS[t] for t in config.layer_types)
    llama = ModelShape(**{**vars(shape), "layer_factors": ()})
    per_layer = llama.activation_bytes_per_token(False, 2) / 4
    assert shape.activation_bytes_per_token(False, 2) == int(10.5 * per_layer)
    stored_inputs = 4 * 4 * 64  # each layer's float32 input
    assert shape.activation_bytes_per_token(True, 2) == stored_inputs + int(3.0 * per_layer)
    from transformers import Qwen3Config  # a plain transformer lists its layer types too: all full attention

    plain = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=256)
    with torch.device("meta"):
        assert ModelShape.of(AutoModelForCausalLM.from_config(plain)).layer_factors == ()


def test_fsdp2_shards_the_training_state_and_counts_the_weight_sync():
    """On W ranks each holds 1/W of the float32 weights, gradients and AdamW state, and the whole
    rollout copy, junior and its own share of the KV caches; FSDP2's gathered units (root +
    two layers, bf16) replace autocast's weight cache, and the weight sync gathers the senior."""
    shape = ModelShape(**{**vars(QWEN3_4B), "root_params": 151_936 * 2560})
    settings = StepSettings(rollout_sequences=32, sequence_tokens=4024, micro_batch_tokens=8048, rollout_bytes=2,
                            rollout_copy=True)
    one = estimate_step_memory(shape, None, settings)
    assert not one.sync and one.peak == max(sum(one.rollout.values()), sum(one.update.values()))
    two = estimate_step_memory(shape, None, StepSettings(**{**vars(settings), "world": 2}))
    for part in ("senior weights", "optimizer state"):
        assert two.rollout[part] == one.rollout[part] // 2
    assert two.update["gradients"] == one.update["gradients"] // 2
    assert two.rollout["rollout copy"] == one.rollout["rollout copy"] and two.update["activations"] == one.update["activations"]
    assert two.update["autocast weight cache"] == 0
    layer = (shape.params - shape.root_params) // shape.layers
    assert two.update["gathered layers"] == (shape.root_params + 2 * layer) * 2
    assert two.sync["gathered senior"] == shape.params * 2 and two.sync["rollout copy"] == shape.params * 2
    assert "weight sync" in two.table() and two.peak < one.peak


def test_the_estimate_per_rank_rolls_out_its_share_of_the_prompts():
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False)
    with torch.device("meta"):
        shape = ModelShape.of(AutoModelForCausalLM.from_config(config))
    assert shape.root_params == 2 * 256 * 64  # embeddings and the untied head
    module = tiny_tandem_module(
        verifier=SpaceVerifier(), objective=GRPO(), sampling=SamplingConfig(n=4, max_new_tokens=100),
        max_prompt_tokens=28, rollout_batch_size=64,
    )
    module.configure_model()
    one, two = (module.memory_estimate(prompts_per_step=4, world=w) for w in (1, 2))
    assert two.rollout["KV caches"] * 2 == one.rollout["KV caches"]  # 8 of the 16 rollouts per rank


def test_a_step_that_cannot_fit_names_the_settings_to_change():
    settings = StepSettings(rollout_sequences=192, sequence_tokens=4024, micro_batch_tokens=64 * 4024, rollout_bytes=2, rollout_copy=True)
    estimate = estimate_step_memory(QWEN3_4B, None, settings)
    with pytest.raises(MemoryBudgetError) as err:
        estimate.check(141 * GIB, "NVIDIA H200")
    message = str(err.value)
    assert "NVIDIA H200 has 141 GiB" in message and "KV caches" in message
    assert "rollout.batch_size" in message and "memory.gradient_checkpointing" in message
    assert "rollout_batch_size" not in message  # (the setting is rollout.batch_size)
    estimate_step_memory(QWEN3_4B, None, StepSettings(**{**vars(settings), "rollout_sequences": 16, "micro_batch_tokens": 8048})).check(141 * GIB)


def test_the_fixes_named_are_those_that_shrink_a_part_the_step_has():
    """A LoRA step (its optimizer state and gradients a few MiB) is not told to train LoRA adapters,
    nor to offload an optimizer state the rollout does not hold (the H100 refusal of 2026-12-05)."""
    kv = {"KV caches": 88 * GIB, "senior weights": 15 * GIB}
    lora = MemoryEstimate(rollout=dict(kv), update={"activations": 27 * GIB, "optimizer state": GIB // 5, "gradients": GIB // 10})
    full = MemoryEstimate(rollout={**kv, "optimizer state": 30 * GIB},
                          update={"activations": 27 * GIB, "optimizer state": 30 * GIB, "gradients": 15 * GIB})
    messages = {}
    for name, estimate in (("lora", lora), ("full", full)):
        with pytest.raises(MemoryBudgetError) as err:
            estimate.check(79 * GIB, "an H100")
        messages[name] = str(err.value)
    assert "rollout.batch_size" in messages["lora"] and "kv_cache_gib" in messages["lora"]
    assert "LoRA" not in messages["lora"] and "offload_optimizer" not in messages["lora"]
    assert "train LoRA adapters" in messages["full"] and "offload_optimizer: true" in messages["full"]


def test_the_module_estimate_reads_its_models_and_settings():
    module = tiny_tandem_module(
        verifier=SpaceVerifier(), objective=GRPO(), sampling=SamplingConfig(n=4, max_new_tokens=100),
        max_prompt_tokens=28, rollout_batch_size=8,
    )
    module.configure_model()
    estimate = module.memory_estimate(prompts_per_step=4)  # 16 rollouts, 8 per engine call
    senior, junior = ModelShape.of(module.senior), ModelShape.of(module.junior)
    # float32 tiny models on the CPU: the engine decodes them as they are, no copy
    assert estimate.rollout["rollout copy"] == 0
    assert estimate.rollout["KV caches"] == 8 * 128 * (senior.kv_bytes_per_token(4) + junior.kv_bytes_per_token(4))
    assert estimate.update["gradients"] == senior.params * 4


class SpaceVerifier(Verifier):
    def grade(self, completion: str, **columns) -> Grade:
        return Grade(correct=" " in completion, reward=float(" " in completion))


def rows_of_lengths(prompts: list[int], completions: list[int]) -> Rollout:
    """Rollouts with these prompt and completion lengths (left-padded prompts, senior-written)."""
    width, p_width, zeros = max(completions), max(prompts), torch.zeros(len(prompts), dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (p_width - p) + [1] * p for p in prompts])
    author = torch.tensor([[int(Author.SENIOR)] * c + [int(Author.PAD)] * (width - c) for c in completions], dtype=torch.int8)
    return Rollout(prompt_mask, prompt_mask, author.long(), author, zeros.bool(), zeros.bool(), zeros, zeros, zeros)


@settings(max_examples=50, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 20), min_size=1, max_size=12),
    completions=st.data(),
    rows_per_pass=st.integers(1, 5),
    limit=st.integers(1, 120),
    fill=st.booleans(),
)
def test_micro_batches_cover_every_row_once_within_the_bounds(prompts, completions, rows_per_pass, limit, fill):
    lengths = completions.draw(st.lists(st.integers(1, 30), min_size=len(prompts), max_size=len(prompts)))
    n, rollout = len(prompts), rows_of_lengths(prompts, lengths)
    module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), micro_batch_size=rows_per_pass,
                                memory=MemorySettings(micro_batch_tokens=limit, fill_passes=fill))
    batches = module.updates.passes(HostRows.of(rollout), list(range(n)))
    assert sorted(i for batch in batches for i in batch) == list(range(n))
    for idx in batches:
        padded = len(idx) * (max(prompts[i] for i in idx) + max(lengths[i] for i in idx))
        assert fill or len(idx) <= rows_per_pass
        assert len(idx) == 1 or padded <= limit  # a single row may exceed the bound alone


def test_fill_passes_puts_short_rows_together_up_to_the_token_bound():
    """Long-tailed lengths: micro_batch_size rows a pass leaves short rows' passes mostly empty;
    fill_passes fills each to micro_batch_tokens, and a long row still goes alone."""
    rollout = rows_of_lengths([20] * 9, [80] * 8 + [380])  # eight rows of 100 tokens and one of 400

    def pass_sizes(fill: bool) -> list[int]:
        module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), micro_batch_size=2,
                                    memory=MemorySettings(micro_batch_tokens=400, fill_passes=fill))
        return [len(b) for b in module.updates.passes(HostRows.of(rollout), list(range(9)))]

    assert pass_sizes(False) == [1, 2, 2, 2, 2]
    assert pass_sizes(True) == [1, 4, 4]
    with pytest.raises(ConfigError, match="fill_passes fills each pass up to memory.micro_batch_tokens"):
        MemorySettings(fill_passes=True)


def test_the_memory_plan_counts_a_filled_pass_at_the_token_bound():
    def activations(**memory) -> float:
        module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), micro_batch_size=1,
                                    sampling=SamplingConfig(n=4, max_new_tokens=100), max_prompt_tokens=28,
                                    memory=MemorySettings(**memory))
        module.configure_model()
        return module.memory_estimate(prompts_per_step=4).update["activations"] - LOGIT_CHUNK_BYTES

    one_row = activations(micro_batch_tokens=1024)  # one row of 128 tokens a pass
    assert activations(micro_batch_tokens=1024, fill_passes=True) == pytest.approx(one_row * 1024 / 128)


def one_step_update(tmp_path, **settings) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = tiny_tandem_module(
        verifier=SpaceVerifier(), objective=GRPO(), sampling=SamplingConfig(temperature=1.0, n=4, max_new_tokens=16),
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0), max_grad_norm=None, **settings,
    )
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.senior.named_parameters()}
    trainer = L.Trainer(
        max_steps=1, logger=False, enable_checkpointing=False, limit_val_batches=0, accelerator="cpu", devices=1,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(module, datamodule=GSM8KDataModule(source="data/gsm8k-sample", val_size=4, batch_size=2))
    assert module.senior.is_gradient_checkpointing == module.memory.gradient_checkpointing
    return {n: p.detach() - before[n] for n, p in module.senior.named_parameters()}


@pytest.mark.parametrize("memory", [
    MemorySettings(micro_batch_tokens=600),  # passes of a few rows, grouped by length
    MemorySettings(gradient_checkpointing=True),
    MemorySettings(release_rollout_caches=False, offload_optimizer=True),  # offload is a no-op on CPU
    MemorySettings(pack_sequences=True, micro_batch_tokens=600),  # one packed row per pass
    MemorySettings(pack_sequences=True, gradient_checkpointing=True),
], ids=["micro_batch_tokens", "gradient_checkpointing", "keep_caches", "pack_sequences", "pack_checkpointed"])
def test_memory_settings_do_not_change_the_update(tmp_path, memory):
    reference = one_step_update(tmp_path / "reference", micro_batch_size=8)
    changed = one_step_update(tmp_path / "changed", micro_batch_size=8, memory=memory)
    assert any(float(d.abs().max()) > 0 for d in reference.values())
    for name, delta in reference.items():
        torch.testing.assert_close(changed[name], delta, atol=1e-6, rtol=1e-4, msg=name)


def test_filled_passes_give_the_update_of_one_row_a_pass(tmp_path, monkeypatch):
    sizes = []
    split = UpdatePhase.passes

    def recorded(self, host, rows, world=1):
        batches = split(self, host, rows, world)
        sizes.extend(len(b) for b in batches)
        return batches

    monkeypatch.setattr(UpdatePhase, "passes", recorded)
    reference = one_step_update(tmp_path / "reference", micro_batch_size=1)
    assert set(sizes) == {1}
    sizes.clear()
    filled = one_step_update(tmp_path / "filled", micro_batch_size=1,
                             memory=MemorySettings(micro_batch_tokens=10_000, fill_passes=True))
    assert max(sizes) > 1  # rows shared passes beyond micro_batch_size
    for name, delta in reference.items():
        torch.testing.assert_close(filled[name], delta, atol=1e-6, rtol=1e-4, msg=name)


def test_an_engine_with_its_own_kv_pool_is_counted_at_that_size():
    from tandem_lit.rollout.static import FastEngine

    module = tiny_tandem_module(
        verifier=SpaceVerifier(), objective=GRPO(), sampling=SamplingConfig(n=4, max_new_tokens=100),
        max_prompt_tokens=28, rollout_batch_size=8,
    )
    module.configure_model()
    senior, junior = ModelShape.of(module.senior), ModelShape.of(module.junior)
    per_token = senior.kv_bytes_per_token(4) + junior.kv_bytes_per_token(4)
    module.engine = FastEngine(kv_cache="paged", kv_cache_tokens=5000)
    assert module.memory_estimate(prompts_per_step=4).rollout["KV caches"] == 5000 * per_token
    module.engine = FastEngine(kv_cache="paged", kv_cache_gib=0.01)
    assert module.memory_estimate(prompts_per_step=4).rollout["KV caches"] == int(0.01 * GIB) // per_token * per_token
    module.engine = FastEngine()  # slot caches: the batch's rows x their tokens
    assert module.memory_estimate(prompts_per_step=4).rollout["KV caches"] == 8 * 128 * per_token


def test_forward_only_passes_match_the_busiest_rank(monkeypatch):
    """Old and reference log-probs under FSDP: token-bounded passes differ in number between ranks
    whose rows differ in length, and every forward gathers weights, so each rank runs as many
    passes as the busiest (rows split further); the log-probs stay what one process computes."""
    import tandem_lit.training.update_phase as update_phase

    module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), micro_batch_size=4,
                                memory=MemorySettings(micro_batch_tokens=10_000))
    module.configure_model()
    prompt = torch.ones(4, 3, dtype=torch.long)
    author = torch.full((4, 5), int(Author.SENIOR), dtype=torch.int8)
    zeros = torch.zeros(4, dtype=torch.long)
    rollout = Rollout(prompt + 10, prompt, (torch.arange(20).reshape(4, 5) % 7) + 10, author,
                      zeros.bool(), zeros.bool(), zeros, zeros, zeros, texts=["x"] * 4)
    passes = []

    def counted(part, lengths):
        passes.append(part.completion_ids.shape[0])
        return module.updates.sequence_logprobs(module.senior, part, lengths=lengths)

    alone = module.updates.logprobs_by_rows(rollout, torch.device("cpu"), counted)
    assert passes == [4]  # one process: the four rows fit one pass
    passes.clear()
    monkeypatch.setattr(update_phase, "max_over_ranks", lambda count, device: 3)  # another rank needs 3 passes
    balanced = module.updates.logprobs_by_rows(rollout, torch.device("cpu"), counted, world=2)
    assert sorted(passes) == [1, 1, 2]
    torch.testing.assert_close(balanced, alone)


def test_forward_only_passes_hold_forward_only_pass_scale_times_a_training_pass():
    """The old and reference log-probs keep nothing for a backward: their passes take
    ``memory.forward_only_pass_scale`` times the rows (and tokens) of a training pass, and give
    the same log-probs as passes of the training size."""
    prompt = torch.ones(8, 3, dtype=torch.long)
    author = torch.full((8, 5), int(Author.SENIOR), dtype=torch.int8)
    zeros = torch.zeros(8, dtype=torch.long)
    rollout = Rollout(prompt + 10, prompt, (torch.arange(40).reshape(8, 5) % 7) + 10, author,
                      zeros.bool(), zeros.bool(), zeros, zeros, zeros, texts=["x"] * 8)
    out = {}
    for scale in (4, 1):
        module = tiny_tandem_module(verifier=SpaceVerifier(), objective=GRPO(), micro_batch_size=1,
                                    memory=MemorySettings(forward_only_pass_scale=scale))
        module.configure_model()
        passes = []

        def counted(part, lengths, module=module, passes=passes):
            passes.append(part.completion_ids.shape[0])
            return module.updates.sequence_logprobs(module.senior, part, lengths=lengths)

        out[scale] = module.updates.logprobs_by_rows(rollout, torch.device("cpu"), counted)
        assert passes == [scale] * (8 // scale)
        assert [len(p) for p in module.updates.passes(HostRows.of(rollout), list(range(8)))] == [1] * 8  # training passes
    torch.testing.assert_close(out[4], out[1])


def test_a_forward_only_pass_is_counted_one_layer_at_a_time():
    """Hand-computed for the 4B at 8,048-token passes, bf16 compute over float32 weights: one
    layer saves 178,176 bytes a token (2(4+2)2560 + 2*2*2560 + 6(4096+1024) + 2(3*4096 + 2*1024)
    + 8*9728). Checkpointed, a training pass holds 36*4*2560 + 178,176 = 546,816 bytes a token;
    a forward-only pass of 4x the tokens, 4 x 178,176 = 712,704 per training token: the larger."""
    settings = StepSettings(rollout_sequences=64, sequence_tokens=4024, micro_batch_tokens=8048, rollout_bytes=2,
                            rollout_copy=True, checkpointing=True, forward_only_tokens=4 * 8048)
    assert QWEN3_4B.layer_bytes_per_token(2) == QWEN3_4B.largest_layer_bytes_per_token(2) == 178_176
    checkpointed = estimate_step_memory(QWEN3_4B, None, settings)
    assert checkpointed.update["activations"] == 4 * 8048 * 178_176 + LOGIT_CHUNK_BYTES
    training_only = estimate_step_memory(QWEN3_4B, None, StepSettings(**{**vars(settings), "forward_only_tokens": None}))
    assert training_only.update["activations"] == 8048 * 546_816 + LOGIT_CHUNK_BYTES
    stored = estimate_step_memory(QWEN3_4B, None, StepSettings(**{**vars(settings), "checkpointing": False}))
    assert stored.update["activations"] == 8048 * 36 * 178_176 + LOGIT_CHUNK_BYTES  # the training pass is larger


def test_liger_swiglu_saves_one_intermediate_wide_tensor_a_layer_less():
    """PyTorch's SwiGLU saves the gate and up projections, the activation and the product (4 x
    9,728 bf16 values a token in the 4B); Liger's saves the two projections and recomputes the
    activation: 2 x 9,728 bytes a layer less, in every layer (checkpointed: in the recomputed one)."""
    settings = StepSettings(rollout_sequences=64, sequence_tokens=4024, micro_batch_tokens=4096, rollout_bytes=2,
                            rollout_copy=True)
    assert QWEN3_4B.activation_bytes_per_token(False, 2, fused_swiglu=True) == 36 * (178_176 - 2 * 9728)
    eager = estimate_step_memory(QWEN3_4B, None, settings)
    fused = estimate_step_memory(QWEN3_4B, None, StepSettings(**{**vars(settings), "fused_swiglu": True}))
    assert eager.update["activations"] - fused.update["activations"] == 4096 * 36 * 2 * 9728
    assert eager.rollout == fused.rollout
    checkpointed = StepSettings(**{**vars(settings), "checkpointing": True})
    assert (estimate_step_memory(QWEN3_4B, None, checkpointed).update["activations"]
            - estimate_step_memory(QWEN3_4B, None, StepSettings(**{**vars(checkpointed), "fused_swiglu": True})).update["activations"]
            == 4096 * 2 * 9728)
