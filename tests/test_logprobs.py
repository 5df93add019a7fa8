"""Chunked, checkpointed completion log-probs equal the plain full-logits computation."""

from __future__ import annotations

import pytest
import torch

from tandem_lit.rollout import logprobs
from tandem_lit.rollout.record import Author, Rollout
from tests.conftest import ragged_rollout


def full_logprobs(model, rollout, temperature):
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    logits = logits[:, rollout.prompt_ids.shape[1] - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """|got - expected| / |expected| over the whole tensor (a gradient's float32 rounding is
    relative to its scale, not to each element)."""
    return float((got - expected).norm() / expected.norm())


def test_chunked_logprobs_and_gradients_equal_the_full_computation(monkeypatch, char_tok):
    from conftest import tiny_llama

    model = tiny_llama(len(char_tok), seed=3)
    generator = torch.Generator().manual_seed(0)
    n, prompt, width = 3, 5, 40
    prompt_mask = torch.ones(n, prompt, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    author = torch.full((n, width), int(Author.SENIOR), dtype=torch.int8)
    author[1, 30:] = Author.PAD  # a shorter completion
    author[2, 10:20] = Author.JUNIOR
    rollout = Rollout(
        torch.randint(4, len(char_tok), (n, prompt), generator=generator), prompt_mask,
        torch.randint(4, len(char_tok), (n, width), generator=generator), author,
        *(torch.zeros(n, dtype=torch.bool),) * 2, *(torch.zeros(n, dtype=torch.long),) * 3,
    )
    expected = full_logprobs(model, rollout, 0.7)
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * len(char_tok) * 2)  # chunks of two positions
    got = logprobs.completion_logprobs(model, rollout, 0.7)
    written = rollout.completion_mask
    # (the reference runs the masked, left-padded layout: float32 rounding apart, log-probs near -15)
    torch.testing.assert_close(got[written], expected[written], rtol=1e-6, atol=1e-6)
    weight = model.model.layers[0].mlp.up_proj.weight
    (grad_expected,) = torch.autograd.grad((expected * written).sum(), weight)
    (grad_got,) = torch.autograd.grad((got * written).sum(), weight)
    assert relative_error(grad_got, grad_expected) < 1e-5


def test_logprobs_over_the_sampled_vocabulary_normalise_over_its_tokens_only(monkeypatch):
    """``vocab``: a head with rows past the tokenizer's tokens (Qwen3's 151,936 for 151,669) is
    normalised over the first ``vocab`` logits, as the engine samples; chunked or not."""
    from conftest import tiny_llama

    model = tiny_llama(48, seed=4)
    rollout = ragged_rollout(32)  # token ids below 32: what a 32-token tokenizer can write
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    logits = logits[:, rollout.prompt_ids.shape[1] - 1 : -1, :32].float() / 0.7
    expected = logits.log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    written = rollout.completion_mask
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * 48 * 2)
    with torch.no_grad():
        got = logprobs.completion_logprobs(model, rollout, 0.7, vocab=32)
        whole = logprobs.completion_logprobs(model, rollout, 0.7)
        assert torch.equal(logprobs.completion_logprobs(model, rollout, 0.7, vocab=48), whole)
        top = logprobs.completion_top_tokens(model, rollout, vocab=32)
    torch.testing.assert_close(got[written], expected[written], rtol=1e-5, atol=1e-5)
    assert (whole[written] < got[written]).all() and (got - whole)[written].mean() > 0.05  # the padding rows held mass
    assert int(top.max()) < 32


# left-padded prompts of 1-6 tokens, right-padded completions of 0-9 (an empty one included)
PROMPT_LENGTHS, COMPLETION_LENGTHS = [1, 6, 4, 3], [5, 9, 0, 7]


def row_by_row_logprobs(model, rollout, temperature) -> list:
    """Each row alone, its real prompt and completion with no padding at all: [c_i] per row."""
    rows = []
    for prompt, keep, completion, written in zip(
        rollout.prompt_ids, rollout.prompt_mask.bool(), rollout.completion_ids, rollout.completion_mask,
    ):
        prompt, completion = prompt[keep], completion[written]
        logits = model(input_ids=torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]
        rows.append((logits.float() / temperature).log_softmax(-1).gather(-1, completion[:, None])[:, 0])
    return rows


def tiny_qwen35(vocab: int):
    from transformers import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(  # 3 Gated DeltaNet layers, then one gated full-attention layer
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config.initializer_range = 0.3
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = Qwen3_5ForCausalLM(config).eval()
        with torch.no_grad():  # random norm weights, so the zero-centred norms matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_left_aligned_rows_equal_each_row_alone(kind):
    """Rows of unequal prompts and completions, laid left-aligned with no attention mask, give the
    log-probs and parameter gradients of each row run alone (so no padding leaks in, through
    attention or Qwen3.5's recurrence and conv, and the predicting positions are the right ones)."""
    from conftest import tiny_llama

    vocab = 40
    model = tiny_llama(vocab, seed=3, init_range=0.1) if kind == "llama" else tiny_qwen35(vocab)
    rollout = ragged_rollout(vocab, PROMPT_LENGTHS, COMPLETION_LENGTHS, seed=1)
    written = rollout.completion_mask
    weights = torch.linspace(-1, 1, written.numel()).view_as(written) * written
    params = [p for p in model.parameters() if p.requires_grad]

    got = logprobs.completion_logprobs(model, rollout, 0.7)
    grads = torch.autograd.grad((got * weights).sum(), params)
    rows = row_by_row_logprobs(model, rollout, 0.7)
    expected = torch.cat(rows)
    expected_grads = torch.autograd.grad(sum((r * w[m]).sum() for r, w, m in zip(rows, weights, written)), params)

    torch.testing.assert_close(got[written], expected, rtol=0, atol=1e-5)
    errors = {name: relative_error(a, b) for (name, _), a, b in zip(model.named_parameters(), grads, expected_grads)}
    assert max(errors.values()) < 1e-4, errors


def test_equal_rows_are_the_masked_layout():
    """Rows of one prompt length: the left-aligned layout is the padded one, minus the mask."""
    from conftest import tiny_llama

    model = tiny_llama(40, seed=3, init_range=0.1)
    rollout = ragged_rollout(40, [4, 4, 4], [6, 6, 6], seed=1)
    got = logprobs.completion_logprobs(model, rollout, 0.7)
    torch.testing.assert_close(got, full_logprobs(model, rollout, 0.7), rtol=0, atol=1e-6)
    hidden = logprobs.completion_hidden_states(model, rollout)
    assert hidden.shape == (3, 6, model.config.hidden_size)
