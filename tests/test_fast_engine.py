"""FastEngine: same rollouts as the reference HFEngine, updated weights, correct log-probs.

Runs on CPU (eager decode step) everywhere and, where a GPU is present, also on CUDA with the
decode step captured as a CUDA graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tandem_lit.errors import ConfigError
from tandem_lit.models.tiny import char_tokenizer, tiny_llama_config
from tandem_lit.rollout.engine import HFEngine
from tandem_lit.rollout.handoff import LineHandoff, ParagraphHandoff, SoloHandoff, TokenHandoff, WordHandoff
from tandem_lit.rollout.record import Author, PromptBatch
from tandem_lit.rollout.sampling import SamplingConfig, sequence_seeds
from tandem_lit.rollout.static import FastEngine

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPTS = ["Q: 2+3?\nA:", "Hi", "The quick brown fox jumps over", "1. a\n\n2."]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def build(arch: str, vocab: int, hidden: int, layers: int, seed: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=2, pad_token_id=0, bos_token_id=1,
    )
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, tie_word_embeddings=True, **common)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()  # q/k/v biases
    return LlamaForCausalLM(tiny_llama_config(vocab, hidden=hidden, layers=layers)).eval()


def prompt_batch(tokenizer, device, prompts=PROMPTS, seed=0):
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    return PromptBatch(enc.input_ids, enc.attention_mask, sequence_seeds(seed, 0, len(prompts))).to(device)


def engines(senior, junior, tokenizer, kernels="torch", rollout_dtype="float32"):
    """The reference engine and a FastEngine; the torch kernels are comparable bit for bit.
    float32 rollouts: these tests compare against the float32 models themselves."""
    reference = HFEngine(rollout_dtype=rollout_dtype)
    fast = FastEngine(kernels=kernels, rollout_dtype=rollout_dtype)
    reference.setup(senior, junior, tokenizer)
    fast.setup(senior, junior, tokenizer)
    return reference, fast


def assert_same_rollouts(a, b):
    assert a.texts == b.texts
    assert torch.equal(a.completion_ids.cpu(), b.completion_ids.cpu())
    assert torch.equal(a.author.cpu(), b.author.cpu())
    assert torch.equal(a.finished.cpu(), b.finished.cpu())
    assert torch.equal(a.handoffs.cpu(), b.handoffs.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fast_engine_matches_reference_engine(tokenizer, device, arch):
    senior = build(arch, len(tokenizer), 64, 2, seed=0).to(device)
    junior = build(arch, len(tokenizer), 32, 1, seed=1).to(device)
    reference, fast = engines(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, device)
    samplers = [
        SamplingConfig(temperature=0.0, max_new_tokens=24),
        SamplingConfig(temperature=1.0, max_new_tokens=24, seed=3),
        SamplingConfig(temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=24),
    ]
    policies = [WordHandoff(0.5), TokenHandoff(0.5), LineHandoff(0.5), ParagraphHandoff(0.5), SoloHandoff(), SoloHandoff("junior")]
    for policy in policies:
        for sampling in samplers:
            assert_same_rollouts(reference.generate(prompts, policy, sampling), fast.generate(prompts, policy, sampling))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", [WordHandoff(0.5), TokenHandoff(0.5)])
def test_identical_models_tandem_equals_solo_greedy(tokenizer, device, policy):
    # fp32 and the same weights on both sides: who writes a token cannot change it under argmax
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0).to(device)
    junior = copy.deepcopy(senior)
    _, fast = engines(senior, junior, tokenizer, kernels="auto")  # the Triton kernels on GPU
    prompts = prompt_batch(tokenizer, device)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=32)
    tandem = fast.generate(prompts, policy, greedy)
    solo = fast.generate(prompts, SoloHandoff(), greedy)
    assert torch.equal(tandem.completion_ids, solo.completion_ids)
    assert (tandem.author == Author.JUNIOR).any(), "the junior should have written some tokens"


@pytest.mark.parametrize("device", DEVICES)
def test_p0_all_senior_p1_all_junior(tokenizer, device):
    senior = build("llama", len(tokenizer), 64, 2, seed=0).to(device)
    junior = build("llama", len(tokenizer), 32, 1, seed=1).to(device)
    _, fast = engines(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, device)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20)
    for p, author in ((0.0, Author.SENIOR), (1.0, Author.JUNIOR)):
        out = fast.generate(prompts, WordHandoff(p), sampling)
        written = out.author[out.completion_mask]
        assert written.numel() > 0 and bool((written == author).all())


@pytest.mark.parametrize("device", DEVICES)
def test_senior_logprobs_match_teacher_forcing(tokenizer, device):
    from tandem_lit.rollout.switch import set_log_mass

    senior = build("qwen3", len(tokenizer), 64, 2, seed=0).to(device)
    junior = build("qwen3", len(tokenizer), 32, 1, seed=1).to(device)
    _, fast = engines(senior, junior, tokenizer, kernels="auto")
    prompts = prompt_batch(tokenizer, device, PROMPTS * 4)  # rows enough to hold switches both ways
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=48)
    out = fast.generate(prompts, WordHandoff(0.5), sampling)
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.completion_mask.long()], dim=1)
    with torch.no_grad():
        logits = senior(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    width = out.completion_ids.shape[1]
    logp = (logits[:, -width - 1 : -1].float() / sampling.temperature).log_softmax(-1)
    expected = logp.gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    # switches (rollout.switch): a token drawn from a start set is renormalised over it; a senior
    # span's end adds its end set's log-mass to the senior's last token. The codes live on the host
    # (Rollout.start_set), the sets with the rest
    flat = logp.flatten(0, 1)
    start = set_log_mass(flat, out.token_sets, out.start_set.flatten().to(device)).view_as(expected)
    end = set_log_mass(flat, out.token_sets, out.end_set.flatten().to(device)).view_as(expected)
    expected = expected - start + torch.nn.functional.pad(end[:, 1:], (0, 1))
    written = out.completion_mask
    assert bool((out.start_set != 0).any()) and bool((out.end_set != 0).any())
    torch.testing.assert_close(out.senior_logprobs[written], expected[written], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("rollout_dtype", ["live", "float32"])
def test_next_rollout_reads_updated_weights(tokenizer, device, lora, rollout_dtype):
    """``live`` reads the trained parameters (LoRA adapters too) at every step; a rollout copy
    (here: float32 with the adapters merged) keeps decoding the old policy until ``load_weights``."""
    from peft import LoraConfig, get_peft_model

    from tandem_lit.rollout.weights import rollout_named_tensors

    senior = build("llama", len(tokenizer), 64, 2, seed=0).to(device)
    if lora:
        senior = get_peft_model(senior, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    junior = build("llama", len(tokenizer), 32, 1, seed=1).to(device)
    # default kernels: on GPU the fused q/k/v and gate/up weights must follow the update
    _, fast = engines(senior, junior, tokenizer, kernels="auto", rollout_dtype=rollout_dtype)
    assert fast.decodes_copy == (lora and rollout_dtype != "live")
    prompts = prompt_batch(tokenizer, device)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=24)
    before = fast.generate(prompts, SoloHandoff(), greedy)
    optimizer = torch.optim.SGD([p for p in senior.parameters() if p.requires_grad], lr=20.0)
    target = before.completion_ids[:, 0]
    for _ in range(2):  # LoRA B starts at zero: two steps make both A and B move
        logits = senior(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask).logits.float()
        loss = logits[:, -1].log_softmax(-1).gather(-1, target.unsqueeze(-1)).mean()  # push the first token down
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if fast.decodes_copy:
        assert_same_rollouts(before, fast.generate(prompts, SoloHandoff(), greedy))  # the copy has not moved
        fast.load_weights(rollout_named_tensors(senior))
    after = fast.generate(prompts, SoloHandoff(), greedy)
    assert not torch.equal(before.completion_ids, after.completion_ids), "the update should change greedy output"
    reference = HFEngine(rollout_dtype="live")
    reference.setup(senior, junior, tokenizer)
    expected = reference.generate(prompts, SoloHandoff(), greedy)
    if device == "cpu" and not fast.decodes_copy:
        assert_same_rollouts(expected, after)
    else:  # fused kernels, or merged adapters: the same policy up to float rounding
        assert (expected.completion_ids == after.completion_ids).float().mean() > 0.9


@pytest.mark.parametrize("device", DEVICES)
def test_batches_of_other_sizes_and_lengths_reuse_the_engine(tokenizer, device):
    senior = build("llama", len(tokenizer), 64, 2, seed=0).to(device)
    junior = build("llama", len(tokenizer), 32, 1, seed=1).to(device)
    reference, fast = engines(senior, junior, tokenizer)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    for prompts in (PROMPTS[:1], PROMPTS, PROMPTS * 3, ["a much longer prompt than the others, " * 4]):
        batch = prompt_batch(tokenizer, device, prompts)
        assert_same_rollouts(reference.generate(batch, WordHandoff(0.5), sampling), fast.generate(batch, WordHandoff(0.5), sampling))


@pytest.mark.parametrize("device", DEVICES)
def test_last_timing_splits_prefill_and_decode(tokenizer, device):
    senior = build("llama", len(tokenizer), 64, 2, seed=0).to(device)
    _, fast = engines(senior, None, tokenizer)
    with pytest.raises(RuntimeError, match="none has run yet"):
        fast.last_timing()
    # the host looks at the stop flags every 16 steps (check_every), so all 12 steps run
    out = fast.generate(prompt_batch(tokenizer, device), SoloHandoff(), SamplingConfig(temperature=1.0, max_new_tokens=12))
    timing = fast.last_timing()
    assert timing.decode_steps == 12 and int(out.lengths.max()) <= 12
    assert timing.prefill_s > 0 and timing.decode_s > 0
    assert timing.decode_step_ms == pytest.approx(1000 * timing.decode_s / 12)
    assert timing.setup_s > 0  # the first call allocates the caches (and captures on GPU)
    # a rollout phase of several calls sums them; what an engine does not report stays unreported
    summed = timing + timing
    assert summed.calls == 2 and summed.decode_steps == 24 and summed.busy_slot_fraction == 2 * timing.busy_slot_fraction
    assert timing.preemptions is None and summed.preemptions is None  # slot caches: no pool


@pytest.mark.parametrize("device", DEVICES)
def test_release_frees_the_caches_and_the_next_rollout_is_the_same(tokenizer, device):
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0).to(device)
    junior = build("qwen3", len(tokenizer), 32, 1, seed=1).to(device)
    _, fast = engines(senior, junior, tokenizer, kernels="auto")
    prompts = prompt_batch(tokenizer, device)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=20)
    first = fast.generate(prompts, WordHandoff(0.5), sampling)
    fast.release()
    assert fast._batch is None and not fast._graphs
    assert all(not m.k_cache and not m.v_cache for m in fast.models.values())
    again = fast.generate(prompts, WordHandoff(0.5), sampling)
    assert_same_rollouts(first, again)
    assert fast.last_timing().setup_s > 0  # re-allocated (and re-captured on GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_triton_kernels_match_torch_path(tokenizer, arch):
    senior = build(arch, len(tokenizer), 128, 2, seed=0).cuda()
    junior = build(arch, len(tokenizer), 64, 1, seed=1).cuda()
    _, plain = engines(senior, junior, tokenizer, kernels="torch")
    _, fused = engines(senior, junior, tokenizer, kernels="triton")
    prompts = prompt_batch(tokenizer, "cuda")
    for policy in (WordHandoff(0.5), SoloHandoff()):
        for temperature in (0.0, 1.0):  # greedy, and the fused sampler's draws
            a = plain.generate(prompts, policy, SamplingConfig(temperature=temperature, max_new_tokens=40))
            b = fused.generate(prompts, policy, SamplingConfig(temperature=temperature, max_new_tokens=40))
            assert_same_rollouts(a, b)  # fp32 with IEEE dot products: the same text
            torch.testing.assert_close(a.senior_logprobs, b.senior_logprobs, atol=1e-4, rtol=1e-4)
    # bf16: the same decode logits up to bf16 rounding
    for model in (senior, junior):
        model.to(torch.bfloat16)
    _, plain = engines(senior, junior, tokenizer, kernels="torch", rollout_dtype="bfloat16")
    _, fused = engines(senior, junior, tokenizer, kernels="triton", rollout_dtype="bfloat16")
    a = plain.generate(prompts, SoloHandoff(), SamplingConfig(temperature=0.0, max_new_tokens=8))
    b = fused.generate(prompts, SoloHandoff(), SamplingConfig(temperature=0.0, max_new_tokens=8))
    # token 0 comes from the shared prefill; token 1 is the first decode step of each path
    assert torch.equal(a.completion_ids[:, :2], b.completion_ids[:, :2])
    torch.testing.assert_close(a.senior_logprobs[:, 1], b.senior_logprobs[:, 1], atol=0.05, rtol=0.05)


@pytest.mark.gpu
def test_fused_sampler_matches_torch_sampling_at_full_vocabulary():
    from tandem_lit.rollout.sampling import sample_tokens, uniform
    from tandem_lit.rollout.static import kernels

    torch.manual_seed(0)
    batch, vocab = 256, 151936
    senior, junior = (torch.randn(batch, vocab + 64, device="cuda") * 4)[:, :vocab], torch.randn(batch, vocab, device="cuda") * 4
    pick = torch.rand(batch, device="cuda") < 0.5
    allowed = torch.rand(vocab, device="cuda") < 0.3
    u = uniform(torch.arange(batch, device="cuda"), 0, 0)
    mixed = torch.where(pick[:, None], junior, senior)
    for temperature in (0.0, 0.6, 1.0):
        config = SamplingConfig(temperature=temperature)
        for mask in (None, allowed):
            want = sample_tokens(mixed, u, config, mask)
            got = kernels.sample_rows(senior, u, temperature, junior, pick, mask)
            if mask is not None:
                assert bool(allowed[got].all())
            # summation order differs from torch's: a draw may differ only where u sits on a CDF step
            assert (got == want).float().mean() >= (1.0 if temperature == 0 else 0.99)
    token = torch.randint(0, vocab, (batch,), device="cuda")
    logp = (senior / 0.6).log_softmax(-1)
    torch.testing.assert_close(kernels.token_logprobs(senior, token, 0.6)[0],
                               logp.gather(-1, token[:, None]).squeeze(-1), atol=1e-4, rtol=1e-4)
    # with switch sets (rollout.switch): the log-prob under each row's start set, its end set's log-mass
    from tandem_lit.rollout.switch import set_log_mass

    sets = torch.stack([allowed, ~allowed, torch.rand(vocab, device="cuda") < 0.01])
    start, end = (torch.randint(0, 4, (batch,), device="cuda") for _ in range(2))
    got, end_mass = kernels.token_logprobs(senior, token, 0.6, sets, start, end)
    torch.testing.assert_close(got, logp.gather(-1, token[:, None]).squeeze(-1) - set_log_mass(logp, sets, start), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end_mass, set_log_mass(logp, sets, end), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_junior_on_a_side_stream_gives_the_same_rollouts(tokenizer, cuda_graphs):
    senior = build("qwen3", len(tokenizer), 128, 2, seed=0).cuda().to(torch.bfloat16)
    junior = build("qwen3", len(tokenizer), 64, 1, seed=1).cuda().to(torch.bfloat16)
    runs = {}
    for overlap in (True, False):
        engine = FastEngine(cuda_graphs=cuda_graphs, overlap_junior=overlap)
        engine.setup(senior, junior, tokenizer)
        runs[overlap] = [
            engine.generate(prompt_batch(tokenizer, "cuda", seed=seed), WordHandoff(0.5), SamplingConfig(temperature=1.0, max_new_tokens=48))
            for seed in (0, 1, 0)
        ]
        assert (engine._side_stream is not None) == overlap
        engine.generate(prompt_batch(tokenizer, "cuda"), SoloHandoff(), SamplingConfig(temperature=1.0, max_new_tokens=8))
    for a, b in zip(runs[True], runs[False], strict=True):
        assert_same_rollouts(a, b)
        assert torch.equal(a.senior_logprobs, b.senior_logprobs)
    assert_same_rollouts(runs[True][0], runs[True][2])  # same seed, same rollout
    assert (runs[True][0].author == Author.JUNIOR).any()


@pytest.mark.parametrize("device", DEVICES)
def test_solo_never_creates_the_side_stream(tokenizer, device):
    senior = build("llama", len(tokenizer), 64, 2, seed=0).to(device)
    junior = build("llama", len(tokenizer), 32, 1, seed=1).to(device)
    engine = FastEngine()
    engine.setup(senior, junior, tokenizer)
    for author in ("senior", "junior"):
        engine.generate(prompt_batch(tokenizer, device), SoloHandoff(author), SamplingConfig(temperature=1.0, max_new_tokens=4))
    assert engine._side_stream is None


def test_unsupported_architecture_fails_closed(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match="HFEngine"):
        FastEngine().setup(gpt2, None, tokenizer)


@pytest.mark.parametrize("device", DEVICES)
def test_an_engine_set_up_and_run_under_the_trainers_autocast_decodes_as_outside_it(tokenizer, device):
    """The rollout phase sets the engine up inside training_step, under Lightning's bf16 autocast.
    What the engine computes then (its rotary table, its fused copies) and how it decodes must not
    change: vLLM built under it rotated positions by a bf16 table (issue 25's 1.25-nat gap)."""
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0).to(device)
    junior = build("qwen3", len(tokenizer), 32, 1, seed=1).to(device)
    prompts = prompt_batch(tokenizer, device)
    sampling, policy = SamplingConfig(temperature=1.0, max_new_tokens=40, seed=3), WordHandoff(0.5)
    plain = FastEngine(rollout_dtype="float32")
    plain.setup(senior, junior, tokenizer)
    expected = plain.generate(prompts, policy, sampling)
    engine = FastEngine(rollout_dtype="float32")
    with torch.autocast(device, dtype=torch.bfloat16):
        engine.setup(senior, junior, tokenizer)
        got = engine.generate(prompts, policy, sampling)
    assert_same_rollouts(expected, got)
    torch.testing.assert_close(got.senior_logprobs, expected.senior_logprobs, rtol=0, atol=0)


@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_the_decode_reports_the_bytes_its_steps_read(tokenizer, kv_cache):
    """One row of a P-token prompt writes N tokens: step k attends to P + k positions, the last step
    (its row done, its slot kept) to P + N - 1, so NP + (N - 1)(N + 2) / 2 in all. Each active
    model reads those positions' keys and values and its weights once a step, the embedding table
    whole only where it is the LM head too (the senior here; the junior's is untied); in tandem
    both models do, solo only the senior."""
    senior = build("qwen3", len(tokenizer), 64, 2, seed=0)
    junior = build("qwen2", len(tokenizer), 32, 1, seed=1)
    assert senior.config.tie_word_embeddings and not junior.config.tie_word_embeddings
    engine = FastEngine(kernels="torch", rollout_dtype="float32", kv_cache=kv_cache, check_every=2)
    engine.setup(senior, junior, tokenizer)
    prompts = prompt_batch(tokenizer, "cpu", PROMPTS[:1])
    steps, prompt = 5, int(prompts.attention_mask.sum())
    attended = steps * prompt + (steps - 1) * (steps + 2) // 2

    def reads(model):  # float32: 4 bytes a number
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
        weights = sum(p.numel() for p in model.parameters())  # (tied: the one matrix once)
        if not config.tie_word_embeddings:
            weights -= model.get_input_embeddings().weight.numel()
        return attended * kv + steps * 4 * weights

    sampling = SamplingConfig(temperature=1.0, max_new_tokens=steps, ignore_eos=True)
    for policy, read in ((SoloHandoff(), reads(senior)), (WordHandoff(0.5), reads(senior) + reads(junior))):
        engine.generate(prompts, policy, sampling)
        timing = engine.last_timing()
        assert timing.decode_steps == steps and timing.decode_read_bytes == read
        assert timing.decode_read_tb_per_s == pytest.approx(read / timing.decode_s / 1e12)


def test_the_decode_does_not_count_the_bytes_of_hybrid_layers(tokenizer):
    """Qwen3.5's linear-attention states are read and written at every step too: its read bytes are
    not reported rather than reported short."""
    from tests.test_hybrid_engine import hybrid

    engine = FastEngine(kernels="torch", rollout_dtype="float32")
    engine.setup(hybrid(len(tokenizer), seed=0), None, tokenizer)
    engine.generate(prompt_batch(tokenizer, "cpu", PROMPTS[:1]), SoloHandoff(), SamplingConfig(max_new_tokens=4))
    assert engine.last_timing().decode_read_bytes is None
