"""DeepSeek-V3's mixture of experts (:mod:`megarl.models.deepseek_moe`; DeepSeek-V3, GLM-4.5) on megatron-core 0.19.2's
own modules.

- routing: megatron's sigmoid ``TopKRouter`` (through :class:`~megarl.models.moe_router.GlobalBatchRouter`) with the
  expert bias (``router.expert_bias``: HF's ``e_score_correction_bias``, a frozen float32 parameter so the layouts
  carry it; megatron's aux-loss-free update is off), logits in float32 (as transformers' and vLLM's routers compute
  them, whatever the model dtype), group-limited top-k, renormalised top-k weights times
  ``routed_scaling_factor``; the shared experts as megatron's ``SharedExpertMLP`` without a gate;
- the first ``first_k_dense`` layers with a dense MLP (megatron's ``moe_layer_freq`` list), the layer specs of this
  rank's stage picked per layer (:func:`block_spec`).
"""

from __future__ import annotations

import copy

import torch

from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.lora import LoRASpec, adapt_layer_spec
from megarl.models.spec import ModelSpec


def config_kwargs(spec: ModelSpec) -> dict:
    """The ``TransformerConfig`` fields of a DeepSeek-V3-style MoE (they replace those of
    :func:`megarl.models.megatron.moe_config_kwargs` where it routes differently)."""
    m = spec.deepseek_moe
    kwargs = dict(moe_layer_freq=[int(is_moe_layer(spec, i)) for i in range(spec.num_layers)],
                  moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                  moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                  moe_router_topk_scaling_factor=m.routed_scaling_factor,
                  moe_router_num_groups=m.n_group if m.n_group > 1 else None,
                  moe_router_group_topk=m.topk_group if m.n_group > 1 else None,
                  moe_shared_expert_gate=False, moe_router_dtype="fp32")
    if spec.shared_expert_ffn_hidden_size:
        kwargs.update(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                      moe_shared_expert_overlap=False)
    return kwargs


def block_spec(moe_layer, config, vp_stage: int | None, spec: ModelSpec, lora: LoRASpec | None = None):
    """The transformer block of this rank's stage (chunk ``vp_stage``): ``moe_layer`` (the MoE layer's spec,
    :func:`megarl.models.megatron.layer_spec`) on MoE layers, a copy with a dense MLP (megatron's own, from the
    local spec, with ``lora``'s adapters if any: :func:`megarl.models.lora.adapt_layer_spec`) on the first
    ``first_k_dense`` layers."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = copy.deepcopy(moe_layer)
    dense.submodules.mlp = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp
    if lora is not None:
        adapt_layer_spec(dense, lora, use_te=False)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = [moe_layer if is_moe_layer(spec, offset + j) else dense
              for j in range(get_num_layers_to_build(config, vp_stage=vp_stage))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LNImpl)


def freeze_expert_bias(model) -> None:
    """Make every router's ``expert_bias`` buffer (megatron keeps it in float32) a frozen float32 parameter named
    the same, so the layouts load, save and reshard it as HF's ``e_score_correction_bias``; megatron's
    aux-loss-free update skips it (``frozen_expert_bias``)."""
    for module in model.modules():
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor) and not isinstance(bias, torch.nn.Parameter):
            del module._buffers["expert_bias"]
            module.expert_bias = torch.nn.Parameter(bias.float(), requires_grad=False)
            module.frozen_expert_bias = True
