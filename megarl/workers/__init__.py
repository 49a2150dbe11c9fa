"""The Megatron roles of the RL step, each a Megatron model (and, when trained, its optimizer) on its pool:

- :mod:`.engine`: one role's model on this rank (:class:`~megarl.workers.engine.MegatronWorker`): forward
  passes over its data-parallel share, PPO-style updates over mini-batches, its checkpoint state;
- :mod:`.actor`: the actor and the reference policy (log-probs, the policy-loss update), a LoRA actor's base;
- :mod:`.critic`: the critic (values, the value-loss update);
- :mod:`.optimizer`: a role's megatron optimizer: torch's fused Adam in it, its checkpointed state and its
  resume at another layout or with other hyper-parameters;
- :mod:`.packing`: rows dealt to DP ranks and packed into micro-batches by token count;
- :mod:`.offload`: a trained role's host offload while the rollout engine generates.

Above ``models``, ``kernels``, ``algos`` and the step's batch (:mod:`megarl.data.batch`); below the trainer,
which runs them.
"""
