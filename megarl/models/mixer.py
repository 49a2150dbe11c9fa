"""A layer's token mixer's canonical (Hugging Face) tensors, the one choice of which family describes them:
DeepSeek-V3's multi-latent attention (:func:`megarl.models.deepseek_spec.attention_shapes`), Qwen3.5's gated DeltaNet
or gated attention (:func:`megarl.models.qwen3_5_spec.attention_shapes`), else the q/k/v/o projections. Parameter
counts (:mod:`megarl.measure.flops`, :mod:`megarl.launch.memory`) and the checkpoint layout
(:meth:`megarl.models.spec.ModelSpec.hf_tensor_shapes`) read it."""

from __future__ import annotations

from megarl.models import deepseek_spec, qwen3_5_spec
from megarl.models.spec_protocol import SpecLike


def attention_shapes(spec: SpecLike, layer: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of layer ``layer``'s attention tensors (``spec`` a :class:`~megarl.models.spec.ModelSpec`).

    MLA and Qwen3.5 (``spec.mla`` or ``spec.gdn`` set): every tensor of the mixer, norms (1-D) and the DeltaNet's
    conv1d (3-D) included. Any other family: the projection matrices only, ``q_proj`` ``(q, h)``, ``k_proj`` and
    ``v_proj`` ``(kv, h)`` (Phi-3's fused ``qkv_proj`` ``(q + 2 kv, h)``) and ``o_proj`` ``(h, q)``, with
    ``q = heads * head_dim``, ``kv = kv_heads * head_dim``; their biases, QK-norms and gpt-oss's sinks are not here.
    """
    if spec.mla is not None:
        return deepseek_spec.attention_shapes(spec, layer)
    if spec.gdn is not None:
        return qwen3_5_spec.attention_shapes(spec, layer)
    p, h, q, kv = f"model.layers.{layer}.self_attn.", spec.hidden_size, spec.q_size, spec.kv_size
    qkv = ({p + "qkv_proj.weight": (q + 2 * kv, h)} if spec.fused_qkv_mlp else
           {p + "q_proj.weight": (q, h), p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h)})
    return {**qkv, p + "o_proj.weight": (h, q)}
