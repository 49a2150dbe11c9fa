"""KL divergence to the reference policy: per-token estimators, the reward penalty and its coefficient.

The estimators (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html) take
the log-probs of the sampled tokens under the policy (``logprob``, log pi) and the reference (``ref_logprob``,
log pi_ref); with ``r = pi_ref / pi`` and tokens sampled from pi, each estimates ``KL(pi || pi_ref)``:

- ``"k1"``: ``-log r = logprob - ref_logprob`` (unbiased, high variance, can be negative);
- ``"k2"``: ``(log r)^2 / 2`` (biased, low variance);
- ``"k3"``: ``(r - 1) - log r`` (unbiased, low variance, >= 0), with ``log r`` clamped to [-20, 20] and the
  result to [-10, 10] against overflow (as in verl's "low_var_kl");
- ``"k3+"``: k3's value with k2's gradient (straight-through), for the KL loss.

**As a loss** (the KL in the actor's loss, GRPO style), what matters is the gradient, not the value: the
samples come from pi but the loss is differentiated only through ``logprob`` (Tang & Munos 2025, "On a few
pitfalls in KL divergence gradient estimation for RL", arXiv:2506.09477). With ``g = grad log pi(y)``
and ``E_pi[g] = 0``, the expected gradient of each estimator is (per token, derivation below, checked exactly
on categorical distributions in ``tests/test_algos_losses.py``):

- k1: ``E_pi[g] = 0``: its gradient estimates nothing (zero-mean noise that lowers the log-prob of whatever
  was sampled), so it does **not** pull the policy towards the reference. Refused as a loss by the config;
  it is the usual estimator for the reward penalty (:func:`apply_kl_penalty`), where only its value counts.
- k2: ``E_pi[log(pi / pi_ref) g] = grad KL(pi || pi_ref)``: the gradient of the KL it estimates (Tang & Munos
  2025).
- k3: ``E_pi[(1 - pi_ref / pi) g] = -E_pi_ref[g] = grad KL(pi_ref || pi)``: the gradient of the *other*
  direction (the forward KL), also zero at ``pi = pi_ref`` and pulling towards the reference; what GRPO's KL
  loss uses (Shao et al. 2024, arXiv:2402.03300, eq. 4).
- k3+: k2's gradient, so ``grad KL(pi || pi_ref)`` with k3's low-variance, non-negative value as the metric.

Each statement is the ``loss_gradient`` of the estimator's registry entry
(:data:`megarl.algos.registry.KL_ESTIMATORS`). All of them are per-token: summed over a response they give the
gradient of the per-token KLs at the sampled contexts, not the part of the sequence KL's gradient that flows
through how earlier tokens change later contexts (Tang & Munos 2025: a "partial gradient"); the KL in
the reward (``algorithm.kl.in_loss=false``) has no such gap.

The KL either penalises the reward (:func:`apply_kl_penalty`, PPO/REINFORCE++ style; coefficient from a
:class:`FixedKLController` or :class:`AdaptiveKLController`) or enters the loss (GRPO style:
``kl_coef * agg_loss(kl_penalty(logprob, ref_logprob, "k3"), mask, ...)``, see
:func:`megarl.algos.losses.actor_loss`). Add an estimator with ``@register_kl("name", loss_gradient=...)``:
``fn(logprob [B, T] float32, ref_logprob [B, T] float32) -> [B, T] float32``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megarl.algos.advantages import as_token_rewards
from megarl.algos.aggregation import masked_mean
from megarl.algos.registry import KL_ESTIMATORS

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

register_kl = KL_ESTIMATORS.register


def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = ``logprob - ref_logprob`` (module docstring)."""
    return logprob - ref_logprob


def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = ``(logprob - ref_logprob)^2 / 2`` (module docstring)."""
    return 0.5 * (logprob - ref_logprob).square()


def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = ``exp(d) - d - 1`` with ``d = ref_logprob - logprob`` clamped to [-20, 20], result clamped to
    [-10, 10] (module docstring)."""
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


def kl_k3_plus(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3+ = k3's value with k2's gradient (straight-through: ``k2 - k2.detach() + k3.detach()``)."""
    surrogate = kl_k2(logprob, ref_logprob)
    return surrogate - surrogate.detach() + kl_k3(logprob, ref_logprob).detach()


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
        logprob: ``[B, T]`` float log-probs of the sampled tokens under the policy (nats).
        ref_logprob: ``[B, T]`` float log-probs of the same tokens under the reference policy.
        kind: a registered estimator ("k1", "k2", "k3", "k3+").

    Returns:
        ``[B, T]`` float32, every position (mask it yourself: :func:`~megarl.algos.aggregation.agg_loss` or
        :func:`apply_kl_penalty`); differentiable w.r.t. ``logprob``.

    Raises:
        ValueError: unknown ``kind`` (listing the known ones), mismatched shapes.
    """
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob and ref_logprob must have the same shape, got {tuple(logprob.shape)} and "
                         f"{tuple(ref_logprob.shape)}")
    return KL_ESTIMATORS.get(kind)(logprob.float(), ref_logprob.float())


def apply_kl_penalty(rewards: torch.Tensor, logprob: torch.Tensor, ref_logprob: torch.Tensor,
                     response_mask: torch.Tensor, *, coef: float, kind: str = "k1"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Subtract a per-token KL penalty from the token rewards (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", arXiv:1909.08593, sec. 2.2; Ouyang et al. 2022, eq. 2).

    ``r'_t = r_t - coef * KL_t`` on valid tokens (the KL is detached: it is part of the reward).

    Args:
        rewards: ``[B, T]`` token rewards or ``[B]`` sequence scores (placed on the last valid token, see
            :func:`~megarl.algos.advantages.as_token_rewards`).
        logprob: ``[B, T]`` float log-probs of the sampled tokens under the policy that generated them.
        ref_logprob: ``[B, T]`` float log-probs under the reference policy.
        response_mask: ``[B, T]`` valid response tokens.
        coef: the KL coefficient beta (>= 0), e.g. ``controller.value``.
        kind: KL estimator (see :func:`kl_penalty`).

    Returns:
        ``(token_rewards [B, T] float32, 0 on masked positions; mean_kl)``: ``mean_kl`` is the float32 scalar
        mean over sequences of each sequence's mean per-token KL, what :meth:`AdaptiveKLController.update`
        takes.

    Raises:
        ValueError: negative ``coef``, unknown ``kind``, mismatched shapes.
    """
    if coef < 0:
        raise ValueError(f"the KL coefficient must be >= 0, got {coef}")
    mask = response_mask.bool()
    kl = torch.where(mask, kl_penalty(logprob, ref_logprob, kind).detach(), 0.0)
    token_rewards = as_token_rewards(rewards, mask) - coef * kl
    return token_rewards, masked_mean(masked_mean(kl, mask, dim=-1), mask.any(-1))


@dataclass
class FixedKLController:
    """A constant KL coefficient.

    Attributes:
        value: the coefficient beta (>= 0).
    """

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing (the coefficient is fixed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """KL coefficient that steers the measured KL towards a target (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences", arXiv:1909.08593, sec. 2.2).

    After each batch: ``e = clip(KL / target - 1, -0.2, 0.2)`` and ``value *= 1 + e * n_steps / horizon``.

    Attributes:
        value: the current coefficient beta (starts at the initial one, > 0).
        target: the target KL per token (nats, > 0).
        horizon: how many samples a full 20% correction takes (> 0).
    """

    value: float
    target: float
    horizon: int = 10000

    def __post_init__(self):
        if self.value <= 0 or self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"adaptive KL controller needs value > 0, target > 0 and horizon > 0, got "
                             f"value={self.value}, target={self.target}, horizon={self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient after a batch of ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
