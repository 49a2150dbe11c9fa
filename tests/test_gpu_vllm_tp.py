"""Two GPUs: vLLM engines of another TP than the Megatron actor, in the training processes, fed by the NCCL
reshard (marked ``gpu``; skipped without 2 GPUs or without vllm).

One world per layout (vLLM's parallel state is per process), all on the same weights: a small Qwen2-shaped
model (:data:`tests.test_gpu_vllm.SPEC`) drawn once from a seeded generator in canonical (HF) form and cut
into each rank's Megatron shard by the layout, in bf16:

- ``1gpu``: Megatron TP=1 -> vLLM TP=1 on one GPU (the reference run);
- ``tp2_to_vllm_tp1x2``: Megatron TP=2 -> two vLLM TP=1 engines (every rank receives the half it lacks);
- ``tp1dp2_to_vllm_tp2``: Megatron TP=1 x DP=2 -> one vLLM TP=2 engine (local copies only).

Each run decodes the prompts greedily and samples at temperature 1 over rollout data parallelism; greedy
output must equal the reference run's and the sampled-token log-probs must agree with the actor's own
teacher-forced ones (computed across the actor's TP group). Figures go to ``$OUT/gpu_vllm_tp.json`` when
``OUT`` is set.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.distributed import run_world
from tests.actor_decoding import actor_teacher_forced
from tests.test_gpu_vllm import GREEDY_TOKENS, SAMPLED, SPEC, _prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

RUNS = {"1gpu": (1, (1, 1, 1), 1), "tp2_to_vllm_tp1x2": (2, (2, 1, 1), 1), "tp1dp2_to_vllm_tp2": (2, (1, 1, 2), 2)}


def canonical_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's HF tensors (fp32, CPU): N(0, 0.02) like megatron's init, norms 1, embeddings x3 (peaked
    logits, see tests/test_gpu_vllm.py)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SPEC.hf_tensor_shapes().items():
        out[name] = torch.ones(shape) if "norm" in name else torch.randn(shape, generator=g) * 0.02
    out["model.embed_tokens.weight"] *= 3
    return out


def _run(rank: int, world: int, mesh_sizes: tuple[int, int, int], rollout_tp: int) -> dict:
    import time

    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel, ranks_per_node
    from megarl.reshard.executor import execute_plan
    from megarl.models.layout_megatron import megatron_layout
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.data_parallel import generate_data_parallel, rollout_dp_group
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    mesh = ParallelLayout(*mesh_sizes)
    initialize_model_parallel(mesh, seed=0)
    actor = build_model(SPEC, mesh, params_dtype=torch.bfloat16).cuda().eval()
    layout = megatron_layout(SPEC, mesh, padded_vocab=actor.vocab_size)
    weights = canonical_weights()
    params = dict(actor.named_parameters())
    with torch.no_grad():
        for name, lt in layout.tensors(rank).items():
            params[name].zero_()
            for b in lt.blocks:
                params[name][b.dst_box] = weights[b.name][b.src_box].to(params[name].dtype)
    engine = VLLMRolloutEngine(SPEC, tp=rollout_tp, gpu_memory_utilization=0.3, seed=0)
    plan = plan_reshard(layout, engine.weight_layout(range(world)), ranks_per_node(world))
    src = {n: p.detach() for n, p in params.items()}
    torch.cuda.synchronize()
    start = time.perf_counter()
    stats = engine.update_weights(lambda dst: execute_plan(plan, src, dst))
    reshard_s = time.perf_counter() - start
    group = rollout_dp_group(rollout_tp)
    prompts = _prompts()
    greedy = generate_data_parallel(engine, prompts, SamplingConfig(temperature=0.0, max_new_tokens=GREEDY_TOKENS),
                                    group)
    sampled = generate_data_parallel(engine, prompts, SamplingConfig(**SAMPLED), group)
    diffs = torch.cat([(actor_teacher_forced(actor, SPEC, prompts[s.prompt_index], s.token_ids)
                        - s.logprobs).abs()
                       for s in sampled.samples])  # every rank of a TP group runs the same forwards
    return dict(greedy=[list(s.token_ids) for s in greedy.samples], logprob_mean_diff=diffs.mean().item(),
                logprob_max_diff=diffs.max().item(), logprob_tokens=len(diffs), reshard_s=reshard_s,
                bytes_received=stats.bytes_received, bytes_copied_local=stats.bytes_copied_local,
                direct=stats.direct, rounds=stats.rounds)


@pytest.fixture(scope="module")
def runs():
    out = {name: run_world(_run, world, mesh, rollout_tp, timeout_s=400)
           for name, (world, mesh, rollout_tp) in RUNS.items()}
    for name, ranks in out.items():
        r = ranks[0]
        print(f"\n{name}: log-prob |vLLM - actor| mean {r['logprob_mean_diff']:.4f} max {r['logprob_max_diff']:.4f} "
              f"over {r['logprob_tokens']} tokens; greedy equal to 1gpu: {r['greedy'] == out['1gpu'][0]['greedy']}; "
              f"reshard {r['reshard_s'] * 1e3:.1f} ms (first call), received {r['bytes_received'] / 1e6:.1f} MB")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_vllm_tp.json"), "w") as f:
            json.dump(out, f, indent=1)
    return out


@pytest.mark.parametrize("name", [n for n in RUNS if n != "1gpu"])
def test_greedy_output_equals_the_single_gpu_run(runs, name):
    for rank, r in enumerate(runs[name]):
        assert r["greedy"] == runs["1gpu"][0]["greedy"], (name, rank)


@pytest.mark.parametrize("name", list(RUNS))
def test_sampled_logprobs_match_the_actor(runs, name):
    for r in runs[name]:
        assert r["logprob_mean_diff"] < 0.02 and r["logprob_max_diff"] < 0.5, (name, r)


def test_only_the_missing_half_crosses_between_gpus(runs):
    weights = sum(t.numel() for t in canonical_weights().values()) * 2  # bf16
    for r in runs["tp2_to_vllm_tp1x2"]:
        assert 0.4 * weights < r["bytes_received"] < 0.6 * weights, r  # the other TP rank's half
    assert all(r["bytes_received"] == 0 for r in runs["tp1dp2_to_vllm_tp2"])
