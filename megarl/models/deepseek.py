"""DeepSeek-V3 (:mod:`megarl.models.deepseek_spec`) on megatron-core 0.19.2's own modules.

- attention: megatron's ``MLASelfAttention`` (``MLATransformerConfig``; local spec: the down projections
  ``linear_q_down_proj`` / ``linear_kv_down_proj`` column-parallel and gathered, ``q_layernorm`` / ``kv_layernorm``
  the a-projection norms, ``linear_q_up_proj`` / ``linear_q_proj`` and ``linear_kv_up_proj`` split by heads over TP;
  its own RoPE, interleaved pairs, plain or YaRN, with YaRN's softmax scale);
- routing: megatron's sigmoid ``TopKRouter`` (through :class:`~megarl.models.moe_router.GlobalBatchRouter`) with the
  expert bias (``router.expert_bias``: HF's ``e_score_correction_bias``, a frozen float32 parameter so the layouts
  carry it; megatron's aux-loss-free update is off), group-limited top-k, renormalised top-k weights times
  ``routed_scaling_factor``; the shared experts as megatron's ``SharedExpertMLP`` without a gate;
- the first ``first_k_dense`` layers with a dense MLP (megatron's ``moe_layer_freq`` list), the layer specs of this
  rank's stage picked per layer (:func:`block_spec`).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megarl.models.deepseek_spec import is_moe_layer
from megarl.models.spec import ModelSpec, SpecError


def config_kwargs(spec: ModelSpec) -> dict:
    """The ``MLATransformerConfig`` fields of a DeepSeek-V3 spec beyond the common ones (the MoE ones of
    :func:`megarl.models.megatron.moe_config_kwargs` are replaced where DeepSeek-V3 routes differently)."""
    m, rope = spec.mla, dict(spec.rope_scaling or {})
    kwargs = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  qk_layernorm=True, rotary_base=spec.rope_theta, rope_type="rope", rotary_scaling_factor=1.0,
                  moe_layer_freq=[int(is_moe_layer(spec, i)) for i in range(spec.num_layers)],
                  moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                  moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0,
                  moe_router_topk_scaling_factor=m.routed_scaling_factor,
                  moe_router_num_groups=m.n_group if m.n_group > 1 else None,
                  moe_router_group_topk=m.topk_group if m.n_group > 1 else None,
                  moe_shared_expert_gate=False)
    if spec.shared_expert_ffn_hidden_size:
        kwargs.update(moe_shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size,
                      moe_shared_expert_overlap=False)
    if rope.get("rope_type") == "yarn":
        kwargs.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                      original_max_position_embeddings=int(rope.get("original_max_position_embeddings")
                                                            or spec.max_position_embeddings),
                      beta_fast=float(rope.get("beta_fast", 32.0)), beta_slow=float(rope.get("beta_slow", 1.0)),
                      mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    return kwargs


def check_layout(spec: ModelSpec, tp: int, cp: int) -> None:
    """Refuse what megatron's MLA cannot shard or run on a layout.

    Raises:
        SpecError: a TP size that does not divide the column-parallel down projections' outputs (``q_lora_rank``,
            ``kv_lora_rank + qk_rope_head_dim``) or the dense layers' ``intermediate_size``; CP > 1.
    """
    m = spec.mla
    for name, size in (("q_lora_rank", m.q_lora_rank or 0), ("kv_lora_rank + qk_rope_head_dim",
                                                             m.kv_lora_rank + m.qk_rope_head_dim),
                       ("intermediate_size (the dense layers')", spec.ffn_hidden_size if m.first_k_dense else 0)):
        if size % tp:
            raise SpecError(f"tp={tp} does not divide {name}={size}: megatron-core's MLA splits it over TP")
    if cp > 1:
        raise SpecError(f"cp={cp}: megarl runs DeepSeek-V3's multi-latent attention without context parallelism "
                        "(its MoE layers need cp=1 as every mixture of experts does); set cp=1")


class LocalMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` building the local spec's projections and norms as the spec gives them.

    megatron-core 0.19.2 resolves MLA's norms so that without a query latent (``q_lora_rank`` None, Moonlight's
    shape) ``linear_q_proj`` must be a fused norm + linear, which only Transformer Engine has: the local spec cannot
    build it. There is no query norm then (HF: ``q_proj`` on the input-normed hidden state), so the spec's plain
    ``linear_q_proj`` is what is meant."""

    def _resolve_qk_norm_config(self, submodules) -> dict:
        return {name: getattr(submodules, name) for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj",
                                                             "q_layernorm", "kv_layernorm")}


def adapt_layer_spec(layer, spec: ModelSpec) -> None:
    """Make megatron-core's local MLA layer spec (``get_gpt_layer_local_spec(multi_latent_attention=True,
    qk_layernorm=True)``) megarl's, in place: :class:`LocalMLASelfAttention`, no query norm without a query latent,
    and :class:`~megarl.kernels.attention.SDPAttention` as the core attention (megatron's local
    ``DotProductAttention`` takes no ``k_channels`` / ``v_channels``: MLA's value heads are narrower than its
    query/key heads)."""
    from megatron.core.transformer.identity_op import IdentityOp

    from megarl.kernels.attention import SDPAttention

    attn = layer.submodules.self_attention
    attn.module = LocalMLASelfAttention
    attn.submodules.core_attention = SDPAttention
    if spec.mla.q_lora_rank is None:
        attn.submodules.q_layernorm = IdentityOp


def block_spec(moe_layer, config, vp_stage: int | None, spec: ModelSpec):
    """The transformer block of this rank's stage (chunk ``vp_stage``): ``moe_layer`` (the MoE layer's spec,
    :func:`megarl.models.megatron.layer_spec`) on MoE layers, a copy with a dense MLP (megatron's own, from the
    local spec, with ``moe_layer``'s LoRA adapters if any) on the first ``first_k_dense`` layers."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    dense = copy.deepcopy(moe_layer)
    dense.submodules.mlp = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.mlp
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
