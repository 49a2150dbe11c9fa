"""megarl: RL post-training (GRPO, PPO, RLOO, REINFORCE++) with Megatron-core actors and a reshard engine into
vLLM / transformers rollouts. Entry point: the ``megarl`` command (:mod:`megarl.cli`)."""

__version__ = "0.1.0"
