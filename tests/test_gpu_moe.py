"""GPU checks of a mixture-of-experts actor resharded into vLLM 0.24.0 (marked ``gpu``; skipped without CUDA or
without vllm): the Qwen3-30B-A3B shape cut to 4 layers (``preset:qwen3-30b-a3b?layers=4``: 128 experts of width
768, top-8, 3.1B parameters), random weights in bf16, one process, vLLM TP=1.

1. vLLM's fused-MoE parameters have the names and shapes of megarl's layout (the engine checks them when it
   starts), and hold what the reshard writes: vLLM's own ``load_weights`` of the actor's weights in checkpoint
   form (one tensor per expert) gives bit for bit the parameters that the reshard writes.
2. vLLM's greedy decoding against the actor's: every token vLLM picked greedily is, teacher-forced through the
   actor on vLLM's own sequence, the actor's argmax or within ``TIE`` of its max logit (a bf16 near-tie, which the
   two engines' kernels may break either way), and how many prompts decode the same as the actor's own greedy
   decoding (a full Megatron forward per token; a near-tie flips the rest of a sequence). The router's margins
   between its k-th and (k+1)-th expert (near-ties change the experts a token visits) are printed beside.
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
from tests.actor_decoding import actor_greedy, actor_logits, actor_teacher_forced
from tests.distributed import run_world
from tests.test_gpu_vllm import _prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

SPEC = preset("qwen3-30b-a3b?layers=4").replace(max_position_embeddings=1024)
GREEDY_TOKENS = 24
TIE = 0.125  # logits closer than this are a bf16 near-tie (sampled log-probs differ by up to 0.05, RESULTS.md)
SAMPLED = dict(n=2, temperature=1.0, max_new_tokens=32, seed=7)


def _check(rank, world):
    import time

    from megarl.models.layout_megatron import megatron_layout, megatron_rank_tensors
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
    r["actor_greedy"] = [actor_greedy(actor, SPEC, p, GREEDY_TOKENS) for p in prompts]
    r.update(_greedy_gaps(actor, prompts, r["vllm_greedy"]))

    # 3. sampled-token log-probs against the actor's
    sampled = engine.generate(prompts, SamplingConfig(**SAMPLED))
    diffs = torch.cat([(actor_teacher_forced(actor, SPEC, prompts[s.prompt_index], s.token_ids) - s.logprobs).abs()
                       for s in sampled.samples])
    r.update(logprob_mean_diff=diffs.mean().item(), logprob_max_diff=diffs.max().item(), logprob_tokens=len(diffs),
             tokens_per_s=sampled.stats.tokens_per_second)
    return r


def _greedy_gaps(actor, prompts, sequences) -> dict:
    """Teacher-forced through the actor on vLLM's greedy sequences: per token, the actor's max logit minus the
    logit of vLLM's token (``gap``, 0 where vLLM took the actor's argmax) and the actor's top-1 minus top-2 logit
    (``margin``); and the router's k-th minus (k+1)-th expert logit per token and layer."""
    routers = [m for n, m in actor.named_modules() if n.endswith("mlp.router")]
    router_inputs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: router_inputs.append((mod, args[0].detach())))
             for m in routers]
    gaps, margins, router_margins = [], [], []
    for prompt, tokens in zip(prompts, sequences):
        router_inputs.clear()
        logits = actor_logits(actor, prompt + tokens)[len(prompt) - 1:-1, :SPEC.vocab_size].float()
        top = logits.topk(2, dim=-1).values
        chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        gaps.append(top[:, 0] - chosen)
        margins.append(top[:, 0] - top[:, 1])
        for mod, hidden in router_inputs:
            scores = torch.nn.functional.linear(hidden.float(), mod.weight.float()).flatten(0, -2)
            kth = scores.topk(SPEC.moe_top_k + 1, dim=-1).values
            router_margins.append(kth[:, -2] - kth[:, -1])
    for h in hooks:
        h.remove()
    gap, margin, router = torch.cat(gaps), torch.cat(margins), torch.cat(router_margins)
    return {"greedy_max_gap": gap.max().item(), "greedy_not_argmax": int((gap > 0).sum()),
            "greedy_not_argmax_margins": margin[gap > 0].tolist(), "greedy_tokens": len(gap),
            "router_near_ties": int((router < 1e-2).sum()), "router_min_margin": router.min().item(),
            "router_choices": len(router)}


@pytest.fixture(scope="module")
def result():
    return run_world(_check, 1)[0]


def test_vllm_fused_moe_parameters_hold_what_the_reshard_writes(result):
    print(f"\nMoE vLLM layout: layer 0 parameters {result['layout_names']}")
    print(f"MoE vLLM reshard: {result['reshard_bytes'] / 2**30:.2f} GiB in {result['reshard_s'] * 1e3:.1f} ms "
          f"(again {result['reshard_again_s'] * 1e3:.1f} ms)")
    assert not result["layout_mismatch"], result["layout_mismatch"][:8]


def test_vllm_greedy_takes_the_actors_argmax_but_at_near_ties(result):
    same = sum(a == b for a, b in zip(result["vllm_greedy"], result["actor_greedy"]))
    print(f"MoE vLLM greedy: {same}/{len(result['actor_greedy'])} prompts equal the actor's own greedy decoding "
          f"({GREEDY_TOKENS} tokens); {result['greedy_not_argmax']} of {result['greedy_tokens']} vLLM tokens not the "
          f"actor's argmax, at actor top-1/top-2 margins {[round(m, 4) for m in result['greedy_not_argmax_margins']]}"
          f" (largest gap to the max logit {result['greedy_max_gap']:.4f}); router k-th/(k+1)-th expert margin "
          f"below 0.01 in {result['router_near_ties']} of {result['router_choices']} token-layer choices "
          f"(smallest {result['router_min_margin']:.2e})")
    assert result["greedy_max_gap"] <= TIE


def test_vllm_sampled_logprobs_match_the_actors(result):
    print(f"MoE vLLM log-prob |vLLM - actor| over {result['logprob_tokens']} sampled tokens: mean "
          f"{result['logprob_mean_diff']:.4f}, max {result['logprob_max_diff']:.4f}; "
          f"{result['tokens_per_s']:.0f} tokens/s")
    assert result["logprob_mean_diff"] < 0.05
