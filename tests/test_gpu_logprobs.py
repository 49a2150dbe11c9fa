"""GPU check of ``rollout.logprobs: sampler`` (:mod:`megarl.rollout.vllm_logprobs`; marked ``gpu``, skipped without
CUDA or vllm): the log-probs gathered in vLLM 0.24.0's sampler equal vLLM's own ``logprobs=0`` output bit for
bit, with the V1 and the V2 model runner, eager and with CUDA graphs (one vLLM start per case, ~35-60 s).

Per case, one engine (a small Qwen2-shaped model with random weights, peaked logits) with small batch limits
(16 sequences, 64 tokens a step), so that 24 prompts of 5 to 150 tokens, 2 samples each, prefill in chunks and
decode in waves of changing batches, with async scheduling (vLLM's default):

- vLLM's ``LLM.generate`` with ``logprobs=0`` while the capture records: every request's captured log-probs
  equal vLLM's ``Logprob`` values, sampled (temperature 1, seeded) and greedy;
- the engine's own ``generate`` (requests with ``logprobs=None``, the capture's values): the samples whose tokens
  equal the first call's have the same log-probs bit for bit (greedy on V1: the all-greedy branch, where vLLM's
  sampler computes no log-probs unless asked). Two runs of vLLM are not bitwise reproducible everywhere (a
  near-tie may flip a token, tests/test_gpu_vllm.py), so at least half the samples must match;
- the request path of multi-turn episodes (16 episodes of 3 turns, each turn joining the running batch a step or
  two after the last ended, its prompt the last turn's prompt, tokens and an observation): requests asking for
  ``logprobs=0`` through ``SampledLogprobs.add`` / ``step`` get captured log-probs equal to vLLM's, and the
  engine's own ``add_request`` / ``step`` (no log-probs asked) give the turns with the same prompt and tokens
  the same values.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

SPEC = ModelSpec("qwen2", vocab_size=4000, hidden_size=512, num_layers=4, num_attention_heads=8, num_kv_heads=2,
                 head_dim=64, ffn_hidden_size=1408, rope_theta=1e6, tie_word_embeddings=True,
                 max_position_embeddings=1024, eos_token_ids=(3999,))
CASES = [("v1", True), ("v1", False), ("v2", True), ("v2", False)]  # model runner, enforce_eager


def _random_weights(params: dict[str, torch.Tensor]) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in params.items():
            if "norm" in name:
                p.fill_(1)
            elif name.endswith("bias"):
                p.zero_()
            else:  # larger embeddings (tied: the output layer too): peaked logits
                p.normal_(0, 0.08 if "embed" in name else 0.02, generator=g)


def _check(rank, world, runner, enforce_eager):
    import numpy as np
    from vllm import SamplingParams, TokensPrompt

    from megarl.rollout.base import SamplingConfig, sample_rows, sample_seed
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, VLLMSettings, request_params

    settings = VLLMSettings(model_runner=runner, logprobs="sampler", max_num_seqs=16, max_num_batched_tokens=64)
    engine = VLLMRolloutEngine(SPEC, gpu_memory_utilization=0.3, enforce_eager=enforce_eager, settings=settings)
    engine.update_weights(_random_weights)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SPEC.vocab_size - 1, (int(n),), generator=g).tolist()
               for n in torch.linspace(5, 150, 24)]
    context = SPEC.max_position_embeddings
    r = {"v2": bool(engine.llm.llm_engine.vllm_config.use_v2_model_runner)}
    for name, sampling in (("sampled", SamplingConfig(n=2, temperature=1.0, max_new_tokens=40, seed=3)),
                           ("greedy", SamplingConfig(n=2, temperature=0.0, max_new_tokens=40, seed=3))):
        rows = sample_rows(len(prompts), sampling.n)
        params = [SamplingParams(**request_params(prompts[k], sampling, context=context,
                                                  stop_token_ids=list(SPEC.eos_token_ids),
                                                  seed=sample_seed(sampling.seed, engine.calls, k, j)))
                  for k, j in rows]
        engine._reset_prefix_cache()
        outputs, got = engine._logprobs.run(
            lambda: engine.llm.generate([TokensPrompt(prompt_token_ids=prompts[k]) for k, _ in rows], params,
                                        use_tqdm=False), [len(prompts[k]) for k, _ in rows])
        want = [np.array([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                         dtype=np.float32) for o in outputs]
        r[f"{name}_total"] = len(want)
        r[f"{name}_tokens"] = sum(len(w) for w in want)
        r[f"{name}_equal"] = sum(a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))
                                 for a, b in zip(got, want))
        engine._reset_prefix_cache()
        samples = engine.generate(prompts, sampling).samples  # the same seeds: engine.calls was not advanced
        same = [(s, w) for s, o, w in zip(samples, outputs, want) if list(s.token_ids) == list(o.outputs[0].token_ids)]
        r[f"{name}_engine_same_tokens"] = len(same)
        r[f"{name}_engine_equal"] = sum(np.array_equal(s.logprobs.numpy().view(np.int32), w.view(np.int32))
                                        for s, w in same)
        r.update(_check_turns(engine, prompts, sampling, name))
    return r


def _turns(prompts, add, step) -> dict:
    """Multi-turn episodes, one per prompt, three turns each: episode ``e`` starts at step ``e``; each next turn
    (prompt: the last turn's prompt, its tokens and 5 observation tokens) joins one or two steps after the last
    finished, beside the other episodes' turns. ``add(request_id, prompt, seed)`` adds a turn, ``step()`` gives
    the finished ones as ``(request_id, token ids, log-probs, reference log-probs)``; returns request id ->
    ``(prompt, token ids, log-probs, reference log-probs)``."""
    episodes = {e: {"prompt": list(p), "turn": 0, "at": e} for e, p in enumerate(prompts)}
    running, out, step_number = {}, {}, 0
    while episodes:
        for e, ep in episodes.items():
            if ep["at"] <= step_number and e not in running.values():
                rid = f"megarl-{e}-{ep['turn']}"
                running[rid] = e
                out[rid] = (list(ep["prompt"]),)
                add(rid, ep["prompt"], 1000 * e + ep["turn"])
        for rid, tokens, values, reference in step():
            e = running.pop(rid)
            ep = episodes[e]
            out[rid] += (list(tokens), values, reference)
            ep["prompt"] += list(tokens) + [(7 * e + i) % 3000 for i in range(5)]
            ep["turn"], ep["at"] = ep["turn"] + 1, step_number + 1 + e % 2
            if ep["turn"] == 3:
                del episodes[e]
        step_number += 1
    return out


def _check_turns(engine, prompts, sampling, name) -> dict:
    """The request path (multi-turn episodes, :func:`_turns`): requests asking vLLM for ``logprobs=0`` added
    through the capture (``SampledLogprobs.add`` / ``step``): every turn's captured log-probs equal vLLM's
    ``Logprob`` values bit for bit; then the engine's own ``add_request`` / ``step`` (no log-probs asked):
    the turns with the same prompt and tokens have the same log-probs."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import request_params

    turn = SamplingConfig(n=1, temperature=sampling.temperature, max_new_tokens=24, seed=sampling.seed)
    capture, llm_engine, stop = engine._logprobs, engine.llm.llm_engine, list(SPEC.eos_token_ids)

    def add(rid, prompt, seed):
        params = SamplingParams(**request_params(prompt, turn, context=SPEC.max_position_embeddings,
                                                 stop_token_ids=stop, seed=seed),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        capture.add(rid, len(prompt), params.max_tokens,
                    lambda: llm_engine.add_request(rid, tokens_input(prompt), params))

    def step():
        return [(o.request_id, c.token_ids, got, np.array([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                                                          dtype=np.float32))
                for o, got in capture.step(llm_engine.step) for c in o.outputs[:1]]

    def bits(a):
        return np.asarray(a, dtype=np.float32).view(np.int32)

    engine._reset_prefix_cache()
    direct = _turns(prompts[:16], add, step)
    engine._reset_prefix_cache()
    own = _turns(prompts[:16], lambda rid, prompt, seed: engine.add_request(rid, prompt, turn, seed),
                 lambda: [(c.request_id, c.token_ids, c.logprobs.numpy(), None) for c in engine.step()])
    same = [k for k in direct if direct[k][:2] == own[k][:2]]
    return {f"{name}_turns_total": len(direct), f"{name}_turns_tokens": sum(len(t[1]) for t in direct.values()),
            f"{name}_turns_equal": sum(np.array_equal(bits(t[2]), bits(t[3])) for t in direct.values()),
            f"{name}_turns_engine_same": len(same),
            f"{name}_turns_engine_equal": sum(np.array_equal(bits(own[k][2]), bits(direct[k][3])) for k in same)}


@pytest.fixture(scope="module", params=CASES, ids=[f"{r}-{'eager' if e else 'cuda_graphs'}" for r, e in CASES])
def result(request):
    r = run_world(_check, 1, *request.param, timeout_s=600)[0]
    print(f"\n{request.param}: {r}")
    return r


def test_runner_is_the_one_asked_for(result, request):
    assert result["v2"] == (request.node.callspec.params["result"][0] == "v2")


@pytest.mark.parametrize("kind", ["sampled", "greedy"])
def test_captured_logprobs_equal_vllms_logprobs_output_bit_for_bit(result, kind):
    assert result[f"{kind}_tokens"] > result[f"{kind}_total"]  # more than one token a sample
    assert result[f"{kind}_equal"] == result[f"{kind}_total"], result


@pytest.mark.parametrize("kind", ["sampled", "greedy"])
def test_the_engines_sampler_path_gives_vllms_logprobs(result, kind):
    assert result[f"{kind}_engine_same_tokens"] >= result[f"{kind}_total"] // 2, result
    assert result[f"{kind}_engine_equal"] == result[f"{kind}_engine_same_tokens"], result


@pytest.mark.parametrize("kind", ["sampled", "greedy"])
def test_multi_turn_episodes_get_vllms_logprobs_from_the_sampler(result, kind):
    assert result[f"{kind}_turns_total"] == 16 * 3 and result[f"{kind}_turns_tokens"] > 16 * 3, result
    assert result[f"{kind}_turns_equal"] == result[f"{kind}_turns_total"], result
    assert result[f"{kind}_turns_engine_same"] >= result[f"{kind}_turns_total"] // 2, result
    assert result[f"{kind}_turns_engine_equal"] == result[f"{kind}_turns_engine_same"], result
