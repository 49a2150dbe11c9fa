"""On-policy distillation: the student samples, a teacher scores every sampled token, and the per-token reverse
KL is the student's (negative) advantage.

For the student ``pi_s`` and the teacher ``pi_t``, on a response ``y`` sampled from the student, the reverse KL's
single-sample estimate at token ``t`` is

    kl_t = log pi_s(y_t | x, y_<t) - log pi_t(y_t | x, y_<t),

whose expectation over the student's samples is ``KL(pi_s || pi_t)`` at that prefix, mode-seeking. On-policy
distillation minimises it with the policy gradient, each token's own ``-kl_t`` as its reward and advantage
(discount 0): Thinking Machines' "On-Policy Distillation" (Lu et al., 2025,
https://thinkingmachines.ai/blog/on-policy-distillation/, "reverse_kl = sampled_logprobs - teacher_logprobs",
``advantages = -reverse_kl``), the on-policy case of GKD (Agarwal et al. 2024, arXiv:2306.13649, eq. 2 with
``lambda = 1`` and the reverse KL); slime adds it to any estimator's advantage, ``A_t - lambda_opd * kl_t``
(``docs/en/advanced/on-policy-distillation.md``). Here::

    A_t = reward_coef * A_task_t - coef * kl_t

with ``A_task`` the advantage of ``algorithm.name`` on the task reward (0 weight: distillation alone). The
student's log-probs are the old ones (the actor before the update, the same weights that sampled, at the
sampling temperature: the PPO ratio's denominator); the teacher's are computed at that temperature too.
"""

from __future__ import annotations

import torch

from megarl.algos.aggregation import masked_mean


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` per-token reverse-KL estimate ``log pi_s - log pi_t`` of the sampled tokens (module docstring),
    in the inputs' dtype (fp32 log-probs: fp32)."""
    return student_logprobs - teacher_logprobs


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                       task_advantages: torch.Tensor | None = None, *, coef: float = 1.0,
                       reward_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token advantages of on-policy distillation and its metrics.

    Args:
        student_logprobs / teacher_logprobs: ``[B, T]`` log-probs of the sampled response tokens under the
            student (before the update) and the teacher.
        mask: ``[B, T]`` the tokens that count (1) and those that do not (0: padding, dropped samples); the
            advantage is 0 there.
        task_advantages: ``[B, T]`` the task reward's advantages, or None (no task reward).
        coef / reward_coef: the weights of ``-kl`` and of the task advantage (module docstring).

    Returns:
        ``[B, T]`` advantages (``task_advantages``' dtype, else the log-probs'), and the metrics over the
        masked tokens: ``distill/reverse_kl`` (mean ``kl_t``), ``distill/student_logprob_mean``,
        ``distill/teacher_logprob_mean``.
    """
    kl = reverse_kl(student_logprobs, teacher_logprobs)
    keep = mask.bool()
    adv = torch.where(keep, -coef * kl, torch.zeros_like(kl))
    if task_advantages is not None and reward_coef:
        adv = adv + reward_coef * task_advantages
    metrics = {"distill/reverse_kl": masked_mean(torch.where(keep, kl, 0.0), keep).item(),
               "distill/student_logprob_mean": masked_mean(torch.where(keep, student_logprobs, 0.0), keep).item(),
               "distill/teacher_logprob_mean": masked_mean(torch.where(keep, teacher_logprobs, 0.0), keep).item()}
    return adv, metrics
