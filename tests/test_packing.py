"""Packed update passes (``memory.pack_sequences``) equal padded rows; the first PPO mini-batch
takes its old log-probs from its own forward.

Tiny float32 Llamas on CPU, rows of very different lengths (left-padded prompts of 2-9 tokens,
completions of 1-60): the padded rows are mostly padding, the packed row has none.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from tandem_lit.errors import ConfigError
from tandem_lit.models import varlen_attention
from tandem_lit.objectives.base import ObjectiveInputs
from tandem_lit.objectives.grpo import GRPO
from tandem_lit.rollout import logprobs
from tandem_lit.rollout.logprobs import completion_logprobs
from tandem_lit.rollout.record import Author, Rollout
from tandem_lit.rollout.result import RolloutResult
from tandem_lit.rollout.sampling import SamplingConfig
from tandem_lit.training.passes import pack_by_tokens
from tandem_lit.training.settings import MemorySettings, UpdateSettings
from tandem_lit.training.update_phase import UpdatePhase
from tandem_lit.verifiers.base import Grade

PROMPTS = [9, 2, 5, 3, 7, 4, 2, 6]
COMPLETIONS = [60, 1, 23, 7, 41, 2, 55, 12]
TEMPERATURE = 0.7


def ragged_rollout(vocab: int, seed: int = 0) -> Rollout:
    generator = torch.Generator().manual_seed(seed)
    n, prompt, width = len(PROMPTS), max(PROMPTS), max(COMPLETIONS)
    prompt_mask = torch.zeros(n, prompt, dtype=torch.long)
    author = torch.full((n, width), int(Author.PAD), dtype=torch.int8)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        prompt_mask[i, prompt - p :] = 1
        author[i, :c] = Author.SENIOR
        author[i, c // 3 : c // 2] = Author.JUNIOR
    prompt_ids = torch.randint(4, vocab, (n, prompt), generator=generator) * prompt_mask
    completion_ids = torch.randint(4, vocab, (n, width), generator=generator) * (author != Author.PAD)
    senior_logprobs = -torch.rand(n, width, generator=generator) * (author != Author.PAD)
    return Rollout(
        prompt_ids, prompt_mask, completion_ids, author,
        torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool), *(torch.zeros(n, dtype=torch.long),) * 3,
        texts=[""] * n, senior_logprobs=senior_logprobs,
    )


def model(vocab: int, attention: str = "sdpa"):
    from conftest import tiny_llama

    llama = tiny_llama(vocab, seed=5, init_range=0.1)
    llama.set_attn_implementation(attention)
    return llama.train()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_padded_rows(monkeypatch, attention):
    vocab = 40
    llama, rollout = model(vocab, attention), ragged_rollout(vocab)
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 17 * vocab)  # several vocabulary chunks in both paths
    written = rollout.completion_mask
    weights = torch.linspace(-1, 1, written.numel()).view_as(written) * written
    results = {}
    for packed in (False, True):
        logp = completion_logprobs(llama, rollout, TEMPERATURE, packed=packed)
        grads = torch.autograd.grad((logp * weights).sum(), list(llama.parameters()))
        results[packed] = logp, grads
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    torch.testing.assert_close(packed[written], padded[written], rtol=0, atol=2e-5)
    assert (packed[~written] == 0).all()
    for (name, _), a, b in zip(llama.named_parameters(), packed_grads, padded_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_packing_is_refused_where_sequences_would_see_each_other():
    llama = model(40)
    llama.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match="linear-attention"):
        completion_logprobs(llama, ragged_rollout(40), TEMPERATURE, packed=True)


def test_packed_passes_are_bounded_by_their_summed_tokens():
    prompts, completions = PROMPTS, COMPLETIONS
    passes = pack_by_tokens(prompts, completions, max_rows=4, max_tokens=70, packed=True)
    assert sorted(i for p in passes for i in p) == list(range(len(prompts)))
    for p in passes:
        assert len(p) <= 4
        assert len(p) == 1 or sum(prompts[i] + completions[i] for i in p) <= 70
    # the padded bound would need more passes: rows x (longest prompt + longest completion)
    assert len(passes) < len(pack_by_tokens(prompts, completions, max_rows=4, max_tokens=70))


def varlen_calls(monkeypatch) -> list[list[int]]:
    """The sequence bounds each packed attention call of ``models.varlen_attention`` got (its CPU path)."""
    calls: list[list[int]] = []
    reference = varlen_attention._reference_varlen

    def spy(query, key, value, cu, scaling):
        calls.append(cu.tolist())
        return reference(query, key, value, cu, scaling)

    monkeypatch.setattr(varlen_attention, "_reference_varlen", spy)
    return calls


def test_packed_rows_through_the_varlen_attention_equal_padded_rows(monkeypatch):
    """Inside ``varlen_during`` an sdpa model runs the variable-length path on packed rows, given
    each sequence's bounds (prompt + completion), with the padded rows' log-probs and gradients;
    afterwards it is sdpa again."""
    vocab = 40
    llama, rollout = model(vocab), ragged_rollout(vocab)
    written = rollout.completion_mask
    weights = torch.linspace(-1, 1, written.numel()).view_as(written) * written
    padded = completion_logprobs(llama, rollout, TEMPERATURE)
    padded_grads = torch.autograd.grad((padded * weights).sum(), list(llama.parameters()))
    calls = varlen_calls(monkeypatch)
    with varlen_attention.varlen_during([llama], torch.device("cpu")):
        assert llama.config._attn_implementation == varlen_attention.VARLEN
        packed = completion_logprobs(llama, rollout, TEMPERATURE, packed=True)
        packed_grads = torch.autograd.grad((packed * weights).sum(), list(llama.parameters()))
    assert llama.config._attn_implementation == "sdpa"
    bounds = [0]
    for p, c in zip(PROMPTS, COMPLETIONS):
        bounds.append(bounds[-1] + p + c)
    assert calls and all(cu == bounds for cu in calls)  # every layer, forward and recomputed chunks alike
    torch.testing.assert_close(packed[written], padded[written], rtol=0, atol=2e-5)
    for (name, _), a, b in zip(llama.named_parameters(), packed_grads, padded_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_outside_packed_passes_the_varlen_attention_is_causal_sdpa():
    """A forward with no sequence bounds (a left-aligned padded pass) gets plain causal attention."""
    llama, ids = model(40), torch.randint(4, 40, (3, 11))
    expected = llama(input_ids=ids).logits
    with varlen_attention.varlen_during([llama], torch.device("cpu")):
        got = llama(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_packed_pass_laid_out_from_host_lengths_reads_nothing_back():
    """On a GPU every read of a device value waits for the passes queued before it. Laid out from
    the host's lengths (as the update does) and run through the varlen attention, a packed pass
    reads nothing back; under sdpa's block mask transformers reads the position ids to find the
    restarts. The log-probs are the same either way."""
    from tests.test_training_features import CountingReads

    vocab = 40
    llama, rollout = model(vocab), ragged_rollout(vocab)
    lengths = (list(PROMPTS), list(COMPLETIONS))
    with CountingReads() as sdpa_reads:
        expected = completion_logprobs(llama, rollout, TEMPERATURE, packed=True, lengths=lengths)
    with varlen_attention.varlen_during([llama], torch.device("cpu")), CountingReads() as varlen_reads:
        got = completion_logprobs(llama, rollout, TEMPERATURE, packed=True, lengths=lengths)
    assert sdpa_reads.reads > 0 and varlen_reads.reads == 0
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    # the lengths read from the device instead: the same layout
    assert torch.equal(expected, completion_logprobs(llama, rollout, TEMPERATURE, packed=True))


@pytest.mark.gpu
def test_the_cuda_varlen_kernel_equals_the_block_masked_sdpa_in_bf16():
    """On a GPU: packed rows through PyTorch's variable-length flash kernel (grouped-query heads)
    give the log-probs and gradients of packed rows under sdpa's block-diagonal mask, to bf16 rounding."""
    vocab = 40
    rollout = ragged_rollout(vocab).to("cuda")
    written = rollout.completion_mask
    weights = torch.linspace(-1, 1, written.numel(), device="cuda").view_as(written) * written
    results = {}
    for varlen in (False, True):
        llama = model(vocab).cuda()
        assert llama.config.num_key_value_heads < llama.config.num_attention_heads
        context = varlen_attention.varlen_during([llama], torch.device("cuda")) if varlen else contextlib.nullcontext()
        with context, torch.autocast("cuda", dtype=torch.bfloat16):
            logp = completion_logprobs(llama, rollout, TEMPERATURE, packed=True)
            grads = torch.autograd.grad((logp * weights).sum(), list(llama.parameters()))
        results[varlen] = logp, grads
    (block, block_grads), (varlen, varlen_grads) = results[False], results[True]
    assert (varlen[written] - block[written]).abs().max() < 0.05
    for a, b in zip(varlen_grads, block_grads):
        assert float((a - b).norm()) <= 0.05 * float(b.norm()) + 1e-6


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps each step's gradients (the update's, parameter by parameter)."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def graded(rollout: Rollout) -> RolloutResult:
    group = torch.arange(len(PROMPTS)) // 2  # 4 prompts, 2 samples each
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    return RolloutResult(rollout, [Grade(correct=r > 0, reward=r) for r in rewards], group, {})


def run_update(llama, rollout: Rollout, memory: MemorySettings, mini_batch_size: int | None = 2):
    phase = UpdatePhase(
        # (the rollouts' log-probs are made up, not an engine's: no gap limit)
        UpdateSettings(mini_batch_size=mini_batch_size, micro_batch_size=3, max_grad_norm=None, logp_gap_limit=None), memory,
        GRPO(clip_low=0.2, clip_high=0.2), SamplingConfig(temperature=TEMPERATURE, max_new_tokens=max(COMPLETIONS)),
    )
    phase.bind(llama, None, lambda loss: loss.backward())
    optimizer = RecordingSGD(llama.parameters(), lr=0.5)
    totals = phase.run(graded(rollout), optimizer, torch.device("cpu"))
    return totals, optimizer.grads


def assert_same_grads(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(expected)
    for update_got, update_expected in zip(got, expected):
        for a, b in zip(update_got, update_expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_packed_update_equals_the_padded_one(monkeypatch):
    vocab = 40
    rollout, llama = ragged_rollout(vocab), model(vocab)
    padded = run_update(copy.deepcopy(llama), rollout, MemorySettings(micro_batch_tokens=90))
    calls = varlen_calls(monkeypatch)
    packed_model = copy.deepcopy(llama)
    packed = run_update(packed_model, rollout, MemorySettings(micro_batch_tokens=90, pack_sequences=True))
    assert calls and packed_model.config._attn_implementation == "sdpa"  # the varlen path, for the update only
    assert padded[0]["updates"] == packed[0]["updates"] == 2
    for name in ("loss", "rollout_logp_gap_mean"):
        assert packed[0][name] == pytest.approx(padded[0][name], rel=1e-5, abs=1e-7)
    assert_same_grads(packed[1], padded[1])


def test_the_first_mini_batch_takes_its_old_logprobs_from_its_own_forward(monkeypatch):
    """Two updates: the behaviour forward runs on the second mini-batch's rows only, and the
    step equals the reference (old log-probs of every row before any update)."""
    vocab = 40
    rollout, llama = ragged_rollout(vocab), model(vocab)
    seen: list[int] = []
    original = UpdatePhase.behaviour_logprobs

    def counting(self, rollout, device, rows=None, world=1, host=None):
        seen.extend(rows if rows is not None else range(len(PROMPTS)))
        return original(self, rollout, device, rows, world, host)

    monkeypatch.setattr(UpdatePhase, "behaviour_logprobs", counting)
    totals, grads = run_update(copy.deepcopy(llama), rollout, MemorySettings(), mini_batch_size=2)
    assert sorted(seen) == [4, 5, 6, 7]  # prompts 2 and 3: the second mini-batch

    # the reference: old log-probs of all rows first, then one update per mini-batch of 2 prompts
    reference = copy.deepcopy(llama)
    objective = GRPO(clip_low=0.2, clip_high=0.2)
    result = graded(rollout)
    with torch.no_grad():
        old = completion_logprobs(reference, rollout, TEMPERATURE)
    advantages = objective.advantages(result.rewards, result.group)
    optimizer = RecordingSGD(reference.parameters(), lr=0.5)
    loss_total = 0.0
    for rows in (torch.arange(0, 4), torch.arange(4, 8)):
        scale = objective.loss_scale(rollout.author[rows], advantages[rows], max(COMPLETIONS))
        optimizer.zero_grad()
        for micro in rows.split(3):
            part = rollout.select(micro).trimmed()
            width = part.completion_ids.shape[1]
            inputs = ObjectiveInputs(
                logp=completion_logprobs(reference, part, TEMPERATURE), author=part.author,
                rewards=result.rewards[micro], group=result.group[micro], old_logp=old[micro, :width],
                advantages=advantages[micro], rollout_logp=part.senior_logprobs,
            )
            loss, _ = objective(inputs, scale)
            loss.backward()
            loss_total += float(loss.detach()) / 2
        optimizer.step()
    assert totals["loss"] == pytest.approx(loss_total, rel=1e-5, abs=1e-7)
    assert_same_grads(grads, optimizer.grads)


def _fsdp_packed_worker(rank: int, world: int, port: int, results) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from conftest import REPO_ROOT
        from torch.distributed.device_mesh import init_device_mesh

        from tandem_lit.models import ModelSource, load_causal_lm
        from tandem_lit.training.distributed import shard_model

        source = ModelSource(str(REPO_ROOT / "configs/tiny/senior"), random_init=True, init_seed=1, dtype="float32")
        reference, model = load_causal_lm(source), load_causal_lm(source)
        model.train()
        shard_model(model, init_device_mesh("cpu", (world,)), bf16_compute=False)
        rollout = ragged_rollout(model.config.vocab_size)
        weights = torch.linspace(-1, 1, rollout.completion_mask.numel()).view_as(rollout.completion_mask)
        mine = torch.arange(rank, len(PROMPTS), world)  # FSDP averages over ranks: each rank's sum x world
        part = rollout.select(mine)
        logp = completion_logprobs(model, part, TEMPERATURE, packed=True)  # through model.completion_hidden
        (logp * weights[mine] * part.completion_mask).sum().mul(world).backward()
        expected = completion_logprobs(reference, rollout, TEMPERATURE)  # one process, padded rows
        (expected * weights * rollout.completion_mask).sum().backward()
        results[rank] = max(
            float((p.grad.full_tensor() - reference.get_parameter(name).grad).abs().max())
            for name, p in model.named_parameters()
        )
    finally:
        dist.destroy_process_group()


def test_packed_passes_under_fsdp_give_the_one_process_padded_gradient():
    import os

    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_packed_worker, args=(2, 30_000 + os.getpid() % 1000, results), nprocs=2)
        outcome = dict(results)
    assert set(outcome) == {0, 1} and max(outcome.values()) < 1e-5, outcome


def test_a_senior_that_cannot_pack_is_refused_before_the_first_step():
    from conftest import tiny_tandem_module

    from tandem_lit.training import preflight
    from tandem_lit.verifiers.math import MathVerifier

    module = tiny_tandem_module(verifier=MathVerifier(), objective=GRPO(), sampling=SamplingConfig(n=2, max_new_tokens=8),
                                memory=MemorySettings(pack_sequences=True))
    module.configure_model()
    preflight.check(module, "fit")  # a Llama with sdpa packs
    module.senior.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match="memory.pack_sequences"):
        preflight.check(module, "fit")
    preflight.check(module, "validate")  # evaluation never packs


def test_the_flash_kernel_sees_queries_in_autocasts_dtype():
    """The rotary embedding hands attention float32 queries under autocast (its cos/sin follow the
    float32 residual stream); SDPA casts them itself, the varlen kernel needs them cast: to autocast's
    dtype, and with no autocast a float32 query has no flash kernel (the per-sequence loop runs)."""
    query = torch.zeros(3, 2, 8)
    assert varlen_attention.flash_dtype(query) is None
    assert varlen_attention.flash_dtype(query.half()) is torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert varlen_attention.flash_dtype(query) is torch.bfloat16
        assert varlen_attention.flash_dtype(query.half()) is torch.float16
