"""GSPO, CISPO, Dr. GRPO, DAPO's overlong penalty and rollout correction against independent implementations
of the papers' equations (float64 loops over sequences, written from the equations), on random batches with
masks, tied groups and variable lengths: values and gradients within 1e-6 relative in fp32; rollout correction
against hand-computed weights."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.advantages import grpo_advantage
from megarl.algos.aggregation import agg_loss
from megarl.algos.losses import actor_loss, get_policy_loss_fn
from megarl.algos.rollout_correction import rollout_correction
from megarl.algos.shaping import overlong_penalty

SEEDS = [0, 1, 2, 3]


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-6, scale=None) -> None:
    """``|actual - expected| <= rel * scale`` elementwise; ``scale`` defaults to ``max|expected|`` (a loss that
    sums terms of both signs is compared at the scale of its terms: pass ``sum |term|``)."""
    scale = expected.abs().max().clamp(min=1e-30) if scale is None else scale
    err = (actual.double() - expected).abs().max()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


def random_batch(seed: int, b: int = 12, t: int = 9, groups: int = 4, spread: float = 0.08):
    """A right-padded batch with variable lengths (one empty row), group ids with a tied group, and per-sequence
    scores; ``logprob`` is a float64 leaf (the fp32 paths get ``leaf.float()``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[-1] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    logprob = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = logprob.detach() + spread * torch.randn(b, t, generator=g, dtype=torch.float64)
    group = torch.arange(b) % groups
    scores = torch.randint(0, 3, (b,), generator=g).double()
    scores[group == 0] = 0.7  # a tied group: advantage exactly 0
    scores[-1] = 0.0  # the empty response: no token to carry a reward
    return mask, logprob, old, group, scores


def per_sequence_advantage(scores, group) -> torch.Tensor:
    """Dr. GRPO's advantage ``R_i - mean_j R_j`` over the group (float64, no std)."""
    out = torch.empty_like(scores)
    for k in group.unique():
        members = group == k
        out[members] = scores[members] - scores[members].mean()
    return out


# --------------------------------------------------------------------------------------------------- GSPO
def gspo_reference(logprob, old, adv_seq, mask, low, high):
    """GSPO eq. 5 and 7 (arXiv:2507.18071): ``-1/G sum_i min(s_i A_i, clip(s_i, 1-low, 1+high) A_i)``,
    ``s_i = (prod_t pi/pi_old)^(1/|y_i|)``, ``G`` the responses with a token."""
    terms = []
    for i in range(mask.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        s = torch.prod(torch.exp(logprob[i][m] - old[i][m])) ** (1.0 / int(m.sum()))
        a = adv_seq[i]
        terms.append(torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a))
    return -torch.stack(terms).mean(), torch.stack(terms).abs().mean()


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_the_sequence_objective(seed):
    mask, logprob, old, group, scores = random_batch(seed)
    adv_seq = per_sequence_advantage(scores, group)
    low, high = 0.01, 0.015
    ref, scale = gspo_reference(logprob, old, adv_seq, mask, low, high)
    (ref_grad,) = torch.autograd.grad(ref, logprob)
    adv = torch.where(mask, adv_seq[:, None], 0.0).float()
    mat, metrics = get_policy_loss_fn("gspo")(logprob.float(), old.float(), adv, mask, clip_ratio_low=low,
                                              clip_ratio_high=high)
    ours = agg_loss(mat, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(ours, logprob)
    assert_rel(ours, ref, scale=scale)
    assert_rel(grad, ref_grad)
    clipped = metrics["clipfrac"].item()
    assert 0 < clipped < 1, clipped  # some sequences clipped, some not: both branches are checked


# -------------------------------------------------------------------------------------------------- CISPO
def cispo_reference(logprob, old, adv, mask, low, high):
    """CISPO eq. 4-5 (arXiv:2506.13585): ``-1/sum_i |o_i| sum_i sum_t sg(clip(r_it, 1-low, 1+high)) A_it
    log pi(o_it)``."""
    total, size, tokens = logprob.new_zeros(()), 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                w = torch.exp(logprob[i, t].detach() - old[i, t]).clamp(1 - low, 1 + high)
                total = total + w * adv[i, t] * logprob[i, t]
                size += abs(float(w * adv[i, t] * logprob[i, t].detach()))
                tokens += 1
    return -total / tokens, size / tokens


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_the_paper(seed):
    mask, logprob, old, group, scores = random_batch(seed, spread=0.3)
    g = torch.Generator().manual_seed(seed + 100)
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)  # token-level advantages
    low, high = 1.0, 0.2
    ref, scale = cispo_reference(logprob, old, adv, mask, low, high)
    (ref_grad,) = torch.autograd.grad(ref, logprob)
    mat, metrics = get_policy_loss_fn("cispo")(logprob.float(), old.float(), adv.float(), mask,
                                               clip_ratio_low=low, clip_ratio_high=high)
    ours = agg_loss(mat, mask, "token-mean")
    (grad,) = torch.autograd.grad(ours, logprob)
    assert_rel(ours, ref, scale=scale)
    assert_rel(grad, ref_grad)
    assert 0 < metrics["clipfrac"].item() < 1 and metrics["clipfrac_lower"].item() == 0
    # with a lower bound, weights below it are raised to it
    _, metrics = get_policy_loss_fn("cispo")(logprob.float(), old.float(), adv.float(), mask,
                                             clip_ratio_low=0.1, clip_ratio_high=0.2)
    assert metrics["clipfrac_lower"].item() > 0
    with pytest.raises(ValueError, match="clip_ratio_low"):
        get_policy_loss_fn("cispo")(logprob, old, adv, mask, clip_ratio_low=1.5)


# ------------------------------------------------------------------------------------------------ Dr. GRPO
def dr_grpo_reference(logprob, old, scores, group, mask, eps, max_tokens):
    """Dr. GRPO (arXiv:2503.20783, eq. 3 and listing 1): ``A_i = R_i - mean(R_group)`` and
    ``-1/G sum_i 1/MAX_TOKENS sum_t min(r_it A_i, clip(r_it, 1-eps, 1+eps) A_i)``."""
    adv = per_sequence_advantage(scores, group)
    terms = []
    for i in range(mask.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        r = torch.exp(logprob[i][m] - old[i][m])
        terms.append(torch.minimum(r * adv[i], r.clamp(1 - eps, 1 + eps) * adv[i]).sum() / max_tokens)
    return -torch.stack(terms).mean(), torch.stack(terms).abs().mean(), adv


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_matches_the_paper(seed):
    mask, logprob, old, group, scores = random_batch(seed)
    eps, max_tokens = 0.05, 16
    ref, scale, ref_adv = dr_grpo_reference(logprob, old, scores, group, mask, eps, max_tokens)
    (ref_grad,) = torch.autograd.grad(ref, logprob)
    adv, _ = grpo_advantage(scores.float(), mask, group_index=group, norm_by_std=False)
    assert (adv[group == 0] == 0).all()  # the tied group: exactly 0
    assert_rel(adv[:, 0], torch.where(mask[:, 0], ref_adv, 0.0))
    loss, _ = actor_loss(logprob.float(), old.float(), adv, mask, policy_loss="ppo",
                         policy_loss_params={"clip_ratio_low": eps, "clip_ratio_high": eps},
                         agg_mode="seq-mean-token-sum-norm", norm_tokens=max_tokens)
    (grad,) = torch.autograd.grad(loss, logprob)
    assert_rel(loss, ref, scale=scale)
    assert_rel(grad, ref_grad)


# ---------------------------------------------------------------------------------------- overlong shaping
def overlong_reference(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. 13 (arXiv:2503.14476), case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max, l_cache", [(16, 4), (256, 64), (7, 7), (5, 1)])
def test_overlong_penalty_matches_eq_13(l_max, l_cache):
    lengths = torch.arange(0, l_max + 3)
    expected = torch.tensor([overlong_reference(int(n), l_max, l_cache) for n in lengths], dtype=torch.float64)
    assert_rel(overlong_penalty(lengths, max_length=l_max, cache_length=l_cache), expected)
    assert_rel(overlong_penalty(lengths, max_length=l_max, cache_length=l_cache, factor=0.5), 0.5 * expected)
    assert overlong_penalty(torch.tensor([l_max]), max_length=l_max, cache_length=l_cache).item() == -1.0
    assert overlong_penalty(torch.tensor([l_max - l_cache]), max_length=l_max, cache_length=l_cache).item() == 0.0


def test_overlong_penalty_refuses_bad_lengths():
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([3]), max_length=4, cache_length=5)


# ------------------------------------------------------------------------------------- rollout correction
LN = math.log


def test_token_tis_weights_at_below_and_above_the_cap():
    cap = 2.0
    at = float(torch.tensor(LN(cap)).exp())  # exp(log 2) in fp32: the ratio that is exactly "at the cap"
    log_rho = torch.tensor([[LN(0.5), 0.0, LN(at), LN(3.0)], [LN(1.5), LN(8.0), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    rollout = torch.full_like(log_rho, -1.0)
    w, keep, m = rollout_correction(rollout + log_rho, rollout, mask, level="token", mode="truncate", cap=at)
    expected = torch.tensor([[0.5, 1.0, at, at], [1.5, at, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=0)
    assert torch.equal(keep, mask)
    assert m["truncated_frac"].item() == pytest.approx(2 / 6) and m["masked_frac"].item() == 0
    assert m["ratio_max"].item() == pytest.approx(8.0, rel=1e-6) and m["ratio_min"].item() == pytest.approx(0.5)
    rho = torch.tensor([0.5, 1.0, at, 3.0, 1.5, 8.0], dtype=torch.float64)
    assert m["ratio_mean"].item() == pytest.approx(rho.mean().item(), rel=1e-6)
    assert m["kl_k3"].item() == pytest.approx((rho - 1 - rho.log()).mean().item(), rel=1e-6)


def test_token_mis_masks_outside_the_band_and_keeps_its_edges():
    lo, hi = 0.5, 2.0
    lo_at, hi_at = float(torch.tensor(LN(lo)).exp()), float(torch.tensor(LN(hi)).exp())
    log_rho = torch.tensor([[LN(0.4), LN(lo_at), 0.0, LN(hi_at), LN(2.5)]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    w, keep, m = rollout_correction(log_rho, torch.zeros(1, 5), mask, level="token", mode="mask", cap=hi_at,
                                    lower=lo_at)
    assert keep.tolist() == [[False, True, True, True, False]]
    assert w.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0]]
    assert m["masked_frac"].item() == pytest.approx(2 / 5) and m["truncated_frac"].item() == 0


def test_sequence_level_weights_apply_the_sequence_ratio_to_every_token():
    # sequence log-ratios: log 0.25 (below 0.5), log 1.5 (inside), log 3 (above 2), one empty row
    log_rho = torch.tensor([[LN(0.5), LN(0.5), 0.0], [LN(3.0), LN(0.5), 0.0], [LN(1.5), LN(2.0), 0.7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]]).bool()
    log_rho[2] = torch.tensor([LN(1.5), LN(2.0), -LN(2.0)])  # sums to log 1.5
    log_rho[1] = torch.tensor([LN(3.0), LN(2.0), -LN(2.0)])  # sums to log 3
    seq = torch.tensor([0.25, 3.0, 1.5])
    w, keep, m = rollout_correction(log_rho, torch.zeros(3, 3), mask, level="sequence", mode="truncate", cap=2.0)
    expected = torch.where(mask, seq.clamp(max=2.0)[:, None], 0.0)
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=0)
    assert m["truncated_frac"].item() == pytest.approx(3 / 8)  # the 3 tokens of the capped sequence
    assert m["ratio_min"].item() == pytest.approx(0.25, rel=1e-6) and m["ratio_max"].item() == pytest.approx(3.0)
    w, keep, m = rollout_correction(log_rho, torch.zeros(3, 3), mask, level="sequence", mode="mask", cap=2.0,
                                    lower=0.5)
    assert keep.tolist() == [[False, False, False], [False, False, False], [True, True, True]]
    assert torch.equal(w, keep.float())
    assert m["masked_frac"].item() == pytest.approx(5 / 8)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_identical_rollout_and_old_logprobs_give_weights_of_exactly_one(level, mode):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(5, 7, generator=g) * 5
    mask = torch.arange(7)[None, :] < torch.tensor([7, 1, 4, 0, 6])[:, None]
    w, keep, m = rollout_correction(lp, lp.clone(), mask, level=level, mode=mode, cap=1.0, lower=1.0)
    assert torch.equal(w, mask.float()) and torch.equal(keep, mask)
    assert m["kl_k3"].item() == 0 and m["ratio_min"].item() == m["ratio_max"].item() == 1.0
    assert m["truncated_frac"].item() == m["masked_frac"].item() == 0
    adv = torch.randn(5, 7, generator=g)
    plain, _ = actor_loss(lp, lp + 0.01, adv, mask)
    weighted, _ = actor_loss(lp, lp + 0.01, adv, keep, rollout_weights=w)
    assert torch.equal(plain, weighted)  # weights of 1 leave the loss as it is, bit for bit


def test_rollout_weights_multiply_every_policy_loss():
    mask, logprob, old, group, scores = random_batch(5)
    adv = torch.where(mask, per_sequence_advantage(scores, group)[:, None], 0.0).float()
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 2
    for name in ("ppo", "gspo", "cispo"):
        mat, _ = get_policy_loss_fn(name)(logprob.float(), old.float(), adv, mask)
        loss, _ = actor_loss(logprob.float(), old.float(), adv, mask, policy_loss=name, rollout_weights=w)
        torch.testing.assert_close(loss, agg_loss(mat * w, mask, "token-mean"))


def test_rollout_correction_refuses_bad_settings():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="level"):
        rollout_correction(lp, lp, lp.bool(), level="batch")
    with pytest.raises(ValueError, match="lower <= 1 <= cap"):
        rollout_correction(lp, lp, lp.bool(), mode="mask", cap=0.9)
