"""A role's megatron optimizer: torch's fused Adam kernel inside it (:func:`use_fused_adam`), and its checkpointed
state: the sharded form a checkpoint saves (:func:`sharded_optimizer_state`) and its load into a resumed run's
optimizer (:func:`load_optimizer_state`), whatever layout, expert chain and hyper-parameters the run has now.

The functions take megatron's optimizer as :meth:`~megarl.workers.engine.MegatronWorker._make_trainable` builds
it: a ``DistributedOptimizer`` or mixed-precision / fp32 optimizer, or a ``ChainedOptimizer`` of the dense and the
experts' ones (its ``chained_optimizers``), each wrapping torch's Adam/AdamW (its ``optimizer``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

# How the DistributedOptimizer's state is checkpointed (megatron-core 0.19). "fully_reshardable" stores each
# parameter's main weight and Adam moments in the model's own (layout-free) tensor space, so a checkpoint resumes
# at any TP x PP x DP; torch Adam's per-parameter "step" (without TE/apex) travels in the param groups and is
# put back by :func:`load_optimizer_state`. Checkpoints written before it used "dp_reshardable"
# (same TP x PP only); megarl.json records the format, and such a checkpoint still loads at its own layout.
# (The default, "fully_sharded_model_space", builds flattened ShardedTensors that its torch_dist saver refuses.)
OPTIMIZER_FORMAT = "fully_reshardable"
LEGACY_OPTIMIZER_FORMAT = "dp_reshardable"
# An MoE model's experts get an optimizer of their own (megatron's ChainedOptimizer of the dense and the expert
# one) where EP > 1 or TP > 1 (expert TP = 1), a single optimizer otherwise. Its state is keyed by parameter name
# alone (megatron's "chained_optim_avoid_prefix"), not under "chained_<k>.", so a checkpoint resumes when the chain
# changes (EP 1 <-> 2, an MoE model's TP 1 <-> 2); megarl.json's "optimizer_chain_prefix" says so, and a checkpoint
# written before it (the prefixed keys) resumes only where its chain is the same.
OPTIMIZER_CHAIN_PREFIX = False


def _optimizers(optimizer) -> list:
    """The optimizers of a chain (megatron's ``ChainedOptimizer``), or ``[optimizer]``."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def use_fused_adam(optimizer) -> None:
    """Step the torch Adam/AdamW inside a megatron optimizer (plain or chained) with torch's fused kernel (one pass
    over each tensor for the whole update), on CPU and CUDA parameters alike. Megatron builds torch's AdamW where
    neither Transformer Engine's nor apex's fused Adam exists, and torch then runs, on the CPU, its per-tensor loop
    of ~10 operations (0.73 s against 0.13 s a step for SmolLM2-135M's 148M fp32 parameters on 2 cores) and, on a
    GPU, its ``foreach`` kernels, whose temporaries (``sqrt(exp_avg_sq)`` and the step, each as large as the
    fp32 main parameters: 2 x 22 GiB for the 5.6B parameters of the 8-layer Qwen3-30B-A3B) set the update's
    peak memory. The same update within float rounding (tests/test_workers_adam.py)."""
    for wrapper in _optimizers(optimizer):
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.device.type in ("cpu", "cuda") for p in group["params"]):
                group["foreach"], group["fused"] = False, True


def init_adam_state(optimizer) -> None:
    """Give the torch Adam/AdamW inside a megatron optimizer (plain, chained, or the sub-optimizers of the
    HybridDeviceOptimizer of ``optim.cpu_offload``) the state that torch creates lazily at its first step
    (``torch.optim.Adam._init_group``): for every parameter a step count of 0 (float32; on the parameter's device
    for the fused kernel) and zero moments of its shape and dtype, so the first update is the same. A
    never-stepped optimizer (the actor during the critic's warm-up) is then checkpointed and resumed as any
    other: megatron-core's DistributedOptimizer reads its one step count from the state to save it (an empty
    state failed its ``assert len(steps) == 1``), and a run resumed from it makes the uninterrupted run's first
    update. The moments take the memory that the first update would take (2 x the fp32 main
    parameters of this rank's shard), from the build on."""
    for wrapper in _optimizers(optimizer):
        inner = getattr(wrapper, "optimizer", None)
        hybrid = getattr(inner, "sub_optimizers", None)  # optim.cpu_offload: megatron's HybridDeviceOptimizer
        for adam in hybrid if hybrid is not None else [inner]:
            if type(adam) not in (torch.optim.Adam, torch.optim.AdamW):
                continue
            for group in adam.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    if adam.state[p]:
                        continue
                    state = adam.state[p]
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if hybrid is not None:
            inner._sync_sub_optimizers_state_to_hdo()  # what its step does after the sub-optimizers' steps


def sharded_optimizer_state(optimizer, model_sd: dict[str, Any], *, is_loading: bool,
                            optimizer_format: str = OPTIMIZER_FORMAT,
                            chain_prefix: bool = OPTIMIZER_CHAIN_PREFIX) -> dict[str, Any]:
    """The optimizer's state for megatron's dist checkpointing, over the model's sharded state ``model_sd``.
    ``optimizer_format``: the DistributedOptimizer's sharding type (:data:`OPTIMIZER_FORMAT`; a checkpoint's own
    when loading one written before it); ``chain_prefix``: the chained optimizers' state under ``chained_<k>.``
    (:data:`OPTIMIZER_CHAIN_PREFIX`; True for a checkpoint written before it). For loading, an optimizer that
    has not stepped gets its state first (:func:`_materialize_state`)."""
    if is_loading:
        _materialize_state(optimizer)
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                        metadata={"distrib_optim_sharding_type": optimizer_format,
                                                  "chained_optim_avoid_prefix": not chain_prefix})


def load_optimizer_state(optimizer, loaded: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state (:func:`megarl.models.checkpoint.load_checkpoint` of
    :func:`sharded_optimizer_state`) into ``optimizer``. The optimizer's hyper-parameters (LR, weight decay,
    betas, eps, their schedule's bounds) are the current config's, not the checkpoint's: its param groups are
    replaced by this optimizer's own, keeping only the update count (megatron would otherwise fail to pair groups
    whose ``max_lr``/``min_lr`` changed, or restore the old weight decay); the LR schedule is resumed apart
    (:meth:`~megarl.workers.engine.MegatronWorker.resume_schedule`)."""
    loaded = _in_current_chain(optimizer, loaded)
    _use_current_param_groups(optimizer, loaded)
    with torch.no_grad(), _adam_steps_left_alone(optimizer):  # megatron copies into the main params in place
        optimizer.load_state_dict(loaded)
    _restore_adam_steps(optimizer)


def _materialize_state(optimizer) -> None:
    """An optimizer whose state is created at its first step (TE's or apex's fused Adam; torch's has its
    state from the build on: :func:`init_adam_state`) cannot describe an empty state for loading. Create it
    the way megatron does for its FSDP checkpoints: one step on zero gradients (the parameters are loaded
    from the checkpoint right after)."""
    for opt in _optimizers(optimizer):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """megatron-core 0.19's DistributedOptimizer, with torch's Adam (no TE/apex), restores the step count
    into each param group's "step" but leaves the per-parameter "step" of torch's Adam state at its
    pre-load value, which Adam's bias correction reads. Copy the group's step into every parameter's."""
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                if p in inner.state and "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


@contextlib.contextmanager
def _adam_steps_left_alone(optimizer):
    """megatron-core 0.19's ``fully_reshardable`` loader, with torch's Adam (no TE/apex), copies every
    tensor of a parameter's optimizer state from the checkpoint, torch Adam's per-parameter ``step``
    included, which the checkpoint keeps in the param groups instead (a ``KeyError: 'step'``). Inside the
    block, each parameter's own step stands in for the missing one (the copy changes nothing);
    :func:`_restore_adam_steps` then sets it from the checkpoint's count."""
    opts = [o for o in _optimizers(optimizer) if hasattr(o, "_set_main_param_and_optimizer_states")]

    def keep_step(opt, original):
        def set_states(model_param, tensors):
            group, order = opt.model_param_group_index_map[model_param]
            step = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]].get("step")
            original(model_param, {"step": step, **tensors} if step is not None else tensors)
        return set_states

    for opt in opts:
        opt._set_main_param_and_optimizer_states = keep_step(opt, opt._set_main_param_and_optimizer_states)
    try:
        yield
    finally:
        for opt in opts:
            del opt._set_main_param_and_optimizer_states  # the class's method again


def _in_current_chain(optimizer, loaded: dict[str, Any]) -> dict[str, Any]:
    """A loaded optimizer state in ``optimizer``'s form where the checkpoint's chain differs (its experts'
    optimizer of their own or not: :data:`OPTIMIZER_CHAIN_PREFIX`). megatron's loader places the tensors as
    this optimizer's state dict has them (one per chained optimizer under ``0``, ``1``..., or a single
    optimizer's at the top) and the rest (param groups, step, grad scaler) as the checkpoint had it; the
    checkpoint's first optimizer's rest goes with every optimizer's tensors, where they have no entry of that
    name (megatron keeps one step count for the chain; the param groups are replaced by
    :func:`_use_current_param_groups`)."""
    def fill(into: dict, rest: dict) -> dict:
        for k, v in rest.items():
            if k not in into:
                into[k] = copy.deepcopy(v)
            elif isinstance(into[k], dict) and isinstance(v, dict):
                fill(into[k], v)
        return into

    chained = {k: v for k, v in loaded.items() if isinstance(k, int)}
    single = {k: v for k, v in loaded.items() if not isinstance(k, int)}
    if not chained or not single:
        return loaded  # the checkpoint's chain is this optimizer's
    if len(_optimizers(optimizer)) > 1:
        return {k: fill(v, single) for k, v in chained.items()}
    return fill(single, chained[min(chained)])


def _use_current_param_groups(optimizer, loaded: dict[str, Any]) -> None:
    """Replace the param groups of a loaded optimizer state (one per chained optimizer, or the single
    one's) by ``optimizer``'s, with the checkpoint's ``step`` (torch Adam's update count, without
    TE/apex). megatron's optimizer state dicts hold them under ``["optimizer"]["param_groups"]`` (the
    distributed and the mixed-precision optimizer) or ``["param_groups"]`` (the fp32 one)."""
    opts = _optimizers(optimizer)
    parts = [loaded] if len(opts) == 1 else [loaded[k] for k in sorted(loaded)]
    for opt, part in zip(opts, parts):
        holder = part.get("optimizer", part)
        steps = {g["step"] for g in holder["param_groups"] if g.get("step") is not None}
        current = opt.state_dict()
        kept = {"step": steps.pop()} if len(steps) == 1 else {}  # megatron keeps one count for all groups
        holder["param_groups"] = [{**g, **kept} for g in current.get("optimizer", current)["param_groups"]]
