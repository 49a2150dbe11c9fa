"""The old log-probs of a step: when the trainer computes them in a pass of their own, and the metrics read
from them.

The PPO ratio ``pi / pi_old`` needs the log-probs of the sampled tokens under the actor as it is before the
step's update (``batch["old_logprobs"]``). A pass without gradients computes them before the update
(``time/old_logprobs``). Where the update is one epoch of one mini-batch of the whole batch, its first
forward runs the very weights and micro-batches of that pass, so it gives the same numbers bit for bit (the
trainer's first-step exactness: ``actor/ppo_kl_first_minibatch`` is 0); the pass is then skipped, as verl
does on-policy (``old_log_prob = log_prob.detach()``), provided nothing reads the old log-probs before the
update. :func:`old_logprob_pass` decides; the update then adds its detached log-probs to the batch
(:meth:`~megarl.workers.actor.PolicyWorker.update`), and :func:`old_logprob_metrics`, computed after the
update whichever way they came, reports the same metrics from them.
"""

from __future__ import annotations

import logging
import math

import torch

from megarl.algos.aggregation import masked_mean
from megarl.algos.kl import kl_penalty
from megarl.algos.mismatch import first_mismatch, first_turns, mismatch_metrics, turn_index
from megarl.algos.rollout_correction import rollout_correction
from megarl.config import AlgorithmConfig, Config
from megarl.data.batch import RolloutBatch

log = logging.getLogger(__name__)


def old_logprob_pass(cfg: Config, *, rows: int, step: int, moe: bool) -> str | None:
    """Why step ``step`` (0-based) of a batch of ``rows`` samples runs the old-log-prob pass, or None where
    the actor update's first forward gives the same old log-probs and the pass is skipped
    (``actor.old_logprob_pass="auto"``); the same answer on every rank. ``moe``: the actor is a
    mixture-of-experts model.

    The pass runs where any of these holds (in this order; the reason says which):

    - ``actor.old_logprob_pass="always"``;
    - ``rollout.exact``: the old log-probs come from the batch-invariant pass (the engine's batch-invariant kernels,
      or one sample per micro-batch without them), not the update's micro-batches;
    - ``actor.ppo_epochs > 1`` or more than one mini-batch (``actor.ppo_mini_batch_size`` < ``rows``): the later
      updates need the weights before the first;
    - the KL penalty is in the reward (``algorithm.kl.coef > 0``, ``kl.in_loss=false``), or the rollout
      correction is on (its weights and mask enter the loss and its normalisers), or on-policy distillation
      (``algorithm.distill.teacher``: the student's log-probs in its advantage): all read the old log-probs
      before the update;
    - a critic's warm-up step (``critic.warmup_steps``): no actor update;
    - an MoE actor: the pass measures the routing agreement with the engine's routes;
    - the pass and the update would run different numbers: LoRA dropout (training only), or forward
      micro-batches of another size (``actor.logprob_micro_batch_size`` not ``micro_batch_size``, without
      token-budget micro-batches).

    Multi-turn episodes, split pools, async and PP > 1 change none of this: their old log-probs come from the
    same actor, before the same update.
    """
    a, alg = cfg.actor, cfg.algorithm
    mini = a.ppo_mini_batch_size
    reasons = (
        (a.old_logprob_pass == "always", "actor.old_logprob_pass=always"),
        (cfg.rollout.exact, "rollout.exact: the batch-invariant pass"),
        (a.ppo_epochs > 1, f"actor.ppo_epochs={a.ppo_epochs}: the later epochs need the weights before the first"),
        (mini != rows, f"{rows} samples in mini-batches of {mini} (actor.ppo_mini_batch_size): the later ones "
                       "need the weights before the first"),
        (alg.kl.coef > 0 and not alg.kl.in_loss, "the KL penalty is in the reward (algorithm.kl.in_loss=false)"),
        (alg.rollout_correction.enabled, "the rollout correction weighs the loss (algorithm.rollout_correction)"),
        (alg.distill.teacher is not None, "on-policy distillation's advantage reads the student's log-probs"),
        (alg.uses_critic and step < cfg.critic.warmup_steps, "the critic's warm-up: no actor update"),
        (moe, "an MoE actor's pass measures the routing agreement"),
        (a.lora.enabled and a.lora.dropout > 0, "LoRA dropout changes the update's forward"),
        (not a.max_tokens_per_micro_batch and a.logprob_micro_batch_size not in (0, a.micro_batch_size),
         "actor.logprob_micro_batch_size differs from micro_batch_size (other rounding)"),
    )
    return next((why for holds, why in reasons if holds), None)


def old_logprob_metrics(batch: RolloutBatch, alg: AlgorithmConfig, *, exact: bool = False) -> dict[str, float]:
    """The step's metrics of ``batch["old_logprobs"]`` ``[B, T]`` (from the pass or the update), read after
    the update: ``actor/rollout_vs_old_logprob_diff`` (mean ``|rollout - old|`` over the response tokens with a
    finite rollout log-prob), ``actor/kl`` (the ``algorithm.kl.estimator`` KL to ``batch["ref_logprobs"]``
    over the response tokens, where there is a reference), with the rollout correction off its
    ``rollout_corr/...`` statistics over the loss mask's tokens (with it on,
    :func:`~megarl.trainer.advantages.set_loss_mask` reports them), and the ``mismatch/...`` figures of
    :func:`~megarl.algos.mismatch.mismatch_metrics` over the same tokens as the first (their mean ``|diff|`` is
    that one): overall, per response-length bucket (``batch["response_lens"]``) and, for multi-turn episodes
    (``batch.meta["episode"]``), per turn of the episode. ``rollout/exact`` records ``exact``
    (``rollout.exact``); with it on, a token whose two log-probs differ is a fault (a weight not synced, a stale
    KV cache, a wrong template token) and a warning names the first one (:func:`~megarl.algos.mismatch.
    first_mismatch`: its sample, prompt and response position).
    """
    old, mask = batch["old_logprobs"], batch["response_mask"].bool()
    valid = mask & ~batch["logprob_nonfinite"]
    turns = None
    if "episode" in batch.meta:  # turns from the sampled runs, before a non-finite token leaves the mask
        turns = turn_index(mask, first_turns(mask, torch.tensor(batch.meta["episode"], dtype=torch.int64)))
    mismatch = mismatch_metrics(old, batch["rollout_logprobs"], valid, lengths=batch["response_lens"], turns=turns)
    metrics = {"actor/rollout_vs_old_logprob_diff": mismatch.pop("abs_diff_mean").item(),
               **{f"mismatch/{k}": v.item() for k, v in mismatch.items()}, "rollout/exact": float(exact)}
    first = first_mismatch(old, batch["rollout_logprobs"], valid) if exact else None
    if first is not None:
        (row, col), n = first, int(metrics["mismatch/tokens"])
        log.warning("rollout.exact: %d of %d tokens differ from the rollout's log-probs; the first is sample %d "
                    "(prompt %d), response token %d: trainer %r, rollout %r (a weight not synced, a stale KV "
                    "cache or another template token?)", round((1 - metrics["mismatch/exact_tokens_frac"]) * n), n,
                    row, int(batch["group"][row]), col, old[row, col].item(),
                    batch["rollout_logprobs"][row, col].item())
    if "ref_logprobs" in batch:
        metrics["actor/kl"] = masked_mean(kl_penalty(old, batch["ref_logprobs"], alg.kl.estimator), mask).item()
    if not alg.rollout_correction.enabled:
        _, _, stats = rollout_correction(old, batch["rollout_logprobs"], batch["loss_mask"].bool(), level="token",
                                         mode="truncate", cap=math.inf, lower=0.0)
        metrics.update({f"rollout_corr/{k}": v.item() for k, v in stats.items()})
    return metrics
