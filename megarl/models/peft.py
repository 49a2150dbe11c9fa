"""LoRA adapters in PEFT's format (Hugging Face ``peft``): the folder ``megarl export`` writes beside the merged
model, and the tensor names vLLM's in-memory LoRA loading reads.

A PEFT adapter folder holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``
by HF module name, ``base_model_name_or_path``) and ``adapter_model.safetensors`` with, for every adapted HF
projection ``P``, ``base_model.model.<P>.lora_A.weight`` ``[r, in]`` and ``base_model.model.<P>.lora_B.weight``
``[out, r]``. megarl's canonical adapters (:func:`megarl.models.layout_lora.lora_targets`) share one ``A`` between q, k
and v (and between gate and up), as megatron's fused layers do; in PEFT's format each projection carries its own
copy of that ``A``, which is the same model (``W_q + s B_q A``, ...).

``base_model_name_or_path`` is the base model's real path (absolute; peft's ``AutoPeftModelForCausalLM`` loads
it from there, offline). Adapters on a mixture-of-experts model's experts (``actor.lora.experts``) load only with
peft >= :data:`MIN_PEFT_EXPERTS` (an older peft ignores them without a warning): such a folder says so in its
weights' metadata (``min_peft_version``), and :func:`save_peft_adapter` warns.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Mapping

import torch

from megarl.models.layout_lora import lora_targets
from megarl.models.lora import LoRASpec
from megarl.models.spec import ModelSpec

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MIN_PEFT_EXPERTS = "0.20.0"  # the first peft that loads LoRA adapters on the experts of an MoE model

log = logging.getLogger(__name__)


def peft_tensors(spec: ModelSpec, lora: LoRASpec, adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's tensors of megarl's canonical adapters (whole tensors by canonical name).

    Raises:
        KeyError: a canonical adapter missing from ``adapters``.
    """
    out = {}
    for w, (a, b) in lora_targets(spec, lora).items():
        module = PREFIX + w.removesuffix(".weight")
        out[module + ".lora_A.weight"] = adapters[a]
        out[module + ".lora_B.weight"] = adapters[b]
    return out


def target_modules(spec: ModelSpec, lora: LoRASpec) -> list[str]:
    """The HF module names PEFT adapts (``q_proj``, ``o_proj``, ``gate_proj``, ...), sorted."""
    return sorted({w.removesuffix(".weight").rsplit(".", 1)[-1] for w in lora_targets(spec, lora)})


def adapter_config(spec: ModelSpec, lora: LoRASpec, base: str | None) -> dict:
    """``adapter_config.json`` of a LoRA adapter on ``base`` (the base model's path or name)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": target_modules(spec, lora),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def save_peft_adapter(directory: str | os.PathLike, spec: ModelSpec, lora: LoRASpec,
                      adapters: Mapping[str, torch.Tensor], base: str | None) -> Path:
    """Write a PEFT adapter folder (module docstring): ``adapter_config.json`` and ``adapter_model.safetensors``,
    each written to a temporary name and renamed; adapters on the experts say which peft they need (metadata
    ``min_peft_version``) and are warned of.

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    # a shared A is one tensor under several names; safetensors stores each name's own copy (clone)
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in peft_tensors(spec, lora, adapters).items()}
    metadata = {"format": "pt"}
    if lora.experts:
        metadata["min_peft_version"] = MIN_PEFT_EXPERTS
        log.warning("%s holds LoRA adapters on the MoE experts, which load only with peft >= %s (an older peft "
                    "ignores them without a warning: the model would lack them); its metadata says so", out,
                    MIN_PEFT_EXPERTS)
    save_file(tensors, str(out / (WEIGHTS_FILE + ".tmp")), metadata=metadata)
    os.replace(out / (WEIGHTS_FILE + ".tmp"), out / WEIGHTS_FILE)
    (out / (CONFIG_FILE + ".tmp")).write_text(json.dumps(adapter_config(spec, lora, base), indent=2))
    os.replace(out / (CONFIG_FILE + ".tmp"), out / CONFIG_FILE)
    return out
