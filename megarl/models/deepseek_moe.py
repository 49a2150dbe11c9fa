"""The DeepSeek-V3-style mixture of experts, shared by the families that route so: DeepSeek-V3
(:mod:`megarl.models.deepseek_spec`; Moonlight, Kimi K2) and GLM-4.5 (:mod:`megarl.models.glm4_moe`).

The MoE block (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437, section 2.1.2, eqs. 12-16): the
router's sigmoid scores ``s``, the top ``topk_group`` of ``n_group`` groups by the sum of their two best ``s + b``
(``b``: the expert score-correction bias ``gate.e_score_correction_bias``), the top ``num_experts_per_tok`` experts
of those by ``s + b``, weighted by their ``s`` renormalised (``norm_topk_prob``) times ``routed_scaling_factor``;
plus ``n_shared_experts`` shared experts as one SwiGLU MLP of width ``n_shared_experts * moe_intermediate_size``
(``mlp.shared_experts``, no gate). The first ``first_k_dense_replace`` layers have a dense MLP of width
``intermediate_size`` instead.

Multi-token prediction layers (``num_nextn_predict_layers``) are dropped on import: the causal LM (transformers'
model, what RL trains) never runs them, and vLLM uses them only as a speculative-decoding draft;
:attr:`DeepSeekMoE.mtp_layers` records how many the checkpoint had. The score-correction bias is not trained (RL
keeps the routing vLLM serves; megatron's aux-loss-free bias update is off). The megatron-core side:
:mod:`megarl.models.deepseek_moe_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike



@dataclass(frozen=True)
class DeepSeekMoE:
    """What a DeepSeek-V3-style MoE adds to a :class:`~megarl.models.spec.ModelSpec` (its ``deepseek_moe`` field).

    Attributes:
        first_k_dense: the first layers with a dense MLP (``first_k_dense_replace``).
        n_group / topk_group: the router picks experts from the ``topk_group`` best of ``n_group`` groups.
        routed_scaling_factor: the routed experts' weights are multiplied by it.
        mtp_layers: multi-token prediction layers the checkpoint had (``num_nextn_predict_layers``; dropped).
    """

    first_k_dense: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    mtp_layers: int = field(default=0, compare=False)


def fields_from_hf(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a :class:`~megarl.models.spec.ModelSpec` from a ``deepseek_v3`` or ``glm4_moe`` config.

    Raises:
        SpecError: what megatron-core would compute differently from transformers and vLLM: an activation other
            than SiLU, routing without renormalised top-k weights, group scores megatron sums differently.
    """
    if cfg.get("hidden_act", "silu") != "silu":
        raise SpecError(f"hidden_act={cfg['hidden_act']!r} on a {family} model is not supported; its MLPs are SwiGLU")
    if not cfg.get("norm_topk_prob", True):
        raise SpecError(f"norm_topk_prob=False on a {family} model is not supported (megatron-core renormalises "
                        "sigmoid top-k weights always); use a checkpoint with norm_topk_prob=True")
    experts, top_k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if n_group > 1 and (experts % n_group or top_k // topk_group != 2):
        raise SpecError(f"n_group={n_group}, topk_group={topk_group}, num_experts_per_tok={top_k}: megatron-core "
                        "scores a group by its top num_experts_per_tok // topk_group experts and transformers by its "
                        "top 2, which agree when that is 2 (DeepSeek-V3: 8 // 4); use n_group=1 or such a config")
    return dict(
        num_experts=experts,
        moe_top_k=top_k,
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        shared_expert_ffn_hidden_size=int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"]),
        moe_norm_topk_prob=True,
        deepseek_moe=DeepSeekMoE(first_k_dense=int(cfg.get("first_k_dense_replace") or 0), n_group=n_group,
                                 topk_group=topk_group,
                                 routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                                 mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0)),
    )


def check(spec: SpecLike) -> None:
    """Validate a DeepSeek-V3-style MoE spec's own fields (:meth:`ModelSpec.__post_init__`).

    Raises:
        SpecError: no ``deepseek_moe`` on a family that routes so, a dense first layer count outside
            ``[0, num_layers)``, or groups that do not split the experts.
    """
    m = spec.deepseek_moe
    if m is None:
        raise SpecError(f"a {spec.family} spec needs its MoE fields (deepseek_moe=DeepSeekMoE(...))")
    if not 0 <= m.first_k_dense < spec.num_layers:
        raise SpecError(f"deepseek_moe.first_k_dense={m.first_k_dense} must be in [0, num_layers={spec.num_layers})")
    if spec.num_experts % m.n_group or not 1 <= m.topk_group <= m.n_group:
        raise SpecError(f"deepseek_moe.n_group={m.n_group} must divide num_experts={spec.num_experts} and "
                        f"topk_group={m.topk_group} be in [1, n_group]")


def is_moe_layer(spec: SpecLike, layer: int) -> bool:
    """Whether decoder layer ``layer`` has the MoE block (any MoE model's, but the first ``first_k_dense`` layers of
    a DeepSeek-V3-style one)."""
    return spec.is_moe and layer >= (spec.deepseek_moe.first_k_dense if spec.deepseek_moe is not None else 0)


def moe_extra_shapes(spec: SpecLike, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer ``layer``'s router score-correction bias ``[experts]`` and shared experts (one SwiGLU MLP)."""
    h, s, p = spec.hidden_size, spec.shared_expert_ffn_hidden_size, f"model.layers.{layer}.mlp."
    shapes: dict[str, tuple[int, ...]] = {p + "gate.e_score_correction_bias": (spec.num_experts,)}
    if s:
        shapes.update({p + "shared_experts.gate_proj.weight": (s, h), p + "shared_experts.up_proj.weight": (s, h),
                       p + "shared_experts.down_proj.weight": (h, s)})
    return shapes


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The config arguments of a spec's MoE (``DeepseekV3Config``, ``Glm4MoeConfig``; no multi-token prediction
    layer)."""
    m = spec.deepseek_moe
    return dict(n_routed_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                n_shared_experts=spec.shared_expert_ffn_hidden_size // spec.moe_ffn_hidden_size,
                first_k_dense_replace=m.first_k_dense, n_group=m.n_group, topk_group=m.topk_group,
                routed_scaling_factor=m.routed_scaling_factor, norm_topk_prob=True, num_nextn_predict_layers=0)
