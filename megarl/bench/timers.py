"""Wall-clock timing of the phases of an RL step (seconds), synchronising the GPU where there is one."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates seconds per named phase: ``with timer("generate"): ...``.

    On a GPU, ``torch.cuda.synchronize()`` runs at both ends of a phase so queued kernels are counted in the
    phase that launched them.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        sync = torch.cuda.is_available()
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> dict[str, float]:
        """Return the accumulated seconds per phase and start again."""
        out, self.seconds = self.seconds, {}
        return out
