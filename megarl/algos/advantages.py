"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++), registered by name.

Every estimator has the signature::

    fn(rewards, response_mask, *, values=None, group_index=None, **params) -> (advantages, returns)

- ``rewards``: ``[B, T]`` float token-level rewards, or ``[B]`` float sequence scores, which
  :func:`as_token_rewards` places on the last valid token of each response (the token that ended it, EOS
  when there is one), so a per-token KL penalty can be added to the same matrix before the estimator runs.
- ``response_mask``: ``[B, T]``, nonzero on response tokens including EOS, zero on padding (see
  :mod:`megarl.algos.aggregation`). Rewards and values at masked positions are ignored.
- ``values``: ``[B, T]`` float critic values V(s_t) of the state before each response token (GAE only).
- ``group_index``: ``[B]`` int64, the prompt each response answers; responses with equal index form a group
  (GRPO, RLOO, REINFORCE++-baseline). A group of one has baseline 0 (and standard deviation 1), as in verl.
  Group statistics use exact deviations (:func:`~megarl.algos.aggregation.group_deviations`): a group whose
  scores are all equal carries no signal and gets advantage exactly 0, whatever its size and score.
- ``**params``: the estimator's own keyword parameters, from the config (an unknown one is a ``TypeError``).
- returns: ``advantages [B, T]`` and ``returns [B, T]`` (the critic's regression target; for critic-free
  estimators the advantages themselves, or the discounted returns), float32, 0 at masked positions.

Estimators see the whole batch: group statistics need every sample of a group, and whitening is over all
valid tokens of the batch, so call them before the batch is split over data-parallel ranks (or on a batch
gathered from them).

The built-ins are declared in :data:`megarl.algos.registry.ADVANTAGES` (with the config fields each takes and
whether it needs a critic or groups); add one with ``@register_advantage("name", params=..., needs=...)``;
look one up with :func:`get_advantage_fn`.
"""

from __future__ import annotations

from typing import Callable

import torch

from megarl.algos.aggregation import group_deviations, group_sum, masked_var, masked_whiten
from megarl.algos.registry import ADVANTAGES

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

register_advantage = ADVANTAGES.register
get_advantage_fn = ADVANTAGES.get


def as_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards from sequence scores or token rewards.

    Args:
        rewards: ``[B]`` sequence scores (placed at the last valid token of each row; a row with no valid
            token gets no reward) or ``[B, T]`` token rewards (kept, zeroed at masked positions).
        response_mask: ``[B, T]`` valid response tokens.

    Returns:
        ``[B, T]`` float32.

    Raises:
        ValueError: shapes that do not match ``[B]``/``[B, T]``.
    """
    mask = response_mask.bool()
    if mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got {tuple(mask.shape)}")
    if rewards.shape == mask.shape:
        return torch.where(mask, rewards.float(), 0.0)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must be [B] sequence scores or [B, T] token rewards with [B, T] = "
                         f"{tuple(mask.shape)} (the response mask), got {tuple(rewards.shape)}")
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return out.scatter_(1, last.clamp(min=0)[:, None], torch.where(last >= 0, rewards.float(), 0.0)[:, None])


def discounted_cumsum(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """Reverse discounted cumulative sum over the valid tokens: ``y_t = x_t + discount * y_t'``.

    ``t'`` is the next valid position after ``t`` (masked positions are skipped, so a hole in the mask does
    not discount), and ``y`` after the last valid token is 0 (the episode ends there: a response cut at the
    length limit is treated as terminal, not bootstrapped). The loop runs over ``T`` (vectorised over ``B``).

    Args:
        x: ``[B, T]`` float.
        mask: ``[B, T]`` valid positions.
        discount: the factor per valid step (gamma, or gamma * lambda for GAE).

    Returns:
        ``[B, T]`` float32, 0 at masked positions.
    """
    m = mask.bool()
    x = torch.where(m, x.float(), 0.0)
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        running = torch.where(m[:, t], x[:, t] + discount * running, running)
        out[:, t] = running
    return torch.where(m, out, 0.0)


def _next_valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: the value of ``x`` at the next valid position after each ``t`` (0 when there is none)."""
    b, t = mask.shape
    positions = torch.where(mask.bool(), torch.arange(t, device=mask.device), t)
    after = torch.cat([positions[:, 1:], positions.new_full((b, 1), t)], dim=1)
    nxt = after.flip(-1).cummin(-1).values.flip(-1)
    return torch.cat([x.float(), x.new_zeros(b, 1, dtype=torch.float32)], dim=1).gather(1, nxt)


def _check_group_index(group_index: torch.Tensor | None, batch: int, name: str) -> torch.Tensor:
    if group_index is None:
        raise ValueError(f"advantage estimator {name!r} needs group_index ([B] int64 prompt ids: responses to "
                         "the same prompt share an id); sample several responses per prompt")
    if group_index.shape != (batch,) or group_index.is_floating_point():
        raise ValueError(f"group_index must be a [B] = [{batch}] integer tensor, got {group_index.dtype} "
                         f"{tuple(group_index.shape)}")
    return group_index


def _grouped_scores(rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor | None,
                    name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per response ``[B]``: its score ``R`` (the sum of its token rewards), ``R`` minus its group's mean
    (exactly 0 in a tied group) and its group's size (float32)."""
    scores = as_token_rewards(rewards, response_mask).sum(-1)
    group_index = _check_group_index(group_index, scores.shape[0], name)
    deviations, counts = group_deviations(scores, group_index)
    return scores, deviations, counts


def _broadcast(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), scores[:, None], 0.0)


def gae_advantage(rewards: torch.Tensor, response_mask: torch.Tensor, *, values: torch.Tensor | None = None,
                  group_index: torch.Tensor | None = None, gamma: float = 1.0, lam: float = 1.0,
                  whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", arXiv:1506.02438, eq. 16), as used by PPO for LLMs (Ouyang et al. 2022).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = sum_l (gamma * lam)^l delta_{t+l}`` over the valid
    tokens, with ``V = 0`` after the last valid token; ``returns = A + V`` (before whitening), the critic's
    target (lam = 1 gives the Monte-Carlo return). The advantages are then whitened over all valid tokens of
    the batch (:func:`~megarl.algos.aggregation.masked_whiten`), as in PPO implementations.

    Args:
        rewards: ``[B, T]`` token rewards or ``[B]`` scores (module docstring).
        response_mask: ``[B, T]``.
        values: ``[B, T]`` float critic values (required).
        group_index: unused.
        gamma: discount per token, in [0, 1].
        lam: GAE lambda, in [0, 1].
        whiten: whiten the advantages.

    Returns:
        ``(advantages, returns)``, ``[B, T]`` float32.

    Raises:
        ValueError: no ``values``, mismatched shapes, gamma or lam outside [0, 1].
    """
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values [B, T] from a critic; configure a critic or "
                         "use a critic-free estimator (grpo, rloo, reinforce_plus_plus)")
    if values.shape != response_mask.shape:
        raise ValueError(f"values must be [B, T] = {tuple(response_mask.shape)}, got {tuple(values.shape)}")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gae needs gamma and lam in [0, 1], got gamma={gamma}, lam={lam}")
    token_rewards = as_token_rewards(rewards, response_mask)
    v = torch.where(response_mask.bool(), values.float(), 0.0)
    deltas = token_rewards + gamma * _next_valid(v, response_mask) - v
    advantages = discounted_cumsum(deltas, response_mask, gamma * lam)
    returns = torch.where(response_mask.bool(), advantages + v, 0.0)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def grpo_advantage(rewards: torch.Tensor, response_mask: torch.Tensor, *, values: torch.Tensor | None = None,
                   group_index: torch.Tensor | None = None, norm_by_std: bool = True,
                   eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2, outcome
    supervision).

    With ``R_i`` the score of response ``i`` (the sum of its token rewards) and its group's mean and
    unbiased standard deviation, every token of response ``i`` gets ``A_i = (R_i - mean) / (std + eps)``, or
    ``A_i = R_i - mean`` with ``norm_by_std=False`` (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
    Critical Perspective" (Dr. GRPO), arXiv:2503.20783, which removes the question-difficulty bias of the
    std). ``R_i - mean`` is exact (:func:`~megarl.algos.aggregation.group_deviations`) and the std is built
    from it, so a group whose scores are all equal gets exactly 0 (with a plain fp32 mean, eight scores of 0.7
    would get +0.056 each: a std of ~1e-8 below ``eps`` amplifies the mean's rounding).

    Args:
        rewards: ``[B, T]`` token rewards or ``[B]`` scores.
        response_mask: ``[B, T]``.
        values: unused.
        group_index: ``[B]`` int64 prompt ids (required).
        norm_by_std: divide by the group's standard deviation.
        eps: added to the standard deviation.

    Returns:
        ``(advantages, advantages)``, ``[B, T]`` float32.

    Raises:
        ValueError: no or malformed ``group_index``, mismatched shapes.
    """
    scores, deviations, counts = _grouped_scores(rewards, response_mask, group_index, "grpo")
    single = counts == 1
    adv = torch.where(single, scores, deviations)
    if norm_by_std:
        std = (group_sum(deviations.square(), group_index)[0] / (counts - 1).clamp(min=1)).sqrt()
        adv = adv / (torch.where(single, 1.0, std) + eps)
    adv = _broadcast(adv, response_mask)
    return adv, adv


def rloo_advantage(rewards: torch.Tensor, response_mask: torch.Tensor, *, values: torch.Tensor | None = None,
                   group_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
    Feedback in LLMs", arXiv:2402.14740, the RLOO estimator).

    Each response's baseline is the mean score of the other responses of its group:
    ``A_i = R_i - (sum_{j != i} R_j) / (n - 1)`` on every token of response ``i`` (``R`` the sum of token
    rewards, ``n`` the group size; baseline 0 when ``n = 1``).

    Args:
        rewards: ``[B, T]`` token rewards or ``[B]`` scores.
        response_mask: ``[B, T]``.
        values: unused.
        group_index: ``[B]`` int64 prompt ids (required).

    Returns:
        ``(advantages, advantages)``, ``[B, T]`` float32.

    Raises:
        ValueError: no or malformed ``group_index``, mismatched shapes.
    """
    scores, deviations, counts = _grouped_scores(rewards, response_mask, group_index, "rloo")
    # R_i - (n mean - R_i) / (n - 1) = n / (n - 1) * (R_i - mean): exact deviations, so a tied group gives 0
    adv = torch.where(counts > 1, deviations * (counts / (counts - 1).clamp(min=1)), scores)
    adv = _broadcast(adv, response_mask)
    return adv, adv


def reinforce_plus_plus_advantage(rewards: torch.Tensor, response_mask: torch.Tensor, *,
                                  values: torch.Tensor | None = None, group_index: torch.Tensor | None = None,
                                  gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global
    Advantage Normalization", arXiv:2501.03262): token-level returns, then global batch normalisation.

    ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the valid tokens (the KL penalty belongs in ``r`` here,
    see :func:`megarl.algos.kl.apply_kl_penalty`), and ``A = (G - mean) / std`` over all valid tokens of the
    batch.

    Args:
        rewards: ``[B, T]`` token rewards or ``[B]`` scores.
        response_mask: ``[B, T]``.
        values / group_index: unused.
        gamma: discount per token, in [0, 1].

    Returns:
        ``(advantages, returns G)``, ``[B, T]`` float32.

    Raises:
        ValueError: gamma outside [0, 1], mismatched shapes.
    """
    if not 0 <= gamma <= 1:
        raise ValueError(f"reinforce_plus_plus needs gamma in [0, 1], got {gamma}")
    returns = discounted_cumsum(as_token_rewards(rewards, response_mask), response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def reinforce_plus_plus_baseline_advantage(rewards: torch.Tensor, response_mask: torch.Tensor, *,
                                           values: torch.Tensor | None = None,
                                           group_index: torch.Tensor | None = None
                                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline (Hu et al. 2025, REINFORCE++, arXiv:2501.03262, the group-sampling variant
    for several samples per prompt): subtract the group mean score, then normalise over the whole batch.

    ``A_i = R_i - mean_group(R)`` on every token of response ``i`` (baseline 0 for a group of one, exact 0 for
    a tied group), then divided by the standard deviation of these advantages over all valid tokens of the
    batch (``sqrt(var + 1e-8)``). The batch mean is not subtracted again (verl's ``masked_whiten`` does): the
    group baseline already centred the scores, and that mean, 0 up to rounding for equal lengths and a length
    weighting otherwise, would give a tied group, which carries no signal, a non-zero advantage.

    Args:
        rewards: ``[B, T]`` token rewards or ``[B]`` scores.
        response_mask: ``[B, T]``.
        values: unused.
        group_index: ``[B]`` int64 prompt ids (required).

    Returns:
        ``(advantages, advantages)``, ``[B, T]`` float32.

    Raises:
        ValueError: no or malformed ``group_index``, mismatched shapes.
    """
    scores, deviations, counts = _grouped_scores(rewards, response_mask, group_index,
                                                 "reinforce_plus_plus_baseline")
    centred = _broadcast(torch.where(counts > 1, deviations, scores), response_mask)
    adv = centred * torch.rsqrt(masked_var(centred, response_mask) + 1e-8)
    return adv, adv
