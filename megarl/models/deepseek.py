"""DeepSeek-V3 (:mod:`megarl.models.deepseek_spec`) on megatron-core 0.19.2's own modules.

- attention: megatron's ``MLASelfAttention`` (``MLATransformerConfig``; local spec: the down projections
  ``linear_q_down_proj`` / ``linear_kv_down_proj`` column-parallel and gathered, ``q_layernorm`` / ``kv_layernorm``
  the a-projection norms, ``linear_q_up_proj`` / ``linear_q_proj`` and ``linear_kv_up_proj`` split by heads over TP;
  its own RoPE, interleaved pairs, plain or YaRN, with YaRN's softmax scale);
- the MoE (routing, shared experts, dense first layers): :mod:`megarl.models.deepseek_moe_layers`, GLM-4.5's too.
"""

from __future__ import annotations

from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megarl.models.spec import ModelSpec, SpecError


def config_kwargs(spec: ModelSpec) -> dict:
    """The ``MLATransformerConfig`` fields of a DeepSeek-V3 spec's attention (its MoE's:
    :func:`megarl.models.deepseek_moe_layers.config_kwargs`)."""
    m, rope = spec.mla, dict(spec.rope_scaling or {})
    kwargs = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  qk_layernorm=True, rotary_base=spec.rope_theta, rope_type="rope", rotary_scaling_factor=1.0)
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
            ``kv_lora_rank + qk_rope_head_dim``); CP > 1.
    """
    m = spec.mla
    for name, size in (("q_lora_rank", m.q_lora_rank or 0), ("kv_lora_rank + qk_rope_head_dim",
                                                             m.kv_lora_rank + m.qk_rope_head_dim)):
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
