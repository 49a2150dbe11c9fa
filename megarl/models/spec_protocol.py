"""What a family module reads of a model description: :class:`SpecLike`, the fields and methods of
:class:`megarl.models.spec.ModelSpec` that the family modules (:mod:`~megarl.models.deepseek_spec`,
:mod:`~megarl.models.deepseek_moe`, :mod:`~megarl.models.glm4_moe`, :mod:`~megarl.models.gemma3_spec`,
:mod:`~megarl.models.gpt_oss`, :mod:`~megarl.models.qwen3_5_spec`, :mod:`~megarl.models.qwen3_phi3_spec`,
:mod:`~megarl.models.mixer`) take, so that they annotate their ``spec`` arguments without importing
:mod:`megarl.models.spec`, which imports them (its methods call their hooks; imports run one way)."""

from __future__ import annotations

from typing import Any, Protocol


class SpecLike(Protocol):
    """A :class:`~megarl.models.spec.ModelSpec` as the family modules see it (see its attributes for the meaning
    and units of each; ``mla``: a :class:`~megarl.models.deepseek_spec.MLA` or None)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    sliding_window: int | None
    num_experts: int
    moe_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int
    sliding_window_pattern: tuple[int, ...] | None
    local_rope_theta: float | None
    query_pre_attn_scalar: int | None
    mla: Any
    deepseek_moe: Any
    glm: Any
    gdn: Any

    @property
    def is_moe(self) -> bool: ...

    @property
    def q_size(self) -> int: ...

    @property
    def kv_size(self) -> int: ...

    @property
    def fused_qkv_mlp(self) -> bool: ...

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def to_hf_config(self) -> Any: ...
