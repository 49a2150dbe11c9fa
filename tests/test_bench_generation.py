"""``megarl bench generation`` on the CPU: its batch, its per-step timers on an object graph shaped like vLLM
0.24's in-process engine, the request variants (on the fake vLLM), the GPU-busy union of kernel intervals and
the summary of ``perf/gpu_generation.sh``'s reports (the GPU runs are the script's)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from megarl.bench.generation import STEP_PARTS, StepTimers, _union_us, summary_table, synthetic_prompts


def test_synthetic_prompts_are_3_to_5_ids_of_the_vocab_and_reproducible():
    prompts = synthetic_prompts(200, 50, seed=3)
    assert len(prompts) == 200 and {len(p) for p in prompts} == {3, 4, 5}
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert prompts == synthetic_prompts(200, 50, seed=3) != synthetic_prompts(200, 50, seed=4)


def test_gpu_busy_time_is_the_union_of_kernel_intervals():
    assert _union_us([(0, 10), (5, 12), (20, 25), (21, 22), (30, 30)]) == 17
    assert _union_us([]) == 0


def test_step_timers_split_an_engine_step_into_its_parts():
    """An engine loop as vLLM's in-process one calls it: schedule, execute (a future), sample (a future whose
    result blocks), update, then the output processor; only steps that scheduled tokens count."""

    def slow(out=None):
        def fn(*args, **kwargs):
            time.sleep(0.002)
            return out
        return fn

    future = SimpleNamespace(result=slow("tokens"))
    scheduler = SimpleNamespace(schedule=slow(SimpleNamespace(total_num_scheduled_tokens=4)),
                                update_from_output=slow())
    executor = SimpleNamespace(execute_model=slow(SimpleNamespace(result=slow())), sample_tokens=lambda g: future)
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core),
                                                     output_processor=SimpleNamespace(process_outputs=slow())))
    timers = StepTimers(llm)
    for _ in range(3):
        out = core.scheduler.schedule()
        core.model_executor.execute_model(out, non_block=True)
        assert core.model_executor.sample_tokens(None).result() == "tokens"
        core.scheduler.update_from_output(out, None)
        llm.llm_engine.output_processor.process_outputs([], engine_core_timestamp=0)
    assert timers.steps == 3
    assert set(timers.seconds) == set(STEP_PARTS)
    assert all(timers.seconds[p] >= 3 * 0.002 for p in ("schedule", "execute", "wait", "update", "output"))
    timers.reset()
    assert timers.steps == 0 and not timers.seconds
    idle = SimpleNamespace(total_num_scheduled_tokens=0)  # a step with nothing scheduled is no engine step
    core.scheduler = scheduler = SimpleNamespace(schedule=lambda *a: idle, update_from_output=slow())
    timers = StepTimers(llm)
    core.scheduler.schedule()
    assert timers.steps == 0 and timers.seconds["schedule"] > 0


def test_each_variant_drops_only_what_its_name_says(monkeypatch):
    import importlib.util
    import sys

    from megarl.bench.generation import VARIANTS, _requests
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import SamplingConfig
    from tests.test_rollout_vllm_tp import FAKE

    source = importlib.util.spec_from_file_location("vllm", f"{FAKE}/vllm/__init__.py")
    fake = importlib.util.module_from_spec(source)
    monkeypatch.setitem(sys.modules, "vllm", fake)  # this test's process only (the fake's dataclasses need it)
    source.loader.exec_module(fake)
    spec = ModelSpec("llama", 50, 16, 1, 2, 1, 8, 24, max_position_embeddings=32, eos_token_ids=(1,))
    out = {}
    for name, (_, seeds, logprobs, stop) in VARIANTS.items():
        prompts, params = _requests(SimpleNamespace(spec=spec), [[3, 4], [5]], SamplingConfig(n=2, max_new_tokens=8),
                                    seeds, logprobs, stop)
        out[name] = [(p["prompt_token_ids"], q.seed, q.logprobs, q.stop_token_ids, q.ignore_eos, q.max_tokens)
                     for p, q in zip(prompts, params)]
    raw = out["raw"]
    assert [r[0] for r in raw] == [[3, 4], [3, 4], [5], [5]] and all(r[5] == 8 for r in raw)
    assert len({r[1] for r in raw}) == 4 and all(r[2] == 0 and r[3] == [1] and not r[4] for r in raw)
    assert out["megarl"] == raw
    assert all(r[1] is None and r[2:] == s[2:] for r, s in zip(out["no_seeds"], raw))
    assert all(r[2] is None and r[1] == s[1] and r[3:] == s[3:] for r, s in zip(out["no_logprobs"], raw))
    assert all(r[3] == [] and r[4] and r[:3] == s[:3] for r, s in zip(out["no_stop"], raw))
    assert all(r[1] is None and r[2] is None and r[3] == [] for r in out["bare"])


def _gen(label, tokens_per_s, v2):
    per = {"wall": 10.0, **{p: 1.0 for p in STEP_PARTS}, "other": 4.0}
    variant = {"tokens": 1000, "seconds": 1000 / tokens_per_s, "tokens_per_s": tokens_per_s, "runs_s": [1.0],
               "steps": 256, "per_step_ms": per, "gpu_util_mean_pct": 50.0}
    return {"label": label, "max_model_len": 32768,
            "vllm": {"v2_model_runner": v2, "async_scheduling": True, "max_num_seqs": 1024,
                     "max_cudagraph_capture_size": 512, "quantization": None},
            "variants": {"megarl": variant, "bare": {**variant, "tokens_per_s": 2 * tokens_per_s}},
            "profile": {"wall_ms_per_step": 10.0, "gpu_busy_ms_per_step": 4.0, "gpu_idle_frac": 0.6,
                        "kernels_ms_per_step": {"gemm": 3.0}, "scopes": {"gpu_model_runner: sample": {
                            "host_ms_per_step": 5.0, "device_ms_per_step": 0.5}}}}


def test_the_summary_states_the_goals(tmp_path):
    (tmp_path / "gen_before.json").write_text(json.dumps(_gen("before", 24_000, False)))
    (tmp_path / "gen_after.json").write_text(json.dumps(_gen("after", 48_000, True)))
    step = {"status": "ok", "step_time_s": 6.5, "generate_tokens_per_s": 45_000,
            "phases": {"generate": {"time_s": 2.9}, "reshard": {"time_s": 0.01}},
            "rollout": {"rollout_vs_old_logprob_diff": 0.01, "kl_k3": 1e-4, "truncated_frac": 0.001},
            "standalone_vllm": {"tokens_per_s": 50_000, "tokens_per_s_runs": [49_000, 50_000, 51_000],
                                "spread": 0.04, "ratio": 0.9}}
    (tmp_path / "step_after.json").write_text(json.dumps(step))
    (tmp_path / "step_fp8.json").write_text(json.dumps({"status": "error"}))  # a failed run is left out
    two = {**step, "step_time_s": 5.0, "phases": {"generate": {"time_s": 1.45}}, "standalone_vllm": None}
    (tmp_path / "step_engines2.json").write_text(json.dumps(two))  # rollout.engines_per_gpu=2
    kv = _gen("fp8kv", 60_000, True)
    kv["vllm"]["kv_cache_dtype"] = "fp8"
    (tmp_path / "gen_fp8kv.json").write_text(json.dumps(kv))  # rollout.kv_cache_dtype=fp8
    (tmp_path / "step_fp8kv.json").write_text(json.dumps({**two, "step_time_s": 6.0}))
    text = summary_table(tmp_path)
    assert "FP8 vs bf16 KV cache, generation (after settings): 60,000 vs 48,000 tokens/s (1.25x)" in text
    assert "bf16, KV fp8 |" in text
    assert "FP8 KV cache vs bf16, the step: 6.00 vs 6.50 s, generate 1.45 vs 2.90 s" in text
    assert "2.00x (goal >= 1.8x: met)" in text
    assert "bare: 2.00x" in text and "V2 runner" in text and "idle 60%" in text
    assert "6.50 s (goal <= 7.0 s: met)" in text and "spread 4.0% (goal <= 5%: met)" in text
    assert "| fp8 |" not in text
    assert "two engines on the GPU vs one: step 5.00 vs 6.50 s, generate 1.45 vs 2.90 s (2.00x)" in text
