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


def in_thread() -> contextlib.AbstractContextManager:
    """The device rewriting of :func:`apply_cpu_patches` for a thread of its own (a torch function mode holds in
    the thread that entered it only): enter it around the thread's work; nothing where the patches are off."""
    return _CudaToCpuMode() if _mode is not None else contextlib.nullcontext()


class _NullEvent:
    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()


def _patch_sync_and_streams() -> None:
    """``torch.cuda.synchronize`` (p2p communication, optimizer, timers), ``torch.cuda.current_stream`` (DDP
    ``start_grad_sync`` waits on CUDA-graph events), ``torch.cuda.Stream`` and ``torch.cuda.stream``
    (``HybridDeviceOptimizer``'s copy streams) become no-ops: on the CPU every copy is done when it returns."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = _NullStream  # a class still (annotations write ``torch.cuda.Stream | None``)
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


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


class _StandInDevice(torch.overrides.TorchFunctionMode):
    """CPU tensors that stand for device tensors: ``marked`` (id -> tensor, held until the mode ends so that no id
    is reused), the tensors made from them by ``detach``, ``clone``, ``float``, ``to`` and ``view`` too (they would be
    on the device); ``cpu()`` of one is an unmarked copy; ``pin_memory()`` returns the tensor. ``Tensor.is_cuda``
    reports the mark while :meth:`standing_in` is active (a property getter does not reach torch-function modes)."""

    PROPAGATE = frozenset({torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.float, torch.Tensor.to,
                           torch.Tensor.view})

    def __init__(self, tensors):
        super().__init__()
        self.marked = {id(t): t for t in tensors}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args and id(args[0]) in self.marked else None
        if func is torch.Tensor.pin_memory:
            return args[0]
        out = func(*args, **kwargs)
        if source is not None and func is torch.Tensor.cpu:
            return out.clone()
        if source is not None and func in self.PROPAGATE and torch.is_tensor(out):
            self.marked[id(out)] = out
        return out

    @contextlib.contextmanager
    def standing_in(self):
        base = torch._C.TensorBase.is_cuda
        torch.Tensor.is_cuda = property(lambda t: id(t) in self.marked or base.__get__(t))
        try:
            with self:
                yield
        finally:
            del torch.Tensor.is_cuda  # TensorBase's again
            self.marked.clear()


def _patch_hybrid_optimizer() -> None:
    """megatron-core's ``HybridDeviceOptimizer`` (``optim.cpu_offload``) splits its parameters by
    ``param.is_cuda``: the first ``offload_fraction`` of the device's parameters (by elements) get a pinned host
    copy (``.cpu().pin_memory()``, fp32) stepped by a CPU Adam, the rest an fp32 copy on the device stepped by
    the device's Adam; a CPU tensor counts for neither, and its bookkeeping then fails. While it splits, its own
    parameters stand for device tensors (:class:`_StandInDevice`), so on the CPU the split, the host copies, the
    gradient copies into them, both steps and the copies back run as they do on a GPU."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    original = HybridDeviceOptimizer._get_sub_optimizer_param_groups
    if getattr(original, "_megarl_cpu", False):
        return

    def split(self, offload_fraction):
        with _StandInDevice(p for group in self.param_groups for p in group["params"]).standing_in():
            return original(self, offload_fraction)

    split._megarl_cpu = True
    HybridDeviceOptimizer._get_sub_optimizer_param_groups = split


def _patch_moe_split_sizes() -> None:
    """The all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``) turns its
    split sizes into host numpy arrays through ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)``, which
    converts only CUDA tensors: CPU tensors stay tensors, which ``all_to_all_single`` refuses as split sizes (it
    takes a sequence of ints). Convert CPU tensors too."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_megarl_cpu", False):
        return

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._megarl_cpu = True
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


PATCHES = {
    "rng_tracker": _patch_rng_tracker,
    "current_device": _patch_current_device,
    "device_arguments": _patch_device_arguments,
    "sync_and_streams": _patch_sync_and_streams,
    "tensor_type": _patch_tensor_type,
    "sequence_parallel_norm": _patch_sequence_parallel_norm,
    "hybrid_optimizer": _patch_hybrid_optimizer,
    "moe_split_sizes": _patch_moe_split_sizes,
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
