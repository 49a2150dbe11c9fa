"""Qwen3 dense and Phi-3/Phi-4 (issue 43): what their configs may hold that megarl refuses, and their own config
arguments (the families: :data:`megarl.models.spec.FAMILIES`)."""

from __future__ import annotations

from typing import Any

from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike


_LONGROPE = ("longrope", "su", "yarn")  # Phi3Config names LongRoPE "longrope" (and maps "su"/"yarn" to it)


def check(family: str, cfg: dict[str, Any]) -> None:
    """Refuse the Qwen3 / Phi-3 configs megarl cannot build: Q/K/V biases (``attention_bias``), Phi-3's LongRoPE
    (Phi-3-mini-128k, Phi-3.5, Phi-4-mini: short and long factors picked by the sequence's length and an attention
    scale, which megatron-core's one-frequency-table ``RotaryEmbedding`` cannot express) and partial rotary
    embeddings (``partial_rotary_factor`` < 1).

    Raises:
        SpecError: naming the field, what is wrong and the fix.
    """
    if cfg.get("attention_bias"):
        raise SpecError(f"attention_bias=True on a {family} model is not supported (its q/k/v projections have no "
                        "bias in the released checkpoints)")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if family == "phi3" and rope_type in _LONGROPE:
        raise SpecError(f"rope_scaling.rope_type={rope_type!r}: Phi-3's LongRoPE (Phi-3-mini-128k, Phi-3.5, "
                        "Phi-4-mini) switches between short and long frequency factors by the sequence's length and "
                        "scales attention, which megatron-core's RotaryEmbedding cannot express; use a checkpoint "
                        "with plain RoPE (Phi-3-mini-4k, Phi-3-medium-4k, Phi-4)")
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise SpecError(f"partial_rotary_factor={partial}: megarl rotates every channel of a head (a {family} "
                        "model with partial_rotary_factor=1.0)")


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The family-specific ``Qwen3Config`` / ``Phi3Config`` arguments of a spec (:meth:`ModelSpec.to_hf_config`)."""
    if spec.family == "qwen3":
        return dict(attention_bias=False, use_sliding_window=False, sliding_window=None)
    return dict(sliding_window=spec.sliding_window, original_max_position_embeddings=spec.max_position_embeddings,
                resid_pdrop=0.0, embd_pdrop=0.0)
