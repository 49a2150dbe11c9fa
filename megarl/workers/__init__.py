"""The Megatron roles of the RL step, each a Megatron model (and, when trained, its optimizer) on its pool:

- :mod:`.engine`: one role's model on this rank (:class:`~megarl.workers.engine.MegatronWorker`): forward
  passes over its data-parallel share, PPO-style updates, checkpoint state; the actor and reference policy
  (:class:`~megarl.workers.engine.PolicyWorker`) and the critic (:class:`~megarl.workers.engine.CriticWorker`);
- :mod:`.packing`: rows dealt to DP ranks and packed into micro-batches by token count;
- :mod:`.offload`: a trained role's host offload while the rollout engine generates.

Above ``models``, ``kernels``, ``algos`` and the step's batch (:mod:`megarl.data.batch`); below the trainer,
which runs them.
"""
