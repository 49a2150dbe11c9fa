"""GPU check of router replay with vLLM 0.24.0 (``actor.moe.router_replay``, issue 32; marked ``gpu``; skipped without
CUDA or without vllm): the Qwen3-30B-A3B shape cut to 4 layers (``preset:qwen3-30b-a3b?layers=4``: 128 experts,
top-8), its random preset weights in bf16, one process, vLLM TP=1 with ``record_routes``.

The actor (a trainable :class:`~megarl.workers.actor.PolicyWorker`, as in a run) is resharded into vLLM, vLLM
samples responses and returns their routed experts, and the actor's old-log-prob pass runs on the samples' batch
with replay on, then off. What its routers dispatched is read by the test's own hooks on megatron's routers
(:func:`tests.test_router_replay.record_dispatch`), against vLLM's routes: with replay every token vLLM routed
goes to vLLM's experts in every layer (agreement 1.0). Printed, one line each ("R3 vLLM ..."): the agreement
without replay per layer, and the rollout-vs-old log-prob difference (|vLLM's sampled log-prob - the actor's|,
mean and max over the response tokens) with and without replay.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megarl.models.spec import preset
from tests.distributed import run_world
from tests.test_gpu_vllm import _prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

MODEL = "qwen3-30b-a3b?layers=4"
SPEC = preset(MODEL).replace(max_position_embeddings=1024)
SAMPLED = dict(n=4, temperature=1.0, max_new_tokens=64, seed=7)
MBS = 4  # old-log-prob micro-batch rows


def _check(rank, world):
    from megarl.config import ActorConfig, MoEConfig
    from megarl.models.checkpoint import as_chunks
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.router_replay import ROUTES
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine
    from megarl.data.batch import build_batch
    from megarl.workers.actor import PolicyWorker
    from tests.test_router_replay import dispatch_agreement, record_dispatch

    mesh = ParallelLayout()
    initialize_model_parallel(mesh, seed=0)
    samples = SAMPLED["n"] * len(_prompts())
    rc = ActorConfig(micro_batch_size=MBS, logprob_micro_batch_size=MBS, ppo_mini_batch_size=samples,
                     moe=MoEConfig(router_replay=True))
    worker = PolicyWorker(SPEC, mesh, "actor", "preset:" + MODEL, torch.bfloat16, rc, trainable=True,
                          temperature=1.0)
    engine = VLLMRolloutEngine(SPEC, tp=1, gpu_memory_utilization=0.35, seed=0, enforce_eager=True,
                               record_routes=True)
    plan = plan_reshard(megatron_layout(SPEC, mesh, use_te=rc.kernels.transformer_engine,
                                        padded_vocab=as_chunks(worker.model)[0].vocab_size),
                        engine.weight_layout([0]))
    engine.update_weights(lambda dst: execute_plan(plan, worker.source_tensors(), dst))

    prompts = [[t % SPEC.vocab_size for t in p] for p in _prompts()]
    out = engine.generate(prompts, SamplingConfig(**SAMPLED)).samples
    batch = build_batch([prompts[s.prompt_index] for s in out], [s.token_ids for s in out],
                        [s.logprobs for s in out], [s.prompt_index for s in out], pad_token_id=0,
                        routed_experts=[s.routed_experts for s in out])
    mask = batch["response_mask"].bool()
    rollout = torch.stack([torch.nn.functional.pad(s.logprobs, (0, mask.shape[1] - len(s.logprobs))) for s in out])
    r = {"routes": [(tuple(s.routed_experts.shape), s.routed_experts.dtype,
                     len(prompts[s.prompt_index]) + len(s.token_ids) - 1) for s in out],
         "tokens": int(mask.sum())}
    used = record_dispatch(worker.model)
    for replay in (True, False):
        worker.routes.replay = replay
        logprobs = worker.compute_logprobs(batch)["logprobs"].float().cpu()
        diff = (logprobs - rollout)[mask].abs()
        r[replay] = {"dispatch": dispatch_agreement(used, batch[ROUTES], MBS), "metrics": worker.routing_agreement(),
                     "logprob_mean_diff": diff.mean().item(), "logprob_max_diff": diff.max().item()}
    return r


def test_router_replay_routes_the_actor_to_vllms_experts(capsys):
    r = run_world(_check, 1)[0]
    on, off = r[True], r[False]
    for name, x in (("with replay", on), ("without replay", off)):
        with capsys.disabled():  # the figures are printed without -s too
            print(f"\nR3 vLLM {name}: routing agreement per layer {[round(a, 4) for a in x['dispatch']]} (metric "
                  f"{x['metrics']['moe/routing_agreement']:.4f}); rollout-vs-old log-prob |diff| mean "
                  f"{x['logprob_mean_diff']:.4f} max {x['logprob_max_diff']:.4f} over {r['tokens']} response tokens")
    # vLLM's routes: int16, one row per token but the last, every layer, top-8
    assert all(shape == (n, SPEC.num_layers, SPEC.moe_top_k) and dtype == torch.int16
               for shape, dtype, n in r["routes"]), r["routes"][:4]
    # with replay the actor's routers dispatch every token vLLM routed to vLLM's experts, in every layer
    assert on["dispatch"] == [1.0] * SPEC.num_layers, on["dispatch"]
    # the metric is the routers' own choice, replay or not (issue 48): without replay what they dispatched, with
    # replay the top-k of their own scores, in layer 0 (whose input replay does not change) the same
    assert off["metrics"]["moe/routing_agreement"] == pytest.approx(sum(off["dispatch"]) / SPEC.num_layers)
    assert on["metrics"]["moe/routing_agreement/layer_0"] == pytest.approx(off["dispatch"][0]), on["metrics"]
