"""One Megatron role as every training rank sees it (:class:`Role`): its worker runs on the ranks of the role's
pool (:mod:`megarl.parallel.placement`), and what it computes there reaches every training rank, so that each
rank again holds the whole step's batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch

from megarl.parallel.placement import share_object, share_tensor

T = TypeVar("T")


@dataclass(frozen=True)
class Role:
    """A Megatron role (actor, reference, critic) on every training rank.

    Attributes:
        worker: the role's worker (:class:`~megarl.workers.actor.PolicyWorker`, :class:`~megarl.workers.actor.
            BasePolicy`, :class:`~megarl.workers.critic.CriticWorker`) where its pool holds this rank, else None.
        ranks: the ranks of the role's pool.
        group: the training ranks' process group (None: the world).
    """

    worker: Any
    ranks: Sequence[int]
    group: Any = None

    def run(self, fn: Callable[[Any], T]) -> T | None:
        """``fn(worker)`` on the ranks of the role's pool, None elsewhere. No collective outside the pool, so
        roles on disjoint pools run at the same time until their results are shared (:meth:`share`)."""
        return None if self.worker is None else fn(self.worker)

    def share(self, local: Any, frame: Sequence[int] | None = None) -> Any:
        """What :meth:`run` gave on the pool (``local``; ignored elsewhere), on every training rank: a
        ``frame``-shaped float32 tensor (``[B, R]`` per-token values), or with ``frame`` None any picklable object
        (metrics). Call on every training rank, in the same order."""
        if frame is None:
            return share_object(local, self.ranks, group=self.group)
        return share_tensor(local, self.ranks, tuple(frame), group=self.group)

    def run_shared(self, fn: Callable[[Any], T], frame: Sequence[int] | None = None) -> T | torch.Tensor:
        """:meth:`share` of :meth:`run`: ``fn(worker)``'s result on every training rank."""
        return self.share(self.run(fn), frame)
