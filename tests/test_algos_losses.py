"""Losses, KL estimators and aggregation against hand-computed values; split invariance of aggregation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.algos.aggregation import AGG_MODES, agg_loss, count_tokens_and_seqs, masked_whiten
from megarl.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from megarl.algos.losses import actor_loss, get_policy_loss_fn, value_loss
from megarl.algos.registry import KL_ESTIMATORS
from megarl.config import ConfigError, load_config

NAN = float("nan")


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- aggregation
LOSS = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
LOSS_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("mode, expected, global_expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4, 10 / 20),            # global_tokens = 20
    ("seq-mean-token-sum", (6 + 4) / 2, 10 / 5),             # global_seqs = 5
    ("seq-mean-token-mean", (2 + 4) / 2, 6 / 5),
    ("seq-mean-token-sum-norm", (6 / 8 + 4 / 8) / 2, (10 / 8) / 5),  # norm_tokens = 8 (Dr. GRPO)
])
def test_agg_loss_modes_hand_computed(mode, expected, global_expected):
    close(agg_loss(LOSS, LOSS_MASK, mode, norm_tokens=8), expected)
    close(agg_loss(LOSS, LOSS_MASK, mode, global_tokens=20, global_seqs=torch.tensor(5.0), norm_tokens=8),
          global_expected)


def test_agg_loss_edges():
    tokens, seqs = count_tokens_and_seqs(LOSS_MASK)
    assert (tokens.item(), seqs.item()) == (4, 2)
    for mode in AGG_MODES:
        close(agg_loss(LOSS[2:], LOSS_MASK[2:], mode, norm_tokens=4), 0.0)  # no valid token: 0, not NaN
    with pytest.raises(ValueError, match="norm_tokens > 0"):
        agg_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm")
    close(agg_loss(torch.tensor([[7.0]]), torch.tensor([[1]]), "seq-mean-token-mean"), 7.0)
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'.*token-mean"):
        agg_loss(LOSS, LOSS_MASK, "mean")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        agg_loss(LOSS[0], LOSS_MASK[0])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), b=st.integers(1, 7), t=st.integers(1, 5), mode=st.sampled_from(AGG_MODES))
def test_agg_loss_is_split_invariant(data, b, t, mode):
    """Sum over any split of the rows (micro-batches x ranks) with global normalisers = the whole batch."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    mask = torch.rand(b, t, generator=g) < data.draw(st.sampled_from([0.3, 0.7, 1.0]))
    leaf = torch.randn(b, t, generator=g, dtype=torch.float64).requires_grad_()
    loss = leaf.float() * 3
    order = torch.tensor(data.draw(st.permutations(range(b))))
    cuts = sorted(data.draw(st.lists(st.integers(0, b), max_size=4)))
    parts = [order[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, b])]
    tokens, seqs = [sum(x) for x in zip(*(count_tokens_and_seqs(mask[p]) for p in parts))]
    total = sum(agg_loss(loss[p], mask[p], mode, global_tokens=tokens, global_seqs=seqs, norm_tokens=t)
                for p in parts)
    (grad_split,) = torch.autograd.grad(total, leaf, retain_graph=True)
    whole = agg_loss(loss, mask, mode, norm_tokens=t)
    (grad_whole,) = torch.autograd.grad(whole, leaf)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(grad_split, grad_whole)


def test_masked_whiten_hand_computed():
    x = torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    s = math.sqrt(5 / 3 + 1e-8)                                   # mean 2.5, unbiased var 5/3
    close(masked_whiten(x, mask), [[-1.5 / s, -0.5 / s, 0], [0.5 / s, 1.5 / s, 0]])
    close(masked_whiten(x, mask, shift_mean=False), [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0],
                                                     [0.5 / s + 2.5, 1.5 / s + 2.5, 0]])
    close(masked_whiten(torch.tensor([[4.0, 1.0]]), torch.tensor([[1, 0]])), [[0.0, 0.0]])


# ---------------------------------------------------------------------------------------------- KL
LP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize("kind, expected", [
    ("k1", [[0.5, -1.0]]),
    ("k2", [[0.125, 0.5]]),
    ("k3", [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]]),     # d = ref - lp = -0.5, 1
])
def test_kl_estimators_hand_computed(kind, expected):
    close(kl_penalty(LP, REF, kind), expected)


def test_k3_clamps_and_straight_through_gradient():
    close(kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([30.0, -30.0]), "k3"), [10.0, 10.0])
    lp = LP.clone().requires_grad_()
    kl_penalty(lp, REF, "k3").sum().backward()
    close(lp.grad, [[1 - math.exp(-0.5), 1 - math.exp(1.0)]])           # d/dlp (e^d - d - 1) = 1 - e^d
    lp.grad = None
    value = kl_penalty(lp, REF, "k3+")
    value.sum().backward()
    close(value, [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2]])      # k3's value ...
    close(lp.grad, [[0.5, -1.0]])                                       # ... with k2's gradient lp - ref
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'.*'k3'"):
        kl_penalty(LP, REF, "k4")


def expected_loss_gradient(kind, logits, ref_logp):
    """``E_{y ~ pi}[grad_logits kl(log pi(y), log pi_ref(y))]``, exactly: the sum over every outcome weighted by
    its (detached) probability, the expectation of the gradient that a KL loss on sampled tokens follows."""
    logp = logits.log_softmax(-1)
    loss = (logp.exp().detach() * kl_penalty(logp, ref_logp, kind)).sum()
    return torch.autograd.grad(loss, logits)[0]


@pytest.mark.parametrize("kind", KL_ESTIMATORS.names())
def test_kl_loss_gradients_are_what_the_registry_states(kind):
    """Each estimator's registry entry says which divergence's gradient its gradient estimates as a loss
    (megarl.algos.kl); check it exactly on random categorical policies (k1: none, its expectation is 0)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(6, dtype=torch.float64, generator=g).requires_grad_()
        ref_logp = (torch.randn(6, dtype=torch.float64, generator=g)).log_softmax(-1)
        logp = logits.log_softmax(-1)
        p, ref = logp.exp(), ref_logp.exp()
        reverse = torch.autograd.grad((p * (logp - ref_logp)).sum(), logits, retain_graph=True)[0]
        forward = torch.autograd.grad((ref * (ref_logp - logp)).sum(), logits)[0]
        got = expected_loss_gradient(kind, logits, ref_logp)
        want = {"KL(pi || pi_ref)": reverse, "KL(pi_ref || pi)": forward, None: torch.zeros(6, dtype=torch.float64)}
        torch.testing.assert_close(got, want[KL_ESTIMATORS.entry(kind).loss_gradient])
        assert reverse.abs().max() > 1e-2 and (forward - reverse).abs().max() > 1e-3  # the cases differ


def test_k1_as_kl_loss_is_refused_and_allowed_in_the_reward():
    with pytest.raises(ConfigError, match=r"algorithm.kl.estimator: 'k1' in the loss.*\['k2', 'k3', 'k3\+'\].*"
                                          r"algorithm.kl.in_loss=false"):
        load_config(None, ["algorithm.kl.estimator=k1"])
    assert load_config(None, ["algorithm.kl.estimator=k1", "algorithm.kl.in_loss=false"]).algorithm.kl.estimator == "k1"
    load_config(None, ["algorithm.kl.estimator=k1", "algorithm.kl.coef=0"])  # no KL at all
    for kind in ("k2", "k3", "k3+"):
        load_config(None, [f"algorithm.kl.estimator={kind}"])


def test_k1_as_kl_loss_drifts_away_from_the_reference():
    """What the refusal prevents (issue 8): SGD on a sampled-token k1 loss keeps lowering the sampled token's
    log-prob below the reference's; k2 and k3+ pull it to the reference."""
    ref = torch.tensor([[-1.5]])
    for kind, lands_near_ref in (("k1", False), ("k2", True), ("k3+", True)):
        logprob = torch.tensor([[-1.0]], requires_grad=True)
        for _ in range(20):
            (grad,) = torch.autograd.grad(kl_penalty(logprob, ref, kind).sum(), logprob)
            logprob = (logprob - 0.5 * grad).detach().requires_grad_()
        assert (abs(logprob.item() + 1.5) < 0.01) == lands_near_ref, (kind, logprob.item())


def test_apply_kl_penalty_hand_computed():
    lp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]])
    ref = torch.tensor([[-1.5, -1.0, NAN], [-1.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards, mean_kl = apply_kl_penalty(torch.tensor([1.0, 2.0]), lp, ref, mask, coef=0.1, kind="k1")
    # k1 = .5, -1 | .5; score at the last valid token
    close(rewards, [[-0.05, 1.1, 0], [1.95, 0, 0]])
    close(mean_kl, ((0.5 - 1.0) / 2 + 0.5) / 2)
    with pytest.raises(ValueError, match=">= 0"):
        apply_kl_penalty(rewards, lp, ref, mask, coef=-1.0)


def test_kl_controllers():
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=256)                      # error 0.5 clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(6.6, n_steps=100)                      # error 0.1
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 1.001)
    ctl.update(0.0, n_steps=10000)                    # error -1 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 1.001 * 0.8)
    other = AdaptiveKLController(value=1.0, target=6.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == ctl.value
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(value=0.1, target=0.0)


# ---------------------------------------------------------------------------------------------- PPO loss
# tokens: (advantage, ratio) -> expected loss with clip_ratio_low=.2, clip_ratio_high=.28, clip_ratio_c=3
TOKENS = [
    (1.0, 1.5),    # A>0, r above 1+eh: clipped at -1.28
    (1.0, 0.5),    # A>0, r below 1-el: max(-0.5, -0.8) = -0.5, not clipped
    (-1.0, 0.5),   # A<0, r below 1-el: clipped at 0.8
    (-1.0, 5.0),   # A<0, huge r: 5, dual-clipped to 3
    (1.0, 1.25),   # A>0, r inside [0.8, 1.28] (clip-higher): -1.25; with eh=.2 it would clip at -1.2
    (2.0, 1.0),    # ratio 1: -2
    (NAN, NAN),    # masked garbage
]


def ppo_inputs():
    adv = torch.tensor([[a for a, _ in TOKENS]])
    logprob = torch.tensor([[math.log(r) for _, r in TOKENS]]).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    return logprob, torch.zeros_like(adv), adv, mask


def test_ppo_clip_higher_and_dual_clip_hand_computed():
    logprob, old, adv, mask = ppo_inputs()
    loss, metrics = get_policy_loss_fn("ppo")(logprob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                              clip_ratio_c=3.0)
    close(loss, [[-1.28, -0.5, 0.8, 3.0, -1.25, -2.0, 0.0]])
    close(metrics["clipfrac"], 2 / 6)              # tokens 0 and 2
    close(metrics["clipfrac_lower"], 1 / 6)        # token 3
    log_r = [math.log(r) for _, r in TOKENS[:6]]
    close(metrics["ppo_kl"], -sum(log_r) / 6)
    close(metrics["approx_kl"], sum(math.exp(x) - 1 - x for x in log_r) / 6)
    loss.sum().backward()
    # d loss / d logprob = -A r where the unclipped term is active, 0 where clipped
    close(logprob.grad, [[0.0, -0.5, 0.0, 0.0, -1.25, -2.0, 0.0]])


def test_ppo_symmetric_clip_without_dual_clip():
    logprob, old, adv, mask = ppo_inputs()
    loss, metrics = get_policy_loss_fn("ppo")(logprob, old, adv, mask)
    close(loss, [[-1.2, -0.5, 0.8, 5.0, -1.2, -2.0, 0.0]])
    close(metrics["clipfrac"], 3 / 6)
    close(metrics["clipfrac_lower"], 0.0)


def test_ppo_length_one_response_and_bad_params():
    loss, _ = get_policy_loss_fn("ppo")(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 0.0]]),
                                        torch.tensor([[3.0, 1.0]]), torch.tensor([[1, 0]]))
    close(loss, [[-3.0, 0.0]])
    with pytest.raises(ValueError, match="clip_ratio_c > 1"):
        get_policy_loss_fn("ppo")(*ppo_inputs(), clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        get_policy_loss_fn("ppo")(*ppo_inputs(), clip_ratio_low=1.0)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 0.0, NAN]]).requires_grad_()
    old = torch.tensor([[0.5, 2.5, 0.0, NAN]])
    returns = torch.tensor([[3.0, 2.0, 0.1, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # clipped predictions .7, 2.3, 0 -> max((1-3)^2, (.7-3)^2) = 5.29, max(0, .09) = .09, .01
    loss, metrics = value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.5 * (5.29 + 0.09 + 0.01) / 3)
    close(metrics["vf_clipfrac"], 2 / 3)
    close(metrics["vpred_mean"], 1.0)
    loss.backward()
    close(values.grad, [[0.0, 0.0, (0.0 - 0.1) / 3, 0.0]])     # clipped tokens and padding get none
    loss, metrics = value_loss(values, old, returns, mask)
    close(loss, 0.5 * (4 + 0 + 0.01) / 3)
    close(metrics["vf_clipfrac"], 0.0)


def test_vf_clipfrac_issue_case_is_not_clipped():
    """Issue 14: v_old = 0.05, v = 0.01, return 0, c = 0.2 is well inside the range: nothing is clipped."""
    values = torch.tensor([[0.01]], requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor([[0.05]]), torch.tensor([[0.0]]), torch.ones(1, 1),
                               cliprange_value=0.2)
    assert metrics["vf_clipfrac"].item() == 0.0
    loss.backward()
    assert values.grad.item() == pytest.approx(0.01)  # the unclipped term's gradient, (v - R)


def test_vf_clipfrac_inside_at_and_outside_the_bounds():
    c, v_old = 0.2, torch.tensor(0.05)
    lo, hi = (v_old - c).item(), (v_old + c).item()  # the bounds as fp32 computes them
    # (v, return, clipped?): inside or at a bound never clips; outside, the clipped term counts where it is
    # the larger one (the prediction moved away from the old one towards the return, past the range)
    cases = [(0.01, 0.0, False), (hi, 1.0, False), (lo, -1.0, False), (hi, -1.0, False),
             (0.3, 1.0, True), (-0.3, -1.0, True), (0.3, -1.0, False), (-0.3, 1.0, False)]
    values = torch.tensor([[v for v, _, _ in cases]])
    returns = torch.tensor([[r for _, r, _ in cases]])
    mask = torch.ones_like(values)
    for i, (_, _, clipped) in enumerate(cases):
        _, metrics = value_loss(values[:, i:i + 1], v_old.view(1, 1), returns[:, i:i + 1], mask[:, i:i + 1],
                                cliprange_value=c)
        assert metrics["vf_clipfrac"].item() == float(clipped), cases[i]
    _, metrics = value_loss(values, v_old.expand_as(values), returns, mask, cliprange_value=c)
    close(metrics["vf_clipfrac"], 2 / len(cases))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2 ** 31), c=st.sampled_from([0.05, 0.1, 0.2, 0.5, 1.0]),
       scale=st.sampled_from([0.01, 1.0, 100.0]))
def test_vf_clipfrac_is_zero_inside_the_range(seed, c, scale):
    """Random predictions strictly inside [v_old - c, v_old + c] (about 1% were counted as clipped before):
    none is clipped and the loss and its gradient are the unclipped ones."""
    g = torch.Generator().manual_seed(seed)
    v_old = torch.randn(8, 16, generator=g) * scale
    # drawn in float64, then rounded to fp32 (as a critic's output is): v - v_old is then often inexact
    offsets = (torch.rand(8, 16, generator=g, dtype=torch.float64) * 2 - 1) * 0.99 * c
    values = (v_old.double() + offsets).float().requires_grad_()
    returns = torch.randn(8, 16, generator=g) * scale
    mask = torch.ones(8, 16)
    loss, metrics = value_loss(values, v_old, returns, mask, cliprange_value=c)
    assert metrics["vf_clipfrac"].item() == 0.0
    plain, _ = value_loss(values, v_old, returns, mask)
    assert loss.item() == plain.item()
    torch.testing.assert_close(torch.autograd.grad(loss, values)[0], torch.autograd.grad(plain, values)[0])


def test_actor_loss_composes_terms_and_is_split_invariant():
    g = torch.Generator().manual_seed(1)
    b, t = 6, 5
    mask = torch.arange(t)[None, :] < torch.tensor([5, 1, 3, 2, 4, 5])[:, None]
    logprob = (-torch.rand(b, t, generator=g)).requires_grad_()
    old, ref = logprob.detach() + 0.1 * torch.randn(2, b, t, generator=g)
    adv, entropy = torch.randn(b, t, generator=g), torch.rand(b, t, generator=g)
    kw = dict(policy_loss_params={"clip_ratio_high": 0.28, "clip_ratio_c": 3.0}, entropy_coeff=0.01,
              kl_coef=0.1, kl_kind="k3", agg_mode="seq-mean-token-mean")
    whole, metrics = actor_loss(logprob, old, adv, mask, entropy=entropy, ref_logprob=ref, **kw)
    pg, _ = get_policy_loss_fn("ppo")(logprob, old, adv, mask, clip_ratio_high=0.28, clip_ratio_c=3.0)
    expected = (agg_loss(pg, mask, "seq-mean-token-mean") - 0.01 * agg_loss(entropy, mask, "seq-mean-token-mean")
                + 0.1 * agg_loss(kl_penalty(logprob, ref, "k3"), mask, "seq-mean-token-mean"))
    torch.testing.assert_close(whole, expected)
    assert set(metrics) == {"pg_loss", "entropy", "kl_loss", "clipfrac", "clipfrac_lower", "ppo_kl", "approx_kl",
                            "log_ratio_absmax"}
    assert metrics["log_ratio_absmax"] == (logprob - old).abs()[mask].max()
    tokens, seqs = count_tokens_and_seqs(mask)
    parts = [torch.tensor([4, 0]), torch.tensor([1]), torch.tensor([5, 2, 3])]
    split = sum(actor_loss(logprob[p], old[p], adv[p], mask[p], entropy=entropy[p], ref_logprob=ref[p],
                           global_tokens=tokens, global_seqs=seqs, **kw)[0] for p in parts)
    torch.testing.assert_close(split, whole)
    with pytest.raises(ValueError, match="ref_logprob"):
        actor_loss(logprob, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        actor_loss(logprob, old, adv, mask, policy_loss="nope")


def test_garbage_on_padding_gets_no_loss_and_no_gradient():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    pad = ~mask.bool()
    logprob = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]]).masked_fill(pad, NAN).requires_grad_()
    garbage = torch.full((2, 3), NAN)
    old = torch.where(pad, garbage, -1.2)
    adv = torch.where(pad, garbage, 0.7)
    entropy = torch.where(pad, garbage, 0.3)
    loss, metrics = actor_loss(logprob, old, adv, mask, entropy=entropy, entropy_coeff=0.01,
                               ref_logprob=old, kl_coef=0.1, kl_kind="k3+")
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.isfinite(logprob.grad).all() and (logprob.grad[pad] == 0).all()
    values = torch.where(pad, garbage, 0.5).requires_grad_()
    vloss, _ = value_loss(values, old, adv, mask, cliprange_value=0.2)
    vloss.backward()
    assert torch.isfinite(vloss) and torch.isfinite(values.grad).all()
