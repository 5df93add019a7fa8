"""Sampling: greedy and truncated sampling, the inverse-CDF draw, and the counter-based RNG."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_lit.errors import ConfigError
from tandem_lit.rollout.sampling import SamplingConfig, sample_tokens, sequence_seeds, uniform

LOGITS = torch.tensor([[1.0, 2.5, -0.5, 0.3, 2.0, -3.0]])  # one row, 6 tokens


def draws(logits: torch.Tensor, config: SamplingConfig, n: int, stream: int = 0) -> torch.Tensor:
    """``n`` tokens drawn from the same logits with n different sequence seeds."""
    u = uniform(torch.arange(n), 0, stream)
    return sample_tokens(logits.expand(n, -1), u, config)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was drawn"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# Upper 1e-4 tail of the chi-square distribution with 5 degrees of freedom is 25.7; a correct
# sampler fails this bound once in 10,000 runs (and the draws are seeded: never flaky).
CHI2_LIMIT_5DOF = 25.7


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 8), vocab=st.integers(2, 40))
def test_greedy_top_k_1_and_tiny_top_p_are_argmax(seed, rows, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    u = torch.rand(rows, generator=gen)
    best = logits.argmax(-1)
    assert torch.equal(sample_tokens(logits, u, SamplingConfig(temperature=0.0)), best)
    assert torch.equal(sample_tokens(logits, u, SamplingConfig(temperature=1.0, top_k=1)), best)
    assert torch.equal(sample_tokens(logits, u, SamplingConfig(temperature=1.3, top_p=1e-6)), best)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 10), top_p=st.floats(0.05, 1.0))
def test_draws_stay_inside_top_k_nucleus_and_allowed_set(seed, k, top_p):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 16, 12
    logits = torch.randn(rows, vocab, generator=gen) * 2
    u = torch.rand(rows, generator=gen)
    token = sample_tokens(logits, u, SamplingConfig(temperature=0.8, top_k=k, top_p=top_p))
    order = logits.argsort(-1, descending=True)
    rank = (order == token.unsqueeze(-1)).float().argmax(-1)
    assert bool((rank < k).all())
    probs = torch.softmax(logits / 0.8, -1).gather(-1, order)[:, :k]
    probs = probs / probs.sum(-1, keepdim=True)
    mass_before = (probs.cumsum(-1) - probs).gather(-1, rank.unsqueeze(-1)).squeeze(-1)
    assert bool((mass_before < top_p + 1e-6).all())
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    allowed[:, 0] = True
    for config in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0), SamplingConfig(top_k=3, top_p=0.5)):
        token = sample_tokens(logits, u, config, allowed)
        assert bool(allowed.gather(-1, token.unsqueeze(-1)).all())
    greedy = sample_tokens(logits, u, SamplingConfig(temperature=0.0), allowed)
    assert torch.equal(greedy, logits.masked_fill(~allowed, float("-inf")).argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax_over_temperature(temperature):
    n = 20000
    tokens = draws(LOGITS, SamplingConfig(temperature=temperature), n)
    counts = torch.bincount(tokens, minlength=6).float()
    probs = torch.softmax(LOGITS[0] / temperature, -1)
    assert chi_square(counts, probs) < CHI2_LIMIT_5DOF
    # and a wrong temperature is told apart (the test has power)
    wrong = torch.softmax(LOGITS[0] / (temperature * 1.5), -1)
    assert chi_square(counts, wrong) > 10 * CHI2_LIMIT_5DOF


def test_top_k_and_top_p_renormalise_the_kept_tokens():
    n = 20000
    probs = torch.softmax(LOGITS[0], -1)  # [0.112 0.501 0.025 0.056 0.304 0.002]
    # top_k=3 keeps tokens 1, 4, 0
    counts = torch.bincount(draws(LOGITS, SamplingConfig(top_k=3), n), minlength=6).float()
    kept = torch.zeros(6)
    kept[[1, 4, 0]] = probs[[1, 4, 0]]
    assert chi_square(counts, kept / kept.sum()) < CHI2_LIMIT_5DOF
    # top_p=0.6: sorted, token 1 (0.501) then token 4 (0.304): the mass before token 4 is 0.501 < 0.6,
    # before token 0 it is 0.805 >= 0.6, so tokens 1 and 4 are kept
    sorted_probs, order = probs.sort(descending=True)
    assert order[:2].tolist() == [1, 4]
    assert sorted_probs[0] < 0.6 <= sorted_probs[:2].sum()
    counts = torch.bincount(draws(LOGITS, SamplingConfig(top_p=0.6), n), minlength=6).float()
    kept = torch.zeros(6)
    kept[[1, 4]] = probs[[1, 4]]
    assert chi_square(counts, kept / kept.sum()) < CHI2_LIMIT_5DOF


def test_uniform_is_a_pure_function_in_unit_interval():
    seeds = torch.arange(50000, dtype=torch.long) * 2654435761 % 2**32
    a = uniform(seeds, 7, 1)
    assert torch.equal(a, uniform(seeds.clone(), 7, 1))
    assert torch.equal(a, uniform(seeds, torch.tensor(7), 1))  # a device-tensor step, as in CUDA graphs
    assert a.dtype == torch.float32 and a.shape == seeds.shape
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    # uniform: ten equal bins each hold a tenth (binomial sigma ~ 67 for 5000 expected)
    counts = torch.histc(a, bins=10, min=0.0, max=1.0)
    assert bool(((counts - 5000).abs() < 400).all()), counts
    # different seeds, steps and streams give different numbers
    assert (a != uniform(seeds, 8, 1)).float().mean() > 0.999
    assert (a != uniform(seeds, 7, 2)).float().mean() > 0.999
    assert (a != uniform(seeds + 1, 7, 1)).float().mean() > 0.999
    assert a.unique().numel() > 49000
    # streams of one seed are not correlated with each other
    b = uniform(seeds, 7, 0)
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
    assert abs(float(corr)) < 0.03


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), step=st.integers(0, 100000), stream=st.integers(0, 7))
def test_uniform_in_range_for_any_seed(seed, step, stream):
    u = uniform(torch.tensor([seed]), step, stream)
    assert 0.0 <= float(u) < 1.0
    assert float(u) == float(uniform(torch.tensor([seed]), step, stream))


def test_sequence_seeds_are_distinct_and_reproducible():
    a = sequence_seeds(0, 5, 64)
    assert torch.equal(a, sequence_seeds(0, 5, 64))
    assert a.unique().numel() == 64
    assert not torch.equal(a, sequence_seeds(0, 6, 64))
    assert not torch.equal(a, sequence_seeds(1, 5, 64))
    assert torch.equal(sequence_seeds(0, 5, 8), a[:8])  # a row's seed does not depend on the batch size


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.01}, {"top_k": -1}, {"max_new_tokens": 0}, {"n": 0},
])
def test_sampling_config_validation(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_sampling_config_defaults_and_greedy_flag():
    assert SamplingConfig(temperature=0.0).greedy
    assert not SamplingConfig(temperature=0.7).greedy
