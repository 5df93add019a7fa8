"""Sampling: one configuration object used for training rollouts, validation and evaluation,
plus a counter-based RNG so that every draw is a pure function of (sequence seed, step, stream).

Why counter-based: a rollout must be reproducible from its seed whatever the batch it sits in,
whichever engine produced it (eager HF loop or CUDA-graph replay), and on any device. A hash of
integers does that with plain tensor ops, needs no generator state, and can be captured in a CUDA
graph. Sampling uses one uniform per sequence and step (inverse CDF), so two engines that compute
the same probabilities pick the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tandem_lit.errors import ConfigError

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingConfig:
    """How tokens are drawn.

    Args:
        temperature: Softmax temperature; 0 means greedy (argmax).
        top_p: Nucleus sampling: keep the smallest set of tokens whose mass reaches ``top_p``.
        top_k: Keep only the ``top_k`` most likely tokens (0 = no limit).
        max_new_tokens: Token budget of one completion (shared by both authors in tandem).
        n: Samples per prompt: GRPO's group size in training, pass@k's n in evaluation.
        seed: Base seed; each sequence's seed is derived from it, the step and the row.
        ignore_eos: Keep writing after an end-of-sequence token (benchmarks that need every
            sequence to run the full budget).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    n: int = 1
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ConfigError(f"sampling.n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply) on int64 tensors holding values < 2**32.

    Multipliers stay below 2**31 so that products stay below 2**63: no signed overflow anywhere.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def uniform(seeds: Tensor, step: Tensor | int, stream: int) -> Tensor:
    """One uniform in [0, 1) per sequence, a pure function of (seed, step, stream).  # [B] float32"""
    folded = (seeds ^ (seeds >> 32)) & _MASK32
    counter = (torch.as_tensor(step, device=seeds.device, dtype=torch.long) * 8 + stream + 0x9E3779B9) & _MASK32
    h = _mix32(folded ^ _mix32(counter))
    h = _mix32((h + 0x632BE5AB) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sequence_seeds(base_seed: int, step: int, count: int, device: torch.device | str = "cpu") -> Tensor:
    """Per-sequence seeds for one batch: a hash of (base seed, step) plus the row, so rows of one
    batch never share a seed and a resumed run draws exactly what the uninterrupted run drew."""
    key = torch.tensor([base_seed & _MASK32, step & _MASK32], dtype=torch.long)
    batch_key = int(_mix32(_mix32(key[0:1]) ^ key[1:2]).item())
    return (batch_key + torch.arange(count, dtype=torch.long, device=device)) & _MASK32


def sample_tokens(
    logits: Tensor,  # [B, V]
    u: Tensor,  # [B] uniforms in [0, 1)
    config: SamplingConfig,
    allowed: Tensor | None = None,  # [B, V] or [V] bool, tokens that may be drawn
) -> Tensor:  # [B] long
    """Draw one token per row by inverse CDF with the given uniforms (argmax when greedy)."""
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if config.greedy:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if config.top_k > 0 or config.top_p < 1.0:
        k = min(config.top_k or logits.shape[-1], logits.shape[-1])
        values, index = logits.topk(k, dim=-1)  # sorted, most likely first
        probs = torch.softmax(values, dim=-1)
        if config.top_p < 1.0:
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs * (mass_before < config.top_p)  # always keeps the first token
        return index.gather(-1, inverse_cdf(probs, u).unsqueeze(-1)).squeeze(-1)
    weights = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)  # unnormalised softmax
    return inverse_cdf(weights, u)


_CDF_BLOCK = 1024


def inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:  # [B, V] >= 0, [B] -> [B] long
    """The token whose cumulative weight first exceeds ``u`` x total: an exact categorical draw.

    Large vocabularies go in two levels (blocks of 1024, then tokens within the chosen block):
    a scan over a 150k-token row is far slower on a GPU than two short ones.
    """
    batch, vocab = weights.shape
    if vocab <= 4 * _CDF_BLOCK:
        cdf = weights.cumsum(dim=-1)
        index = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)
        return index.clamp_max(vocab - 1)
    blocks = torch.nn.functional.pad(weights, (0, (-vocab) % _CDF_BLOCK)).view(batch, -1, _CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [B, blocks]
    target = u * block_cdf[:, -1]
    chosen = torch.searchsorted(block_cdf, target.unsqueeze(-1), right=True).clamp_max(block_cdf.shape[1] - 1)
    before = torch.where(chosen > 0, block_cdf.gather(-1, (chosen - 1).clamp_min(0)), 0.0)
    inner = blocks.gather(1, chosen.unsqueeze(-1).expand(batch, 1, _CDF_BLOCK)).squeeze(1).cumsum(dim=-1)
    offset = torch.searchsorted(inner, (target.unsqueeze(-1) - before), right=True).clamp_max(_CDF_BLOCK - 1)
    index = (chosen * _CDF_BLOCK + offset).squeeze(-1).clamp_max(vocab - 1)
    # rounding between the two levels can land on a zero-weight token: take the mode instead
    return torch.where(weights.gather(-1, index.unsqueeze(-1)).squeeze(-1) > 0, index, weights.argmax(dim=-1))
