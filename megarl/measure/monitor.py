"""Device utilisation and memory, sampled in a background thread, and the process's resident memory.

On a GPU, :class:`UtilizationSampler` reads this rank's device through NVML (``nvidia-ml-py``): the
utilisation rate (percent of the interval in which a kernel ran, NVML's ``gpu`` field) and the device memory
in use (bytes, every process on the device). Without a GPU it reads this process from ``/proc``: CPU use
(percent of one core, so up to ``100 * cores``) and resident memory (bytes).

The process's peak resident memory (Linux ``VmHWM``) can be reset by writing ``5`` to ``/proc/self/clear_refs``
(Linux >= 4.0, ``proc(5)``), which is how :class:`~megarl.measure.timers.PhaseTimer` reports a peak per phase
on the CPU.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Resident memory of this process now, bytes (0 where ``/proc`` is not readable)."""
    return (_status_kib("VmRSS") or 0) * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory of this process since it started or since :func:`reset_peak_rss`, bytes."""
    return (_status_kib("VmHWM") or 0) * 1024


def reset_peak_rss() -> bool:
    """Reset the peak that :func:`peak_rss_bytes` reports to the current resident memory; False where the
    kernel does not allow it (the peak then stays the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far."""
    t = os.times()
    return t.user + t.system


@dataclass
class Samples:
    """What a sampler saw: one entry per sample.

    Attributes:
        source: "nvml" (this rank's GPU) or "proc" (this process; on a GPU machine with the reason NVML failed).
        util_pct: GPU utilisation, percent; or CPU use of this process, percent of one core.
        memory_bytes: device memory in use (GPU) or resident memory (CPU), bytes.
    """

    source: str
    util_pct: list[float] = field(default_factory=list)
    memory_bytes: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        """``{source, samples, util_mean_pct, util_max_pct, memory_mean_bytes, memory_max_bytes}`` (None for
        the statistics when nothing was sampled)."""
        n = len(self.util_pct)
        return {"source": self.source, "samples": n,
                "util_mean_pct": sum(self.util_pct) / n if n else None,
                "util_max_pct": max(self.util_pct) if n else None,
                "memory_mean_bytes": sum(self.memory_bytes) / n if n else None,
                "memory_max_bytes": max(self.memory_bytes) if n else None}


class UtilizationSampler:
    """Samples this rank's GPU (NVML) or this process (``/proc``) every ``interval_s`` in a daemon thread::

        with UtilizationSampler(0.1) as s:
            ...
        s.samples.summary()

    Where torch sees a GPU but NVML cannot be initialised, it samples the process instead and says why in
    ``samples.source``.
    """

    def __init__(self, interval_s: float = 0.1):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        source = "proc"
        if torch.cuda.is_available():
            import pynvml

            try:
                pynvml.nvmlInit()
                self._handle = _nvml_handle(pynvml, torch.cuda.current_device())
                source = "nvml"
            except pynvml.NVMLError as e:  # a benchmark does not stop for its monitor
                source = f"proc (NVML unavailable: {e})"
        self.samples = Samples(source)

    def _read(self, last: tuple[float, float]) -> tuple[float, float]:
        if self._handle is not None:
            import pynvml

            self.samples.util_pct.append(float(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            self.samples.memory_bytes.append(int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used))
            return last
        now = (time.perf_counter(), _cpu_seconds())
        self.samples.util_pct.append(100.0 * (now[1] - last[1]) / max(now[0] - last[0], 1e-9))
        self.samples.memory_bytes.append(rss_bytes())
        return now

    def _loop(self) -> None:
        last = (time.perf_counter(), _cpu_seconds())
        while not self._stop.wait(self.interval_s):
            last = self._read(last)

    def __enter__(self) -> "UtilizationSampler":
        self._thread = threading.Thread(target=self._loop, name="megarl-utilization", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._handle is not None:
            import pynvml

            pynvml.nvmlShutdown()


def device_bytes_in_use() -> int:
    """Bytes of this rank's GPU in use by every process and allocator (0 without a GPU)."""
    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def _nvml_handle(pynvml, device: int):
    """NVML's handle of torch's CUDA device ``device`` (by UUID, so ``CUDA_VISIBLE_DEVICES`` remapping is
    honoured; by index where torch does not expose the UUID)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(device)
