"""Offline post-training on the actor's engine, ``megarl sft`` and ``megarl dpo``, and ``megarl eval``.

- :mod:`.data`: conversations to tokens with the assistant's tokens marked (from the chat template's rendering),
  SFT examples, preference pairs, their loader and batches;
- :mod:`.policy`: the SFT and DPO losses on :class:`~megarl.workers.actor.PolicyWorker` (every layout, LoRA);
- :mod:`.trainer`: the run on a rank, driven by ``megarl train``'s loop, checkpoints and reports;
- :mod:`.sft`, :mod:`.dpo`: each command's data, step and validation; :mod:`.command`: their arguments;
- :mod:`.evaluate`: ``megarl eval``, a checkpoint's validation accuracy on a prompt file.

Above ``workers``, ``data`` and ``algos``; beside the RL trainer (:mod:`megarl.trainer`), whose loop, checkpoints
and run folder it reuses; below the CLI.
"""
