"""Rollout correction: importance weights between the trainer's old log-probs and the rollout engine's.

The rollout engine (vLLM in bf16, with its own kernels) samples from a policy ``pi_rollout`` that is not
exactly the trainer's ``pi_old`` at the same weights; the PPO ratio ``pi / pi_old`` assumes samples from
``pi_old``. Weighting each sample's policy loss by ``rho = pi_old / pi_rollout`` corrects the mismatch (Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", fengyao.notion.site: truncated
importance sampling, TIS); masking the samples whose ``rho`` is far from 1 instead drops them (masked importance
sampling, MIS; Zheng et al. 2025 / Ring team 2025, "IcePop": token-level masking outside ``[alpha, beta]``).

``rho`` is taken per token (``rho_t = exp(old_t - rollout_t)``) or per sequence (``rho_i = exp(sum_t (old_t -
rollout_t))``, the ratio of the sequence's probabilities, applied to each of its tokens):

- ``mode="truncate"`` (TIS): weight ``min(rho, cap)``; every token stays in the loss.
- ``mode="mask"`` (MIS): weight 1 where ``lower <= rho <= cap``, and the token (or the whole sequence) leaves
  the loss elsewhere (out of the loss mask, so out of its normalisers too).

The weights are constants of the update (no gradient). With identical old and rollout log-probs every ``rho``
is exactly 1 (``exp(0)``), so every weight is exactly 1 and nothing is masked. Positions outside the response
mask never reach a weight or a statistic, NaN or infinite as they may be, and a batch or row without a valid
token gives finite statistics; a token whose rollout log-prob is not finite is taken out of the mask before
(:mod:`megarl.algos.nonfinite`), and an infinite ratio inside it is clamped (``|log rho| <= 20``). The config names the usual
settings, as verl's ``RolloutCorrectionConfig`` presets do
(:data:`megarl.algos.registry.ROLLOUT_CORRECTION_PRESETS`: ``token_tis``, ``seq_tis``, ``token_mis``,
``seq_mis``, ``icepop``).
"""

from __future__ import annotations

import torch

from megarl.algos.aggregation import masked_mean
from megarl.algos.registry import ROLLOUT_CORRECTION_LEVELS as LEVELS
from megarl.algos.registry import ROLLOUT_CORRECTION_MODES as MODES


def rollout_correction(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, response_mask: torch.Tensor, *,
                       level: str = "token", mode: str = "truncate", cap: float = 2.0, lower: float = 0.5
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights ``pi_old / pi_rollout`` of the rollout's tokens (module docstring).

    Args:
        old_logprob: ``[B, T]`` float log-probs of the sampled tokens under the trainer's policy at rollout time.
        rollout_logprob: ``[B, T]`` float log-probs the rollout engine reported for them.
        response_mask: ``[B, T]`` valid response tokens.
        level: "token" or "sequence".
        mode: "truncate" (TIS) or "mask" (MIS).
        cap: TIS's truncation ``C`` (> 0), or MIS's upper bound (>= 1).
        lower: MIS's lower bound, in [0, 1] (unused by TIS).

    Returns:
        ``(weights [B, T] float32, keep [B, T] bool, metrics)``: the weights (1 on kept MIS tokens, 0 on masked
        positions), the tokens that stay in the loss (``response_mask`` minus what MIS masks), and detached
        float32 scalars: ``kl_k3`` (k3 estimate of KL(pi_rollout || pi_old), ``mean(rho_t - 1 - log rho_t)``
        over valid tokens, from token ratios whatever the level), ``ratio_mean``/``ratio_min``/``ratio_max``
        (of ``rho`` at the level: over valid tokens, or over sequences with a valid token), and
        ``truncated_frac`` (TIS; 0 with MIS) and ``masked_frac`` (MIS; 0 with TIS): the share of valid tokens
        whose weight was cut, or that left the loss.

    Raises:
        ValueError: an unknown level or mode, bounds outside their domain, mismatched shapes.
    """
    if level not in LEVELS or mode not in MODES:
        raise ValueError(f"rollout correction: level must be one of {LEVELS} and mode one of {MODES}, got "
                         f"level={level!r}, mode={mode!r}")
    if not (cap > 0 and (mode == "truncate" or 0 <= lower <= 1 <= cap)):
        raise ValueError(f"rollout correction: needs cap > 0 (truncate) or 0 <= lower <= 1 <= cap (mask), got "
                         f"cap={cap}, lower={lower}")
    if not old_logprob.shape == rollout_logprob.shape == response_mask.shape:
        raise ValueError(f"old_logprob, rollout_logprob and response_mask must all be [B, T], got "
                         f"{[tuple(t.shape) for t in (old_logprob, rollout_logprob, response_mask)]}")
    mask = response_mask.bool()
    log_rho = torch.where(mask, old_logprob.float() - rollout_logprob.float(), 0.0).clamp(-20.0, 20.0)
    token_rho = log_rho.exp()
    if level == "token":
        rho, level_rho = token_rho, token_rho[mask]
    else:
        seq_rho = log_rho.sum(-1).clamp(-20.0, 20.0).exp()
        rho, level_rho = torch.where(mask, seq_rho[:, None], 1.0), seq_rho[mask.any(-1)]
    if mode == "truncate":
        weights = torch.where(mask, rho.clamp(max=cap), 0.0)
        keep = mask
        cut = mask & (rho > cap)
    else:
        inside = (rho >= lower) & (rho <= cap)
        keep = mask & inside
        weights = keep.float()
        cut = mask & ~inside
    none = level_rho.numel() == 0
    metrics = {
        "kl_k3": masked_mean(token_rho - 1 - log_rho, mask),
        "ratio_mean": level_rho.new_ones(()) if none else level_rho.mean(),
        "ratio_min": level_rho.new_ones(()) if none else level_rho.min(),
        "ratio_max": level_rho.new_ones(()) if none else level_rho.max(),
        "truncated_frac": masked_mean((cut if mode == "truncate" else torch.zeros_like(cut)).float(), mask),
        "masked_frac": masked_mean((cut if mode == "mask" else torch.zeros_like(cut)).float(), mask),
    }
    return weights, keep, metrics
