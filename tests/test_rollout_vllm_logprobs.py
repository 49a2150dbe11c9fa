"""``rollout.logprobs: sampler`` (:mod:`megarl.rollout.vllm_logprobs`) on a CPU.

:func:`~megarl.rollout.vllm_logprobs.assemble` against a plain-Python reference (each output token's log-prob is
that of the last kept sampler row of its request at its index) on continuous-batching runs with chunked prefill,
preemption, async rows past the stop, requests that are not collected (aborted) and several samples of one
prompt; its refusals. The vLLM engine through the fake vLLM (:mod:`tests.fake_vllm.vllm`, whose V1 and V2 model
runners hand their sampler rows to the hooks) gives the same rollout batch with ``sampler`` as with ``output``.
The bit-for-bit check against vLLM's own ``logprobs=0`` is tests/test_gpu_logprobs.py.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.rollout.base import RolloutError
from megarl.rollout.vllm_logprobs import Step, assemble
from tests.distributed import run_world
from tests.test_rollout_vllm_tp import _fake_vllm

PROMPTS = [[3, 5, 7], [11], [2, 4, 6, 8, 10], [9, 9], [1, 2, 3, 4, 5, 6, 7], [13, 1, 4]]


def _requests(count: int, seed: int) -> list[tuple[str, int, list[int], list[float]]]:
    rng = random.Random(seed)
    return [(f"{k}-{rng.randrange(16 ** 8):08x}", rng.randint(1, 7), [rng.randrange(50) for _ in range(n)],
             [-rng.random() * 4 for _ in range(n)]) for k in range(count) for n in [rng.randint(1, 9)]]


def _steps(rows_per_step, as_tensors: bool) -> list[Step]:
    def field(values, dtype):
        return torch.tensor(values, dtype=dtype) if as_tensors else np.array(values)

    return [Step([r.req_id for r in rows], field([r.index for r in rows], torch.int64),
                 field([r.kept for r in rows], torch.bool), torch.tensor([r.token for r in rows], dtype=torch.int32),
                 torch.tensor([r.logprob for r in rows], dtype=torch.float32)) for rows in rows_per_step]


def _reference(rows_per_step, requests) -> dict[str, list[float]]:
    """Plain Python: output token t of a request is its last kept row at index prompt + t."""
    out = {}
    for rid, (plen, tokens) in requests.items():
        values = []
        for t, token in enumerate(tokens):
            hits = [r for rows in rows_per_step for r in rows if r.req_id == rid and r.kept and r.index == plen + t]
            assert hits[-1].token == token
            values.append(float(np.float32(hits[-1].logprob)))
        out[rid] = values
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("as_tensors", [False, True])
def test_assemble_equals_the_plain_python_reference(seed, as_tensors):
    from tests.fake_vllm.vllm.runners import sampler_rows

    reqs = _requests(10, seed)
    rows = sampler_rows(reqs, seed=seed)
    assert any(not r.kept and r.index >= reqs[int(r.req_id.split("-")[0])][1] for s in rows for r in s), \
        "the run recomputes a preempted request (discarded rows inside its output)"
    collected = {rid: (plen, tokens) for rid, plen, tokens, _ in reqs[1:]}  # request 0: aborted, not collected
    got = assemble(_steps(rows, as_tensors), collected)
    want = _reference(rows, collected)
    assert {k: v.tolist() for k, v in got.items()} == want
    assert all(v.dtype == np.float32 for v in got.values())
    assert want == {rid: [float(np.float32(v)) for v in values] for rid, _, _, values in reqs[1:]}


def test_assemble_takes_the_last_kept_row_and_samples_of_one_prompt_apart():
    from tests.fake_vllm.vllm.runners import Row

    rows = [[Row("a-1", 3, True, 7, -1.0), Row("b-2", 3, True, 8, -2.0)],  # two samples of one 3-token prompt
            [Row("a-1", 4, True, 5, -0.5), Row("b-2", 3, True, 8, -2.5)],  # b's token 0 sampled again (last wins)
            [Row("a-1", 5, True, 1, -9.0), Row("b-2", 2, False, 8, -7.0)]]  # a: past its stop; b: a discarded row
    got = assemble(_steps(rows, False), {"a-1": (3, [7, 5]), "b-2": (3, [8])})
    assert {k: v.tolist() for k, v in got.items()} == {"a-1": [-1.0, -0.5], "b-2": [-2.5]}


def test_assemble_refuses_missing_rows_and_other_tokens():
    from tests.fake_vllm.vllm.runners import Row

    rows = [[Row("a-1", 3, True, 7, -1.0)], [Row("a-1", 4, False, 5, -0.5)]]
    with pytest.raises(RolloutError, match=r"1 of 2 output tokens have no sampler row \(e.g. request 'a-1' token 1\)"):
        assemble(_steps(rows, False), {"a-1": (3, [7, 5])})
    with pytest.raises(RolloutError, match=r"request 'a-1' token 0: output 6, row 7"):
        assemble(_steps(rows[:1], False), {"a-1": (3, [6])})


def _engines_on_fake_vllm(rank: int, world: int) -> dict:
    _fake_vllm()
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings

    spec = ModelSpec("llama", 64, 16, 1, 2, 1, 8, 32, tie_word_embeddings=True, max_position_embeddings=64)
    out = {}
    for runner in ("v1", "v2"):
        for temperature in (1.0, 0.0):
            sampling = SamplingConfig(n=3, temperature=temperature, max_new_tokens=6, seed=5, stop_token_ids=(0,))
            batches = {}
            for source in ("output", "sampler"):
                engine = VLLMRolloutEngine(spec, settings=VLLMSettings(model_runner=runner, logprobs=source))
                engine.update_weights(lambda params: [p.fill_(0.25) for p in params.values()])
                result = engine.generate(PROMPTS, sampling, prompt_offset=2)
                batches[source] = [(s.prompt_index, s.sample_index, s.token_ids, s.logprobs.dtype,
                                    s.logprobs.numpy().tobytes(), s.finish_reason) for s in result.samples]
                batches[source + "_runner"] = type(engine._runner).__name__
            out[(runner, temperature)] = batches
    return out


@pytest.fixture(scope="module")
def engines():
    return run_world(_engines_on_fake_vllm, 1)[0]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampler_logprobs_give_the_same_rollout_batch_as_vllms_output(engines, runner, temperature):
    batches = engines[(runner, temperature)]
    assert batches["sampler_runner"] == batches["output_runner"] == f"Runner{runner.upper()}"
    assert len(batches["output"]) == len(PROMPTS) * 3
    assert sum(len(b[2]) for b in batches["output"]) > 3 * len(PROMPTS)  # more than one token a sample
    assert batches["sampler"] == batches["output"]


def test_config_refuses_other_sources_and_the_hf_engine():
    assert load_config(None, ["rollout.engine=vllm", "rollout.logprobs=sampler"]).rollout.logprobs == "sampler"
    with pytest.raises(ConfigError, match=r"rollout\.logprobs: must be one of \['output', 'sampler'\], got 'gpu'"):
        load_config(None, ["rollout.engine=vllm", "rollout.logprobs=gpu"])
    with pytest.raises(ConfigError, match=r"rollout\.logprobs: sampler reads vLLM's sampler, but rollout\.engine=hf"):
        load_config(None, ["rollout.logprobs=sampler"])
