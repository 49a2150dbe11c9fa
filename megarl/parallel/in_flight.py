"""In-flight weight updates between the turns of episodes (``trainer.in_flight_updates``, async multi-turn on a
rollout pool of its own).

Without them the engines finish every batch they generate ahead with the weights they started it with
(:mod:`megarl.trainer.pipeline`). With them, the weights of step ``t`` reach the engines as soon as step ``t``'s
update ends, while they still generate the batches of later steps: each rollout rank then lets the turns it
is running end on the old weights, takes the new ones (the step's reshard, world-wide), and runs every later
turn with them; an episode's tokens carry the version of the weights that sampled each
(:mod:`megarl.data.staleness`). This is the in-flight update of PipelineRL and AReaL (whose interrupted
requests resume on the new weights mid-sequence) and prime-rl, taken at turn boundaries: a turn is never
sampled by two versions, and vLLM's prefix cache is reset with the new weights, so the next turn's prefill
recomputes the history's KV with them.

The rendezvous: the first training rank sends a one-element flag to every rollout rank after the step's
update (:func:`announce`); each rollout rank posted its receive when it started the step's generation and
polls it between engine steps (:class:`NewWeights`, the generation loop's ``pause``). A rollout rank whose
episodes all end before the flag comes waits for it, then takes the weights; only then are the episodes
gathered over the rollout ranks (a gather before it could wait on a rank that is in the reshard), so the
step's events on the training ranks read ``train t``, ``reshard t``, then the hand-overs.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def _flag() -> torch.Tensor:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    return torch.zeros(1, device=device)


def flag_source(world_size: int, rollout_ranks: Sequence[int]) -> int:
    """The rank that announces new weights: the first rank outside the rollout pool."""
    return min(set(range(world_size)) - set(rollout_ranks))


class NewWeights:
    """The weights of ``version``, announced by ``source`` and written into this rollout rank's engine by
    ``reshard(version)`` (:meth:`~megarl.trainer.trainer.Trainer.reshard_actor_to_engine`) once due: a
    :class:`~megarl.agents.rollout.WeightUpdate`.

    Attributes:
        done: the weights are written.
    """

    def __init__(self, version: int, source: int, reshard):
        self.version, self._reshard, self.done = version, reshard, False
        self._flag = _flag()
        self._work = dist.irecv(self._flag, src=source)

    def due(self) -> bool:
        """The flag came and the weights are not written yet (does not block)."""
        return not self.done and self._work.is_completed()

    def __call__(self) -> None:
        """Wait for the flag, then take part in the reshard (world-wide)."""
        self._work.wait()
        self._reshard(self.version)
        self.done = True

    def finish(self) -> None:
        """Take the weights now where the episodes ended before they came (blocks until the flag)."""
        if not self.done:
            self()


def announce(rollout_ranks: Sequence[int], source: int) -> None:
    """On ``source`` (the training rank of :func:`flag_source`): tell every rollout rank that new weights follow
    (call after the update, before the reshard); nothing on the other ranks."""
    if dist.get_rank() != source:
        return
    flag = _flag() + 1
    for rank in rollout_ranks:
        dist.send(flag, dst=rank)
