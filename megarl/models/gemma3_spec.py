"""Gemma 3's (text, ``gemma3_text``) fields of a :class:`~megarl.models.spec.ModelSpec`, read from and written to its
Hugging Face config; the Megatron pieces are :mod:`megarl.models.gemma3`'s."""

from __future__ import annotations

from typing import Any

from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike


def _error(message: str) -> SpecError:
    return SpecError(message)


def refuse_multimodal(model_type: str | None, archs: list[str]) -> None:
    """Refuse a Gemma 3 vision-language checkpoint (``Gemma3ForConditionalGeneration``, model_type ``gemma3``):
    its text weights are named ``model.language_model.*`` (``language_model.model.*`` before transformers 5) beside
    the vision tower, and its config nests the text model's."""
    if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in archs:
        raise _error("a Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration, model_type 'gemma3') is "
                        "not supported; megarl trains the text model (Gemma3ForCausalLM, model_type 'gemma3_text'): "
                        "use a text-only checkpoint (google/gemma-3-1b-*), or save the language model with "
                        "transformers as a Gemma3ForCausalLM checkpoint")


def fields_from_hf(cfg: dict[str, Any]) -> tuple[float, dict | None, int | None, dict[str, Any]]:
    """The global RoPE base and scaling, the sliding window (kept when as long as the context: the local layers
    still have their own RoPE base; None without local layers) and the Gemma 3 fields of a :class:`ModelSpec`, from
    a ``gemma3_text`` config: ``layer_types`` (or the older ``sliding_window_pattern``, default 6: every 6th layer
    global), ``rope_parameters`` per layer type (transformers 5) or ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq`` (older config.json files), ``query_pre_attn_scalar``.

    Raises:
        SpecError: what megarl does not run: logit soft-capping (Gemma 2's; Gemma 3 has none), bidirectional
            attention, biases, another activation than GELU-tanh, scaled RoPE on the local layers, local layers
            without a ``sliding_window``.
    """
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise _error(f"{key}={cfg[key]} on a gemma3_text model is not supported (Gemma 3 checkpoints set "
                            f"none); set {key}=null in config.json")
    if cfg.get("use_bidirectional_attention") or cfg.get("attention_bias"):
        raise _error("use_bidirectional_attention or attention_bias on a gemma3_text model is not supported; "
                        "megarl trains causal Gemma 3 decoders without biases")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise _error(f"hidden_activation={act!r} on a gemma3_text model is not supported; Gemma 3's MLP is "
                        "GeGLU with 'gelu_pytorch_tanh'")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern") or 6) == 0
                                       else "sliding_attention" for i in range(layers)]
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        glob, local = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
    else:
        glob = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 1e6))
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    if local.get("rope_type", "default") != "default":
        raise _error(f"a scaled RoPE on Gemma 3's local layers ({local}) is not supported; megarl scales the "
                        "global layers' RoPE only")
    theta = float(glob.pop("rope_theta", 1e6))
    glob.pop("type", None)
    if glob.get("rope_type", "default") == "default":
        glob = {}
    pattern = tuple(int(t == "sliding_attention") for t in types)
    window = cfg.get("sliding_window") if any(pattern) else None
    if any(pattern) and not window:
        raise _error(f"a gemma3_text config with local layers (layer_types {types}) needs a sliding_window")
    return theta, glob or None, window, dict(
        sliding_window_pattern=pattern if any(pattern) else None,
        local_rope_theta=float(local.get("rope_theta", 1e4)),
        query_pre_attn_scalar=int(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]))


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The ``Gemma3TextConfig`` arguments of a Gemma 3 spec beyond the common ones."""
    pattern = spec.sliding_window_pattern or (1 if spec.sliding_window else 0,) * spec.num_layers
    glob = {"rope_type": "default", "rope_theta": spec.rope_theta, **(spec.rope_scaling or {})}
    return dict(hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=spec.query_pre_attn_scalar or spec.head_dim,
                sliding_window=spec.sliding_window or spec.max_position_embeddings,
                layer_types=["sliding_attention" if w else "full_attention" for w in pattern],
                rope_parameters={"full_attention": glob, "sliding_attention": {
                    "rope_type": "default", "rope_theta": spec.local_rope_theta or spec.rope_theta}},
                final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False)
