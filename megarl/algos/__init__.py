"""RL algorithms as pure tensor functions (no model, engine or process group).

- :mod:`~megarl.algos.advantages`: GAE, GRPO, RLOO, REINFORCE++ (+baseline), registered by name.
- :mod:`~megarl.algos.losses`: policy losses (PPO clipped surrogate with clip-higher and dual-clip, GSPO, CISPO),
  actor loss, clipped value loss.
- :mod:`~megarl.algos.rollout_correction`: importance weights between the actor's old and the rollout engine's
  log-probs (TIS/MIS, token or sequence level) and their mismatch metrics.
- :mod:`~megarl.algos.mismatch`: the rollout/trainer log-prob mismatch figures (NeMo-RL's
  ``token_mult_prob_error`` and ``gen_kl_error``, max and p99 |diff|), per length bucket and per turn.
- :mod:`~megarl.algos.shaping`: DAPO's overlong reward penalty.
- :mod:`~megarl.algos.nonfinite`: the rule for non-finite rollout log-probs, scores, losses and gradients.
- :mod:`~megarl.algos.kl`: k1/k2/k3/k3+ KL estimators, the reward KL penalty, fixed/adaptive KL coefficient.
- :mod:`~megarl.algos.distill`: on-policy distillation's per-token reverse KL to a teacher as the advantage.
- :mod:`~megarl.algos.aggregation`: masked reductions, exact group deviations, loss aggregation with global
  normalisers.
- :mod:`~megarl.algos.registry`: the registries (no torch): names, the config fields each algorithm takes.

One RL step uses them in this order (``B`` responses of at most ``T`` tokens)::

    found = find_nonfinite(rollout_logprob, mask, scores)          # check_nonfinite: fail past the threshold
    token_rewards = as_token_rewards(scores, mask)                                   # or apply_kl_penalty
    advantages, returns = estimate_without(found.scores, ADVANTAGES.bind(name, cfg.algorithm), token_rewards,
                                           mask, values=..., group_index=...)       # without the dropped
    mask = mask & ~found.tokens & ~found.scores[:, None]
    weights, keep, _ = rollout_correction(old_logprob, rollout_logprob, mask, ...)    # optional
    tokens, seqs = count_tokens_and_seqs(keep)   # of the whole mini-batch, summed over DP ranks
    loss, metrics = actor_loss(logprob, old_logprob, advantages, keep_k, global_tokens=tokens,
                               rollout_weights=weights_k, ...)

The package imports nothing itself: :mod:`~megarl.algos.registry` stays free of torch, so
:mod:`megarl.config` reads the allowed names from it; import the tensor modules by name.
"""
