"""Host offload of a trained role (``actor.offload`` / ``critic.offload``): its parameters, gradients and
optimizer state leave the GPU while the rollout engine generates, and come back for training, so that a model
that fits only one phase at a time still runs.

What moves are storages, not modules: megatron's DDP keeps the parameters and the gradients in contiguous
buffers (``param_data`` / ``grad_data`` of ``model.buffers``; each parameter and ``main_grad`` is a view), and
the DistributedOptimizer keeps its fp32 main parameters (a view of the parameter buffer for fp32 models, a copy
for bf16) and torch Adam's ``exp_avg`` / ``exp_avg_sq``. Each storage is copied to a host buffer (pinned where
CUDA exists, kept from step to step) and resized to 0 bytes on the device; moving back resizes it and copies
the bytes in, so every view (parameters, ``main_grad``, optimizer shards) sees its values again without being
rebuilt. On a machine without a GPU the same code runs on CPU storages (the memory is not saved there; the
code path and its results are what the tests check). Optimizer state already on the host (``optim.cpu_offload``:
megatron's ``HybridDeviceOptimizer`` keeps it there) is not on the parameters' device and stays where it is.
"""

from __future__ import annotations

import time

import torch

KINDS = ("params", "grads", "optimizer")


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Moves one Megatron worker's storages between its device and host memory.

    Args:
        model: the DDP-wrapped model (``buffers`` / ``expert_parallel_buffers`` of megatron's
            ``DistributedDataParallel``), or with VPP the list of its DDP-wrapped chunks.
        optimizer: megatron's optimizer (a ``ChainedOptimizer`` or one optimizer; its ``.optimizer`` is torch's).

    Use :meth:`to_host` with the kinds to move (``grads`` and ``optimizer`` are idle from the end of an update
    to the start of the next; ``params`` after the reshard has read them), then :meth:`to_device`.
    """

    def __init__(self, model, optimizer):
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # host copies, reused from step to step
        self._away: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.pin = torch.cuda.is_available()

    def _tensors(self, kind: str) -> list[torch.Tensor]:
        buffers = [b for m in self.chunks
                   for b in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", []))]
        if kind == "params":
            return [p.data for m in self.chunks for p in m.parameters()]
        if kind == "grads":
            return [b.grad_data for b in buffers if b.grad_data is not None]
        inner = [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        state = [t for opt in inner for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        mains = [p for opt in inner for g in opt.param_groups for p in g["params"]]
        return state + mains

    def _storages(self, kinds) -> list[tuple[str, int, torch.UntypedStorage]]:
        """Distinct resident storages of ``kinds`` on the parameters' device (views share one), in a fixed
        order."""
        seen, out = set(), []
        device = next(p.device for m in self.chunks for p in m.parameters())
        for kind in KINDS:
            for t in self._tensors(kind):
                s = t.untyped_storage()
                if s.nbytes() == 0 or s.data_ptr() in seen or t.device != device:
                    continue
                seen.add(s.data_ptr())
                if kind in kinds:
                    out.append((kind, len(out), s))
        return out

    @property
    def bytes_on_host(self) -> int:
        """Bytes now held on the host (0 when everything is on the device)."""
        return sum(s.numel() for _, s in self._away)

    def to_host(self, kinds=KINDS) -> float:
        """Copy the storages of ``kinds`` to the host and free them on the device; returns seconds.

        Storages already moved are skipped, and a storage shared by two kinds (fp32 main parameters that are
        views of the parameter buffer) moves with the first kind in :data:`KINDS` order (the parameters). The
        freed device memory goes back to the driver (``empty_cache``), where the rollout engine can take it.
        """
        start = time.perf_counter()
        for kind, i, storage in self._storages(tuple(kinds)):
            n = storage.nbytes()
            host = self._host.get((kind, i))
            if host is None or host.numel() != n:
                host = self._host[(kind, i)] = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
            host.copy_(_bytes_view(storage), non_blocking=self.pin)
            self._away.append((storage, host))
        if self.pin:
            torch.cuda.synchronize()  # the copies are done before the storages are freed
        for storage, _ in self._away:
            storage.resize_(0)
        if self.pin:
            torch.cuda.empty_cache()
        return time.perf_counter() - start

    def to_device(self) -> float:
        """Give every moved storage its bytes back on the device; returns seconds."""
        start = time.perf_counter()
        for storage, host in self._away:
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()
        self._away = []
        return time.perf_counter() - start


class RoleOffloads:
    """The host offloads of a run's trained roles (those whose config sets ``offload``; none: every call does
    nothing), moved together, with the seconds their moves took since :meth:`take_seconds` (a step's
    ``offload/to_host_s`` and ``offload/to_device_s``).

    Args:
        workers: the trained roles' workers held on this rank (their ``model``, ``optimizer`` and ``rc.offload``).
    """

    def __init__(self, workers):
        self.offloads = [HostOffload(w.model, w.optimizer) for w in workers if w.rc.offload]
        self.seconds = {"to_host": 0.0, "to_device": 0.0}

    @property
    def bytes_on_host(self) -> int:
        """Bytes now held on the host by every offloaded role."""
        return sum(o.bytes_on_host for o in self.offloads)

    def to_host(self, kinds: tuple[str, ...]) -> None:
        """Move ``kinds`` (of :data:`KINDS`) of every offloaded role to host memory (:meth:`HostOffload.to_host`)."""
        self.seconds["to_host"] += sum(o.to_host(kinds) for o in self.offloads)

    def to_device(self) -> None:
        """Bring everything the offloaded roles moved back to the device (:meth:`HostOffload.to_device`)."""
        self.seconds["to_device"] += sum(o.to_device() for o in self.offloads)

    def take_seconds(self) -> dict[str, float]:
        """``{"to_host", "to_device"}``: the seconds of the moves since the last call, counted from 0 again."""
        seconds, self.seconds = self.seconds, {"to_host": 0.0, "to_device": 0.0}
        return seconds
