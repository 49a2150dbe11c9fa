"""Multi-turn episodes on the vLLM engine's request-level path (``LLMEngine.add_request`` / ``step``), on the CPU
with the fake vLLM (:mod:`tests.fake_vllm.vllm`): every turn's prompt holds the earlier turns' sampled ids as
the engine returned them, later turns hit the prefix cache, and a trainer step on episodes runs through it; the
same for an agent function's calls (:mod:`megarl.agents.endpoint`; the trainer's with ``rollout.logprobs: sampler``,
whose turns' log-probs come from the fake model runner's sampler rows)."""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.test_rollout_vllm_tp import _fake_vllm


def _episodes_on_fake_vllm(rank: int, world: int, task) -> dict:
    vllm = _fake_vllm()
    import torch

    from megarl.agents.env import EnvironmentFactory
    from megarl.agents.episode import ChatRenderer
    from megarl.agents.parsers import load_parser
    from megarl.agents.rollout import EpisodeSettings, run_episodes
    from megarl.config import load_config
    from megarl.models.hf_io import load_tokenizer, open_hf_checkpoint
    from megarl.rollout.base import SamplingConfig, turn_seed
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, request_params
    from megarl.trainer.trainer import Trainer
    from tests.rl_tasks import agent_overrides, multi_turn_overrides

    model_dir, data, runs = task
    spec, tok = open_hf_checkpoint(str(model_dir)).spec, load_tokenizer(str(model_dir))
    engine = VLLMRolloutEngine(spec)
    engine.update_weights(lambda dst: [t.normal_(generator=torch.Generator().manual_seed(0)) for t in dst.values()])

    class Again:
        def reset(self, row, prompt):
            return prompt

        def step(self, turn):
            from megarl.agents.env import StepResult

            return StepResult([{"role": "user", "content": "a b c d e f g"}])

    prompt = [{"role": "user", "content": " ".join(["a", "b", "c", "d", "e"] * 4)}]  # 20 tokens: a cached block
    sampling = SamplingConfig(n=2, max_new_tokens=4, seed=5)
    out = run_episodes(engine, ChatRenderer(tok, [], load_parser("auto", tok.chat_template)),
                       EnvironmentFactory("again", Again), [{}], [prompt], sampling,
                       EpisodeSettings(max_turns=3, max_turn_tokens=4), call=7)
    # each turn's ids are the engine's own completion of that turn's prompt and seed
    weights = vllm.fingerprint(engine.llm._assemble())

    def exact_turns(out, call, prompt_index=0):
        exact = []
        for e in out.episodes:
            exact += exact_episode(e, call, prompt_index)
        return exact

    def exact_episode(e, call, prompt_index):
        exact = []
        (sample,) = e.samples
        held, pos = list(sample.prompt_ids), 0
        for turn in range(e.turns):
            params = vllm.SamplingParams(**request_params(held, SamplingConfig(max_new_tokens=4), context=64,
                                                          stop_token_ids=list(spec.eos_token_ids),
                                                          seed=turn_seed(5, call, prompt_index, e.sample_index,
                                                                         turn)))
            want = vllm.fake_completion(weights, held, params, spec.vocab_size).token_ids
            got = sample.response_ids[pos:pos + len(want)]
            exact.append(got == want and sample.mask[pos:pos + len(want)] == [1] * len(want))
            pos += len(want)
            obs = 0
            while pos + obs < len(sample.mask) and sample.mask[pos + obs] == 0:
                obs += 1
            held = list(sample.prompt_ids) + sample.response_ids[:pos + obs]
            pos += obs
        return exact

    exact = exact_turns(out, 7)
    # an agent function's calls on the same request path: the recorded ids are the engine's completions
    from megarl.agents.endpoint import load_agent, run_agent_episodes

    agent_out = run_agent_episodes(engine, ChatRenderer(tok, [], load_parser("auto", tok.chat_template)),
                                   load_agent("tests.rl_tasks:secret_agent"), [{}], [prompt], sampling,
                                   EpisodeSettings(max_turns=3, max_turn_tokens=4), call=8)
    agent_exact = exact_turns(agent_out, 8)
    cfg = load_config(None, multi_turn_overrides(model_dir, data, runs, "vllm-episodes") + [
        "rollout.engine=vllm", "data.prompts_per_step=4", "rollout.n=2", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4", "trainer.steps=1"])
    trainer = Trainer(cfg)
    metrics = trainer.step(next(iter(trainer.loader)))
    requests = len(trainer.engine.llm.llm_engine.added)
    trainer = Trainer(load_config(None, agent_overrides(model_dir, data, runs, "vllm-agent") + [
        "rollout.engine=vllm", "rollout.logprobs=sampler", "data.prompts_per_step=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "trainer.steps=1"]))
    agent_metrics = trainer.step(next(iter(trainer.loader)))
    return dict(exact=exact, turns=[e.turns for e in out.episodes], cached=out.cached_tokens,
                prompt_tokens=out.stats.prompt_tokens, metrics=metrics, requests=requests,
                agent_exact=agent_exact, agent_turns=[e.turns for e in agent_out.episodes],
                agent_cached=agent_out.cached_tokens, agent_metrics=agent_metrics,
                agent_requests=len(trainer.engine.llm.llm_engine.added),
                agent_asked=set(trainer.engine.llm.llm_engine.asked))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from tests.rl_tasks import make_tiny_model, write_prompts

    root = tmp_path_factory.mktemp("vllm_episodes")
    return run_world(_episodes_on_fake_vllm, 1, (make_tiny_model(root / "model"), write_prompts(root / "p.jsonl", 8),
                                                 root / "runs"), timeout_s=600)[0]


def test_episode_turns_are_the_engines_completions_and_reuse_its_prefix_cache(result):
    assert result["turns"] == [3, 3] and all(result["exact"]) and len(result["exact"]) == 6
    assert result["cached"] >= 4 * 16  # turns 2 and 3 of both episodes found their history's first block


def test_a_trainer_step_on_episodes_runs_through_the_vllm_request_path(result):
    m = result["metrics"]
    assert m["agent/turns_mean"] == 2 and result["requests"] == 2 * 4 * 2  # 2 turns x 4 prompts x 2 episodes
    assert m["agent/observation_tokens"] > 0 and m["actor/ppo_kl_first_minibatch"] == 0


def test_an_agent_functions_calls_are_the_engines_completions_and_train_through_the_vllm_path(result):
    assert result["agent_turns"] == [2, 2] and all(result["agent_exact"]) and len(result["agent_exact"]) == 4
    assert result["agent_cached"] >= 2 * 16  # each second call found the first call's prompt block
    m = result["agent_metrics"]
    assert m["agent/turns_mean"] == 2 and result["agent_requests"] == 2 * 4 * 2
    assert m["agent/observation_tokens"] > 0 and m["agent/samples_split"] == 0
    assert result["agent_asked"] == {None}  # rollout.logprobs=sampler: no request asked vLLM for log-probs
