"""RL algorithms as pure tensor functions (no model, engine or process group).

- :mod:`~megarl.algos.advantages`: GAE, GRPO, RLOO, REINFORCE++ (+baseline), registered by name.
- :mod:`~megarl.algos.losses`: PPO clipped surrogate (clip-higher, dual-clip), actor loss, clipped value loss.
- :mod:`~megarl.algos.kl`: k1/k2/k3 KL estimators, the reward KL penalty, fixed/adaptive KL coefficient.
- :mod:`~megarl.algos.aggregation`: masked reductions and loss aggregation with global normalisers.

One RL step uses them in this order (``B`` responses of at most ``T`` tokens)::

    token_rewards = as_token_rewards(scores, mask)                                   # or apply_kl_penalty
    advantages, returns = get_advantage_fn(name)(token_rewards, mask, values=..., group_index=..., **params)
    tokens, seqs = count_tokens_and_seqs(mask)   # of the whole mini-batch, summed over DP ranks
    loss, metrics = actor_loss(logprob, old_logprob, advantages, mask_k, global_tokens=tokens, ...)
"""

from megarl.algos.advantages import as_token_rewards, get_advantage_fn, register_advantage
from megarl.algos.aggregation import AGG_MODES, agg_loss, count_tokens_and_seqs, masked_mean, masked_whiten
from megarl.algos.kl import (AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty,
                             register_kl)
from megarl.algos.losses import (actor_loss, get_policy_loss_fn, ppo_clip_loss, register_policy_loss,
                                 value_loss)

__all__ = [
    "AGG_MODES", "AdaptiveKLController", "FixedKLController", "actor_loss", "agg_loss", "apply_kl_penalty",
    "as_token_rewards", "count_tokens_and_seqs", "get_advantage_fn", "get_policy_loss_fn", "kl_penalty",
    "masked_mean", "masked_whiten", "ppo_clip_loss", "register_advantage", "register_kl",
    "register_policy_loss", "value_loss",
]
