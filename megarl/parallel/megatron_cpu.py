"""The patches megatron-core needs to run on a CPU-only machine with gloo, in one place.

megatron-core is written for CUDA: it calls ``torch.cuda.*`` unconditionally in its RNG tracker, DDP buffers,
pipeline schedules and optimizers. No config flag avoids those calls, so on a machine without a GPU
:func:`apply_cpu_patches` replaces each of them with its CPU equivalent. On a machine with a GPU it does
nothing. Each patch names the call sites it fixes (measured on megatron-core 0.19.2, torch 2.11; recipe in
``../shared/reference/megatron-cpu/``).

The models must also be built with ``use_cpu_initialization=True``, every fusion off and the local layer
spec; :func:`megarl.models.megatron.transformer_config` does that when no GPU exists.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

_applied: list[str] = []


def _patch_rng_tracker() -> None:
    """``tensor_parallel.random.CudaRNGStatesTracker.add/fork`` call ``torch.cuda.get_rng_state`` (used by
    ``model_parallel_cuda_manual_seed``, dropout and activation recompute). Replace the tracker with one that
    keeps CPU generator states, and map the module's cuda-state getters/setters to the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    base = mrandom.CudaRNGStatesTracker
    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    class CPURNGStatesTracker(base):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker  # initialize_rng_tracker(force_reset=True) rebuilds it
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_current_device() -> None:
    """``torch.cuda.current_device()`` is passed as ``device=`` all over megatron-core (RoPE frequencies,
    p2p receive buffers, DDP grad buffers, optimizer state); make it name the CPU."""
    torch.cuda.current_device = lambda: "cpu"


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites ``device="cuda"`` arguments to the CPU, makes ``Tensor.cuda()`` a no-op and drops
    ``pin_memory``: megatron-core hard-codes them in ``pipeline_parallel/schedules.py`` (``total_num_tokens``
    of every schedule), ``language_module.py`` (tied embeddings with PP > 1) and ``rope_utils``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_mode: _CudaToCpuMode | None = None


def _patch_device_arguments() -> None:
    global _mode
    _mode = _CudaToCpuMode()
    _mode.__enter__()  # process-wide for the main thread, for the life of the process


class _NullStream:
    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return None


def _patch_sync_and_streams() -> None:
    """``torch.cuda.synchronize`` (p2p communication, optimizer, timers) and ``torch.cuda.current_stream``
    (DDP ``start_grad_sync`` waits on CUDA-graph events) become no-ops."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()


def _patch_tensor_type() -> None:
    """The optimizers check ``param.type() == 'torch.cuda.FloatTensor'`` (distributed optimizer param groups,
    Float16 optimizer, ``clip_grad_by_total_norm_fp32``); report CPU tensors under their CUDA type name.
    ``Tensor.type(dtype)`` conversions are untouched."""
    original = torch.Tensor.type
    if getattr(original, "_megarl_cpu", False):
        return

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    type_._megarl_cpu = True
    torch.Tensor.type = type_


def _patch_sequence_parallel_norm() -> None:
    """The local spec's ``WrappedTorchNorm`` refuses ``sequence_parallel=True`` (it wants apex or TE). Build
    the torch norm anyway and tag its parameters ``sequence_parallel`` so their grads are all-reduced over TP
    by ``finalize_model_grads``."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original_new = cls.__new__
    if getattr(original_new, "_megarl_cpu", False):
        return

    def new(cls_, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls_, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            module = original_new(cls_, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in module.parameters():
            p.sequence_parallel = True
        return module

    new._megarl_cpu = True
    cls.__new__ = staticmethod(new)


PATCHES = {
    "rng_tracker": _patch_rng_tracker,
    "current_device": _patch_current_device,
    "device_arguments": _patch_device_arguments,
    "sync_and_streams": _patch_sync_and_streams,
    "tensor_type": _patch_tensor_type,
    "sequence_parallel_norm": _patch_sequence_parallel_norm,
}


def apply_cpu_patches() -> list[str]:
    """Apply every patch in :data:`PATCHES` once, only where ``torch.cuda.is_available()`` is False.

    Call in every rank before megatron's ``model_parallel_cuda_manual_seed`` or any model construction.

    Returns:
        The names of the patches now active (empty on a GPU machine).
    """
    if torch.cuda.is_available():
        return []
    for name, patch in PATCHES.items():
        if name not in _applied:
            patch()
            _applied.append(name)
    log.debug("megatron-core CPU patches active: %s", _applied)
    return list(_applied)
