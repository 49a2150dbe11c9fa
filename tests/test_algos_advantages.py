"""Advantage estimators against hand-computed values and a naive per-sample reference loop."""

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos.advantages import (ADVANTAGES, as_token_rewards, discounted_cumsum, get_advantage_fn,
                                     register_advantage)
from megarl.algos.aggregation import group_deviations, masked_whiten

NAN = float("nan")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def whiten(values):
    """Reference whitening of a list of valid values (mean 0, unbiased std 1)."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / math.sqrt(std ** 2 + 1e-8) for v in values]


def test_scores_go_to_the_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    out = as_token_rewards(torch.tensor([2.0, 3.0, 4.0, 5.0]), mask)
    close(out, [[0, 0, 2, 0], [0, 0, 3, 0], [0, 0, 0, 0], [5, 0, 0, 0]])
    token = torch.tensor([[1.0, 2.0, NAN, NAN]])
    close(as_token_rewards(token, torch.tensor([[1, 1, 0, 0]])), [[1, 2, 0, 0]])
    with pytest.raises(ValueError, match="rewards must be"):
        as_token_rewards(torch.zeros(3), mask)


# groups (interleaved ids): 7 -> scores 1, 0, 0; 3 -> 1, 3; 9 -> 5 alone
GROUPS = torch.tensor([7, 3, 7, 3, 7, 9])
SCORES = torch.tensor([1.0, 1.0, 0.0, 3.0, 0.0, 5.0])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]])


def test_grpo_hand_computed():
    adv, ret = get_advantage_fn("grpo")(SCORES, MASK, group_index=GROUPS, eps=0.0)
    # group 7: mean 1/3, unbiased std sqrt(1/3); group 3: mean 2, std sqrt(2); group 9 alone: mean 0, std 1
    a7, b7, a3 = (2 / 3) / math.sqrt(1 / 3), (-1 / 3) / math.sqrt(1 / 3), 1 / math.sqrt(2)
    close(adv, [[a7, a7, 0], [-a3, 0, 0], [b7, b7, b7], [a3, a3, 0], [b7, 0, 0], [5, 5, 0]])
    assert ret is adv
    adv, _ = get_advantage_fn("grpo")(SCORES, MASK, group_index=GROUPS, norm_by_std=False)
    close(adv, [[2 / 3, 2 / 3, 0], [-1, 0, 0], [-1 / 3] * 3, [1, 1, 0], [-1 / 3, 0, 0], [5, 5, 0]])


def test_grpo_sums_token_rewards_and_equal_scores_give_zero():
    token_rewards = torch.tensor([[0.5, 0.5, NAN], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, _ = get_advantage_fn("grpo")(token_rewards, mask, group_index=torch.tensor([0, 0]))
    close(adv, [[0, 0, 0], [0, 0, 0]])


GROUPED = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("n, value", [(8, 0.7), (6, 2.6), (16, 0.1)])  # issue 14's groups
def test_tied_group_gets_exactly_zero_advantage(n, value):
    scores = torch.full((n,), value)
    assert scores.sum() / n - scores[0] != 0  # the fp32 mean is inexact here: the naive estimate is not 0
    mask = torch.ones(n, 3)
    for name in GROUPED:
        for params in ({}, {"norm_by_std": False}) if name == "grpo" else ({},):
            adv, _ = get_advantage_fn(name)(scores, mask, group_index=torch.zeros(n, dtype=torch.int64), **params)
            assert torch.equal(adv, torch.zeros(n, 3)), (name, params, adv[:, 0])


def reference_group_advantages(scores, groups):
    """float64 per-group loop: GRPO (mean, unbiased std, eps 1e-6), RLOO and the centred scores."""
    grpo, rloo, centred = [], [], []
    for i, s in enumerate(scores):
        members = [x for x, g in zip(scores, groups) if g == groups[i]]
        n, mean = len(members), statistics.fmean(members)
        grpo.append((s - mean) / (statistics.stdev(members) + 1e-6))
        rloo.append(s - (sum(members) - s) / (n - 1))
        centred.append(s - mean)
    return grpo, rloo, centred


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 64), value=st.integers(-10**6, 10**6).map(lambda k: k / 1000), seed=st.integers(0, 2**31),
       tied_first=st.booleans())
def test_tied_groups_are_exactly_zero_for_any_size_and_value(n, value, seed, tied_first):
    """A tied group of any size 2..64 and any value (mostly not representable in binary) next to a group with
    spread: the tied one gets exactly 0 in every grouped estimator, the other matches a float64 reference."""
    g = torch.Generator().manual_seed(seed)
    tied = [value] * n
    spread = (torch.randn(n, generator=g, dtype=torch.float64) * 3).tolist()
    scores64 = tied + spread if tied_first else spread + tied
    groups = torch.tensor([0] * n + [1] * n if tied_first else [1] * n + [0] * n)
    order = torch.randperm(2 * n, generator=g)  # interleave the groups
    scores, groups = torch.tensor(scores64, dtype=torch.float32)[order], groups[order]
    scores64 = [float(torch.tensor(scores64, dtype=torch.float32)[i]) for i in order]  # the fp32 inputs
    mask = torch.ones(2 * n, 2)
    is_tied = groups == 0
    expected = dict(zip(("grpo", "rloo"), reference_group_advantages(scores64, groups.tolist())))
    for name in GROUPED:
        adv, _ = get_advantage_fn(name)(scores, mask, group_index=groups)
        assert torch.equal(adv[is_tied], torch.zeros(n, 2)), name
        if name in expected:
            want = torch.tensor(expected[name], dtype=torch.float32)[~is_tied]
            torch.testing.assert_close(adv[~is_tied, 0], want, rtol=1e-4, atol=1e-4)
    deviations, sizes = group_deviations(scores, groups)
    assert torch.equal(deviations[is_tied], torch.zeros(n)) and torch.equal(sizes, torch.full((2 * n,), n * 1.0))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 64), value=st.integers(-10**6, 10**6).map(lambda k: k / 1000), width=st.integers(1, 4))
def test_whitening_a_batch_of_equal_values_gives_exact_zeros(n, value, width):
    """REINFORCE++ returns, GAE advantages and the REINFORCE++-baseline batch normalisation whiten with exact
    deviations: equal values (every group tied, every return equal) give 0, not O(1e-4) noise."""
    lengths = torch.randint(1, width + 1, (n,), generator=torch.Generator().manual_seed(n))
    mask = torch.arange(width)[None, :] < lengths[:, None]
    x = torch.where(mask, torch.tensor(value), float("nan"))
    assert torch.equal(masked_whiten(x, mask), torch.zeros(n, width))
    scores = torch.full((n,), value)
    adv, _ = get_advantage_fn("reinforce_plus_plus")(scores, torch.ones(n, 1), gamma=1.0)
    assert torch.equal(adv, torch.zeros(n, 1))
    token_rewards = torch.where(mask, torch.tensor(value), 0.0)
    adv, _ = get_advantage_fn("gae")(token_rewards, mask, values=token_rewards * 0, gamma=0.0, lam=1.0)
    assert torch.equal(adv, torch.zeros(n, width))
    for name in GROUPED:
        groups = torch.arange(n) % max(1, n // 2)
        adv, _ = get_advantage_fn(name)(scores, mask, group_index=groups)
        assert torch.equal(adv, torch.zeros(n, width)), name


def test_rloo_hand_computed():
    adv, ret = get_advantage_fn("rloo")(SCORES, MASK, group_index=GROUPS)
    # group 7: 1 - (0+0)/2, 0 - (1+0)/2, 0 - (1+0)/2; group 3: 1 - 3, 3 - 1; group 9: baseline 0
    close(adv, [[1, 1, 0], [-2, 0, 0], [-0.5] * 3, [2, 2, 0], [-0.5, 0, 0], [5, 5, 0]])
    assert ret is adv


def test_gae_hand_computed():
    # row 0: V = .5 1 2, reward 1 at the end; row 1: a hole at t=1 (skipped), garbage there and on padding;
    # row 2: a length-1 response.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.2, 5.0, 1.0, NAN], [1.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 1.0, 2.0, 9.0], [1.0, 99.0, 0.5, NAN], [0.3, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [1, 0, 0, 0]])
    adv, ret = get_advantage_fn("gae")(rewards, mask, values=values, gamma=0.9, lam=0.8, whiten=False)
    # row 0: d = .4 .8 -1 -> A2 = -1, A1 = .8 + .72 * -1 = .08, A0 = .4 + .72 * .08 = .4576
    # row 1: d0 = .2 + .9 * .5 - 1 = -.35, d2 = 1 - .5 = .5 -> A2 = .5, A0 = -.35 + .72 * .5 = .01
    # row 2: d0 = 1 - .3 = .7
    close(adv, [[0.4576, 0.08, -1.0, 0], [0.01, 0, 0.5, 0], [0.7, 0, 0, 0]])
    close(ret, [[0.9576, 1.08, 1.0, 0], [1.01, 0, 1.0, 0], [1.0, 0, 0, 0]])
    white, ret2 = get_advantage_fn("gae")(rewards, mask, values=values, gamma=0.9, lam=0.8)
    w = whiten([0.4576, 0.08, -1.0, 0.01, 0.5, 0.7])
    close(white, [[w[0], w[1], w[2], 0], [w[3], 0, w[4], 0], [w[5], 0, 0, 0]])
    torch.testing.assert_close(ret2, ret)


def test_gae_lambda_one_gamma_one_returns_are_monte_carlo():
    rewards = torch.tensor([[0.1, 0.2, 0.3]])
    adv, ret = get_advantage_fn("gae")(rewards, torch.ones(1, 3), values=torch.tensor([[5.0, -1.0, 2.0]]),
                                       whiten=False)
    close(ret, [[0.6, 0.5, 0.3]])
    close(adv, [[0.6 - 5.0, 0.5 + 1.0, 0.3 - 2.0]])


def naive_gae(rewards, values, lengths, gamma, lam):
    """Per-sample, per-step GAE on right-padded rows (the textbook recursion)."""
    adv = torch.zeros_like(rewards)
    for i, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            nxt = values[i, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[i, t].item() + gamma * nxt - values[i, t].item()
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv


def test_gae_matches_naive_loop_on_random_right_padded_batch():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 7, 2]
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.where(mask, torch.randn(5, 7, generator=g), 0.0)
    values = torch.where(mask, torch.randn(5, 7, generator=g), 0.0)
    adv, ret = get_advantage_fn("gae")(rewards, mask, values=values, gamma=0.95, lam=0.7, whiten=False)
    expected = naive_gae(rewards, values, lengths, 0.95, 0.7)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, 0.0))


def test_reinforce_plus_plus_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = get_advantage_fn("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    close(ret, [[0.25, 0.5, 1.0], [2.0, 0, 0]])
    w = whiten([0.25, 0.5, 1.0, 2.0])
    close(adv, [[w[0], w[1], w[2]], [w[3], 0, 0]])


def test_reinforce_plus_plus_baseline_hand_computed():
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1]])
    adv, _ = get_advantage_fn("reinforce_plus_plus_baseline")(scores, mask, group_index=torch.tensor([0, 0, 1, 1]))
    # centred scores .5 -.5 0 0, broadcast to 2 + 1 + 1 + 3 tokens, divided by the std over those 7 tokens
    # (not shifted again: group 1 is tied and stays 0)
    tokens = [0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    s = math.sqrt(statistics.variance(tokens) + 1e-8)
    close(adv, [[0.5 / s, 0.5 / s, 0], [-0.5 / s, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_discounted_cumsum_skips_holes():
    x = torch.tensor([[1.0, 100.0, 2.0, 4.0]])
    close(discounted_cumsum(x, torch.tensor([[1, 0, 1, 1]]), 0.5), [[1 + 0.5 * (2 + 0.5 * 4), 0, 4.0, 4.0]])


def test_errors_name_the_missing_input_and_the_known_estimators():
    with pytest.raises(ValueError, match="needs values"):
        get_advantage_fn("gae")(SCORES, MASK)
    with pytest.raises(ValueError, match="needs group_index"):
        get_advantage_fn("rloo")(SCORES, MASK)
    with pytest.raises(ValueError, match="integer"):
        get_advantage_fn("grpo")(SCORES, MASK, group_index=GROUPS.float())
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo2'.*'grpo'.*register_advantage"):
        get_advantage_fn("ppo2")
    with pytest.raises(TypeError, match="gamma"):
        get_advantage_fn("grpo")(SCORES, MASK, group_index=GROUPS, gamma=0.9)
    with pytest.raises(ValueError, match="gamma"):
        get_advantage_fn("reinforce_plus_plus")(SCORES, MASK, gamma=1.5)


def test_user_estimator_registers_and_name_clash_is_refused():
    @register_advantage("test_constant")
    def constant(rewards, response_mask, *, values=None, group_index=None, value=1.0):
        adv = response_mask.float() * value
        return adv, adv

    try:
        adv, _ = get_advantage_fn("test_constant")(SCORES, MASK, value=2.0)
        assert adv.sum().item() == 2.0 * MASK.sum().item()
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("grpo")(constant)
    finally:
        ADVANTAGES._entries.pop("test_constant")


@pytest.mark.parametrize("estimator", ["masked_whiten", "reinforce_plus_plus", "gae"])
def test_whitening_at_one_million_tokens_is_within_1e_6_of_float64(estimator):
    """Whitening over 1M tokens: every advantage within 1e-6 of a float64 whitening (issue 24: a float32
    running sum shifted every advantage by 4.4e-5)."""
    from megarl.algos.advantages import gae_advantage, reinforce_plus_plus_advantage
    from megarl.algos.aggregation import masked_whiten

    g = torch.Generator().manual_seed(0)
    b, t = 1000, 1000
    mask = torch.arange(t)[None, :] < torch.randint(t // 2, t + 1, (b,), generator=g)[:, None]
    x = torch.rand(b, t, generator=g) * 2 + 3  # far from zero mean: a float32 sum drifts
    if estimator == "masked_whiten":
        raw, out = x, masked_whiten(x, mask)
    elif estimator == "reinforce_plus_plus":
        out, raw = reinforce_plus_plus_advantage(x * 0.01, mask)  # raw: the returns it whitened
    else:
        zero = torch.zeros(b, t)
        out, raw = gae_advantage(x, mask, values=zero, lam=0.5, gamma=0.9)  # returns = unwhitened advantages
    valid = raw.double()[mask]
    ref = (valid - valid.mean()) / (valid.var() + 1e-8).sqrt()
    assert (out.double()[mask] - ref).abs().max() <= 1e-6
