"""Model classes megarl adds to vLLM 0.24.0's registry (``vllm.ModelRegistry.register_model``, vLLM's interface for
models outside its tree): the architectures vLLM builds only inside another class.
:class:`~megarl.rollout.vllm_engine.VLLMRolloutEngine` calls :func:`register` before it starts vLLM; vLLM is imported
only there, for an architecture of :data:`ARCHITECTURES`.

Qwen3.5, dense and MoE, text only (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``: the transformers classes of
``qwen3_5_text`` / ``qwen3_5_moe_text``, what megarl trains and writes into the engine's config.json). vLLM 0.24
registers Qwen3.5 only as its vision-language classes (``Qwen3_5ForConditionalGeneration``, ``...Moe...``,
models/registry.py). For an architecture it does not know, ``_normalize_arch`` tries the other default suffixes, so
``Qwen3_5ForCausalLM`` becomes ``Qwen3_5ForConditionalGeneration``, which reads ``config.vision_config`` that a
text config lacks: the engine fails to start (``'Qwen3_5TextConfig' object has no attribute 'vision_config'``,
seen with vLLM 0.24.0's own loader on the CPU, ``tests/test_vllm_loader.py``). The language model inside that class
is vLLM's ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (models/qwen3_5.py), with the parameter names of a
text checkpoint (``model.layers.*``, ``lm_head``; megarl's vLLM layout writes those). What it lacks to run alone is
vLLM's ``IsHybrid`` interface: the gated DeltaNet's recurrent state (shapes, dtypes, copy functions) that the hybrid
KV-cache manager asks the model class for. The vision-language class computes them from ``hf_text_config`` alone,
so its class methods serve the text model unchanged (as vLLM's own ``Qwen3NextForCausalLM``, a text hybrid model,
has them).
"""

from __future__ import annotations

import functools

ARCHITECTURES = frozenset({"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"})  # those megarl registers a class for


@functools.cache
def _text_models() -> dict[str, type]:
    """The classes of :data:`ARCHITECTURES`: vLLM's Qwen3.5 language models with ``IsHybrid`` (module docstring)."""
    from vllm.model_executor.models.interfaces import IsHybrid
    from vllm.model_executor.models.qwen3_5 import (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                                                    Qwen3_5MoeForCausalLM)

    # the gated DeltaNet's state as vLLM's hybrid KV-cache manager asks the model class for it, computed by the
    # vision-language class from hf_text_config alone
    state = {name: classmethod(getattr(Qwen3_5ForConditionalGeneration, name).__func__)
             for name in ("get_mamba_state_dtype_from_config", "get_mamba_state_shape_from_config",
                          "get_mamba_state_copy_func")}
    doc = "vLLM's Qwen3.5{} language model, run alone (megarl.rollout.vllm_models)."
    return {"Qwen3_5ForCausalLM": type("Qwen3_5TextForCausalLM", (Qwen3_5ForCausalLM, IsHybrid),
                                       {**state, "__doc__": doc.format("")}),
            "Qwen3_5MoeForCausalLM": type("Qwen3_5MoeTextForCausalLM", (Qwen3_5MoeForCausalLM, IsHybrid),
                                          {**state, "__doc__": doc.format("-MoE")})}


def register(architecture: str) -> None:
    """Register megarl's class for ``architecture`` (a Hugging Face ``architectures[0]``) with vLLM's model registry
    of this process, where :data:`ARCHITECTURES` has it; nothing otherwise (vLLM's own class serves it, and vLLM is
    not imported here)."""
    if architecture in ARCHITECTURES:
        from vllm import ModelRegistry

        ModelRegistry.register_model(architecture, _text_models()[architecture])
