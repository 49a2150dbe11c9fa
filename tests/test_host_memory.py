"""Host memory of GPU ranks (issue 30's H200 finding): a full 7B run with ``actor.optim.cpu_offload=0.8`` trained
and was killed by the host's OOM killer in its first checkpoint save, because the distributed optimizer's
``fully_reshardable`` save gathers 12 bytes per parameter on the host of every rank. The estimate counts that
(``save_host``, against Qwen2.5-7B's own parameter count) and :func:`~megarl.launch.memory.warn_host_memory` warns
before ``megarl train`` starts its ranks; the CPU estimate is unchanged."""

from __future__ import annotations

import logging

from megarl.config import load_config
from megarl.launch.memory import GIB, estimate_memory, warn_host_memory
from megarl.trainer.preflight import model_spec

QWEN25_7B_PARAMS = 7_615_616_512  # Qwen/Qwen2.5-7B's safetensors index: embeddings and lm_head untied
H200 = 141 * GIB


def _cfg(*overrides):
    return load_config(None, ["model.path=preset:qwen2.5-7b", "model.dtype=bfloat16", "rollout.engine=vllm",
                              "validation.enabled=false", *overrides])


def test_the_save_gathers_12_bytes_per_parameter_on_a_gpu_rank():
    cfg = _cfg()
    est = estimate_memory(cfg, model_spec(cfg), 1, gpu=True, device_bytes=H200)
    assert est.save_host == 12 * QWEN25_7B_PARAMS
    assert estimate_memory(cfg, model_spec(cfg), 1, gpu=False).save_host == 0  # CPU figures as before
    lora = _cfg("actor.lora.rank=64", "actor.lora.alpha=128")
    est_lora = estimate_memory(lora, model_spec(lora), 1, gpu=True, device_bytes=H200)
    assert 0 < est_lora.save_host < est.save_host / 20  # the adapters' state alone


def test_the_h200_run_that_was_killed_at_its_save_is_warned_about(caplog):
    cfg = _cfg("actor.optim.cpu_offload=0.8")
    with caplog.at_level(logging.WARNING, logger="megarl.launch.memory"):
        msg = warn_host_memory(cfg, model_spec(cfg), 1, local_ranks=1, device_bytes=H200, host_bytes=125 * GIB)
    assert msg is not None and msg in caplog.text
    assert "actor.optim.cpu_offload" in msg and "over the 125.0 GiB" in msg
    # what fits stays silent: the full model without offload on that host, and LoRA
    full = _cfg()
    assert warn_host_memory(full, model_spec(full), 1, local_ranks=1, device_bytes=H200, host_bytes=125 * GIB) is None
    lora = _cfg("actor.lora.rank=64", "actor.lora.alpha=128", "actor.optim.cpu_offload=0.8")
    assert warn_host_memory(lora, model_spec(lora), 1, local_ranks=1, device_bytes=H200, host_bytes=125 * GIB) is None
    # eight ranks of one node each gather their shard: 8 x 85 GiB is over a 560 GiB host
    dp8 = _cfg("actor.parallel.dp=8", "data.prompts_per_step=32")
    assert warn_host_memory(dp8, model_spec(dp8), 8, local_ranks=8, device_bytes=H200, host_bytes=560 * GIB)
