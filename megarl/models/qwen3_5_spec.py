"""Qwen3.5's (text, ``qwen3_5_text``: ``Qwen3_5ForCausalLM``) fields of a :class:`~megarl.models.spec.ModelSpec`,
read from and written to its Hugging Face config, and its canonical tensors; the Megatron pieces are
:mod:`megarl.models.qwen3_5`'s.

Qwen3.5 / Qwen3-Next (Qwen team, "Qwen3-Next", 2025; transformers' ``models/qwen3_5/modeling_qwen3_5.py``) mixes two
token mixers, three gated DeltaNet layers (linear attention; Yang et al., arXiv 2412.06464) to one gated full-attention
layer (``layer_types``): the full-attention layers' ``q_proj`` yields each head's query and an output gate
(``[q_h; gate_h]`` per head, the output times ``sigmoid(gate)``), with QK-norm and RoPE on the first
``partial_rotary_factor`` of each head's channels; every RMSNorm scales by ``1 + weight`` (Gemma's) but the
DeltaNet's gated output norm. The DeltaNet layer's checkpoint tensors (``linear_attn.``): ``in_proj_qkv`` (rows
``[q; k; v]``, ``2 * hk * dk + hv * dv``), ``in_proj_z`` (the output gate, ``hv * dv``), ``in_proj_b`` (beta) and
``in_proj_a`` (the decay's input), ``hv`` each; ``conv1d.weight`` ``[2 * hk * dk + hv * dv, 1, w]``; ``A_log`` and
``dt_bias`` ``[hv]``; ``norm.weight`` ``[dv]``; ``out_proj`` ``[hidden, hv * dv]``.

Qwen3.5-MoE (``qwen3_5_moe_text``: ``Qwen3_5MoeForCausalLM``) has Qwen3.5's layers and, in place of the dense MLP,
Qwen3-Next's MoE block (its top-k weights always renormalised). Qwen3-Next (``qwen3_next``: ``Qwen3NextForCausalLM``)
is the same stack with a Qwen2-MoE-like block on every layer
(softmax top-k router, a shared expert with a sigmoid gate); its checkpoint fuses the DeltaNet's input projections
by key-head group: ``in_proj_qkvz`` holds, for each key head ``g``, ``[q_g; k_g; v_g; z_g]`` (``dk``, ``dk``,
``hv / hk * dv`` and ``hv / hk * dv`` rows), ``in_proj_ba`` ``[b_g; a_g]`` (``hv / hk`` rows each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike



@dataclass(frozen=True)
class GatedDeltaNetShape:
    """The hybrid stack of a Qwen3.5 model.

    Attributes:
        linear_pattern: per layer, 1 for a gated DeltaNet layer, 0 for a gated full-attention layer (megatron's
            ``linear_attention_freq`` list).
        num_key_heads / num_value_heads: the DeltaNet's query/key heads and value heads (a multiple of them).
        key_head_dim / value_head_dim: channels per key and value head.
        conv_kernel: the causal convolution's width, tokens.
        partial_rotary_factor: the share of a full-attention head's channels RoPE rotates (the first ones).
    """

    linear_pattern: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    partial_rotary_factor: float = 0.25

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


QWEN3_NEXT = "qwen3_next"


def refuse_multimodal(model_type: str | None, archs: list[str]) -> None:
    """Refuse a Qwen3.5 vision-language checkpoint (``Qwen3_5ForConditionalGeneration``, ``qwen3_5`` /
    ``qwen3_5_moe``): its text weights are named ``model.language_model.*`` beside the vision tower."""
    if model_type in ("qwen3_5", "qwen3_5_moe") or any(a.startswith("Qwen3_5") and "Conditional" in a for a in archs):
        raise SpecError(f"a Qwen3.5 vision-language checkpoint (model_type {model_type!r}, {archs}) is not supported; "
                        "megarl trains the text model (Qwen3_5ForCausalLM, model_type 'qwen3_5_text'): save the "
                        "language model with transformers as a Qwen3_5ForCausalLM checkpoint")


def fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`GatedDeltaNetShape` (``gdn``) of a ``qwen3_5_text`` config.

    Raises:
        SpecError: biases on the attention, another activation than SiLU, or a layer type other than
            ``linear_attention`` / ``full_attention``.
    """
    if cfg.get("attention_bias"):
        raise SpecError("attention_bias=True on a qwen3_5_text model is not supported (Qwen3.5 has no biases)")
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise SpecError(f"hidden_act={cfg.get('hidden_act')!r} on a qwen3_5_text model is not supported; use 'silu'")
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("full_attention_interval") or 4) == 0
                                       else "linear_attention" for i in range(cfg["num_hidden_layers"])]
    if set(types) - {"linear_attention", "full_attention"}:
        raise SpecError(f"layer_types {sorted(set(types))}: megarl builds 'linear_attention' (gated DeltaNet) and "
                        "'full_attention' layers only")
    rope, moe = dict(cfg.get("rope_parameters") or {}), {}
    if cfg.get("model_type") == "qwen3_5_moe_text":  # its router always renormalises the top-k weights
        moe = dict(moe_norm_topk_prob=True)
    if rope.get("rope_type", "default") != "default":
        raise SpecError(f"rope_parameters.rope_type={rope['rope_type']!r} on a qwen3_5_text model is not supported; "
                        "megarl runs Qwen3.5's plain (partial) RoPE")
    return dict(**moe, gdn=GatedDeltaNetShape(
        linear_pattern=tuple(int(t == "linear_attention") for t in types),
        num_key_heads=int(cfg["linear_num_key_heads"]), num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]), value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))))


def check(spec: SpecLike) -> None:
    """Refuse an inconsistent Qwen3.5 spec (no ``gdn`` shape, a pattern not one entry per layer, value heads not a
    multiple of key heads, a rotary share that is not a whole even number of channels)."""
    g = spec.gdn
    if g is None:
        raise SpecError(f"a {spec.family} spec needs its gated DeltaNet shape (gdn)")
    if len(g.linear_pattern) != spec.num_layers or set(g.linear_pattern) - {0, 1}:
        raise SpecError(f"gdn.linear_pattern={g.linear_pattern} must hold a 0 or 1 for each of the {spec.num_layers} "
                        "layers")
    if min(g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel) < 1 or \
            g.num_value_heads % g.num_key_heads:
        raise SpecError(f"gdn: linear_num_value_heads={g.num_value_heads} must be a multiple of "
                        f"linear_num_key_heads={g.num_key_heads} (all sizes >= 1)")
    if spec.family == "qwen3_5_moe" and not spec.moe_norm_topk_prob:
        raise SpecError("a qwen3_5_moe model's router renormalises its top-k weights: moe_norm_topk_prob must be True")
    rot = spec.head_dim * g.partial_rotary_factor
    if rot != int(rot) or int(rot) % 2 or rot < 2:
        raise SpecError(f"partial_rotary_factor={g.partial_rotary_factor} of head_dim={spec.head_dim} must rotate a "
                        "whole, even number of channels")


def attention_shapes(spec: SpecLike, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer ``layer``'s token mixer's canonical tensors: the gated DeltaNet's or the gated attention's."""
    g, h = spec.gdn, spec.hidden_size
    if g.linear_pattern[layer]:
        p, conv = f"model.layers.{layer}.linear_attn.", 2 * g.key_dim + g.value_dim
        shapes = {p + "dt_bias": (g.num_value_heads,), p + "A_log": (g.num_value_heads,),
                  p + "conv1d.weight": (conv, 1, g.conv_kernel), p + "norm.weight": (g.value_head_dim,),
                  p + "out_proj.weight": (h, g.value_dim)}
        if spec.family == QWEN3_NEXT:  # fused by key-head group
            return {**shapes, p + "in_proj_qkvz.weight": (conv + g.value_dim, h),
                    p + "in_proj_ba.weight": (2 * g.num_value_heads, h)}
        return {**shapes, p + "in_proj_qkv.weight": (conv, h), p + "in_proj_z.weight": (g.value_dim, h),
                p + "in_proj_b.weight": (g.num_value_heads, h), p + "in_proj_a.weight": (g.num_value_heads, h)}
    p, hd = f"model.layers.{layer}.self_attn.", spec.head_dim
    return {p + "q_proj.weight": (2 * spec.q_size, h), p + "k_proj.weight": (spec.kv_size, h),
            p + "v_proj.weight": (spec.kv_size, h), p + "o_proj.weight": (h, spec.q_size),
            p + "q_norm.weight": (hd,), p + "k_norm.weight": (hd,)}


def presets(spec_cls) -> dict[str, SpecLike]:
    """Named Qwen3.5 shapes: Qwen/Qwen3.5-27B's text model (64 layers, every 4th gated full attention with 24 query
    heads and 4 KV heads of 256 channels, a quarter of them rotated; the DeltaNet layers 16 key heads and 48 value
    heads of 128 channels) and Qwen/Qwen3-Next-80B-A3B-Instruct (48 layers of 512 experts, top 10, width 512, and a
    shared expert of 512; 16 query heads and 2 KV heads of 256 channels; DeltaNet 16 key and 32 value heads of 128).
    Sources: tests/test_presets.py."""
    next_pattern = tuple(int(i % 4 != 3) for i in range(48))
    # transformers Qwen3NextConfig defaults = Qwen3-Next-80B-A3B but intermediate_size (5632 there; 5120, unused: no
    # dense MLP, in copies of the Instruct config.json), rope_theta and context (those copies); token ids unchecked
    return {"qwen3-next-80b-a3b": spec_cls(
        QWEN3_NEXT, 151936, 2048, 48, 16, 2, 256, 5120, rope_theta=1e7, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=262144, bos_token_id=151643, eos_token_ids=(151645,),
        pad_token_id=151643, num_experts=512, moe_top_k=10, moe_ffn_hidden_size=512,
        shared_expert_ffn_hidden_size=512, moe_norm_topk_prob=True, moe_aux_loss_coef=0.001,
        gdn=GatedDeltaNetShape(next_pattern, 16, 32, 128, 128)),
        # a copy of Qwen3.5-27B's text_config in a public repository (transformers' defaults are another size);
        # eos is the text_config's 248044 (the multimodal config's top level says 248046)
        "qwen3.5-27b": spec_cls(
        "qwen3_5", 248320, 5120, 64, 24, 4, 256, 17408, rope_theta=1e7, rms_norm_eps=1e-6,
        tie_word_embeddings=False, max_position_embeddings=262144, eos_token_ids=(248044,), pad_token_id=248044,
        gdn=GatedDeltaNetShape(tuple(int(i % 4 != 3) for i in range(64)), 16, 48, 128, 128))}


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The ``Qwen3_5TextConfig`` arguments of a Qwen3.5 spec beyond the common ones."""
    g = spec.gdn
    moe = dict(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size, decoder_sparse_step=1,
               shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size, mlp_only_layers=[],
               norm_topk_prob=spec.moe_norm_topk_prob) if spec.family == QWEN3_NEXT else {}
    if spec.family == "qwen3_5_moe":
        moe = dict(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                   shared_expert_intermediate_size=spec.shared_expert_ffn_hidden_size)
    return dict(**moe, layer_types=["linear_attention" if x else "full_attention" for x in g.linear_pattern],
                linear_num_key_heads=g.num_key_heads, linear_num_value_heads=g.num_value_heads,
                linear_key_head_dim=g.key_head_dim, linear_value_head_dim=g.value_head_dim,
                linear_conv_kernel_dim=g.conv_kernel, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                 "partial_rotary_factor": g.partial_rotary_factor})
