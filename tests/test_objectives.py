"""Objectives: losses and gradients against hand-computed values, authorship weights, micro-batching,
and failing closed on missing or malformed authorship."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem_lit.errors import ConfigError
from tandem_lit.objectives import (
    GRPO,
    AuthorshipError,
    ObjectiveInputs,
    Reinforce,
    SoftMaskedReinforce,
    token_weights,
)
from tandem_lit.objectives.base import AGGREGATIONS
from tandem_lit.rollout.record import Author

S, J, P, PROMPT = int(Author.SENIOR), int(Author.JUNIOR), int(Author.PAD), int(Author.PROMPT)

# Three rollouts of three tokens (row 1 ended after two). Log-probs are the leaf we differentiate.
LOGP = [[-1.0, -2.0, -0.5], [-0.2, -1.5, -9.0], [-3.0, -0.1, -0.4]]
AUTHOR = [[S, J, S], [S, S, P], [J, S, S]]


def inputs(rewards, logp=LOGP, author=AUTHOR, group=None, **extra) -> ObjectiveInputs:
    logp = torch.tensor(logp, requires_grad=True)
    author = torch.tensor(author, dtype=torch.int8) if author is not None else None
    rewards = torch.tensor(rewards, dtype=torch.float32)
    group = torch.tensor(group if group is not None else list(range(len(rewards))))
    return ObjectiveInputs(logp=logp, author=author, rewards=rewards, group=group, **extra)


def loss_and_grad(objective, batch: ObjectiveInputs, scale=None):
    loss, metrics = objective(batch, scale)
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return loss.item(), grad, metrics


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32), expected, atol=tol, rtol=0), (actual, expected)


# --------------------------------------------------------------------------------- REINFORCE


def test_reinforce_positive_only_hand_computed():
    """Rewards [1, 0, 1], junior tokens unmasked (j=1): rows 0 and 2 enter, row 1 is discarded
    from the loss AND the normaliser. Token weights: 3 + 3 = 6.
    loss = -(1*(-1 - 2 - 0.5) + 1*(-3 - 0.1 - 0.4)) / 6 = 7/6; d loss / d logp = -1/6 on rows 0, 2."""
    loss, grad, metrics = loss_and_grad(Reinforce(), inputs([1.0, 0.0, 1.0]))
    close(loss, 7 / 6)
    close(grad, [[-1 / 6] * 3, [0, 0, 0], [-1 / 6] * 3])
    assert metrics["included_fraction"] == pytest.approx(2 / 3)
    # the discarded rollout's log-probs do not matter at all
    other = [LOGP[0], [-50.0, -50.0, -50.0], LOGP[2]]
    assert loss_and_grad(Reinforce(), inputs([1.0, 0.0, 1.0], logp=other))[0] == pytest.approx(loss)


def test_reinforce_junior_weight_and_graded_reward():
    """j=0.2, rewards [0.5, 0, 1]: weights row0 [1, .2, 1], row2 [.2, 1, 1], W = 4.4.
    loss = -(0.5*(-1 - 0.4 - 0.5) + 1*(-0.6 - 0.1 - 0.4)) / 4.4 = (0.95 + 1.1) / 4.4."""
    loss, grad, _ = loss_and_grad(Reinforce(junior_weight=0.2), inputs([0.5, 0.0, 1.0]))
    close(loss, (0.95 + 1.1) / 4.4)
    close(grad, [[-0.5 / 4.4, -0.5 * 0.2 / 4.4, -0.5 / 4.4], [0, 0, 0], [-0.2 / 4.4, -1 / 4.4, -1 / 4.4]])


def test_soft_masked_reinforce_hand_computed():
    """c=-0.5, j=0.2 (the paper's skill-gap values), rewards [1, 0, 1]: every rollout enters.
    Weights row0 [1, .2, 1] row1 [1, 1, 0] row2 [.2, 1, 1]; W = 6.4.
    Weighted log-prob sums: row0 -1.9, row1 -1.7, row2 -1.1.
    loss = (-1*-1.9 - (-0.5)*-1.7 - 1*-1.1) / 6.4 = (1.9 - 0.85 + 1.1) / 6.4 = 2.15 / 6.4.
    The failed rollout's gradient is +0.5 w / 6.4: its tokens are pushed down."""
    objective = SoftMaskedReinforce()
    assert (objective.failed_weight, objective.junior_weight) == (-0.5, 0.2)
    loss, grad, metrics = loss_and_grad(objective, inputs([1.0, 0.0, 1.0]))
    close(loss, 2.15 / 6.4)
    close(grad, [[-1 / 6.4, -0.2 / 6.4, -1 / 6.4], [0.5 / 6.4, 0.5 / 6.4, 0], [-0.2 / 6.4, -1 / 6.4, -1 / 6.4]])
    assert metrics["included_fraction"] == 1.0


@pytest.mark.parametrize("aggregation,loss,grad", [
    # seq-mean-token-mean: mean over 3 rows of each row's weighted token mean (row weights 2.2, 2, 2.2)
    ("seq-mean-token-mean", (1.9 / 2.2 - 0.85 / 2 + 1.1 / 2.2) / 3,
     [[-1 / 6.6, -0.2 / 6.6, -1 / 6.6], [0.5 / 6, 0.5 / 6, 0], [-0.2 / 6.6, -1 / 6.6, -1 / 6.6]]),
    # seq-mean-token-sum: weighted token sum / 3 rows
    ("seq-mean-token-sum", 2.15 / 3,
     [[-1 / 3, -0.2 / 3, -1 / 3], [0.5 / 3, 0.5 / 3, 0], [-0.2 / 3, -1 / 3, -1 / 3]]),
    # seq-mean-token-sum-norm (Dr. GRPO): weighted token sum / (3 rows x 3 max tokens)
    ("seq-mean-token-sum-norm", 2.15 / 9,
     [[-1 / 9, -0.2 / 9, -1 / 9], [0.5 / 9, 0.5 / 9, 0], [-0.2 / 9, -1 / 9, -1 / 9]]),
    ("token-mean", 2.15 / 6.4,
     [[-1 / 6.4, -0.2 / 6.4, -1 / 6.4], [0.5 / 6.4, 0.5 / 6.4, 0], [-0.2 / 6.4, -1 / 6.4, -1 / 6.4]]),
])
def test_aggregations_hand_computed(aggregation, loss, grad):
    objective = SoftMaskedReinforce(aggregation=aggregation)
    actual_loss, actual_grad, _ = loss_and_grad(objective, inputs([1.0, 0.0, 1.0]))
    close(actual_loss, loss)
    close(actual_grad, grad)


def test_positive_only_seq_mean_counts_only_included_sequences():
    """Positive-only with seq-mean-token-mean: 2 rows enter, each with 3 tokens of weight 1:
    loss = (3.5/3 + 3.5/3) / 2 = 7/6 (the discarded row does not dilute the mean)."""
    loss, grad, _ = loss_and_grad(Reinforce(aggregation="seq-mean-token-mean"), inputs([1.0, 0.0, 1.0]))
    close(loss, 7 / 6)
    close(grad, [[-1 / 6] * 3, [0] * 3, [-1 / 6] * 3])


@pytest.mark.parametrize("aggregation,counted,uncounted", [
    ("seq-mean-token-mean", -1.0, -2 / 3),  # each counted row's mean is -1
    ("seq-mean-token-sum", -2.0, -4 / 3),  # each counted row's sum is -2
    ("seq-mean-token-sum-norm", -1.0, -4 / 6),  # -4 / (rows x 2 tokens)
])
def test_seq_mean_leaves_rows_without_weight_out_of_the_count(aggregation, counted, uncounted):
    """GRPO on-policy (ratio 1), advantage +1 everywhere, junior_weight 0: every counted token's
    loss is -1. Rows 0 and 1 are the senior's; row 2 is all the junior's, so all its tokens weigh
    0. The seq-mean modes average over the 2 rows that carry weight (verl: -1.0 for
    seq-mean-token-mean), not over 3 (-0.667), with or without a batch-wide LossScale."""
    batch = inputs([0.0] * 3, logp=[[-1.0, -2.0], [-0.5, -0.1], [-3.0, -0.2]], author=[[S, S], [S, S], [J, J]],
                   advantages=torch.ones(3))
    objective = GRPO(aggregation=aggregation)
    close(objective(batch)[0], counted)
    scale = objective.loss_scale(batch.author, batch.advantages, max_tokens=2)
    assert scale.sequences == 2
    close(objective(batch, scale)[0], counted)
    assert counted != pytest.approx(uncounted)  # (what counting row 2 gave)


# -------------------------------------------------------------------------------------- GRPO


def test_grpo_advantages_group_batch_none():
    """Groups [0, 0, 1, 1], rewards [1, 0, 1, 1]. Group 0: mean 0.5, centred +-0.5, unbiased
    std sqrt(0.5). Group 1: all equal, advantage 0. Batch std (unbiased) of [1, 0, 1, 1] is 0.5."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    eps = 1e-6
    a = 0.5 / (math.sqrt(0.5) + eps)
    close(GRPO(scale_rewards="group").advantages(rewards, group), [a, -a, 0, 0])
    close(GRPO(scale_rewards="batch").advantages(rewards, group), [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0, 0])
    close(GRPO(scale_rewards="none").advantages(rewards, group), [0.5, -0.5, 0, 0])
    # group ids need not be contiguous or sorted
    close(GRPO().advantages(rewards[[0, 2, 1, 3]], torch.tensor([7, 3, 7, 3])), [a, 0, -a, 0])


# 8 rollouts in 4 groups of 2; on 2 processes each holds 2 whole groups (rank_rows)
BATCH_REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def _batch_scaled_worker(rank: int, world: int, port: int, folder: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def over_ranks(values: list[float]) -> list[float]:  # training.distributed.all_reduce_sum, whose
        summed = torch.tensor(values, dtype=torch.float64)  # import (Lightning) would take longer
        dist.all_reduce(summed)  # than the test
        return summed.tolist()

    try:
        rows = slice(4 * rank, 4 * rank + 4)
        rewards, group = torch.tensor(BATCH_REWARDS)[rows], torch.tensor([0, 0, 1, 1])
        torch.save((GRPO(scale_rewards="batch").advantages(rewards, group, over_ranks),
                    GRPO(scale_rewards="batch").advantages(rewards, group)), f"{folder}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_batch_scaled_advantages_on_two_processes_equal_one_process(tmp_path):
    """scale_rewards: batch on 2 gloo processes: each divides by the std of all 8 rewards (0.535),
    as one process does, not by its own 4 (0.577 and 0.5)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    one = GRPO(scale_rewards="batch").advantages(torch.tensor(BATCH_REWARDS), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    close(one, [0.5 / (0.5345225 + 1e-6) * a for a in (1, -1, 0, 0, -1, 1, 0, 0)], tol=1e-5)
    mp.spawn(_batch_scaled_worker, args=(2, port, str(tmp_path)), nprocs=2)
    (gathered_0, alone_0), (gathered_1, alone_1) = (torch.load(tmp_path / f"{rank}.pt") for rank in range(2))
    gathered, alone = torch.cat([gathered_0, gathered_1]), torch.cat([alone_0, alone_1])
    close(gathered, one)
    assert not torch.allclose(alone, one)  # each rank's own std


def test_grpo_asymmetric_clip_hand_computed():
    """clip_low 0.2, clip_high 0.28, advantages [+1, -2], old log-probs 0 so ratio = exp(logp).
    Row 0 (A=+1) ratios [1.5, 0.5, 1.25]: 1.5 is clipped to 1.28 (no gradient); 0.5 below the range
    is NOT clipped for a positive advantage (pessimistic bound); 1.25 is inside [0.8, 1.28]
    (a symmetric 0.2 clip would have cut it).
    Row 1 (A=-2) ratios [0.5, 1.5, 0.85]: 0.5 is clipped to 0.8 (no gradient); 1.5 above the range
    is NOT clipped for a negative advantage; 0.85 is inside.
    per-token = max(-A r, -A clip(r)):
      row 0: [-1.28, -0.5, -1.25]   row 1: [1.6, 3.0, 1.7];   token-mean over 6 senior tokens.
    d/dlogp = -A r where unclipped, else 0, divided by 6."""
    ratios = torch.tensor([[1.5, 0.5, 1.25], [0.5, 1.5, 0.85]])
    batch = inputs(
        [0.0, 0.0], logp=ratios.log().tolist(), author=[[S, S, S], [S, S, S]],
        old_logp=torch.zeros(2, 3), advantages=torch.tensor([1.0, -2.0]),
    )
    loss, grad, metrics = loss_and_grad(GRPO(clip_low=0.2, clip_high=0.28), batch)
    close(loss, (-1.28 - 0.5 - 1.25 + 1.6 + 3.0 + 1.7) / 6, tol=1e-5)
    close(grad, [[0, -0.5 / 6, -1.25 / 6], [0, 2 * 1.5 / 6, 2 * 0.85 / 6]], tol=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(2 / 6)
    # symmetric clipping cuts the 1.25 ratio of the positive row as well
    batch.logp.grad = None
    loss_sym, grad_sym, _ = loss_and_grad(GRPO(clip_low=0.2, clip_high=0.2), batch)
    close(loss_sym, (-1.28 + 0.08 - 0.5 - 1.2 + 1.6 + 3.0 + 1.7) / 6, tol=1e-5)  # row0 tok0 clips at 1.2
    close(grad_sym[0], [0, -0.5 / 6, 0])


def test_grpo_on_policy_is_the_policy_gradient_and_junior_tokens_masked_by_default():
    """On-policy (no old log-probs) the ratio is 1 and d loss / d logp = -A w / W. GRPO's default
    junior weight is 0 (Tandem RLVR): junior tokens get no gradient and leave the normaliser.
    Groups [0, 0, 1], rewards [1, 0, 1]: advantages [a, -a, 0] with a = 0.5 / (sqrt(0.5) + eps).
    Senior tokens: row0 2, row1 2, row2 2 -> W = 6."""
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    loss, grad, _ = loss_and_grad(GRPO(), inputs([1.0, 0.0, 1.0], group=[0, 0, 1]))
    close(loss, (-a * 2 + a * 2) / 6)
    close(grad, [[-a / 6, 0, -a / 6], [a / 6, a / 6, 0], [0, 0, 0]])


def test_grpo_k3_kl_hand_computed():
    """kl_coef 0.1, one senior token per row, on-policy, advantages given [1, 0].
    k3 = exp(ref - logp) - (ref - logp) - 1. Row 0: logp -1, ref -1.5: delta -0.5,
    k3 = e^-0.5 + 0.5 - 1; d k3 / d logp = 1 - e^-0.5. Row 1: logp -2, ref -1: delta 1,
    k3 = e - 2; d k3 / d logp = 1 - e.
    loss = (-1 + 0.1 k3_0 + 0 + 0.1 k3_1) / 2; grad = ([-1 + 0.1 (1 - e^-0.5)], [0.1 (1 - e)]) / 2."""
    batch = inputs(
        [0.0, 0.0], logp=[[-1.0], [-2.0]], author=[[S], [S]],
        ref_logp=torch.tensor([[-1.5], [-1.0]]), advantages=torch.tensor([1.0, 0.0]),
    )
    objective = GRPO(kl_coef=0.1)
    assert objective.uses_reference
    k3_0 = math.exp(-0.5) + 0.5 - 1
    k3_1 = math.e - 2
    loss, grad, metrics = loss_and_grad(objective, batch)
    close(loss, (-1 + 0.1 * k3_0 + 0.1 * k3_1) / 2)
    close(grad, [[(-1 + 0.1 * (1 - math.exp(-0.5))) / 2], [0.1 * (1 - math.e) / 2]])
    assert metrics["kl"] == pytest.approx((k3_0 + k3_1) / 2)
    with pytest.raises(ConfigError, match="ref_logp"):
        objective(inputs([0.0, 0.0], logp=[[-1.0], [-2.0]], author=[[S], [S]], advantages=torch.tensor([1.0, 0.0])))
    assert not GRPO().uses_reference


def test_grpo_dual_clip_hand_computed():
    """clip 0.2, clip_ratio_c 3, old log-probs 0 so ratio = exp(logp), one senior token per row.
    Row 0 (A=-1, r=5): the PPO term max(5, 1.2) = 5 exceeds -A c = 3: dual-clipped to 3, no gradient.
    Row 1 (A=-1, r=2): max(2, 1.2) = 2 < 3: kept, d/dlogp = -A r = 2.
    Row 2 (A=+1, r=5): positive advantage, never dual-clipped: max(-5, -1.2) = -1.2, no gradient.
    Token-mean over 3: loss (3 + 2 - 1.2) / 3; without dual clip (5 + 2 - 1.2) / 3."""
    batch = inputs(
        [0.0, 0.0, 0.0], logp=[[math.log(5)], [math.log(2)], [math.log(5)]], author=[[S], [S], [S]],
        old_logp=torch.zeros(3, 1), advantages=torch.tensor([-1.0, -1.0, 1.0]),
    )
    loss, grad, metrics = loss_and_grad(GRPO(clip_ratio_c=3.0), batch)
    close(loss, (3 + 2 - 1.2) / 3, tol=1e-5)
    close(grad, [[0.0], [2 / 3], [0.0]], tol=1e-6)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)
    batch.logp.grad = None
    close(loss_and_grad(GRPO(), batch)[0], (5 + 2 - 1.2) / 3, tol=1e-5)


def test_grpo_kl_clamp_hand_computed():
    """kl_coef 1, on-policy, zero advantage: the loss is the mean k3. Row 0: ref - logp = 4:
    k3 = e^4 - 5 = 49.6, clamped to 10 (no gradient); row 1: delta -0.5, k3 = e^-0.5 - 0.5,
    unclamped, d k3 / d logp = 1 - e^-0.5."""
    batch = inputs(
        [0.0, 0.0], logp=[[-5.0], [-1.0]], author=[[S], [S]],
        ref_logp=torch.tensor([[-1.0], [-1.5]]), advantages=torch.zeros(2),
    )
    k3_1 = math.exp(-0.5) - 0.5
    loss, grad, metrics = loss_and_grad(GRPO(kl_coef=1.0, kl_clamp=10.0), batch)
    close(loss, (10 + k3_1) / 2, tol=1e-5)
    close(grad, [[0.0], [(1 - math.exp(-0.5)) / 2]], tol=1e-6)
    assert metrics["kl"] == pytest.approx((10 + k3_1) / 2, rel=1e-5)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_huge_log_ratio_is_clamped_to_a_finite_loss_and_gradient(advantage):
    """Row 0's log-ratio is 100 (exp overflows float32), row 1's is 0. The log-ratio is clamped to
    20 before exp, as verl clamps it: the loss and the gradient stay finite, the clamped token gets
    no gradient (the clamp's), and the clamped share of the counted tokens is 1/2. With A = -1 the
    PPO term of row 0 is e^20 (dual clip off), finite; row 1's gradient is -A r / 2."""
    batch = inputs([0.0, 0.0], logp=[[100.0], [0.0]], author=[[S], [S]], old_logp=torch.zeros(2, 1),
                   advantages=torch.full((2,), advantage))
    loss, grad, metrics = loss_and_grad(GRPO(), batch)
    assert math.isfinite(loss) and torch.isfinite(grad).all()
    close(grad, [[0.0], [-advantage / 2]])
    expected = (-1.2 - 1.0) / 2 if advantage > 0 else (math.exp(20.0) + 1.0) / 2
    assert loss == pytest.approx(expected, rel=1e-5)
    assert metrics["ratio_clamped_fraction"] == pytest.approx(0.5)
    # the KL term's log-ratio too (k3 of ref - logp = 100 would be inf before its own clamp)
    batch = inputs([0.0], logp=[[-100.0]], author=[[S]], ref_logp=torch.zeros(1, 1), advantages=torch.zeros(1))
    loss, grad, _ = loss_and_grad(GRPO(kl_coef=1.0, kl_clamp=10.0), batch)
    assert loss == pytest.approx(10.0) and torch.isfinite(grad).all()


def test_token_metrics_count_only_tokens_in_the_loss():
    """junior_weight 0: junior tokens leave clip_fraction and ratio_mean. Row 0 (A=+1): a senior
    token at ratio 1.5 (clipped) and a junior token at ratio 1.0; the fraction is 1 of 1 senior
    token, not 1 of 2 written tokens."""
    batch = inputs(
        [0.0], logp=[[math.log(1.5), 0.0]], author=[[S, J]], old_logp=torch.zeros(1, 2), advantages=torch.tensor([1.0]),
    )
    _, _, metrics = loss_and_grad(GRPO(), batch)
    assert metrics["clip_fraction"] == pytest.approx(1.0)
    assert metrics["ratio_mean"] == pytest.approx(1.5)
    batch.logp.grad = None
    _, _, metrics = loss_and_grad(GRPO(junior_weight=1.0), batch)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("objective", [GRPO(tis_cap=2.0), Reinforce(tis_cap=2.0)], ids=repr)
def test_truncated_importance_sampling_hand_computed(objective):
    """tis_cap 2, on-policy (old = logp), one row, A = +1 (reward 1), tokens [S, S, J]:
    the engine's log-probs are [logp - log 3, logp - log 1.5, anything]: factors
    min(3, 2) = 2 and 1.5; the junior token keeps 1 (the junior drew it). Loss weights: the
    senior tokens (GRPO masks the junior's; REINFORCE counts it with j=1)."""
    logp = [[-1.0, -2.0, -0.5]]
    rollout = torch.tensor(logp) - torch.tensor([[math.log(3.0), math.log(1.5), 7.0]])
    batch = inputs([1.0], logp=logp, author=[[S, S, J]], advantages=torch.tensor([1.0]), rollout_logp=rollout)
    _, grad, metrics = loss_and_grad(objective, batch)
    if isinstance(objective, GRPO):  # d/dlogp of -A r (r = 1 at logp = old) times the factor, over 2 tokens
        close(grad, [[-2.0 / 2, -1.5 / 2, 0.0]], tol=1e-6)
    else:  # -A w logp times the factor, over 3 tokens (junior weight 1)
        close(grad, [[-2.0 / 3, -1.5 / 3, -1.0 / 3]], tol=1e-6)
    assert metrics["tis_weight_mean"] == pytest.approx(1.75)
    assert metrics["tis_capped_fraction"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="tis_cap"):
        objective(inputs([1.0], logp=logp, author=[[S, S, J]], advantages=torch.tensor([1.0])))


@pytest.mark.parametrize("objective", [GRPO(tis_cap=2.0, tis_level="sequence"), GRPO(tis_cap=4.0, tis_level="sequence"),
                                       Reinforce(tis_cap=2.0, tis_level="sequence")], ids=repr)
def test_sequence_level_truncated_importance_sampling_hand_computed(objective):
    """tis_level sequence, on-policy, one row [S, S, J], A = +1: the engine's log-probs are
    [logp - log 1.5, logp - log 2, anything]: the row's weight is 1.5 x 2 = 3 (the junior token's
    ratio is 1), min(3, cap) on every token of the row. GRPO (junior weight 0): the 2 senior
    tokens' gradient -A x factor / 2; REINFORCE (junior weight 1): -factor / 3 on all 3 tokens."""
    logp = [[-1.0, -2.0, -0.5]]
    rollout = torch.tensor(logp) - torch.tensor([[math.log(1.5), math.log(2.0), 7.0]])
    batch = inputs([1.0], logp=logp, author=[[S, S, J]], advantages=torch.tensor([1.0]), rollout_logp=rollout)
    _, grad, metrics = loss_and_grad(objective, batch)
    factor = min(3.0, objective.tis_cap)
    if isinstance(objective, GRPO):
        close(grad, [[-factor / 2, -factor / 2, 0.0]], tol=1e-5)
    else:
        close(grad, [[-factor / 3] * 3], tol=1e-5)
    assert metrics["tis_weight_mean"] == pytest.approx(factor, rel=1e-5)
    assert metrics["tis_capped_fraction"] == (1.0 if objective.tis_cap < 3 else 0.0)


def test_geometric_mean_sequence_masking_hand_computed():
    """geo_mask 1.002: a row leaves the loss when the geometric mean of its senior tokens' weights
    exp(mean(old - rollout)) is outside [1/1.002, 1.002], i.e. |mean log-ratio| > log 1.002 = 0.001998.
    Row 0: mean 0.001 (kept); row 1: mean (0.01 - 0.002) / 2 = 0.004 (masked); row 2: its one
    senior token -0.005 (masked; the junior token's 5 is not the senior's); row 3: no senior token (kept)."""
    old = torch.zeros(4, 2)
    rollout = -torch.tensor([[0.001, 0.001], [0.01, -0.002], [-0.005, 5.0], [3.0, 3.0]])
    author = torch.tensor([[S, S], [S, S], [S, J], [J, J]])
    objective = GRPO(geo_mask=1.002)
    assert objective.masks_sequences and not GRPO().masks_sequences
    assert objective.rejected(old, rollout, author).tolist() == [False, True, True, False]
    assert GRPO().rejected(old, rollout, author).tolist() == [False] * 4
    with pytest.raises(ConfigError, match="geo_mask needs the rollout engine's log-probs"):
        objective.rejected(old, None, author)


def test_mismatch_stats_hand_computed():
    """Senior tokens with old - rollout = [log 2, 0, -log 2], weights [2, 1, 0.5]; the junior token's
    10 is not measured. k3 = w - 1 - log w: [1 - log 2, 0, log 2 - 0.5], mean 0.5 / 3. ESS =
    (sum w)^2 / (n sum w^2) = 3.5^2 / (3 x 5.25) = 7/9. Added in two parts: the same."""
    from tandem_lit.objectives.mismatch import MismatchStats

    old = torch.tensor([[math.log(2.0), 0.0], [-math.log(2.0), 10.0]])
    rollout, author = torch.zeros(2, 2), torch.tensor([[S, S], [S, J]])
    whole, parts = MismatchStats(), MismatchStats()
    whole.add(old, rollout, author)
    parts.add(old[:1], rollout[:1], author[:1])
    parts.add(old[1:], rollout[1:], author[1:])
    parts.add(old, None, author)  # an engine without log-probs adds nothing
    for stats in (whole, parts):
        assert stats.metrics() == pytest.approx({"mismatch_kl": 0.5 / 3, "mismatch_ess": 7 / 9})
    assert MismatchStats().metrics() == {}


@pytest.mark.parametrize("kwargs", [
    {"scale_rewards": "std"}, {"clip_low": -0.1}, {"clip_high": -1}, {"kl_coef": -0.5},
    {"aggregation": "mean"}, {"junior_weight": -1}, {"clip_ratio_c": 1.0}, {"kl_clamp": 0.0},
    {"tis_cap": 0.0}, {"tis_level": "sequence"}, {"tis_cap": 2.0, "tis_level": "row"}, {"geo_mask": 1.0},
])
def test_grpo_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        GRPO(**kwargs)


# --------------------------------------------------------------- properties over random batches

OBJECTIVES = {
    "reinforce": lambda j, agg: Reinforce(junior_weight=j, aggregation=agg),
    "soft": lambda j, agg: SoftMaskedReinforce(failed_weight=-0.3, junior_weight=j, aggregation=agg),
    "grpo": lambda j, agg: GRPO(junior_weight=j, aggregation=agg, scale_rewards="group"),
}


def random_batch(seed: int, rows: int, width: int):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=gen) * 3
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    author = torch.where(torch.rand(rows, width, generator=gen) < 0.4, J, S).to(torch.int8)
    author[torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)] = P
    rewards = (torch.rand(rows, generator=gen) < 0.5).float()
    group = torch.arange(rows) // 2
    return logp, author, rewards, group


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(OBJECTIVES)),
    aggregation=st.sampled_from(AGGREGATIONS),
    j=st.sampled_from([0.0, 0.2, 0.35, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(2, 8),
    width=st.integers(1, 7),
)
def test_junior_token_gradient_is_j_times_senior(name, aggregation, j, seed, rows, width):
    """Within a rollout every token has the same per-token loss derivative (on-policy), so the
    gradient on a junior token is exactly j times the gradient on a senior token of that rollout,
    and padding gets none."""
    logp, author, rewards, group = random_batch(seed, rows, width)
    logp.requires_grad_(True)
    objective = OBJECTIVES[name](j, aggregation)
    loss, _ = objective(ObjectiveInputs(logp=logp, author=author, rewards=rewards, group=group))
    (grad,) = torch.autograd.grad(loss, logp)
    assert bool((grad[author == P] == 0).all())
    for r in range(rows):
        senior = grad[r][author[r] == S]
        junior = grad[r][author[r] == J]
        if senior.numel():
            assert torch.allclose(senior, senior[0].expand_as(senior), atol=1e-7)
            if junior.numel():
                assert torch.allclose(junior, j * senior[0].expand_as(junior), atol=1e-7, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(OBJECTIVES)),
    aggregation=st.sampled_from(AGGREGATIONS),
    j=st.sampled_from([0.0, 0.2, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(2, 9),
    width=st.integers(1, 6),
    micro=st.integers(1, 4),
)
def test_micro_batches_with_shared_scale_add_up_to_the_full_batch(name, aggregation, j, seed, rows, width, micro):
    logp, author, rewards, group = random_batch(seed, rows, width)
    objective = OBJECTIVES[name](j, aggregation)
    advantages = objective.advantages(rewards, group)
    scale = objective.loss_scale(author, advantages, max_tokens=width)

    def run(index, with_scale):
        part = logp[index].clone().requires_grad_(True)
        batch = ObjectiveInputs(logp=part, author=author[index], rewards=rewards[index], group=group[index],
                                advantages=advantages[index])
        loss, _ = objective(batch, scale if with_scale else None)
        (grad,) = torch.autograd.grad(loss, part)
        return loss, grad

    everything = torch.arange(rows)
    full_loss, full_grad = run(everything, with_scale=False)
    scaled_loss, _ = run(everything, with_scale=True)
    assert torch.allclose(scaled_loss, full_loss, atol=1e-6)
    parts = [run(index, with_scale=True) for index in everything.split(micro)]
    assert torch.allclose(sum(loss for loss, _ in parts), full_loss, atol=1e-5)
    assert torch.allclose(torch.cat([g for _, g in parts]), full_grad, atol=1e-6)


# ------------------------------------------------------------------------------ fail closed


@pytest.mark.parametrize("objective", [Reinforce(), SoftMaskedReinforce(), GRPO()], ids=repr)
@pytest.mark.parametrize("author,match", [
    (None, "no authorship"),
    (torch.full((3, 2), S, dtype=torch.int8), "shape"),
    (torch.full((3, 3), float(S)), "dtype"),
    (torch.full((3, 3), True), "dtype"),
    (torch.tensor([[S, PROMPT, S], [S, S, P], [J, S, S]], dtype=torch.int8), r"codes \[1\]"),
    (torch.tensor([[S, 7, S], [S, S, P], [J, S, S]]), r"codes \[7\]"),
])
def test_missing_or_malformed_authorship_raises(objective, author, match):
    batch = inputs([1.0, 0.0, 1.0])
    batch.author = author
    with pytest.raises(AuthorshipError, match=match):
        objective(batch)
    if match != "shape":  # the batch normaliser fails closed too (it never sees the log-probs)
        with pytest.raises(AuthorshipError):
            objective.loss_scale(author, torch.ones(3), max_tokens=3)


def test_token_weights_reads_codes():
    author = torch.tensor([[S, J, P]], dtype=torch.int8)
    close(token_weights(author, 0.35, like=torch.zeros(1, 3)), [[1.0, 0.35, 0.0]])
    with pytest.raises(ConfigError):
        Reinforce(junior_weight=-0.1)
