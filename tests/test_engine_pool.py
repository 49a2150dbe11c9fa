"""Several rollout engines on one device (``rollout.engines_per_gpu``, :mod:`megarl.rollout.engine_pool`), on the CPU
with the transformers engine in spawned processes: a pool samples what one engine samples, its weights arrive
through the shared staging tensors at every update, sleep and errors cross the process boundary as
``RolloutError``, a worker that dies is named, the config refuses what a pool cannot run, the memory estimate
counts the staging copy, and a training run on two DP ranks with a pool of two on each repeats the run with one
engine a rank."""

from __future__ import annotations

import functools
import json
import os
import signal

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.rollout.base import RolloutError, SamplingConfig, state_dict_writer
from megarl.rollout.engine_pool import EnginePool
from megarl.rollout.hf_engine import HFRolloutEngine
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts
from tests.test_rollout_hf_engine import PROMPTS, TINY, loaded_engine, random_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLING = SamplingConfig(n=3, max_new_tokens=6, temperature=1.0, seed=11)


def _pool(size: int, state_dict) -> EnginePool:
    pool = EnginePool(functools.partial(HFRolloutEngine, TINY, max_batch_size=4), size)
    pool.update_weights(state_dict_writer(state_dict, pool.weight_layout([0]), 0))
    return pool


def _as_lists(out):
    return [(s.prompt_index, s.sample_index, s.token_ids) for s in out.samples], [s.logprobs for s in out.samples]


def test_a_pool_of_three_samples_what_one_engine_samples_and_follows_each_weight_update():
    first, second = random_state_dict(TINY, seed=0), random_state_dict(TINY, seed=1)
    one = loaded_engine(TINY, first, max_batch_size=4)
    pool = _pool(3, first)
    try:
        for weights in (first, second):  # the second update rewrites the staging tensors every worker maps
            if weights is second:
                one.update_weights(state_dict_writer(second, one.weight_layout([0]), 0))
                pool.update_weights(state_dict_writer(second, pool.weight_layout([0]), 0))
            pool.calls = one.calls = 4  # a resumed run's counter reaches every worker (it seeds the samples)
            pool.policy_version = one.policy_version = 9
            want, got = one.generate(PROMPTS, SAMPLING, prompt_offset=2), pool.generate(PROMPTS, SAMPLING,
                                                                                          prompt_offset=2)
            (want_ids, want_lp), (got_ids, got_lp) = _as_lists(want), _as_lists(got)
            assert got_ids == want_ids  # prompt-major, global prompt indices, the same tokens
            for a, b in zip(got_lp, want_lp):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # batch shapes differ: float rounding only
            assert {s.policy_version for s in got.samples} == {9}
            assert got.stats.generated_tokens == want.stats.generated_tokens
            assert got.stats.prompt_tokens == want.stats.prompt_tokens
            assert pool.calls == one.calls == 5
        assert _as_lists(pool.generate(PROMPTS, SAMPLING))[0] != _as_lists(pool.generate(PROMPTS, SAMPLING))[0]
        one.calls = pool.calls  # two prompts for three engines: one share is empty
        assert _as_lists(pool.generate(PROMPTS[:2], SAMPLING))[0] == _as_lists(one.generate(PROMPTS[:2], SAMPLING))[0]
    finally:
        pool.close()


def test_sleep_and_engine_errors_cross_to_the_pool_and_a_dead_worker_is_named():
    pool = _pool(2, random_state_dict(TINY, seed=0))
    try:
        pool.sleep(2)  # level 2 frees every engine's weights: they must be written again
        with pytest.raises(RolloutError, match="engine worker 0: RolloutError: .*wake_up"):
            pool.generate(PROMPTS, SAMPLING)
        pool.wake_up()
        pool.update_weights(state_dict_writer(random_state_dict(TINY, seed=0), pool.weight_layout([0]), 0))
        assert len(pool.generate(PROMPTS, SAMPLING).samples) == len(PROMPTS) * SAMPLING.n
        with pytest.raises(RolloutError, match="engine worker 1: RolloutError: .*vocab"):
            pool.generate([[1, 2], [TINY.vocab_size + 5]], SAMPLING)  # the second share's prompt is bad
        process = pool._workers[1][0]
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        with pytest.raises(RolloutError, match=rf"engine worker 1 \(pid {process.pid}\) exited with code -9"):
            pool.generate(PROMPTS, SAMPLING)
    finally:
        pool.close()
    assert not any(p.is_alive() for p, _ in pool._workers)


def test_a_worker_that_cannot_build_its_engine_is_one_error_with_its_reason():
    with pytest.raises(RolloutError, match="(?s)engine worker 0 could not start.*max_batch_size must be >= 1"):
        EnginePool(functools.partial(HFRolloutEngine, TINY, max_batch_size=0), 2)


@pytest.mark.parametrize("overrides,field", [
    (["rollout.engine=vllm", "rollout.tp=2"], "rollout.tp"),
    (["rollout.engine=vllm", "rollout.quantization=fp8"], "rollout.quantization"),
    (["rollout.engine=vllm", "rollout.exact=true", "model.dtype=bfloat16"], "rollout.exact"),
    (["rollout.overlap_scoring=true"], "rollout.overlap_scoring"),
    (["rollout.multi_turn.enabled=true", "rollout.multi_turn.env=megarl.agents.calculator:CalculatorEnv"],
     "rollout.multi_turn.enabled"),
    (["rollout.engine=vllm", "rollout.request_seeds=false"], "rollout.request_seeds"),
    (["actor.lora.rank=8", "actor.lora.sync=merged"], "actor.lora.rank"),
    (["trainer.mode=async", "placement.pools.train=[0]", "placement.pools.gen=[1]", "placement.actor=train",
      "placement.reference=train", "placement.rollout=gen"], "placement.rollout"),
])
def test_what_a_pool_cannot_run_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.engines_per_gpu=2", *overrides])
    assert field in str(e.value) and "rollout.engines_per_gpu=1" in str(e.value)


def test_the_memory_estimate_adds_the_staging_copy_and_checks_each_engines_share():
    """vLLM, 1.5B in bf16 on an 80 GiB GPU: two engines reserve what one does plus one bf16 copy of the weights
    (the staging tensors); 0.06 of the GPU holds the weights (~2.9 GiB) for one engine, not for each of two."""
    from megarl.launch.memory import check_rollout_weights, estimate_memory
    from megarl.models.spec import preset

    spec, gib = preset("qwen2.5-1.5b"), 2 ** 30
    base = ["model.path=preset:qwen2.5-1.5b", "rollout.engine=vllm", "model.dtype=bfloat16"]
    one, two = (estimate_memory(load_config(None, [*base, f"rollout.engines_per_gpu={k}"]), spec, 1, gpu=True,
                                device_bytes=80 * gib) for k in (1, 2))
    assert two.rollout - one.rollout == spec.num_params() * 2
    check_rollout_weights(load_config(None, [*base, "rollout.gpu_memory_utilization=0.06"]), spec, 80 * gib)
    with pytest.raises(ConfigError, match="over 2 engines.*lower rollout.engines_per_gpu"):
        check_rollout_weights(load_config(None, [*base, "rollout.gpu_memory_utilization=0.06",
                                                 "rollout.engines_per_gpu=2"]), spec, 80 * gib)


def test_a_run_with_two_engines_repeats_the_run_with_one(tmp_path):
    """Two GRPO steps of the tiny task (transformers engine) on two DP ranks, each rank's share of the prompts
    split again over its pool: every metric but the timings equal; the rollout log-probs' (the mismatch to the
    actor's) within float rounding between batch shapes."""
    model = make_tiny_model(tmp_path / "model")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    runs = {}
    for k in (1, 2):
        overrides = [*task_overrides(model, prompts, tmp_path / "runs", f"k{k}"), "trainer.steps=2",
                     "data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=16",
                     f"rollout.engines_per_gpu={k}", "validation.enabled=false", "actor.parallel.dp=2"]
        run_world(train_on_rank, 2, overrides, timeout_s=600)
        lines = (tmp_path / "runs" / f"k{k}" / "metrics.jsonl").read_text().splitlines()
        runs[k] = [{m: v for m, v in json.loads(line).items()
                    if not m.startswith(("time/", "throughput/", "perf/", "memory/", "pool/"))} for line in lines]
    assert len(runs[1]) == 2
    rollout_logprobs = ("mismatch/", "rollout_corr/", "actor/rollout_vs_old_logprob_diff")
    for one, two in zip(runs[1], runs[2]):
        assert one.keys() == two.keys()
        assert {m: v for m, v in two.items() if not m.startswith(rollout_logprobs)} == \
            {m: v for m, v in one.items() if not m.startswith(rollout_logprobs)}
        for m in (m for m in one if m.startswith(rollout_logprobs) and not m.endswith("exact_tokens_frac")):
            assert two[m] == pytest.approx(one[m], abs=1e-5), m  # (which floats are equal follows the rounding)
