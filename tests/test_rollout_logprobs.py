"""The transformers engine's sampled-token log-probs equal the Megatron actor's teacher-forced log-probs, and
data-parallel generation equals one engine generating everything.

One 2-rank gloo world: both ranks run the same engine on the same random weights (GQA, tied embeddings, a
vocab that Megatron pads), then the actor at TP=2 and at TP=1 (x DP=2) re-scores every prompt + response with
:func:`vocab_parallel_logprobs`, for temperature 1, temperature 0.7 with top-k/top-p, and greedy; prompts of
different lengths (left padding in the engine), EOS-terminated and length-truncated samples.
"""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.base import SamplingConfig
from tests.distributed import run_world
from tests.test_rollout_hf_engine import PROMPTS, TINY, loaded_engine, pick_stop_token, random_state_dict

CONFIGS = {
    "t1": SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=11),
    "t0.7_topk_topp": SamplingConfig(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=16, seed=12),
    "greedy": SamplingConfig(temperature=0.0, max_new_tokens=16),
}
PROMPTS_DP = PROMPTS + [[60, 61, 62]]  # 7 prompts: shards of 4 and 3


def actor_logprobs(model, spec, prompts, out, temperature: float) -> list[torch.Tensor]:
    """Teacher-forced log-probs of every sample's response tokens, from right-padded prompt + response."""
    from megarl.models.logprobs import vocab_parallel_logprobs

    seqs = [prompts[s.prompt_index] + list(s.token_ids) for s in out.samples]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, seq in enumerate(seqs):
        ids[i, :len(seq)] = torch.tensor(seq)
    positions = torch.arange(width).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, None)  # [b, s, padded_vocab / tp]; causal, no mask needed
        lp, _ = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size,
                                        temperature=temperature or 1.0)
    starts = [len(prompts[s.prompt_index]) - 1 for s in out.samples]
    return [lp[i, a:a + len(s.token_ids)] for i, (a, s) in enumerate(zip(starts, out.samples))]


def _world(rank, world):
    from megatron.core import parallel_state as ps

    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.rollout.data_parallel import generate_data_parallel

    weights = random_state_dict(TINY, seed=1)
    probe = loaded_engine(TINY, weights)
    eos = pick_stop_token([probe.generate(PROMPTS, c) for c in CONFIGS.values() if not c.greedy])
    spec = TINY.replace(eos_token_ids=(eos,))
    engine = loaded_engine(spec, weights, rank=rank, max_batch_size=5)
    outputs = {name: engine.generate(PROMPTS, c) for name, c in CONFIGS.items()}
    result = {"reasons": {n: sorted({s.finish_reason for s in o.samples}) for n, o in outputs.items()},
              "diff": {}, "checked": {}}
    for tp in (2, 1):
        mesh = ParallelLayout(tp=tp, dp=world // tp)
        initialize_model_parallel(mesh)
        model = build_model(spec, mesh).eval()
        fill_local_tensors(megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(), 0),
                           dict(model.named_parameters()), state_dict_reader(weights, spec.hf_tensor_shapes()))
        for name, out in outputs.items():
            ref = actor_logprobs(model, spec, PROMPTS, out, CONFIGS[name].temperature)
            result["diff"][(tp, name)] = max((s.logprobs - r).abs().max().item() for s, r in zip(out.samples, ref))
            result["checked"][(tp, name)] = sum(len(r) for r in ref)
        # A wrong temperature is caught: the check can fail.
        out = outputs["t0.7_topk_topp"]
        ref = actor_logprobs(model, spec, PROMPTS, out, 1.0)
        result["diff_wrong_temperature"] = max((s.logprobs - r).abs().max().item()
                                               for s, r in zip(out.samples, ref))
    ps.destroy_model_parallel()

    sampling = CONFIGS["t1"]
    whole = loaded_engine(spec, weights).generate(PROMPTS_DP, sampling)
    dp = generate_data_parallel(loaded_engine(spec, weights, rank=rank), PROMPTS_DP, sampling)
    result["dp_equal_tokens"] = [s.token_ids for s in dp.samples] == [s.token_ids for s in whole.samples]
    result["dp_index"] = [(s.prompt_index, s.sample_index) for s in dp.samples]
    result["dp_logprob_diff"] = max((a.logprobs - b.logprobs).abs().max().item() if a.token_ids == b.token_ids
                                    else float("inf") for a, b in zip(dp.samples, whole.samples))
    result["dp_tokens"] = (dp.stats.generated_tokens, whole.stats.generated_tokens)
    return result


@pytest.fixture(scope="module")
def world():
    return run_world(_world, 2)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generation_logprobs_equal_actor_teacher_forced(world, tp, name):
    for r in world:
        assert r["checked"][(tp, name)] > 50
        assert r["diff"][(tp, name)] <= 1e-4, r["diff"]


def test_samples_cover_eos_and_length_truncation(world):
    for r in world:
        assert r["reasons"]["t1"] == ["length", "stop"]
        assert r["reasons"]["t0.7_topk_topp"] == ["length", "stop"]


def test_wrong_temperature_is_detected(world):
    assert all(r["diff_wrong_temperature"] > 0.1 for r in world)


def test_data_parallel_generation_equals_one_engine(world):
    n = CONFIGS["t1"].n
    for r in world:
        assert r["dp_equal_tokens"]
        assert r["dp_index"] == [(k, j) for k in range(len(PROMPTS_DP)) for j in range(n)]
        assert r["dp_logprob_diff"] <= 1e-5
        assert r["dp_tokens"][0] == r["dp_tokens"][1]


def _sliding_window_world(rank, world):
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    spec = TINY.replace(family="mistral", sliding_window=4)
    weights = random_state_dict(spec, seed=2)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=13)
    out = loaded_engine(spec, weights, max_batch_size=5).generate(PROMPTS, sampling)
    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    diffs = {}
    for name, s in (("window", spec), ("full", spec.replace(sliding_window=None))):
        model = build_model(s, mesh).eval()
        fill_local_tensors(megatron_rank_tensors(s, mesh, 0, 0), dict(model.named_parameters()),
                           state_dict_reader(weights, s.hf_tensor_shapes()))
        ref = actor_logprobs(model, s, PROMPTS, out, 1.0)
        diffs[name] = max((x.logprobs - r).abs().max().item() for x, r in zip(out.samples, ref))
    return diffs


def test_sliding_window_generation_logprobs_equal_actor_teacher_forced():
    """Mistral with a 4-token window, responses of 16 tokens from left-padded prompts: the transformers
    engine's log-probs equal the windowed Megatron actor's, and not a full-attention actor's."""
    diffs = run_world(_sliding_window_world, 1)[0]
    assert diffs["window"] <= 1e-4 and diffs["full"] > 1e-2, diffs
