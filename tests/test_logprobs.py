"""Chunked, checkpointed completion log-probs equal the plain full-logits computation."""

from __future__ import annotations

import torch

from tandem_lit.rollout import logprobs
from tandem_lit.rollout.record import Author, Rollout


def full_logprobs(model, rollout, temperature):
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    logits = logits[:, rollout.prompt_ids.shape[1] - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)


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
    torch.testing.assert_close(got[written], expected[written], rtol=0, atol=1e-6)
    weight = model.model.layers[0].mlp.up_proj.weight
    (grad_expected,) = torch.autograd.grad((expected * written).sum(), weight)
    (grad_got,) = torch.autograd.grad((got * written).sum(), weight)
    torch.testing.assert_close(grad_got, grad_expected, rtol=0, atol=1e-6)
