"""RL algorithms as pure tensor functions (no model, engine or process group).

- :mod:`~megarl.algos.advantages`: GAE, GRPO, RLOO, REINFORCE++ (+baseline), registered by name.
- :mod:`~megarl.algos.losses`: PPO clipped surrogate (clip-higher, dual-clip), actor loss, clipped value loss.
- :mod:`~megarl.algos.kl`: k1/k2/k3/k3+ KL estimators, the reward KL penalty, fixed/adaptive KL coefficient.
- :mod:`~megarl.algos.aggregation`: masked reductions, exact group deviations, loss aggregation with global
  normalisers.
- :mod:`~megarl.algos.registry`: the registries (no torch): names, the config fields each algorithm takes.

One RL step uses them in this order (``B`` responses of at most ``T`` tokens)::

    token_rewards = as_token_rewards(scores, mask)                                   # or apply_kl_penalty
    advantages, returns = ADVANTAGES.bind(name, cfg.algorithm)(token_rewards, mask, values=..., group_index=...)
    tokens, seqs = count_tokens_and_seqs(mask)   # of the whole mini-batch, summed over DP ranks
    loss, metrics = actor_loss(logprob, old_logprob, advantages, mask_k, global_tokens=tokens, ...)

The package imports nothing itself: :mod:`~megarl.algos.registry` stays free of torch, so
:mod:`megarl.config` reads the allowed names from it; import the tensor modules by name.
"""
