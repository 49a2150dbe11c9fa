"""Reward functions: rule rewards (GSM8K, arithmetic), reward-model scoring, and a registry for user functions.

See :mod:`megarl.rewards.registry` for the calling convention; ``load_reward_fn("gsm8k")`` or
``load_reward_fn("mypkg.mymod:fn", params)`` gives a callable ``(prompts, responses, ground_truths) -> [B]``.
The run's reward, ``reward.fn`` mixed with a generative judge (:mod:`megarl.rewards.judge`) where
``reward.judge`` is on, is :class:`megarl.rewards.mix.StepReward`.
"""

from megarl.rewards import arithmetic, gsm8k, http_reward, reward_model  # noqa: F401  (the built-in rewards)
from megarl.rewards.registry import REWARDS, LoadedReward, RewardError, load_reward_fn, register_reward

# reasoning-gym's tasks, each scored by its own score_answer (imported when a config names it)
REWARDS.declare("reasoning_gym", "megarl.environments.reasoning_gym:reasoning_gym_reward")

__all__ = ["LoadedReward", "RewardError", "load_reward_fn", "register_reward"]
