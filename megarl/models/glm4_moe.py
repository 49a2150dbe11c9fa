"""The GLM-4.5 family (``Glm4MoeForCausalLM``, model_type ``glm4_moe``; GLM-4.5, GLM-4.5-Air, GLM-4.6): grouped-query
attention with partial rotary embeddings and DeepSeek-V3's mixture of experts.

Read in transformers 5's ``models/glm4_moe/modeling_glm4_moe.py`` and vLLM 0.24.0's ``models/glm4_moe.py``
(2026-12-06); Zhipu AI, "GLM-4.5: Agentic, Reasoning, and Coding (ARC) Foundation Models", arXiv 2508.06471:

- attention: Llama's GQA with a bias on q/k/v (``attention_bias``; none on ``o_proj``), an optional RMSNorm of every
  query and key head before RoPE (``use_qk_norm``: GLM-4.5 has it, GLM-4.5-Air not), and RoPE on the first
  ``head_dim * partial_rotary_factor`` channels of each head only (rotate-half pairs; the rest pass through;
  ``partial_rotary_factor`` 0.5 when the config has none, as both transformers and vLLM default). megatron-core
  runs it as ``GPTModel(rotary_percent=partial_rotary_factor)``, its ``add_qkv_bias`` and ``qk_layernorm``;
- the MoE: :mod:`megarl.models.deepseek_moe`'s (sigmoid routing with ``e_score_correction_bias``, group top-k,
  ``routed_scaling_factor``, shared experts, the first ``first_k_dense_replace`` layers dense, the multi-token
  prediction layers dropped on import), in the checkpoint's names (``mlp.gate``, ``mlp.experts.{e}.gate_proj``,
  ``mlp.shared_experts``) and built on megatron-core by :mod:`megarl.models.deepseek_moe_layers`.

LoRA adapts Llama's targets: q/k/v, o, the dense first layers' MLP and the MoE layers' ``shared_experts`` (the routed
experts with ``lora.experts``). Router replay is refused until it is compared with transformers on this family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from megarl.models import deepseek_moe
from megarl.models.deepseek_moe import DeepSeekMoE
from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike

S = TypeVar("S", bound=SpecLike)

FAMILY = "glm4_moe"
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig.__post_init__'s and vLLM's Glm4MoeAttention's default


@dataclass(frozen=True)
class GLMAttention:
    """What a GLM-4.5 model's attention adds to a :class:`~megarl.models.spec.ModelSpec` (its ``glm`` field).

    Attributes:
        attention_bias: q/k/v carry a bias (``attention_bias``; o_proj never).
        qk_norm: RMSNorm of every query and key head (``use_qk_norm``; ``q_norm`` / ``k_norm`` ``[head_dim]``).
        partial_rotary_factor: the share of a head's channels RoPE rotates (the first ones).
    """

    attention_bias: bool = True
    qk_norm: bool = False
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR

    def rotary_dim(self, head_dim: int) -> int:
        """The channels of a head RoPE rotates: ``int(head_dim * partial_rotary_factor)`` (transformers' and
        megatron-core's rounding)."""
        return int(head_dim * self.partial_rotary_factor)


def fields_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~megarl.models.spec.ModelSpec` fields of a ``glm4_moe`` config beyond the common ones (its MoE's:
    :func:`megarl.models.deepseek_moe.fields_from_hf`, and :class:`GLMAttention`).

    Raises:
        SpecError: a RoPE scaling (GLM-4.5 has none: megarl runs plain RoPE on this family), or the MoE's.
    """
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise SpecError(f"rope_scaling.rope_type={rope_type!r} on a glm4_moe model is not supported (GLM-4.5's "
                        "released configs have plain RoPE); use rope_scaling=null")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return dict(glm=GLMAttention(attention_bias=bool(cfg.get("attention_bias", False)),
                                 qk_norm=bool(cfg.get("use_qk_norm", False)),
                                 partial_rotary_factor=float(DEFAULT_PARTIAL_ROTARY_FACTOR if partial is None
                                                             else partial)),
                **deepseek_moe.fields_from_hf(FAMILY, cfg))


def check(spec: SpecLike) -> None:
    """Validate a GLM-4.5 spec's own fields (:meth:`ModelSpec.__post_init__`).

    Raises:
        SpecError: no ``glm`` on this family, or one on another; a rotary share outside ``(0, 1]`` or rotating an
            odd number of channels; a RoPE scaling.
    """
    g = spec.glm
    if (g is None) != (spec.family != FAMILY):
        raise SpecError(f"the glm field (GLMAttention) belongs to {FAMILY} specs, and a {FAMILY} spec needs it; "
                        f"family={spec.family!r}, glm={g}")
    if g is None:
        return
    rot = g.rotary_dim(spec.head_dim)
    if not 0 < g.partial_rotary_factor <= 1 or rot < 2 or rot % 2:
        raise SpecError(f"glm.partial_rotary_factor={g.partial_rotary_factor} must be in (0, 1] and rotate an even "
                        f"number >= 2 of the head's {spec.head_dim} channels (got {rot})")
    if spec.rope_scaling:
        raise SpecError(f"rope_scaling={spec.rope_scaling}: a glm4_moe model runs plain RoPE")


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The ``Glm4MoeConfig`` arguments of a spec beyond the common ones (no multi-token prediction layer)."""
    g = spec.glm
    return dict(attention_bias=g.attention_bias, use_qk_norm=g.qk_norm, partial_rotary_factor=g.partial_rotary_factor,
                rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                 "partial_rotary_factor": g.partial_rotary_factor},
                **deepseek_moe.hf_config_kwargs(spec))


def presets(model_spec: Callable[..., S]) -> dict[str, S]:
    """Named GLM-4.5 shapes (:data:`megarl.models.spec.PRESETS`): zai-org/GLM-4.5 (355B, 32B active: 92 layers, the
    first 3 dense, 160 experts, QK-norm) and zai-org/GLM-4.5-Air (106B, 12B active: 46 layers, the first dense, 128
    experts, no QK-norm); both have 96 query and 8 KV heads of 128 channels, half of them rotated, q/k/v biases, one
    shared expert, top-8 routing in one group and one MTP layer (dropped). Sources: tests/test_presets.py."""
    def spec(hidden, layers, ffn, *, experts, moe_ffn, first_dense, scaling, qk_norm) -> S:
        return model_spec(FAMILY, 151552, hidden, layers, 96, 8, 128, ffn, rope_theta=1e6, rms_norm_eps=1e-5,
                          tie_word_embeddings=False, max_position_embeddings=131072,
                          eos_token_ids=(151329, 151336, 151338), pad_token_id=151329, num_experts=experts,
                          moe_top_k=8, moe_ffn_hidden_size=moe_ffn, shared_expert_ffn_hidden_size=moe_ffn,
                          deepseek_moe=DeepSeekMoE(first_k_dense=first_dense, routed_scaling_factor=scaling,
                                                   mtp_layers=1),
                          glm=GLMAttention(attention_bias=True, qk_norm=qk_norm, partial_rotary_factor=0.5))

    # glm-4.5: THUDM slime's scripts/models/glm4.5-355B-A32B.sh (its Megatron arguments); its token ids (as the
    # Air's) not checked offline. glm-4.5-air: transformers Glm4MoeConfig defaults = GLM-4.5-Air, and a dump of its
    # config.json (attention_bias, head_dim, rope_theta, token ids) in a public repository
    return {"glm-4.5": spec(5120, 92, 12288, experts=160, moe_ffn=1536, first_dense=3, scaling=2.5, qk_norm=True),
            "glm-4.5-air": spec(4096, 46, 10944, experts=128, moe_ffn=1408, first_dense=1, scaling=1.0,
                                qk_norm=False)}
