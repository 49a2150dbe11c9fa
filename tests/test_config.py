"""Configs: every shipped YAML loads and validates for its world; the CPU default YAML is the embedded default;
README's test command is what CI runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config import Config, ConfigError, DPORunConfig, SFTRunConfig, load_config
from megarl.parallel.placement import validate_for_world

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "parallel_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    import yaml

    sections = yaml.safe_load(path.read_text())
    schema = SFTRunConfig if "sft" in sections else DPORunConfig if "dpo" in sections else Config
    cfg = load_config(path, schema=schema)
    validate_for_world(cfg, cfg.world_size)


def test_cpu_default_yaml_is_the_embedded_default():
    assert load_config(ROOT / "parallel_configs/cpu_smollm2_grpo.yaml") == load_config(None)


def test_overrides_apply_in_order_and_unknown_keys_fail():
    cfg = load_config(ROOT / "parallel_configs/cpu_smollm2_ppo.yaml", ["critic.optim.lr=3e-5", "rollout.n=2"])
    assert cfg.algorithm.name == "ppo" and cfg.critic.optim.lr == 3e-5 and cfg.rollout.n == 2
    with pytest.raises(ConfigError, match="actor.optimizer"):
        load_config(None, ["actor.optimizer.lr=1"])
    with pytest.raises(ConfigError, match="rollout.n"):
        validate_for_world(load_config(None, ["algorithm.name=grpo", "rollout.n=1", "actor.ppo_mini_batch_size=4"]),
                           1)


def test_world_size_checks_name_the_field():
    cfg = load_config(None, ["actor.parallel.tp=2"])
    with pytest.raises(ConfigError, match="actor.parallel"):
        validate_for_world(cfg, 3)
    with pytest.raises(ConfigError, match="actor.parallel.dp"):
        validate_for_world(load_config(None, ["actor.parallel.dp=4"]), 2)
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch: needs actor.parallel.pp=1"):
        validate_for_world(load_config(None, ["actor.parallel.pp=2", "actor.max_tokens_per_micro_batch=4096"]), 2)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_config(None, ["actor.max_tokens_per_micro_batch=-1"])
    # with a token budget, micro_batch_size does not cut the mini-batch; dp still must divide it
    validate_for_world(load_config(None, ["actor.micro_batch_size=64", "actor.max_tokens_per_micro_batch=4096"]), 1)
    with pytest.raises(ConfigError, match="16 is not a multiple of dp \\(3\\)"):
        validate_for_world(load_config(None, ["actor.max_tokens_per_micro_batch=4096", "actor.parallel.dp=3",
                                              "data.prompts_per_step=12"]), 3)


def test_truncated_sampling_is_refused_naming_the_field_and_the_fix():
    """rollout.top_p < 1 / top_k: the samples would not come from the policy whose log-probs the actor
    computes (issue 8), so the importance ratio would be biased."""
    with pytest.raises(ConfigError, match=r"rollout.top_p: 0.8 < 1: .*biases the PPO importance ratio.*"
                                          r"set rollout.top_p=1.0"):
        load_config(None, ["rollout.top_p=0.8"])
    with pytest.raises(ConfigError, match=r"rollout.top_k: 50 truncates.*set rollout.top_k=-1"):
        load_config(None, ["rollout.top_k=50"])
    cfg = load_config(None, ["rollout.top_p=1.0", "rollout.top_k=-1", "rollout.temperature=0.7"])
    assert (cfg.rollout.top_p, cfg.rollout.top_k) == (1.0, -1)


VLLM = ["rollout.engine=vllm"]


@pytest.mark.parametrize("overrides,field,says", [
    (["rollout.quantization=fp8"], "rollout.quantization", "need rollout.engine=vllm"),
    (VLLM + ["rollout.quantization=int4"], "rollout.quantization", "one of \\['fp8'\\]"),
    (["rollout.kv_cache_dtype=fp8"], "rollout.kv_cache_dtype", "needs rollout.engine=vllm"),
    (VLLM + ["rollout.kv_cache_dtype=int8"], "rollout.kv_cache_dtype", "one of \\['fp8'\\]"),
    (VLLM + ["rollout.kv_cache_dtype=fp8", "rollout.quantization=fp8"], "rollout.kv_cache_dtype",
     "scales from the engine's dummy weights"),
    (VLLM + ["rollout.model_runner=v3"], "rollout.model_runner", "one of \\['v1', 'v2'\\]"),
    (["rollout.model_runner=v2"], "rollout.model_runner", "is a vLLM knob, but rollout.engine=hf"),
    (["rollout.request_seeds=false"], "rollout.request_seeds", "is a vLLM knob"),
    (VLLM + ["rollout.max_num_seqs=0"], "rollout.max_num_seqs", ">= 1"),
    (VLLM + ["rollout.kv_cache_memory_bytes=0"], "rollout.kv_cache_memory_bytes", ">= 1"),
    (["rollout.kv_cache_memory_bytes=1000000"], "rollout.kv_cache_memory_bytes", "is a vLLM knob"),
    (VLLM + ["rollout.max_num_seqs=512", "rollout.max_num_batched_tokens=256"], "rollout.max_num_batched_tokens",
     "below rollout.max_num_seqs=512"),
    (VLLM + ["rollout.cudagraph_capture_sizes=[1,8]"], "rollout.cudagraph_capture_sizes", "enforce_eager=true"),
    (VLLM + ["rollout.enforce_eager=false", "rollout.cudagraph_capture_sizes=[]"], "rollout.cudagraph_capture_sizes",
     "non-empty"),
    (VLLM + ["rollout.enforce_eager=false", "rollout.cudagraph_capture_sizes=[1,8]",
             "rollout.max_cudagraph_capture_size=16"], "rollout.max_cudagraph_capture_size", "largest"),
    (VLLM + ["rollout.quantization=fp8", "algorithm.rollout_correction.preset=none",
             "algorithm.rollout_correction.level=token"], "algorithm.rollout_correction.level", "preset=none"),
])
def test_the_vllm_knobs_are_validated_naming_the_field(overrides, field, says):
    with pytest.raises(ConfigError, match=f"{field}: .*{says}"):
        load_config(None, overrides)


def test_fp8_rollouts_default_to_token_tis_which_preset_none_turns_off():
    rc = load_config(None, VLLM + ["rollout.quantization=fp8"]).algorithm.rollout_correction
    assert rc.enabled and rc.settings() == ("token", "truncate", 2.0, 0.0)
    assert not load_config(None, VLLM).algorithm.rollout_correction.enabled  # bf16: off, as before
    off = load_config(None, VLLM + ["rollout.quantization=fp8", "algorithm.rollout_correction.preset=none"])
    assert not off.algorithm.rollout_correction.enabled
    seq = load_config(None, VLLM + ["rollout.quantization=fp8", "algorithm.rollout_correction.preset=seq_mis"])
    assert seq.algorithm.rollout_correction.settings()[:2] == ("sequence", "mask")  # a choice of one's own stays
    knobs = load_config(None, VLLM + ["rollout.enforce_eager=false", "rollout.cudagraph_capture_sizes=[1,8,512]",
                                      "rollout.async_scheduling=false", "rollout.max_num_seqs=512"]).rollout
    from megarl.rollout.vllm_engine import VLLMSettings, llm_kwargs

    kwargs = llm_kwargs(VLLMSettings.from_config(knobs), model_dir="m", context=64, seed=0, enforce_eager=False,
                        gpu_memory_utilization=0.5)
    assert kwargs["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 512]}
    assert (kwargs["async_scheduling"], kwargs["max_num_seqs"]) == (False, 512) and "max_num_batched_tokens" not in kwargs
    assert "kv_cache_dtype" not in kwargs and "kv_cache_memory_bytes" not in kwargs  # vLLM's defaults


def test_an_fp8_kv_cache_reaches_vllm_and_defaults_to_token_tis():
    from megarl.rollout.vllm_engine import VLLMSettings, llm_kwargs

    cfg = load_config(None, VLLM + ["rollout.kv_cache_dtype=fp8"])
    assert cfg.algorithm.rollout_correction.settings() == ("token", "truncate", 2.0, 0.0)
    kwargs = llm_kwargs(VLLMSettings.from_config(cfg.rollout), model_dir="m", context=64, seed=0, enforce_eager=True,
                        gpu_memory_utilization=0.5)
    assert kwargs["kv_cache_dtype"] == "fp8"


def test_fp8_rollouts_need_whole_128_blocks_at_the_rollout_tp():
    from megarl.models.spec import preset
    from megarl.trainer.preflight import validate_for_model

    cfg = load_config(None, VLLM + ["rollout.quantization=fp8", "rollout.tp=4"])
    with pytest.raises(ConfigError, match="rollout.quantization: vLLM tp=4 with block-FP8 weights: .*gate_up_proj "
                                          "has 2240 rows"):
        validate_for_model(cfg, preset("qwen2.5-1.5b"))
    with pytest.raises(ConfigError, match="rollout.quantization: .*qkv_proj has 576 rows"):
        validate_for_model(load_config(None, VLLM + ["rollout.quantization=fp8"]), preset("smollm2-135m"))
    validate_for_model(load_config(None, VLLM + ["rollout.quantization=fp8", "rollout.tp=2"]), preset("qwen2.5-1.5b"))


def test_readme_test_command_is_what_ci_runs():
    readme = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("    ./build.sh")]
    assert len(readme) == 2 and "megarl train" in readme[0]
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines() if ln.strip().startswith("./build.sh")]
    assert ci == [readme[1]]


def test_the_8_gpu_config_fits_qwen2_5_7b_and_its_reshard_stays_on_each_gpu():
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.spec import preset
    from megarl.parallel.mesh import ParallelLayout
    from megarl.reshard.planner import plan_reshard
    from megarl.trainer.preflight import validate_for_model

    cfg = load_config(ROOT / "parallel_configs/gpu_8xh200_qwen2.5-7b.yaml")
    validate_for_world(cfg, 8)
    spec = preset("qwen2.5-7b")
    validate_for_model(cfg, spec)  # heads, KV heads, FFN and vocab split at actor TP=2 and vLLM TP=2; context
    assert cfg.rollout.tp == 2
    p = cfg.actor.parallel
    plan = plan_reshard(megatron_layout(spec, ParallelLayout(p.tp, p.pp, p.dp)),
                        vllm_layout(spec, cfg.rollout.tp, range(8)), 8)
    # actor TP=2 and rollout TP=2 hold the same heads, FFN rows and vocab rows on each GPU
    assert all(plan.elements(r)["received"] == 0 and plan.elements(r)["local"] > 0 for r in range(8))


def test_a_bare_yes_no_key_is_named_as_yamls_boolean():
    """``reward.judge.choices={yes: 1, no: 0}`` (YAML reads yes/no as booleans) names the mapping and the quoting
    that keeps the labels strings; quoted, the labels load."""
    with pytest.raises(ConfigError, match=r"^reward.judge.choices: Key True \(bool\) is incompatible .*YAML reads "
                                          r"a bare yes/no/on/off as a boolean; quote the keys"):
        load_config(None, ["reward.judge.choices={yes: 1, no: 0}"])
    assert load_config(None, ['reward.judge.choices={"yes": 1, "no": 0}']).reward.judge.choices == {"yes": 1, "no": 0}
