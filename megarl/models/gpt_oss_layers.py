"""gpt-oss's megatron-core configuration and layer spec (the family: :mod:`megarl.models.gpt_oss`).

megatron-core 0.19.2 has every piece gpt-oss needs on its local spec: ``softmax_type="learnable"`` (the sinks, as
``core_attention.softmax_offset``), ``add_bias_linear``, the per-layer window (``window_size`` +
``window_attn_skip_freq``), ``quick_gelu`` with ``activation_func_clamp_value`` and ``glu_linear_offset`` in
``SequentialMLP``'s experts, a router bias. One piece fails on the CPU path: an expert's ``linear_fc2`` at expert
TP = 1 and EP = 1 returns megatron's all-reduce's input as it is (a view made inside a custom autograd Function),
and ``MLP.forward`` then adds the routing-weighted bias to it in place, which autograd forbids.
:class:`ExpertRowParallelLinear` skips that all-reduce (over one rank: nothing to reduce), as megatron itself does
at EP > 1 (``explicit_expert_comm``). An expert's ``linear_fc1`` holds gate and up rows interleaved (gpt-oss's
canonical ``gate_up_proj``, whose rows vLLM holds in that order too): :func:`reorder_expert_outputs` hands megatron's
GLU its ``[gate; up]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from megatron.core.activations import quick_gelu
from megatron.core.tensor_parallel.layers import RowParallelLinear

from megarl.models.gpt_oss import SWIGLU_LIMIT, rope_attention_factor
from megarl.models.spec import ModelSpec


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` whose expert instances (``is_expert``) skip the reduce over a TP group of
    one rank (the same output, not a view of the input: :mod:`module docstring <megarl.models.gpt_oss_layers>`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and self.tp_group.size() == 1:
            self.explicit_expert_comm = True


def config_kwargs(spec: ModelSpec) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a gpt-oss spec (:mod:`megarl.models.gpt_oss`'s list)."""
    kwargs = dict(add_bias_linear=True, softmax_type="learnable", activation_func=quick_gelu,
                  activation_func_clamp_value=SWIGLU_LIMIT, glu_linear_offset=1.0,
                  softmax_scale=rope_attention_factor(spec) ** 2 / spec.head_dim ** 0.5)
    if spec.sliding_window_pattern is not None:
        kwargs.update(window_attn_skip_freq=list(spec.sliding_window_pattern))
    return kwargs


def adapt_layer_spec(layer) -> None:
    """Give the ``SequentialMLP`` experts of megatron-core's local MoE layer spec :class:`ExpertRowParallelLinear`
    as their ``linear_fc2``, in place."""
    moe = layer.submodules.mlp.keywords["submodules"]
    experts = moe.experts
    moe.experts = functools.partial(experts.func, *experts.args, **{
        **experts.keywords,
        "submodules": dataclasses.replace(experts.keywords["submodules"], linear_fc2=ExpertRowParallelLinear)})


def _gate_then_up(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2F]`` with gate and up interleaved (gate ``j`` at ``2j``) -> ``[gate; up]`` (megatron's GLU order)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def reorder_expert_outputs(model) -> None:
    """Make each routed expert's ``linear_fc1`` (its weight and bias rows interleaved as gpt-oss's canonical
    ``gate_up_proj``: :mod:`megarl.models.gpt_oss`) hand megatron's ``MLP`` its output and bias as ``[gate; up]``,
    with a forward hook (LoRA's adapted layer included: its adapter's rows are interleaved too)."""
    for name, module in model.named_modules():
        if ".experts.local_experts." in name and name.endswith(".linear_fc1"):
            module.register_forward_hook(lambda m, args, out: (_gate_then_up(out[0]),
                                                               None if out[1] is None else _gate_then_up(out[1])))
