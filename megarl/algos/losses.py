"""Actor and critic losses: the policy losses (PPO's clipped surrogate with clip-higher and dual-clip, GSPO,
CISPO), the clipped value loss, and the actor loss that adds the entropy bonus and the KL loss.

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
    _check_shapes(logprob, old_logprob, advantages, response_mask)
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


def _check_shapes(logprob, old_logprob, advantages, response_mask) -> None:
    if not logprob.shape == old_logprob.shape == advantages.shape == response_mask.shape:
        raise ValueError(f"logprob, old_logprob, advantages and response_mask must all be [B, T], got "
                         f"{[tuple(t.shape) for t in (logprob, old_logprob, advantages, response_mask)]}")


def _check_clip_range(name: str, low: float, high: float, low_max: float) -> None:
    if not (0 <= low <= low_max and high >= 0):
        raise ValueError(f"{name} needs 0 <= clip_ratio_low <= {low_max} and clip_ratio_high >= 0, got "
                         f"clip_ratio_low={low}, clip_ratio_high={high}")


def gspo_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, *, clip_ratio_low: float = 3e-4,
              clip_ratio_high: float = 4e-4) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv:2507.18071), in its token form GSPO-token (sec. 4.3, eq. 13-14).

    The importance ratio is the sequence's, the geometric mean of its token ratios (eq. 7):
    ``s_i = exp(mean_t (logprob - old_logprob))`` over the valid tokens of response ``i`` (log-ratio clamped to
    [-20, 20]). Token ``t`` of response ``i`` takes ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, whose value is
    ``s_i`` and whose gradient is ``s_i * grad log pi(y_t)``, and the loss
    ``l_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))``: the whole sequence is
    clipped or not. With one advantage per response (GRPO's) and ``loss_agg_mode="seq-mean-token-mean"``, the
    loss and its gradient are those of GSPO's sequence objective (eq. 5:
    ``-1/G sum_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i)``); the paper's clip ranges are 3e-4 and 4e-4.

    Args:
        logprob / old_logprob / advantages / response_mask: ``[B, T]`` (module docstring).
        clip_ratio_low: lower clip range, in [0, 1).
        clip_ratio_high: upper clip range, >= 0.

    Returns:
        ``(loss_mat [B, T] float32, metrics)``; metrics (means over valid tokens): ``clipfrac`` (tokens of
        clipped sequences), ``clipfrac_lower`` (0), ``ppo_kl`` and ``approx_kl`` (token-level, as
        :func:`ppo_clip_loss`'s) and ``seq_ratio`` (``s_i``).

    Raises:
        ValueError: a clip range outside its domain, mismatched shapes.
    """
    _check_clip_range("gspo", clip_ratio_low, clip_ratio_high, low_max=1 - 1e-12)
    _check_shapes(logprob, old_logprob, advantages, response_mask)
    mask = response_mask.bool()
    adv = torch.where(mask, advantages.float(), 0.0)
    logp = torch.where(mask, logprob.float(), 0.0)
    log_ratio = logp - torch.where(mask, old_logprob.float(), 0.0)
    seq_log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).clamp(-20.0, 20.0)
    ratio = (logp - logp.detach() + seq_log_ratio.detach()[:, None]).exp()  # value s_i, gradient s_i grad logp
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        token_log_ratio = log_ratio.clamp(-20.0, 20.0)
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "clipfrac_lower": torch.zeros((), dtype=torch.float32),
            "ppo_kl": masked_mean(-token_log_ratio, mask),
            "approx_kl": masked_mean(token_log_ratio.exp() - 1 - token_log_ratio, mask),
            "seq_ratio": masked_mean(ratio, mask),
        }
    return torch.where(mask, loss, 0.0), metrics


def cispo_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, *, clip_ratio_low: float = 1.0,
               clip_ratio_high: float = 0.28) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently
    with Lightning Attention", arXiv:2506.13585, sec. 3.1, eq. 4-5).

    Instead of clipping the update, CISPO clips the importance weight and stops its gradient, so every token
    keeps a gradient: ``l_t = -sg[clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_t * logprob_t`` with
    ``r_t = exp(logprob_t - old_logprob_t)`` (log-ratio clamped to [-20, 20]). The paper sets no lower bound
    (``clip_ratio_low = 1``: the weight is only capped above) and normalises by the batch's tokens
    (``loss_agg_mode="token-mean"``). The loss's value is not a surrogate objective; its gradient is
    ``-sg[clipped r_t] A_t grad logprob_t``.

    Args:
        logprob / old_logprob / advantages / response_mask: ``[B, T]`` (module docstring).
        clip_ratio_low: lower bound epsilon_low of the weight, in [0, 1] (1: none).
        clip_ratio_high: upper bound epsilon_high of the weight, >= 0.

    Returns:
        ``(loss_mat [B, T] float32, metrics)``; metrics (means over valid tokens): ``clipfrac`` (tokens whose
        weight is capped above), ``clipfrac_lower`` (capped below), ``ppo_kl`` and ``approx_kl`` (as
        :func:`ppo_clip_loss`'s).

    Raises:
        ValueError: a clip range outside its domain, mismatched shapes.
    """
    _check_clip_range("cispo", clip_ratio_low, clip_ratio_high, low_max=1.0)
    _check_shapes(logprob, old_logprob, advantages, response_mask)
    mask = response_mask.bool()
    adv = torch.where(mask, advantages.float(), 0.0)
    logp = torch.where(mask, logprob.float(), 0.0)
    log_ratio = (logp - torch.where(mask, old_logprob.float(), 0.0)).clamp(-20.0, 20.0)
    with torch.no_grad():
        ratio = log_ratio.exp()
        weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
        metrics = {
            "clipfrac": masked_mean((ratio > 1 + clip_ratio_high).float(), mask),
            "clipfrac_lower": masked_mean((ratio < 1 - clip_ratio_low).float(), mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, mask),
        }
    return torch.where(mask, -weight * adv * logp, 0.0), metrics


def actor_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, *, policy_loss: str = "ppo",
               policy_loss_params: Mapping[str, Any] | None = None, agg_mode: str = "token-mean",
               global_tokens: torch.Tensor | float | None = None, global_seqs: torch.Tensor | float | None = None,
               norm_tokens: float | None = None, entropy: torch.Tensor | None = None, entropy_coeff: float = 0.0,
               ref_logprob: torch.Tensor | None = None, kl_coef: float = 0.0, kl_kind: str = "k3",
               rollout_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss on one micro-batch: policy loss - entropy bonus + KL loss, each aggregated alike.

    ``loss = agg(policy_loss) - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty(logprob, ref_logprob,
    kl_kind))``, all with the same ``agg_mode`` and global normalisers, so the split-invariance contract of
    :mod:`megarl.algos.aggregation` holds for the whole loss (sum the returned losses over micro-batches and
    data-parallel ranks). The KL term is the GRPO-style KL loss (Shao et al. 2024, arXiv:2402.03300, eq. 3);
    leave ``kl_coef = 0`` when the KL is in the reward instead (:func:`megarl.algos.kl.apply_kl_penalty`).
    ``rollout_weights`` (the rollout correction's truncated importance weights,
    :mod:`megarl.algos.rollout_correction`) multiply the policy loss of each token, whatever the policy loss;
    tokens that the correction masks are left out through ``response_mask``.

    Args:
        logprob / old_logprob / advantages / response_mask: ``[B, T]`` (module docstring).
        policy_loss: a registered policy loss name ("ppo", "gspo", "cispo").
        policy_loss_params: its keyword parameters (e.g. ``{"clip_ratio_high": 0.28, "clip_ratio_c": 3.0}``).
        agg_mode / global_tokens / global_seqs / norm_tokens: see :func:`~megarl.algos.aggregation.agg_loss`.
        entropy: ``[B, T]`` float per-token entropy of the policy (nats, with grad), needed when
            ``entropy_coeff != 0``.
        entropy_coeff: weight of the entropy bonus (>= 0 rewards exploration).
        ref_logprob: ``[B, T]`` float reference log-probs, needed when ``kl_coef != 0``.
        kl_coef: weight of the KL loss.
        kl_kind: KL estimator for the loss (see :func:`~megarl.algos.kl.kl_penalty`; what each one's gradient
            estimates is in :mod:`megarl.algos.kl`: "k2" or "k3+" for the gradient of KL(pi || pi_ref)).
        rollout_weights: ``[B, T]`` float, no grad: per-token weights of the policy loss (None: all 1).

    Returns:
        ``(loss, metrics)``: ``loss`` a float32 scalar with grad; ``metrics`` detached float32 scalars:
        ``pg_loss``, ``entropy`` and ``kl_loss`` are this micro-batch's shares (sum them like the loss), the
        policy loss's own metrics are means over this micro-batch's valid tokens (weight them by its valid
        tokens to average them), ``log_ratio_absmax`` the largest ``|logprob - old_logprob|`` of a valid token
        (take the maximum; 0 when the update's log-probs are the old ones bit for bit).

    Raises:
        ValueError: unknown policy loss or KL kind, a coefficient set without its input, bad parameters.
    """
    loss_fn = get_policy_loss_fn(policy_loss)
    pg_mat, pg_metrics = loss_fn(logprob, old_logprob, advantages, response_mask, **(policy_loss_params or {}))
    if rollout_weights is not None:
        pg_mat = pg_mat * torch.where(response_mask.bool(), rollout_weights.detach().float(), 0.0)
    norms = dict(global_tokens=global_tokens, global_seqs=global_seqs, norm_tokens=norm_tokens)
    pg = agg_loss(pg_mat, response_mask, agg_mode, **norms)
    with torch.no_grad():
        diff = torch.where(response_mask.bool(), (logprob.float() - old_logprob.float()).abs(), 0.0)
    metrics = {"pg_loss": pg.detach(), **pg_metrics,
               "log_ratio_absmax": diff.max() if diff.numel() else diff.new_zeros(())}
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
               global_seqs: torch.Tensor | float | None = None, norm_tokens: float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
        agg_mode / global_tokens / global_seqs / norm_tokens: see :func:`~megarl.algos.aggregation.agg_loss`.

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
    loss = agg_loss(0.5 * loss_mat, mask, agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_tokens=norm_tokens)
    metrics = {"vf_loss": loss.detach(), "vf_clipfrac": masked_mean(clipped_active.float(), mask),
               "vpred_mean": masked_mean(v.detach(), mask)}
    return loss, metrics
