"""Actor and critic losses: the PPO clipped surrogate (clip-higher, dual-clip), the clipped value loss, and
the actor loss that adds the entropy bonus and the KL loss.

A policy loss is registered by name and has the signature::

    fn(logprob, old_logprob, advantages, response_mask, **params) -> (loss_mat, metrics)

- ``logprob``: ``[B, T]`` float log-probs of the sampled tokens under the policy being trained (with grad).
- ``old_logprob``: ``[B, T]`` float log-probs under the policy that generated the samples (the rollout, or
  behaviour, policy; no grad).
- ``advantages``: ``[B, T]`` float (see :mod:`megarl.algos.advantages`).
- ``response_mask``: ``[B, T]`` valid response tokens (see :mod:`megarl.algos.aggregation`).
- ``**params``: the loss's own keyword parameters, from the config.
- returns: ``loss_mat`` ``[B, T]`` float32 per-token loss (0 on masked positions, with zero gradient there
  even if the inputs hold inf or NaN there), to be reduced by
  :func:`~megarl.algos.aggregation.agg_loss`, and ``metrics``: name -> detached float32 scalar, means over
  this batch's valid tokens.

The built-ins are declared in :data:`megarl.algos.registry.POLICY_LOSSES` (with the config fields each takes);
add one with ``@register_policy_loss("name", params=...)``; :func:`actor_loss` looks it up by name.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from megarl.algos.aggregation import agg_loss, masked_mean
from megarl.algos.kl import kl_penalty
from megarl.algos.registry import POLICY_LOSSES

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

register_policy_loss = POLICY_LOSSES.register
get_policy_loss_fn = POLICY_LOSSES.get


def ppo_clip_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_ratio_c: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347, eq. 7), with decoupled clip ranges (Yu et al. 2025, DAPO, arXiv:2503.14476, sec. 3.1
    "clip-higher") and dual clip for negative advantages (Ye et al. 2020, "Mastering Complex Control in MOBA
    Games with Deep Reinforcement Learning", arXiv:1912.09729, sec. "dual-clip PPO").

    With the per-token ratio ``r = exp(logprob - old_logprob)`` (log-ratio clamped to [-20, 20]) and
    advantage ``A``: ``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; with
    ``clip_ratio_c`` set, tokens with ``A < 0`` take ``min(l, -A clip_ratio_c)`` (the loss of a very large
    ratio on a bad token is bounded at ``c |A|``).

    Args:
        logprob / old_logprob / advantages / response_mask: ``[B, T]`` (module docstring).
        clip_ratio_low: lower clip range epsilon_low, in [0, 1).
        clip_ratio_high: upper clip range epsilon_high, >= 0.
        clip_ratio_c: dual-clip bound c (> 1), or None for no dual clip.

    Returns:
        ``(loss_mat [B, T] float32, metrics)`` with metrics ``clipfrac`` (fraction of tokens where the clipped
        term is active), ``clipfrac_lower`` (fraction of tokens where the dual clip is active; 0 without it),
        ``ppo_kl`` (k1 estimate of KL(old || new), ``mean(old_logprob - logprob)``) and ``approx_kl`` (k3
        estimate of KL(old || new), ``mean(r - 1 - log r)``).

    Raises:
        ValueError: a clip range outside its domain, mismatched shapes.
    """
    if not (0 <= clip_ratio_low < 1 and clip_ratio_high >= 0):
        raise ValueError(f"ppo needs 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                         f"clip_ratio_low={clip_ratio_low}, clip_ratio_high={clip_ratio_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"ppo dual clip needs clip_ratio_c > 1 (or None to disable it), got {clip_ratio_c}")
    if not logprob.shape == old_logprob.shape == advantages.shape == response_mask.shape:
        raise ValueError(f"logprob, old_logprob, advantages and response_mask must all be [B, T], got "
                         f"{[tuple(t.shape) for t in (logprob, old_logprob, advantages, response_mask)]}")
    mask = response_mask.bool()
    adv = torch.where(mask, advantages.float(), 0.0)
    log_ratio = torch.where(mask, logprob.float() - old_logprob.float(), 0.0).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(mask)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c
        dual_active = (adv < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "clipfrac_lower": masked_mean(dual_active.float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        }
    return torch.where(mask, loss, 0.0), metrics


def actor_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, *, policy_loss: str = "ppo",
               policy_loss_params: Mapping[str, Any] | None = None, agg_mode: str = "token-mean",
               global_tokens: torch.Tensor | float | None = None, global_seqs: torch.Tensor | float | None = None,
               entropy: torch.Tensor | None = None, entropy_coeff: float = 0.0,
               ref_logprob: torch.Tensor | None = None, kl_coef: float = 0.0, kl_kind: str = "k3"
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss on one micro-batch: policy loss - entropy bonus + KL loss, each aggregated alike.

    ``loss = agg(policy_loss) - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty(logprob, ref_logprob,
    kl_kind))``, all with the same ``agg_mode`` and global normalisers, so the split-invariance contract of
    :mod:`megarl.algos.aggregation` holds for the whole loss (sum the returned losses over micro-batches and
    data-parallel ranks). The KL term is the GRPO-style KL loss (Shao et al. 2024, arXiv:2402.03300, eq. 3);
    leave ``kl_coef = 0`` when the KL is in the reward instead (:func:`megarl.algos.kl.apply_kl_penalty`).

    Args:
        logprob / old_logprob / advantages / response_mask: ``[B, T]`` (module docstring).
        policy_loss: a registered policy loss name ("ppo").
        policy_loss_params: its keyword parameters (e.g. ``{"clip_ratio_high": 0.28, "clip_ratio_c": 3.0}``).
        agg_mode / global_tokens / global_seqs: see :func:`~megarl.algos.aggregation.agg_loss`.
        entropy: ``[B, T]`` float per-token entropy of the policy (nats, with grad), needed when
            ``entropy_coeff != 0``.
        entropy_coeff: weight of the entropy bonus (>= 0 rewards exploration).
        ref_logprob: ``[B, T]`` float reference log-probs, needed when ``kl_coef != 0``.
        kl_coef: weight of the KL loss.
        kl_kind: KL estimator for the loss (see :func:`~megarl.algos.kl.kl_penalty`; what each one's gradient
            estimates is in :mod:`megarl.algos.kl`: "k2" or "k3+" for the gradient of KL(pi || pi_ref)).

    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar with grad; ``metrics`` detached float32 scalars:
        ``pg_loss``, ``entropy`` and ``kl_loss`` are this micro-batch's shares (sum them like the loss), the
        policy loss's own metrics are means over this micro-batch's valid tokens (average them).

    Raises:
        ValueError: unknown policy loss or KL kind, a coefficient set without its input, bad parameters.
    """
    loss_fn = get_policy_loss_fn(policy_loss)
    pg_mat, pg_metrics = loss_fn(logprob, old_logprob, advantages, response_mask, **(policy_loss_params or {}))
    norms = dict(global_tokens=global_tokens, global_seqs=global_seqs)
    pg = agg_loss(pg_mat, response_mask, agg_mode, **norms)
    metrics = {"pg_loss": pg.detach(), **pg_metrics}
    loss = pg
    if entropy_coeff != 0:
        if entropy is None:
            raise ValueError(f"entropy_coeff={entropy_coeff} needs the per-token entropy [B, T]")
        ent = agg_loss(entropy, response_mask, agg_mode, **norms)
        metrics["entropy"] = ent.detach()
        loss = loss - entropy_coeff * ent
    if kl_coef != 0:
        if ref_logprob is None:
            raise ValueError(f"kl_coef={kl_coef} needs the reference log-probs ref_logprob [B, T]")
        mask = response_mask.bool()
        kl_mat = kl_penalty(torch.where(mask, logprob, 0.0), torch.where(mask, ref_logprob, 0.0), kl_kind)
        kl = agg_loss(kl_mat, mask, agg_mode, **norms)
        metrics["kl_loss"] = kl.detach()
        loss = loss + kl_coef * kl
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, *, cliprange_value: float | None = None,
               agg_mode: str = "token-mean", global_tokens: torch.Tensor | float | None = None,
               global_seqs: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's clipped squared error (PPO2 value clipping: OpenAI baselines ``ppo2``; discussed in
    Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients", arXiv:2005.12729, sec. 3).

    ``l = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token, or ``0.5 * (V - R)^2``
    without clipping, then aggregated like the actor's loss. The clipped prediction is ``V`` itself inside
    the range (``V_old + clip(V - V_old, -c, c)``, the usual spelling, is not exactly ``V`` in float
    arithmetic, and the rounding would decide which term is larger and count the token as clipped).

    Args:
        values: ``[B, T]`` float predictions of the critic being trained (with grad).
        old_values: ``[B, T]`` float predictions of the critic at rollout time (those GAE used).
        returns: ``[B, T]`` float regression targets (from the advantage estimator).
        response_mask: ``[B, T]`` valid tokens.
        cliprange_value: c (> 0), or None for no clipping.
        agg_mode / global_tokens / global_seqs: see :func:`~megarl.algos.aggregation.agg_loss`.

    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar with grad; ``metrics`` detached: ``vf_loss`` (this
        micro-batch's share), ``vf_clipfrac`` (fraction of valid tokens where the clipped term is larger,
        which needs ``V`` outside ``[V_old - c, V_old + c]``; 0 without clipping) and ``vpred_mean`` (mean
        prediction).

    Raises:
        ValueError: ``cliprange_value <= 0``, mismatched shapes.
    """
    if cliprange_value is not None and cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be > 0 (or None for no clipping), got {cliprange_value}")
    if not values.shape == old_values.shape == returns.shape == response_mask.shape:
        raise ValueError(f"values, old_values, returns and response_mask must all be [B, T], got "
                         f"{[tuple(t.shape) for t in (values, old_values, returns, response_mask)]}")
    mask = response_mask.bool()
    v, target = torch.where(mask, values.float(), 0.0), torch.where(mask, returns.float(), 0.0)
    loss_mat = (v - target).square()
    clipped_active = torch.zeros_like(mask)
    if cliprange_value is not None:
        v_old = torch.where(mask, old_values.float(), 0.0)
        clipped = (v.clamp(v_old - cliprange_value, v_old + cliprange_value) - target).square()
        clipped_active = clipped > loss_mat
        loss_mat = torch.maximum(loss_mat, clipped)
    loss = agg_loss(0.5 * loss_mat, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    metrics = {"vf_loss": loss.detach(), "vf_clipfrac": masked_mean(clipped_active.float(), mask),
               "vpred_mean": masked_mean(v.detach(), mask)}
    return loss, metrics
