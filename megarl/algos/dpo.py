"""Direct Preference Optimization's sigmoid loss (Rafailov et al. 2023, "Direct Preference Optimization: Your
Language Model is Secretly a Reward Model", eq. 7), as a pure tensor function of sequence log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sigmoid DPO loss of ``N`` preference pairs, averaged over the pairs:

        L = -1/N sum_i log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))])

    (eq. 7; ``y_w`` the chosen completion, ``y_l`` the rejected one, each log-prob the sum over the completion's
    tokens). ``log sigmoid`` is computed as ``-softplus(-z)``, finite for any finite ``z``.

    Args:
        policy_chosen / policy_rejected: ``[N]`` float, the trained policy's sequence log-probs (with gradient).
        ref_chosen / ref_rejected: ``[N]`` float, the reference policy's (no gradient is taken through them).
        beta: the KL coefficient beta > 0 of the implicit reward ``beta * log(pi / pi_ref)``.

    Returns:
        ``(loss, metrics)``: the loss, a scalar of the inputs' dtype; metrics (detached, means over the pairs):
        ``rewards_chosen`` and ``rewards_rejected`` (the implicit rewards ``beta * (log pi - log pi_ref)``),
        ``margin`` (their difference) and ``accuracy`` (the share of pairs whose chosen reward is the larger).

    Raises:
        ValueError: inputs of different shapes, an empty batch, or ``beta <= 0``.
    """
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1 or policy_chosen.numel() == 0:
        raise ValueError(f"dpo_loss takes four [N] tensors of one shape with N >= 1, got shapes {sorted(shapes)}")
    if not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    chosen = beta * (policy_chosen - ref_chosen.detach())
    rejected = beta * (policy_rejected - ref_rejected.detach())
    margin = chosen - rejected
    loss = F.softplus(-margin).mean()
    metrics = {"rewards_chosen": chosen.detach().mean(), "rewards_rejected": rejected.detach().mean(),
               "margin": margin.detach().mean(), "accuracy": (margin.detach() > 0).to(margin.dtype).mean()}
    return loss, metrics
