"""Teacher-forced log-probs of completion tokens, without materialising [N, T, V] float logits.

A 3,000-token completion over a 150k vocabulary is 1.8 GB of float logits per sequence. The
backbone runs once; the vocabulary projection, temperature and log-softmax run in chunks of
positions, each recomputed in the backward pass (activation checkpointing), so peak memory is
one chunk however long the completion.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tandem_lit.rollout.record import Rollout
from tandem_lit.rollout.weights import plain_model

log = logging.getLogger(__name__)

CHUNK_ELEMENTS = 2**28  # float logits per chunk (1 GiB)


def avoid_cudnn_attention_backward() -> None:
    """Route scaled-dot-product attention away from the cuDNN backend for training on CUDA.

    On H100/H200 with torch 2.11, cuDNN's SDPA backward returns NaN query gradients when an
    attention mask is passed and the length is 64 mod 128 (pytorch/pytorch#196678): our training
    forward always passes the padding mask, and a tiny bf16-mixed run got NaN weights after its
    first update. Flash / memory-efficient / math attention are exact on the same inputs. Set
    process-wide (not a context manager) because activation checkpointing re-runs the forward
    inside backward, outside any context around the forward.
    """
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention disabled for training (NaN gradients with padding masks: pytorch#196678)")


def last_hidden_state(model: nn.Module, **inputs) -> Tensor:
    """The backbone's last hidden state (no vocabulary projection)."""
    return plain_model(model).base_model(**inputs).last_hidden_state


def completion_hidden_states(model: nn.Module, rollout: Rollout) -> Tensor:  # -> [N, T, H]
    """The backbone's hidden states at the positions that predict each completion token."""
    completion = rollout.completion_ids
    width = completion.shape[1]
    ids = torch.cat([rollout.prompt_ids, completion], dim=1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    # (FSDP: ``shard_model`` registers this as a forward of the root unit, so that its shards,
    # embeddings and head, are gathered for it and their gradients reduced after backward)
    forward = getattr(model, "completion_hidden", None) or functools.partial(last_hidden_state, model)
    hidden = forward(input_ids=ids, attention_mask=mask, position_ids=positions)
    return hidden[:, -width - 1 : -1]


def completion_logprobs(model: nn.Module, rollout: Rollout, temperature: float) -> Tensor:  # -> [N, T]
    """log p(token_t | prompt, tokens_<t) of every completion token, logits divided by
    ``temperature`` (if > 0). Padding positions get some value; callers mask them."""
    causal_lm = plain_model(model)
    head = causal_lm.get_output_embeddings()
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    completion = rollout.completion_ids
    width = completion.shape[1]
    hidden = completion_hidden_states(model, rollout)

    def chunk_logprobs(h: Tensor, targets: Tensor) -> Tensor:
        logits = head(h).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature > 0:
            logits = logits / temperature
        return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    step = max(1, CHUNK_ELEMENTS // (completion.shape[0] * head.weight.shape[0]))
    parts = []
    for start in range(0, width, step):
        h, targets = hidden[:, start : start + step], completion[:, start : start + step]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(chunk_logprobs, h, targets, use_reentrant=False))
        else:
            parts.append(chunk_logprobs(h, targets))
    return torch.cat(parts, dim=1)


@torch.no_grad()
def completion_top_tokens(model: nn.Module, rollout: Rollout) -> Tensor:  # -> [N, T] long
    """The model's most likely token at every completion position, teacher-forced on the
    completion (what it would have written next after each prefix)."""
    head = plain_model(model).get_output_embeddings()
    hidden = completion_hidden_states(model, rollout)
    step = max(1, CHUNK_ELEMENTS // (hidden.shape[0] * head.weight.shape[0]))
    return torch.cat([head(hidden[:, s : s + step]).argmax(-1) for s in range(0, hidden.shape[1], step)], dim=1)
