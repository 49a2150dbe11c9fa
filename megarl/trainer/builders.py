"""What a run is built from, on every rank: its data (prepared when missing), prompts, EOS tokens, validation,
rollout engine and the engines' weight layout, and the RNG seeds (torchtitan-style builders: each a short
function of the config, called by :class:`~megarl.trainer.trainer.Trainer` and :mod:`megarl.offline.evaluate`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megarl.config import Config, ConfigError
from megarl.data.dataset import PromptDataset
from megarl.models import checkpoint as ck
from megarl.models.layout import Layout, hf_layout
from megarl.models.layout_vllm import vllm_layout
from megarl.models.lora import LoRASpec
from megarl.models.spec import ModelSpec
from megarl.trainer.preflight import check_files, prepare_files, read_prompts
from megarl.trainer.validation import Validation

log = logging.getLogger(__name__)


def prepare_data(cfg: Config, files: list[str], field: str = "data.train_files") -> list[str]:
    """Data files (``field`` of the config), prepared first when missing and ``data.prepare`` makes them
    (:func:`~megarl.trainer.preflight.prepare_files`; ``megarl train`` has done so before any rank started).

    Raises:
        ConfigError: a missing file and nothing to prepare it from.
    """
    check_files(cfg, field, files)
    # Rank 0 alone looks and prepares; every rank then waits at the barrier. (A rank that looked for itself and
    # found the files rank 0 had just written skipped the barrier that rank 0 then waited at forever.)
    if dist.get_rank() == 0:
        prepare_files(cfg, files)
    dist.barrier()
    still = [f for f in files if not Path(f).is_file()]
    if still:
        raise ConfigError(f"{field}: {still} still missing after preparing GSM8K into {Path(still[0]).parent}")
    return list(files)


def load_prompts(cfg: Config, tokenizer, files: list[str] | None = None,
                 field: str = "data.train_files") -> PromptDataset:
    """Tokenised, templated, length-filtered prompts of ``files`` (default: the train files;
    :func:`~megarl.trainer.preflight.read_prompts`)."""
    return read_prompts(cfg, tokenizer, prepare_data(cfg, list(cfg.data.train_files if files is None else files),
                                                     field), field)


def resolve_eos(spec: ModelSpec, tokenizer, source: str, generation_config: dict | None = None) -> ModelSpec:
    """``spec`` with every token that ends a response: the config's EOS ids, then those of the model's
    ``generation_config.json`` that the config lacks (Llama-3-Instruct ends a chat turn with ``<|eot_id|>``,
    named only there; vLLM and ``generate`` stop at both too); where neither names one (``eos_token_id: null``,
    a checkpoint saved without generation settings), the tokenizer's EOS, said in a warning.

    Raises:
        ConfigError: naming ``model.path`` and the fix, when neither the configs nor the tokenizer names one.
    """
    extra = (generation_config or {}).get("eos_token_id")
    extra = [extra] if isinstance(extra, int) else list(extra or [])
    ids = tuple(dict.fromkeys([*spec.eos_token_ids, *(int(i) for i in extra)]))
    if ids:
        return spec.replace(eos_token_ids=ids) if ids != spec.eos_token_ids else spec
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"model.path: neither the config of {source} (eos_token_id: null) nor its tokenizer "
                          "names an end-of-sequence token, so responses could not end; set eos_token_id in its "
                          "config.json or eos_token in its tokenizer_config.json")
    log.warning("the config of %s has no eos_token_id: responses end at the tokenizer's EOS %r (id %d)", source,
                tokenizer.eos_token, eos)
    return spec.replace(eos_token_ids=(int(eos),))



def model_meta(cfg: Config, spec: ModelSpec, tokenizer_source: str, source_config: dict | None,
               generation_config: dict | None) -> dict:
    """The model's part of a checkpoint's ``megarl.json``: its config, dtype, tokenizer, layer spec, the
    source's ``config.json`` and ``generation_config.json``, and a LoRA actor's adapters and base."""
    lora = LoRASpec.from_config(cfg.actor.lora)
    base = None if cfg.model.path == "default" else cfg.model.path
    return ck.model_meta(spec, ck.DTYPES[cfg.model.dtype], tokenizer_source,
                         use_te=cfg.actor.kernels.transformer_engine, source_config=source_config,
                         generation_config=generation_config,
                         **({"lora": ck.lora_meta(lora.as_dict(), base)} if lora else {}))


def load_validation(cfg: Config, tokenizer, score, spec) -> Validation:
    """The held-out evaluation of ``cfg.validation``, its prompts templated and filtered like the training
    prompts (:func:`load_prompts`), scored by ``score(prompts, responses, ground_truths) -> [B] scores``."""
    return Validation(cfg.validation, load_prompts(cfg, tokenizer, cfg.validation.files, "validation.files"),
                      score=score, tokenizer=tokenizer, seed=cfg.run.seed,
                      max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=tuple(spec.eos_token_ids))


def make_engine(cfg: Config, spec):
    """The rollout engine of ``rollout.engine``, without weights: transformers on this rank's CPU, or vLLM on
    its GPU (the trainer builds it after the Megatron roles, so its memory budget sees them on the GPU; its
    weights arrive by reshard from the actor's GPU shards). vLLM engines of ``rollout.tp`` consecutive ranks
    each, returning the samples' routed experts with ``actor.moe.router_replay``; prompts are split over the rollout data-parallel group
    (:func:`~megarl.rollout.data_parallel.rollout_dp_group`). With ``rollout.engines_per_gpu`` > 1, a pool of that
    many such engines on the rank's device (:class:`~megarl.rollout.engine_pool.EnginePool`), each in a process
    of its own with its share of ``rollout.gpu_memory_utilization``.
    """
    r = cfg.rollout
    if r.engines_per_gpu > 1:
        from megarl.rollout.engine_pool import EnginePool

        one = dataclasses.replace(cfg, rollout=dataclasses.replace(
            r, engines_per_gpu=1, gpu_memory_utilization=r.gpu_memory_utilization / r.engines_per_gpu))
        device = "cpu" if r.engine == "hf" else f"cuda:{torch.cuda.current_device()}"
        return EnginePool(functools.partial(make_engine, one, spec), r.engines_per_gpu, device)
    if r.engine == "hf":
        from megarl.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(spec, max_batch_size=r.max_batch_size)
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings

    lora = cfg.actor.lora
    return VLLMRolloutEngine(spec, tp=r.tp, gpu_memory_utilization=r.gpu_memory_utilization,
                             enforce_eager=r.enforce_eager, max_model_len=r.max_model_len, seed=cfg.run.seed,
                             lora_rank=lora.rank if lora.enabled and lora.sync == "adapter" else 0,
                             settings=VLLMSettings.from_config(r), record_routes=cfg.actor.moe.router_replay)


def rollout_layout(cfg: Config, spec: ModelSpec, ranks) -> Layout:
    """The engines' weight layout on the rollout pool's ``ranks`` (what the reshard writes), known on every
    rank, engine or not: whole HF tensors for transformers (experts fused, as
    :meth:`~megarl.rollout.hf_engine.HFRolloutEngine.weight_layout` holds them), vLLM's TP shards of ``rollout.tp``
    (block-FP8 with ``rollout.quantization: fp8``)."""
    if cfg.rollout.engine == "hf":
        return hf_layout(spec, ranks, fused_experts=True)
    return vllm_layout(spec, cfg.rollout.tp, ranks, cfg.rollout.quantization)


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs alike on every rank (CPU-initialised random weights
    and the data order read them), before the :class:`Trainer` is built."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)

