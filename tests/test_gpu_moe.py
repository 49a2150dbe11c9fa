"""GPU checks of a mixture-of-experts actor resharded into vLLM 0.24.0 (marked ``gpu``; skipped without CUDA or
without vllm): the Qwen3-30B-A3B shape cut to 4 layers (``preset:qwen3-30b-a3b?layers=4``: 128 experts of width
768, top-8, 3.1B parameters), random weights in bf16, one process, vLLM TP=1.

1. vLLM's fused-MoE parameters have the names and shapes of megarl's layout (the engine checks them when it
   starts), and hold what the reshard writes: vLLM's own ``load_weights`` of the actor's weights in checkpoint
   form (one tensor per expert) gives bit for bit the parameters that the reshard writes.
2. vLLM's greedy decoding equals the actor's own (a full Megatron forward per token).
3. Sampled tokens' log-probs (temperature 1) against the actor's teacher-forced ones: |diff| mean and max.
4. The reshard time.

The actor's embeddings are scaled by 3 and its routers by 8, so that logits and routing are peaked: with flat
random logits bf16 rounding flips near-ties in the top-k of the router or the vocab (GPU.md), and the comparison
says nothing. Prints one line per figure, "MoE vLLM ..." (perf/gpu_moe.sh collects them).
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

SPEC = preset("qwen3-30b-a3b?layers=4").replace(max_position_embeddings=1024)
GREEDY_TOKENS = 24
SAMPLED = dict(n=2, temperature=1.0, max_new_tokens=32, seed=7)


def _logits(model, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    positions = torch.arange(len(ids), device=device).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, positions, None)[0]


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(steps):
        token = int(_logits(model, ids)[-1, :SPEC.vocab_size].float().argmax())
        out.append(token)
        ids.append(token)
        if token in SPEC.eos_token_ids:
            break
    return out


def _teacher_forced(model, prompt: list[int], response) -> torch.Tensor:
    from megarl.models.logprobs import vocab_parallel_logprobs

    ids = list(prompt) + list(response)
    with torch.no_grad():
        logits = _logits(model, ids)[None]
        labels = torch.tensor([ids[1:] + [0]], device=logits.device)
        logp, _ = vocab_parallel_logprobs(logits, labels, vocab_size=SPEC.vocab_size)
    return logp[0, len(prompt) - 1:len(ids) - 1].float().cpu()


def _check(rank, world):
    import time

    from megarl.models.layout import megatron_layout, megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import assemble_canonical
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    mesh = ParallelLayout()
    initialize_model_parallel(mesh, seed=0)
    actor = build_model(SPEC, mesh, params_dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        actor.embedding.word_embeddings.weight.mul_(3)
        for name, p in actor.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.mul_(8)
    engine = VLLMRolloutEngine(SPEC, tp=1, gpu_memory_utilization=0.45, seed=0, enforce_eager=True)
    src = {n: p.detach() for n, p in actor.named_parameters()}
    plan = plan_reshard(megatron_layout(SPEC, mesh, padded_vocab=actor.vocab_size), engine.weight_layout([0]))
    r = {}

    # 1. vLLM's own loader on the checkpoint form of the actor's weights vs the reshard
    canonical = assemble_canonical(megatron_rank_tensors(SPEC, mesh, 0, 0, padded_vocab=actor.vocab_size), src,
                                   SPEC.hf_tensor_shapes())
    engine.model.load_weights(iter(canonical.items()))
    loaded = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    del canonical
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.update_weights(lambda dst: execute_plan(plan, src, dst))
    torch.cuda.synchronize()
    r["reshard_s"] = time.perf_counter() - start
    params = dict(engine.model.named_parameters())
    r["layout_mismatch"] = [n for n, t in loaded.items() if not torch.equal(params[n], t)]
    r["layout_names"] = sorted(n for n in loaded if "layers.0." in n)
    del loaded
    start = time.perf_counter()
    engine.update_weights(lambda dst: execute_plan(plan, src, dst))
    torch.cuda.synchronize()
    r["reshard_again_s"] = time.perf_counter() - start
    r["reshard_bytes"] = sum(p.numel() * p.element_size() for p in engine.model.parameters())

    # 2. greedy decoding equals the actor's own
    prompts = [[t % SPEC.vocab_size for t in p] for p in _prompts()]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    r["vllm_greedy"] = [list(s.token_ids) for s in engine.generate(prompts, greedy).samples]
    r["actor_greedy"] = [_greedy(actor, p, GREEDY_TOKENS) for p in prompts]

    # 3. sampled-token log-probs against the actor's
    sampled = engine.generate(prompts, SamplingConfig(**SAMPLED))
    diffs = torch.cat([(_teacher_forced(actor, prompts[s.prompt_index], s.token_ids) - s.logprobs).abs()
                       for s in sampled.samples])
    r.update(logprob_mean_diff=diffs.mean().item(), logprob_max_diff=diffs.max().item(), logprob_tokens=len(diffs),
             tokens_per_s=sampled.stats.tokens_per_second)
    return r


@pytest.fixture(scope="module")
def result():
    return run_world(_check, 1)[0]


def test_vllm_fused_moe_parameters_hold_what_the_reshard_writes(result):
    print(f"\nMoE vLLM layout: layer 0 parameters {result['layout_names']}")
    print(f"MoE vLLM reshard: {result['reshard_bytes'] / 2**30:.2f} GiB in {result['reshard_s'] * 1e3:.1f} ms "
          f"(again {result['reshard_again_s'] * 1e3:.1f} ms)")
    assert not result["layout_mismatch"], result["layout_mismatch"][:8]


def test_vllm_greedy_equals_the_actors(result):
    same = sum(a == b for a, b in zip(result["vllm_greedy"], result["actor_greedy"]))
    print(f"MoE vLLM greedy: {same}/{len(result['actor_greedy'])} prompts equal the actor's "
          f"({GREEDY_TOKENS} tokens)")
    assert result["vllm_greedy"] == result["actor_greedy"]


def test_vllm_sampled_logprobs_match_the_actors(result):
    print(f"MoE vLLM log-prob |vLLM - actor| over {result['logprob_tokens']} sampled tokens: mean "
          f"{result['logprob_mean_diff']:.4f}, max {result['logprob_max_diff']:.4f}; "
          f"{result['tokens_per_s']:.0f} tokens/s")
    assert result["logprob_mean_diff"] < 0.05
