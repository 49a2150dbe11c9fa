"""From a scored rollout batch to what the losses read: the rule for non-finite rollout log-probs and scores
(:func:`drop_nonfinite`), DAPO's overlong reward shaping, the token rewards with the KL penalty where it is in
the reward, the advantages and returns of ``algorithm.name``, and the loss mask (the response tokens that enter
the actor's loss, with the rollout correction's weights; the critic's without the dropped samples).

Each function reads the config's ``algorithm`` section and extends the :class:`~megarl.data.batch.RolloutBatch`
in place; the estimators, KL estimators and corrections themselves are the pure tensor functions of
:mod:`megarl.algos` (chosen through its registries: nothing here names an algorithm).
"""

from __future__ import annotations

import logging

import torch

from megarl.algos.aggregation import masked_mean
from megarl.algos.distill import distill_advantages
from megarl.algos.kl import apply_kl_penalty
from megarl.algos.nonfinite import check_nonfinite, estimate_without, find_nonfinite
from megarl.algos.registry import ADVANTAGES
from megarl.algos.rollout_correction import rollout_correction
from megarl.algos.shaping import overlong_penalty
from megarl.config import AlgorithmConfig
from megarl.data.batch import RolloutBatch

log = logging.getLogger(__name__)


def drop_nonfinite(batch: RolloutBatch, alg: AlgorithmConfig, step: int) -> dict[str, float]:
    """The rule of :mod:`megarl.algos.nonfinite` on a scored batch (``batch["scores"]``, ``rollout_logprobs``):
    ``batch["dropped"]`` ``[B]`` bool (the samples whose score is not finite) and ``batch["logprob_nonfinite"]``
    ``[B, T]`` bool (the response tokens whose rollout log-prob is not finite), which :func:`compute_advantages`
    and :func:`set_loss_mask` leave out. Returns ``rollout/nonfinite_logprob_tokens``, ``reward/nonfinite`` and
    ``nonfinite/sample_frac``; any found is said in a warning.

    Raises:
        NonFiniteError: more than ``algorithm.nonfinite.max_fraction`` of the samples have one, naming the first
            (its place in step ``step``'s batch, its prompt and dataset row, the field and the value).
    """
    found = find_nonfinite(batch["rollout_logprobs"], batch["response_mask"], batch["scores"])
    check_nonfinite(found, batch["rollout_logprobs"], batch["scores"], max_fraction=alg.nonfinite.max_fraction,
                    describe=lambda i: f"sample {i} of step {step} (prompt {int(batch['group'][i])} of the step, "
                                       f"dataset row {batch.meta['index'][i]})")
    batch["dropped"], batch["logprob_nonfinite"] = found.scores, found.tokens
    metrics = found.metrics()
    if metrics["nonfinite/sample_frac"]:
        log.warning("step %d: %d rollout log-probs that are not finite left the loss, %d samples whose score is not "
                    "finite were dropped from their groups (megarl.algos.nonfinite)", step,
                    metrics["rollout/nonfinite_logprob_tokens"], metrics["reward/nonfinite"])
    return metrics


def shape_rewards(batch: RolloutBatch, alg: AlgorithmConfig, max_new_tokens: int) -> None:
    """``batch["overlong_penalty"]`` ``[B]`` float32: DAPO's overlong penalty (``algorithm.overlong``,
    :func:`~megarl.algos.shaping.overlong_penalty`) of responses near ``max_new_tokens``, added to the scores by
    :func:`compute_advantages`; nothing when ``algorithm.overlong.buffer_tokens`` is 0."""
    ov = alg.overlong
    if ov.buffer_tokens:
        batch["overlong_penalty"] = overlong_penalty(batch["response_lens"], max_length=max_new_tokens,
                                                     cache_length=ov.buffer_tokens, factor=ov.penalty_factor)


def compute_advantages(batch: RolloutBatch, alg: AlgorithmConfig, kl_ctl) -> dict[str, float]:
    """``batch["advantages"]`` and ``batch["returns"]`` ``[B, T]`` float32 of the ``algorithm.name`` estimator
    over the token rewards: ``batch["scores"]`` ``[B]`` (plus the overlong penalty), with the KL penalty to the
    reference (``batch["ref_logprobs"]``) in the reward when ``algorithm.kl.in_loss`` is false, its coefficient
    from ``kl_ctl`` (a fixed or adaptive KL controller, updated here; only there are ``batch["old_logprobs"]``
    read); over the samples not ``batch["dropped"]`` (:func:`drop_nonfinite`: 0 on those). With a teacher's
    ``batch["teacher_logprobs"]`` (on-policy distillation) the advantages are
    :func:`~megarl.algos.distill.distill_advantages` of the student's old log-probs, the teacher's and the
    estimator's, with its ``distill/...`` metrics. Returns
    ``actor/kl_coef``, ``reward/overlong_penalty_mean`` and ``advantages/mean`` where they apply (``actor/kl``:
    :func:`~megarl.trainer.old_logprobs.old_logprob_metrics`)."""
    mask = batch["response_mask"]
    metrics = {}
    rewards = batch["scores"] + batch["overlong_penalty"] if "overlong_penalty" in batch else batch["scores"]
    if "overlong_penalty" in batch:
        metrics["reward/overlong_penalty_mean"] = batch["overlong_penalty"].mean().item()
    if "ref_logprobs" in batch:
        if not alg.kl.in_loss:
            rewards, mean_kl = apply_kl_penalty(rewards, batch["old_logprobs"], batch["ref_logprobs"], mask,
                                                coef=kl_ctl.value, kind=alg.kl.estimator)
            kl_ctl.update(float(mean_kl), len(batch))
        metrics["actor/kl_coef"] = kl_ctl.value
    estimator = ADVANTAGES.bind(alg.name, alg)  # with its parameters from the config
    dropped = batch.tensors.get("dropped", torch.zeros(len(batch), dtype=torch.bool))
    adv, ret = estimate_without(dropped, estimator, rewards, mask, values=batch.tensors.get("values"),
                                group_index=batch["group"])
    if "teacher_logprobs" in batch:  # on-policy distillation: -coef * reverse KL (+ reward_coef * adv)
        keep = mask.bool() & ~dropped[:, None] & ~batch.tensors.get("logprob_nonfinite", torch.zeros_like(mask.bool()))
        adv, distill_metrics = distill_advantages(batch["old_logprobs"], batch["teacher_logprobs"], keep, adv,
                                                  coef=alg.distill.coef, reward_coef=alg.distill.reward_coef)
        metrics.update(distill_metrics)
    batch["advantages"], batch["returns"] = adv, ret
    metrics["advantages/mean"] = masked_mean(adv, mask.bool() & ~dropped[:, None]).item()
    return metrics


def set_loss_mask(batch: RolloutBatch, alg: AlgorithmConfig) -> dict[str, float]:
    """``batch["loss_mask"]`` ``[B, T]`` float32 (the tokens in the actor's loss): the response mask without
    what :func:`drop_nonfinite` found (tokens with a non-finite rollout log-prob, dropped samples), without the
    responses cut at the limit (``algorithm.overlong.filter``) and without what the rollout correction masks;
    ``batch["rollout_weights"]`` ``[B, T]`` when it truncates (TIS); ``batch["value_mask"]`` (the critic's:
    the response mask without the dropped samples). Returns the ``rollout_corr/...`` metrics of the correction
    where it is on (only then are ``batch["old_logprobs"]`` read; with it off,
    :func:`~megarl.trainer.old_logprobs.old_logprob_metrics` gives its statistics) and
    ``response/overlong_filtered``."""
    mask = batch["response_mask"].bool()
    if "dropped" in batch:
        batch["value_mask"] = (mask & ~batch["dropped"][:, None]).float()
        mask = mask & ~batch["dropped"][:, None] & ~batch["logprob_nonfinite"]
    metrics = {}
    if alg.overlong.filter:
        cut = torch.tensor([r == "length" for r in batch.meta["finish_reason"]], dtype=torch.bool)
        mask = mask & ~cut[:, None]
        metrics["response/overlong_filtered"] = float(cut.float().mean()) if len(cut) else 0.0
    rc = alg.rollout_correction
    if rc.enabled:
        level, mode, cap, lower = rc.settings()
        weights, keep, stats = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"], mask,
                                                  level=level, mode=mode, cap=cap, lower=lower)
        metrics.update({f"rollout_corr/{k}": v.item() for k, v in stats.items()})
        mask = keep
        if mode == "truncate":
            batch["rollout_weights"] = weights
    batch["loss_mask"] = mask.float()
    return metrics
