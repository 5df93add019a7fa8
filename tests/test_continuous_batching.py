"""Per-sequence token budgets and continuous batching.

Every engine honours ``PromptBatch.max_new_tokens`` (a row that reaches its budget is truncated,
as at ``sampling.max_new_tokens``). FastEngine set up with ``max_batch`` below the number of rows decodes
them as a queue (freed slots refilled, live rows compacted into smaller batches): its rollouts
must equal the reference engine's and the all-at-once FastEngine's whatever the admission order,
so a sequence depends on its own seed only, never on its slot or its neighbours.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import (
    LineHandoff,
    ParagraphHandoff,
    SentenceHandoff,
    SoloHandoff,
    TokenHandoff,
    WordHandoff,
)
from tandem_lit.rollout.record import PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine, continuous
from tandem_lit.rollout.static.continuous import prefill_parts, with_responses
from tandem_lit.rollout.static.scheduler import RefillTimer
from tandem_lit.rollout.text_handoff import TextHandoffEngine
from tests.test_fast_engine import build, prompt_batch
from tests.test_hybrid_engine import hybrid

BUDGETS = torch.tensor([3, 17, 1, 9])


@pytest.fixture(scope="module")
def tokenizer():
    from tandem_lit.models.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="module")
def plain_pair(tokenizer):
    return build("qwen3", len(tokenizer), 64, 2, seed=0), build("llama", len(tokenizer), 32, 1, seed=1)


def with_budgets(prompts: PromptBatch, budgets: torch.Tensor) -> PromptBatch:
    return PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts.partner, budgets)


@pytest.mark.parametrize("kind", ["hf", "fast", "text"])
def test_every_engine_stops_each_row_at_its_own_budget(tokenizer, plain_pair, kind):
    senior, junior = plain_pair
    engine = {"hf": HFEngine, "fast": FastEngine, "text": TextHandoffEngine}[kind](rollout_dtype="float32")
    engine.setup(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, "cpu")
    if kind == "text":  # text-level handoff reads the junior's own encoding of the prompts
        prompts = PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20, seed=3, ignore_eos=True)
    policy = WordHandoff(p=0.5)
    full = engine.generate(prompts, policy, sampling)
    cut = engine.generate(with_budgets(prompts, BUDGETS), policy, sampling)
    assert cut.truncated.all() and not cut.finished.any()
    if kind == "text":  # the budget counts tokens either model wrote; re-encoded spans may differ in count
        assert (cut.lengths <= BUDGETS).all()
        assert all(f.startswith(c) for c, f in zip(cut.texts, full.texts))
        return
    assert cut.lengths.tolist() == BUDGETS.tolist()
    for row, budget in enumerate(BUDGETS.tolist()):  # a budget cuts the same rollout, nothing else
        assert cut.completion_ids[row, :budget].tolist() == full.completion_ids[row, :budget].tolist()
        assert cut.author[row, :budget].tolist() == full.author[row, :budget].tolist()


@pytest.mark.parametrize("budgets", [torch.tensor([0, 1, 1, 1]), torch.tensor([1, 1, 21, 1]), torch.tensor([1, 2])])
def test_a_budget_outside_one_to_max_new_tokens_is_refused(tokenizer, plain_pair, budgets):
    senior, junior = plain_pair
    engine = HFEngine(rollout_dtype="float32")
    engine.setup(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, "cpu")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(with_budgets(prompts, budgets), SoloHandoff(), SamplingConfig(max_new_tokens=20))


def test_select_keeps_budgets_partner_and_drops_shared_padding(tokenizer):
    prompts = prompt_batch(tokenizer, "cpu")
    prompts = PromptBatch(prompts.input_ids, prompts.attention_mask, prompts.seeds, prompts, BUDGETS)
    picked = prompts.select([1, 2])  # "Hi" and the longest prompt
    assert picked.max_new_tokens.tolist() == [17, 1]
    assert picked.seeds.tolist() == prompts.seeds[[1, 2]].tolist()
    assert picked.partner.input_ids.shape == picked.input_ids.shape
    short = prompts.select([1])
    assert short.input_ids.shape[1] == int(prompts.attention_mask[1].sum())


# ------------------------------------------------------------------------- continuous batching

# prompts of different widths; with their seeds and budgets, 10 sequences decoded 3 at a time
QUEUE_PROMPTS = ["Q: 2+3?\nA:", "Hi", "The quick brown fox jumps over", "1. a\n\n2.", "x", "Once upon a time,"] * 2
QUEUE_PROMPTS = QUEUE_PROMPTS[:10]
QUEUE_BUDGETS = torch.tensor([24, 5, 13, 1, 24, 9, 2, 20, 7, 16])
JUNIOR_PROMPTS = ["Réponds en français.", "Salut", "Le renard", "En français: 1.", "y", "Il était une fois"] * 2
POLICIES = {
    "solo": SoloHandoff("senior"),
    "token": TokenHandoff(p=0.5),
    "word": WordHandoff(p=0.5),
    "sentence": SentenceHandoff(p=0.5, max_span=6),
    "line": LineHandoff(p=0.5, max_span=5),
    "paragraph": ParagraphHandoff(p=0.5, max_span=4),
}
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=24)
SAMPLED = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3)


def queue_batch(tokenizer, junior_prompts=None, budgets=QUEUE_BUDGETS) -> PromptBatch:
    enc = tokenizer(QUEUE_PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    seeds = sequence_seeds(7, 0, len(QUEUE_PROMPTS))
    partner = None
    if junior_prompts is not None:
        own = tokenizer(junior_prompts[: len(QUEUE_PROMPTS)], padding=True, padding_side="left", return_tensors="pt")
        partner = PromptBatch(own.input_ids, own.attention_mask, seeds)
    return PromptBatch(enc.input_ids, enc.attention_mask, seeds, partner, budgets)


def assert_same(a, b, logprobs=True):
    assert a.texts == b.texts
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.author, b.author)
    for name in ("finished", "truncated", "handoffs", "decisions", "junior_draws"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if logprobs:
        torch.testing.assert_close(a.senior_logprobs, b.senior_logprobs, rtol=1e-4, atol=1e-4)


def three_engines(senior, junior, tokenizer):
    made = [HFEngine(rollout_dtype="float32"), FastEngine(kernels="torch", rollout_dtype="float32"),
            FastEngine(kernels="torch", rollout_dtype="float32", check_every=2)]
    for engine, max_batch in zip(made, (None, None, 3)):
        engine.setup(senior, junior, tokenizer, max_batch=max_batch)
    return made


def check_queue(engines, prompts, policy, sampling, compacts=True):
    """The continuous engine twice: refills prefilled beside the next decode chunk (admitted a
    chunk later), then with the decode waiting for each refill (the default; ``last_timing`` is
    that run's). ``compacts``: the waiting schedule must end in a compaction (with preemptions it may
    end with every row finishing in one chunk instead)."""
    reference, static, continuous = engines
    want = reference.generate(prompts, policy, sampling)
    assert_same(static.generate(prompts, policy, sampling), want)
    continuous.overlap_prefill = "on"  # on the CPU too: admissions deferred by a chunk
    try:
        got = continuous.generate(prompts, policy, sampling)
    finally:
        continuous.overlap_prefill = "off"
    assert_same(got, want)
    beside = continuous.last_timing()
    assert beside.refills > 0 and beside.prefill_beside_s > 0  # refills ran beside a chunk
    assert_same(continuous.generate(prompts, policy, sampling), want)
    timing = continuous.last_timing()
    assert timing.refills > 0 and (timing.compactions > 0 or not compacts)  # slots were reused and rows moved
    assert timing.prefill_beside_s == 0
    assert 0 < timing.busy_slot_fraction <= 1
    assert timing.written_tokens == int(got.lengths.sum())  # every response token, written once (the mean live rows' numerator)
    return got


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_continuous_batching_equals_the_reference_for_every_policy(tokenizer, plain_pair, policy, sampling):
    senior, junior = plain_pair
    check_queue(three_engines(senior, junior, tokenizer), queue_batch(tokenizer), policy, sampling)


def test_continuous_batching_with_per_model_prompts(tokenizer, plain_pair):
    senior, junior = plain_pair
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    check_queue(three_engines(senior, junior, tokenizer), prompts, WordHandoff(p=0.5), SAMPLED)


@pytest.mark.parametrize("pair", ["hybrid-hybrid", "hybrid-llama"])
def test_continuous_batching_on_qwen35_hybrid_pairs(tokenizer, pair):
    """Linear-attention layers keep per-sequence conv/recurrent states: refills overwrite them,
    compaction moves them with their rows."""
    vocab = len(tokenizer)
    senior = hybrid(vocab, 0)
    junior = hybrid(vocab, 1, hidden=32) if pair == "hybrid-hybrid" else build("llama", vocab, 32, 1, seed=1)
    engines = three_engines(senior, junior, tokenizer)
    for policy in (SoloHandoff("senior"), WordHandoff(p=0.5)):
        check_queue(engines, queue_batch(tokenizer), policy, SAMPLED)


@pytest.mark.parametrize("order", [[9, 3, 0, 7, 1, 8, 2, 6, 4, 5], [5, 4, 6, 2, 8, 1, 7, 0, 3, 9]])
def test_admission_order_changes_nothing(tokenizer, plain_pair, order):
    """Permute the rows (so each sequence lands in another slot, next to other neighbours, admitted
    at another step), generate, un-permute: the same rollouts."""
    senior, junior = plain_pair
    engine = FastEngine(kernels="torch", rollout_dtype="float32", check_every=3)
    engine.setup(senior, junior, tokenizer, max_batch=4)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    for policy in (SoloHandoff("senior"), TokenHandoff(p=0.5), ParagraphHandoff(p=0.5, max_span=4)):
        straight = engine.generate(prompts, policy, SAMPLED)
        shuffled = engine.generate(prompts.select(order), policy, SAMPLED)
        back = torch.tensor(order).argsort()
        unshuffled = shuffled.select(back)
        assert_same(unshuffled, straight)


def test_the_refill_timer_waits_until_idle_slots_cost_a_prefill():
    """Ski rental by hand: 10 rows, chunks of 10 steps of 10 ms, so an empty slot costs 10 ms a
    chunk; the last refill's prefill took 50 ms."""
    timer = RefillTimer("amortized")
    assert timer.due(free=1, waiting=5, live=9)  # no prefill timed yet: refill at once
    timer.prefill_s = 0.05
    timer.observe(batch=10, steps=10, step_s=0.01)  # no slot was empty in that chunk
    assert not timer.due(free=2, waiting=5, live=8)  # 0 paid + 20 ms ahead < 50 ms
    timer.free = 2
    timer.observe(batch=10, steps=10, step_s=0.01)  # 20 ms paid
    assert not timer.due(free=0, waiting=5, live=10)
    assert timer.due(free=3, waiting=5, live=7)  # 20 + 30 ms ahead >= 50 ms
    timer.refilled()
    assert timer.idle_s == 0 and not timer.due(free=2, waiting=5, live=8)
    assert timer.due(free=2, waiting=2, live=8)  # the whole queue fits: nothing to wait for
    assert timer.due(free=10, waiting=50, live=0)  # nothing decodes
    assert not timer.due(free=3, waiting=0, live=7)
    eager = RefillTimer("eager")
    eager.prefill_s = 1.0
    assert eager.due(free=1, waiting=5, live=9)


def test_refills_put_off_to_the_last_moment_change_nothing(tokenizer, plain_pair, monkeypatch):
    """A timer that waits as long as it may (a prefill that never pays off: refill only when
    the whole queue fits or nothing decodes) gives the rollouts of refilling at once, in fewer refills."""

    class Patient(RefillTimer):
        def due(self, free, waiting, live):
            self.prefill_s = float("inf")
            return super().due(free, waiting, live)

    senior, junior = plain_pair
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    eager = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2, refill="eager")
    eager.setup(senior, junior, tokenizer, max_batch=3)
    want = eager.generate(prompts, WordHandoff(p=0.5), SAMPLED)
    eager_refills = eager.last_timing().refills
    monkeypatch.setattr(continuous, "RefillTimer", Patient)
    patient = FastEngine(kernels="torch", rollout_dtype="float32", check_every=2)
    patient.setup(senior, junior, tokenizer, max_batch=3)
    assert_same(patient.generate(prompts, WordHandoff(p=0.5), SAMPLED), want)
    timing = patient.last_timing()
    assert 0 < timing.refills < eager_refills
    assert timing.refilled_sequences == prompts.batch_size - 3  # every sequence past the first batch


def test_a_refilled_slot_forgets_its_last_sequence(tokenizer, plain_pair):
    """One slot, sequences one after another: each must equal the same sequence decoded alone
    (a stale KV entry, valid flag, recurrent state or counter would change it)."""
    senior, junior = plain_pair
    engine = FastEngine(kernels="torch", rollout_dtype="float32", check_every=1)
    engine.setup(senior, junior, tokenizer, max_batch=1)
    prompts = queue_batch(tokenizer)
    together = engine.generate(prompts, WordHandoff(p=0.5), SAMPLED)
    for row in (2, 5, 9):
        alone = engine.generate(prompts.select([row]), WordHandoff(p=0.5), SAMPLED)
        assert together.texts[row] == alone.texts[0]
        assert torch.equal(together.author[row, : alone.author.shape[1]], alone.author[0])


def cuda_pair(vocab: int, pair: str):
    """The GPU tests' senior and junior on CUDA: a Qwen3 (``plain``) or Qwen3.5 hybrid senior, a Llama junior."""
    senior = build("qwen3", vocab, 64, 2, seed=0) if pair == "plain" else hybrid(vocab, 0)
    return senior.cuda(), build("llama", vocab, 32, 1, seed=1).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("pair", ["plain", "hybrid-llama"])
def test_continuous_batching_on_cuda_graphs_and_triton_kernels_equals_all_at_once(tokenizer, pair):
    """The GPU path: one captured graph per ladder size, per-row slots in the Triton attention
    kernels, refills between replays and compaction of both models' caches (float32, so the
    comparison is exact up to kernel order)."""
    senior, junior = cuda_pair(len(tokenizer), pair)
    together, queued = FastEngine(rollout_dtype="float32"), FastEngine(rollout_dtype="float32", check_every=2)
    for engine, max_batch in ((together, None), (queued, 3)):
        engine.setup(senior, junior, tokenizer, max_batch=max_batch)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS).to("cuda")
    for policy, sampling, overlap in itertools.product((SoloHandoff("senior"), WordHandoff(p=0.5)), (GREEDY, SAMPLED),
                                                        ("on", "off")):
        # refills prefilled on the prefill stream beside a chunk (on), or waited for (off)
        queued.overlap_prefill = overlap
        want = together.generate(prompts, policy, sampling)
        got = queued.generate(prompts, policy, sampling)
        timing = queued.last_timing()
        assert timing.refills > 0 and (timing.prefill_beside_s > 0) == (overlap == "on")
        assert timing.compactions > 0 or overlap == "on"
        # float32 GEMMs of other batch sizes round differently: a rare near-tie may break the
        # other way and change the rest of that row, so rows are compared whole, and most must match
        same = [i for i in range(len(want.texts)) if torch.equal(got.completion_ids[i], want.completion_ids[i])]
        assert len(same) >= len(want.texts) - 1, f"only rows {same} match"
        assert torch.equal(got.author[same], want.author[same]) and torch.equal(got.finished[same], want.finished[same])
        torch.testing.assert_close(got.senior_logprobs[same], want.senior_logprobs[same], rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------- paged KV cache

def paged(senior, junior, tokenizer, max_batch=3, check_every=2, **pool):
    engine = FastEngine(kernels="torch", rollout_dtype="float32", check_every=check_every, kv_cache="paged", **pool)
    engine.setup(senior, junior, tokenizer, max_batch=max_batch)
    return engine


# a pool of 15 pages of 4 positions: fewer than three sequences of prompt + 24 tokens need
SMALL_POOL = dict(kv_page_size=4, kv_cache_tokens=60)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("policy", ["solo", "word", "paragraph"])
def test_the_paged_cache_gives_the_rollouts_of_the_slot_cache(tokenizer, plain_pair, policy, sampling):
    """Pages of 3 positions (not a divisor of anything), a pool as large as the slot caches: refills
    and compactions move block-table rows, never K/V."""
    senior, junior = plain_pair
    engines = three_engines(senior, junior, tokenizer)
    engines[2] = paged(senior, junior, tokenizer, kv_page_size=3)
    check_queue(engines, queue_batch(tokenizer, JUNIOR_PROMPTS), POLICIES[policy], sampling)
    timing = engines[2].last_timing()
    assert timing.preemptions == 0 and 0 < timing.kv_pool_peak_fraction < 1


@pytest.mark.parametrize("prefill_tokens", [16384, 1], ids=["one-prefill", "a-prefill-a-row"])
@pytest.mark.parametrize("policy", ["solo", "word"])
def test_a_pool_too_small_for_the_batch_preempts_and_changes_nothing(tokenizer, plain_pair, policy, prefill_tokens):
    """Sequences that need a page when none is free preempt the newest ones, which go on later
    from their prompts and the tokens they wrote, prefilled (in one call, or one row a call): the
    same rollouts, token for token and log-prob for log-prob."""
    senior, junior = plain_pair
    engines = three_engines(senior, junior, tokenizer)
    engines[2] = paged(senior, junior, tokenizer, prefill_tokens=prefill_tokens, **SMALL_POOL)
    check_queue(engines, queue_batch(tokenizer, JUNIOR_PROMPTS), POLICIES[policy], SAMPLED)
    timing = engines[2].last_timing()
    assert timing.preemptions > 0 and timing.kv_pool_peak_fraction == 1.0
    assert timing.resumed_tokens > 0  # not decoded again from the prompt
    prompts = int(queue_batch(tokenizer).attention_mask.sum())
    assert timing.prefill_positions >= prompts + timing.resumed_tokens  # (sequences preempted twice: more)
    if prefill_tokens == 1:  # a prefill a row: nothing padded
        assert timing.prefill_padded_positions == timing.prefill_positions
    else:
        assert timing.prefill_padded_positions > timing.prefill_positions


def test_a_paged_engine_counts_the_positions_its_prefills_ran_over_and_padded(tokenizer, plain_pair):
    """Every sequence admitted at once, in one prefill: its positions are the prompts' tokens, its
    padded positions the rows times the longest prompt."""
    senior, junior = plain_pair
    prompts = queue_batch(tokenizer)
    engine = paged(senior, junior, tokenizer, max_batch=prompts.batch_size, prefill_tokens=16384)
    engine.generate(prompts, POLICIES["word"], SAMPLED)
    timing = engine.last_timing()
    lengths = prompts.attention_mask.sum(-1)
    assert timing.prefill_positions == int(lengths.sum())
    assert timing.prefill_padded_positions == prompts.batch_size * int(lengths.max()) > timing.prefill_positions


def test_resumed_prefill_inputs_append_each_rows_tokens_after_its_prompt():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    got_ids, got_mask = with_responses(ids, mask, [torch.tensor([1, 2]), None])
    assert got_ids.tolist() == [[0, 5, 6, 1, 2], [0, 0, 7, 8, 9]]
    assert got_mask.tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]


def test_prefill_parts_bound_the_padded_positions_of_each_call():
    assert prefill_parts([10, 10, 10, 30, 5], budget=30) == [[3], [0, 1, 2], [4]]
    # resumed sequences of mixed lengths, longest first: like lengths share a run. In admission
    # order the runs would be [0, 1], [2, 3], [4]: 2 x 3000 + 2 x 2900 + 110 = 11,910 padded
    # positions; here 2 x 3000 + 3 x 120 = 6,360
    parts = prefill_parts([100, 3000, 120, 2900, 110], budget=6000)
    assert parts == [[1, 3], [2, 4, 0]]
    assert sum(len(p) * max([100, 3000, 120, 2900, 110][i] for i in p) for p in parts) == 6360
    assert prefill_parts([40, 1], budget=30) == [[0], [1]]  # a row longer than the bound goes alone
    assert prefill_parts([0, 0, 0], budget=1) == [[0, 1, 2]]  # unknown widths: one call


@pytest.mark.parametrize("order", [[9, 3, 0, 7, 1, 8, 2, 6, 4, 5], [5, 4, 6, 2, 8, 1, 7, 0, 3, 9]])
def test_paged_rollouts_do_not_depend_on_admission_order(tokenizer, plain_pair, order):
    """Shuffled rows land in other slots and other pages, next to other neighbours, preempted at
    other times: the same rollouts as the slot cache in the original order."""
    senior, junior = plain_pair
    slots = FastEngine(kernels="torch", rollout_dtype="float32", check_every=3)
    slots.setup(senior, junior, tokenizer, max_batch=4)
    pages = paged(senior, junior, tokenizer, max_batch=4, check_every=3, **SMALL_POOL)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS)
    back = torch.tensor(order).argsort()
    for policy in (SoloHandoff("senior"), TokenHandoff(p=0.5)):
        want = slots.generate(prompts, policy, SAMPLED)
        assert_same(pages.generate(prompts.select(order), policy, SAMPLED).select(back), want)
        assert pages.last_timing().preemptions > 0


@pytest.mark.parametrize("pair", ["hybrid-hybrid", "hybrid-llama"])
def test_paged_cache_on_qwen35_hybrid_pairs(tokenizer, pair):
    """Full-attention layers read pages; linear-attention states stay per row (moved by compaction,
    overwritten on refill and after a preemption)."""
    vocab = len(tokenizer)
    senior = hybrid(vocab, 0)
    junior = hybrid(vocab, 1, hidden=32) if pair == "hybrid-hybrid" else build("llama", vocab, 32, 1, seed=1)
    engines = three_engines(senior, junior, tokenizer)
    for pool, preempts in ((dict(kv_page_size=5), False), (SMALL_POOL, True)):
        engines[2] = paged(senior, junior, tokenizer, **pool)
        for policy in (SoloHandoff("senior"), WordHandoff(p=0.5)):
            check_queue(engines, queue_batch(tokenizer), policy, SAMPLED, compacts=not preempts)
            timing = engines[2].last_timing()
            assert (timing.preemptions > 0) == preempts
            assert (timing.resumed_tokens > 0) == preempts  # the preempted went on from their own tokens


def test_one_slot_and_a_tiny_pool_reuse_pages_cleanly(tokenizer, plain_pair):
    """One row, pages of one position, a pool of exactly one sequence: every page is reused by
    the next sequence, and each rollout equals the sequence decoded alone."""
    senior, junior = plain_pair
    prompts = queue_batch(tokenizer)
    longest = int((prompts.attention_mask.sum(-1) + QUEUE_BUDGETS).max())
    engine = paged(senior, junior, tokenizer, max_batch=1, check_every=1, kv_page_size=1, kv_cache_tokens=longest)
    together = engine.generate(prompts, WordHandoff(p=0.5), SAMPLED)
    reference = HFEngine(rollout_dtype="float32")
    reference.setup(senior, junior, tokenizer)
    assert_same(together, reference.generate(prompts, WordHandoff(p=0.5), SAMPLED))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_cache="pages"), "kv_cache"),
    (dict(kv_cache="paged", kv_page_size=0), "kv_page_size"),
    (dict(kv_cache="paged", kv_cache_tokens=0), "positive"),
    (dict(kv_cache="paged", kv_cache_gib=-1.0), "positive"),
    (dict(kv_cache="paged", kv_cache_tokens=100, kv_cache_gib=1.0), "not both"),
    (dict(kv_cache_tokens=100), "paged"),
    (dict(refill="lazy"), "refill"),
])
def test_bad_kv_cache_settings_fail_in_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        FastEngine(**kwargs)
    assert "\n" not in str(info.value)


def test_a_pool_smaller_than_one_sequence_is_refused(tokenizer, plain_pair):
    senior, junior = plain_pair
    engine = paged(senior, junior, tokenizer, kv_page_size=4, kv_cache_tokens=40)  # the longest needs 30 + 24
    with pytest.raises(ConfigError, match="kv_cache_tokens"):
        engine.generate(queue_batch(tokenizer), SoloHandoff(), SAMPLED)


def test_the_pool_is_sized_in_gib_from_both_models_bytes_per_token(tokenizer, plain_pair):
    senior, junior = plain_pair
    engine = paged(senior, junior, tokenizer, kv_page_size=8, kv_cache_gib=0.001)
    engine.generate(queue_batch(tokenizer), SoloHandoff(), GREEDY)
    per_token = sum(m.kv_bytes_per_token() for m in engine.models.values())
    assert per_token == 4 * (2 * 2 * 2 * 16 + 1 * 2 * 2 * 8)  # float32; (layers x K,V x kv heads x head dim) each
    pool = engine.models["senior"].k_cache[0]  # [pages, KV, page, D]
    assert (pool.shape[0], pool.shape[2]) == (int(0.001 * 1024**3 // (8 * per_token)), 8)
    assert engine.last_timing().kv_pool_tokens == (pool.shape[0] - 1) * 8  # the scratch page aside


@pytest.mark.gpu
@pytest.mark.parametrize("pair", ["plain", "hybrid-llama"])
@pytest.mark.parametrize("pool", [dict(kv_page_size=16), SMALL_POOL], ids=["roomy", "preempting"])
def test_paged_cache_on_cuda_graphs_and_triton_kernels_equals_the_slot_cache(tokenizer, pair, pool):
    """The GPU path: block table as a static tensor of the captured graphs, the Triton kernels
    reading pages (float32: exact up to kernel order), refills, preemptions and compaction."""
    senior, junior = cuda_pair(len(tokenizer), pair)
    slots = FastEngine(rollout_dtype="float32", check_every=2)
    pages = FastEngine(rollout_dtype="float32", check_every=2, kv_cache="paged", **pool)
    for engine in (slots, pages):
        engine.setup(senior, junior, tokenizer, max_batch=3)
    prompts = queue_batch(tokenizer, JUNIOR_PROMPTS).to("cuda")
    for policy in (SoloHandoff("senior"), WordHandoff(p=0.5)):
        for sampling in (GREEDY, SAMPLED):
            want = slots.generate(prompts, policy, sampling)
            got = pages.generate(prompts, policy, sampling)
            timing = pages.last_timing()
            assert timing.refills > 0 and timing.compactions > 0
            assert (timing.preemptions > 0) == (pool is SMALL_POOL)
            # as above: a float32 near-tie may break the other way in another batch composition
            same = [i for i in range(len(want.texts)) if torch.equal(got.completion_ids[i], want.completion_ids[i])]
            assert len(same) >= len(want.texts) - 1, f"only rows {same} match"
            assert torch.equal(got.author[same], want.author[same]) and torch.equal(got.finished[same], want.finished[same])
            torch.testing.assert_close(got.senior_logprobs[same], want.senior_logprobs[same], rtol=1e-3, atol=1e-3)
