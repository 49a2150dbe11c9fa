"""Agents written as ordinary code (:mod:`megarl.agents.endpoint`): an async function on an OpenAI-style chat
client trains exactly what its calls sampled (prompt, sampled ids with their log-probs, the template's ids between
them as context), a history that is not an append starts a new sample, the budgets and the run's sampling are
kept, and the HTTP endpoint serves the same episodes as the in-process client. A scripted engine
(:mod:`tests.agent_fixtures`) stands for the model, so every token is known."""

from __future__ import annotations

import asyncio
import json

import pytest

from megarl.agents.calculator import evaluate
from megarl.agents.endpoint import AgentError, AgentFunction, ChatRequestError, EpisodeLimit, load_agent, \
    run_agent_episodes
from megarl.agents.episode import ChatRenderer
from megarl.agents.parsers import load_parser
from megarl.agents.rollout import EpisodeSettings
from megarl.rollout.base import SamplingConfig
from tests.agent_fixtures import CHATML, ScriptedEngine, bpe_tokenizer

USER = [{"role": "user", "content": "hello"}]
CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {
                                             "expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(CHATML)


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


def _script(tok):
    """Turn 0: "the" spelt t, h, e (re-encoding merges it into other ids) then a call of 1+2; turn 1: a call of
    3*4; turn 2: the answer. The turn is the count of assistant headers in the prompt."""
    turns = [tok.convert_tokens_to_ids(["t", "h", "e"]) + _ids(tok, _call("1+2")), _ids(tok, _call("3*4")),
             _ids(tok, "the answer is 12")]
    turns = [t + [tok.eos_token_id] for t in turns]
    return turns, lambda p: turns[tok.decode(p).count("<|im_start|>assistant") - 1]


def _run(tok, agent, *, n=1, settings=None, sampling=None, **kw):
    turns, script = _script(tok)
    engine = ScriptedEngine(script, [tok.eos_token_id])
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    fn = agent if isinstance(agent, AgentFunction) else AgentFunction("test", agent, True)
    out = run_agent_episodes(engine, renderer, fn, [{"ground_truth": "12"}], [USER],
                             sampling or SamplingConfig(n=n, max_new_tokens=64, seed=1),
                             settings or EpisodeSettings(max_turns=4, max_turn_tokens=400), **kw)
    return out, engine, turns


replies = []  # what the calculator agent's calls returned, for the tests to read


async def calculator_agent(row, client, prompt):
    """Three calls: two tool calls answered by the agent's own calculator, then the answer."""
    messages = list(prompt)
    for _ in range(3):
        r = await client.chat.completions.create(model="any", messages=messages, tools=[CALC])
        replies.append(r)
        message = r.choices[0].message
        if not message.tool_calls:
            return None
        # the second reply passed back rebuilt by hand, as a harness might (ids and JSON layout its own)
        messages.append(message.model_dump() if len(replies) % 3 == 1 else {
            "role": "assistant", "content": message.content,
            "tool_calls": [{"id": "mine", "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in message.tool_calls]})
        for c in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": evaluate(json.loads(c.function.arguments)["expression"])})
    return None


def test_an_agent_function_trains_exactly_what_its_calls_sampled(tok):
    replies.clear()
    out, engine, turns = _run(tok, calculator_agent)
    (episode,) = out.episodes
    assert episode.end == "done" and episode.turns == 3 and episode.tool_calls == 2 and episode.splits == 0
    assert episode.reward is None and episode.last_text == "the answer is 12"
    first, second, third = (r.choices[0] for r in replies)
    assert first.finish_reason == "tool_calls" and first.message.content == "the"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("calculator", {"expression": "1+2"})]
    assert third.finish_reason == "stop" and third.message.content == "the answer is 12"
    assert third.message.tool_calls is None

    (sample,) = episode.samples
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    assert sample.prompt_ids == _ids(tok, tok.apply_chat_template(USER, tools=[CALC], tokenize=False,
                                                                  add_generation_prompt=True))
    # the engine got each call's prompt as the last one, its sampled ids as sampled, and the template's ids
    p0, p1, p2 = engine.added
    between = []
    for before, sampled, after in ((p0, turns[0], p1), (p1, turns[1], p2)):
        assert after[:len(before) + len(sampled)] == before + sampled
        between.append(after[len(before) + len(sampled):])
    assert tok.decode(between[0]) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    assert between[0] == _ids(tok, tok.decode(between[0]))  # the template's text, encoded
    # the trained sequence: prompt, sampled (mask 1, the rollout log-probs), template ids (mask 0), ...
    assert sample.ids == p2 + turns[2]
    assert sample.response_ids == turns[0] + between[0] + turns[1] + between[1] + turns[2]
    assert sample.mask == [1] * len(turns[0]) + [0] * len(between[0]) + [1] * len(turns[1]) + \
        [0] * len(between[1]) + [1] * len(turns[2])
    assert sample.logprobs == [-0.5 if m else 0.0 for m in sample.mask]
    # ... which is not what decoding and encoding the history would give
    assert _ids(tok, tok.decode(sample.ids)) != sample.ids
    assert replies[0].prompt_token_ids == p0 and replies[0].choices[0].token_ids == turns[0]
    assert renderer.decode(sample.ids).endswith("the answer is 12<|im_end|>")


async def editing_agent(row, client, prompt):
    """Call, edit the reply before passing it back (not an append: a new sample), call, call again appending."""
    r = await client.chat.completions.create(messages=prompt, tools=[CALC])
    edited = {"role": "assistant", "content": "hello there"}  # not what was sampled
    messages = prompt + [edited, {"role": "user", "content": "again"}]
    r = await client.chat.completions.create(messages=messages, tools=[CALC])
    messages += [r.choices[0].message, {"role": "user", "content": "again"}]
    await client.chat.completions.create(messages=messages, tools=[CALC])
    return 0.5


def test_a_history_that_is_not_an_append_starts_a_new_sample(tok):
    out, engine, turns = _run(tok, editing_agent)
    (episode,) = out.episodes
    assert episode.end == "done" and episode.reward == 0.5 and episode.turns == 3 and episode.splits == 1
    assert out.metrics()["agent/samples_split"] == 1
    first, second = episode.samples
    p0, p1, p2 = engine.added
    assert (first.prompt_ids, first.response_ids, first.mask) == (p0, turns[0], [1] * len(turns[0]))
    # the edited history is rendered and encoded whole: the second sample's prompt
    edited = USER + [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "again"}]
    assert second.prompt_ids == p1 == _ids(tok, tok.apply_chat_template(edited, tools=[CALC], tokenize=False,
                                                                        add_generation_prompt=True))
    # the third call appends to the second: one sample, the second turn's ids as sampled
    assert p2[:len(p1) + len(turns[1])] == p1 + turns[1] and second.ids == p2 + turns[2]
    assert sum(second.mask) == len(turns[1]) + len(turns[2])


async def greedy_agent(row, client, prompt):
    """Calls until refused, appending each reply."""
    messages = list(prompt)
    while True:
        r = await client.chat.completions.create(messages=messages, tools=[CALC])
        messages += [r.choices[0].message, {"role": "user", "content": "again"}]


def test_budgets_refuse_a_call_and_end_the_episode_by_their_name(tok):
    out, engine, _ = _run(tok, greedy_agent, settings=EpisodeSettings(max_turns=2, max_turn_tokens=400))
    (episode,) = out.episodes
    assert (episode.end, episode.turns, episode.reward, len(engine.added)) == ("max_turns", 2, None, 2)
    out, _, turns = _run(tok, greedy_agent, settings=EpisodeSettings(max_turns=4, max_turn_tokens=400,
                                                                     max_episode_tokens=len(_script(tok)[0][0]) + 5))
    (episode,) = out.episodes
    assert episode.end == "episode_budget" and episode.turns == 1 and out.metrics()["agent/ended/episode_budget"] == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.5}, "temperature: 0.5 asked, but the run samples with rollout.temperature=1.0"),
    ({"n": 2}, "n: must be 1"),
    ({"stop": ["\n"]}, "stop: stop strings are not served"),
    ({"logit_bias": {}}, "logit_bias: not served"),
    ({"messages": []}, "messages: a non-empty list"),
])
def test_requests_the_endpoint_does_not_serve_are_refused_naming_the_field(tok, kwargs, message):
    seen = []

    async def agent(row, client):
        try:
            await client.chat.completions.create(**{"messages": USER, **kwargs})
        except ChatRequestError as e:
            seen.append(e)
            raise

    out, engine, _ = _run(tok, AgentFunction("t", agent, False))
    assert out.episodes[0].end == "env_error" and out.episodes[0].reward == 0.0 and engine.added == []
    assert message in str(seen[0]) and not isinstance(seen[0], EpisodeLimit)


def test_agent_functions_are_checked_when_loaded_and_by_what_they_return(tok):
    with pytest.raises(AgentError, match="is not an async function"):
        load_agent("tests.rl_tasks:says_target")
    assert load_agent("tests.test_agents_openai:calculator_agent").takes_prompt

    async def says_yes(row, client):
        return "yes"

    with pytest.raises(AgentError, match="returned str 'yes'; it must return the episode's reward"):
        _run(tok, AgentFunction("t", says_yes, False))


class StreamsClient:
    """An OpenAI-style client over HTTP/1.1 with asyncio streams (``openai`` is not in the CPU venv): every
    episode's connection opened at once and kept alive, as ``openai.AsyncOpenAI``'s are;
    ``chat.completions.create`` POSTs to ``<base>/chat/completions`` and returns the JSON answer as a dict."""

    def __init__(self, base_url):
        host_port, self.path = base_url.removeprefix("http://").split("/", 1)
        self.host, self.port = host_port.split(":")
        self.chat = self.completions = self
        self.streams = None

    async def create(self, **body):
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, int(self.port))
        reader, writer = self.streams
        data = json.dumps(body).encode()
        writer.write(f"POST /{self.path}/chat/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, value = line.decode().split(":", 1)
            headers[key.strip().lower()] = value.strip()
        answer = json.loads(await reader.readexactly(int(headers["content-length"])))
        if status != 200:
            raise ChatRequestError(answer["error"]["message"])
        return answer

    async def close(self):
        if self.streams is not None:
            self.streams[1].close()


async def http_agent(row, client, prompt):
    """The calculator agent on JSON dicts (what an HTTP client returns)."""
    messages = list(prompt)
    for _ in range(3):
        message = (await client.chat.completions.create(model="m", messages=messages, tools=[CALC]))[
            "choices"][0]["message"]
        messages.append(message)
        for c in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": c["id"],
                             "content": evaluate(json.loads(c["function"]["arguments"])["expression"])})
        if not message.get("tool_calls"):
            break
    try:
        await client.chat.completions.create(messages=messages, temperature=0.1)
    except ChatRequestError as e:
        assert "rollout.temperature" in str(e)
    return 1.0


def test_the_http_endpoint_serves_the_same_episodes_as_the_in_process_client(tok):
    served, engine, _ = _run(tok, http_agent, n=32, server=True, client_factory=StreamsClient)
    local, _, _ = _run(tok, http_agent, n=32)
    assert [e.end for e in served.episodes] == ["done"] * 32 and served.episodes[0].turns == 3
    for a, b in zip(served.episodes, local.episodes):
        assert [(s.ids, s.mask, s.logprobs) for s in a.samples] == [(s.ids, s.mask, s.logprobs) for s in b.samples]
        assert a.reward == 1.0 and a.splits == 0 and a.tool_calls == 2


def test_megarl_train_drives_an_agent_function_end_to_end(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from megarl.trainer.metrics import read_metrics
    from tests.rl_tasks import agent_overrides, make_tiny_model, write_prompts

    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 16)
    overrides = agent_overrides(model, data, tmp_path / "runs", "agent") + [
        "trainer.steps=3", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=16", "actor.optim.lr=5e-3", "algorithm.kl.coef=0",
        "trainer.log_samples=4"]
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train", *overrides], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    history = read_metrics(tmp_path / "runs" / "agent" / "metrics.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        assert h["agent/turns_mean"] == 2 and h["agent/ended/done"] == 1.0 and h["agent/samples_split"] == 0
        assert h["agent/sampled_tokens"] == 16 * 2 and h["agent/observation_tokens"] > 0
        # the trainer's log-probs of the recorded ids are the engine's: the ids trained are the ids sampled
        assert h["actor/rollout_vs_old_logprob_diff"] < 1e-4, h["actor/rollout_vs_old_logprob_diff"]
        # the mismatch per turn: two turns of every episode, their tokens those of the whole step
        assert h["mismatch/token_mult_prob_error"] < 1 + 1e-4 and "mismatch/turn_3/tokens" not in h
        assert h["mismatch/turn_1/tokens"] + h["mismatch/turn_2/tokens"] == h["mismatch/tokens"] == 16 * 2
        assert 0.0 <= h["reward/mean"] <= 1.0


@pytest.mark.parametrize("overrides, message", [
    (["rollout.multi_turn.tools=[calculator]"],
     "rollout.multi_turn.tools: must be empty with rollout.multi_turn.agent"),
    (["rollout.multi_turn.env=guess_number"], "rollout.multi_turn.env: is not used with rollout.multi_turn.agent"),
    (["rollout.multi_turn.agent=tests.rl_tasks:says_target"],
     "rollout.multi_turn.agent: 'tests.rl_tasks:says_target' is not an async function"),
    (["rollout.multi_turn.agent=tests.rl_tasks:no_such_agent"],
     "rollout.multi_turn.agent: agent 'tests.rl_tasks:no_such_agent': module 'tests.rl_tasks' has no attribute"),
    (["rollout.multi_turn.agent=''", "rollout.multi_turn.agent_server=true"],
     "rollout.multi_turn.agent_server: serves an agent function"),
])
def test_bad_agent_settings_are_refused_naming_the_field(tok, overrides, message):
    from megarl.config import ConfigError, load_config
    from megarl.trainer.episodes import build_agent

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_agent(load_config(None, ["rollout.multi_turn.enabled=true",
                                       "rollout.multi_turn.agent=tests.rl_tasks:secret_agent", *overrides]), tok)


def test_the_http_endpoint_needs_the_openai_package_or_says_how_to_do_without(tok):
    import importlib.util

    from megarl.config import ConfigError, load_config
    from megarl.trainer.episodes import build_agent

    cfg = load_config(None, ["rollout.multi_turn.enabled=true", "rollout.multi_turn.agent=tests.rl_tasks:secret_agent",
                             "rollout.multi_turn.agent_server=true"])
    if importlib.util.find_spec("openai") is not None:
        assert build_agent(cfg, tok).server
    else:
        with pytest.raises(ConfigError,
                           match="the openai package is not installed .* rollout.multi_turn.agent_server=false"):
            build_agent(cfg, tok)


def test_an_agent_on_the_openai_client_trains_the_same_ids_over_http(tok):
    pytest.importorskip("openai")  # vLLM's environments have it; the CPU venv may not
    replies.clear()
    served, _, _ = _run(tok, calculator_agent, n=32, server=True)  # openai.AsyncOpenAI at the local endpoint
    assert type(replies[0]).__module__.startswith("openai")
    replies.clear()
    local, _, _ = _run(tok, calculator_agent, n=32)
    for a, b in zip(served.episodes, local.episodes):  # 32 connections at once
        assert a.end == "done" and a.turns == 3 and a.tool_calls == 2 and a.splits == 0
        assert [(s.ids, s.mask, s.logprobs) for s in a.samples] == [(s.ids, s.mask, s.logprobs) for s in b.samples]
