"""Wall-clock time and peak memory of the phases of an RL step, synchronising the GPU where there is one."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from megarl.measure.monitor import peak_rss_bytes, reset_peak_rss
from megarl.parallel.faults import fault_point
from megarl.parallel.lifecycle import phase


class PhaseTimer:
    """Accumulates seconds and peak memory per named phase: ``with timer("generate"): ...``.

    On a GPU, ``torch.cuda.synchronize()`` runs at both ends of a phase so queued kernels are counted in the
    phase that launched them, and the phase's peak memory is ``torch.cuda.max_memory_allocated()`` (bytes of
    tensors allocated by torch on this rank's device, after resetting the peak at the phase's start; memory
    that vLLM maps itself is not in it). On the CPU it is the process's peak resident memory (``VmHWM``, reset
    at the phase's start where the kernel allows it, see :mod:`megarl.measure.monitor`). Each phase is
    also this rank's :func:`~megarl.parallel.lifecycle.phase` (named when a collective fails) and the fault
    point ``phase.<name>`` (:mod:`megarl.parallel.faults`).

    Attributes:
        seconds: phase -> seconds since the last :meth:`reset` (summed over repeated entries).
        peak_bytes: phase -> the largest peak memory of its entries, bytes.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str):
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()
        start = time.perf_counter()
        try:
            with phase(name):
                fault_point(f"phase.{name}")
                yield
        finally:
            if gpu:
                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() if gpu else peak_rss_bytes()
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)

    def reset(self) -> dict[str, float]:
        """Return the accumulated seconds per phase and start again (the peaks are kept until
        :meth:`reset_peaks`)."""
        out, self.seconds = self.seconds, {}
        return out

    def reset_peaks(self) -> dict[str, int]:
        """Return the peak memory per phase, bytes, and start again."""
        out, self.peak_bytes = self.peak_bytes, {}
        return out
