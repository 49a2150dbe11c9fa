"""verifiers environments (megarl/environments/verifiers.py) against verifiers 0.4.0 itself: a multi-turn env of
the tests (tests/vf_guess.py: its Env.run gives feedback as user turns, a @vf.stop ends it, a weighted rubric and a
reward of the env's own) runs in megarl's episode loop on a scripted engine; the episode reward is verifiers'
own scoring of the same messages, every reward function is logged as ``reward/<name>``, and a 3-turn episode is
token-exact (the trained ids are the sampled ids and the template's rendering of the observations)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from megarl.agents.env import EnvError, EnvironmentFactory, load_environment
from megarl.agents.episode import ChatRenderer
from megarl.agents.parsers import load_parser
from megarl.agents.rollout import EpisodeSettings, run_episodes
from megarl.environments import import_package
from megarl.rollout.base import SamplingConfig
from tests.agent_fixtures import ScriptedEngine, bpe_tokenizer

vf = pytest.importorskip("verifiers.v1")


@pytest.fixture(autouse=True)
def taskset_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # tests/vf_guess.py, imported by its id


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _episode(tok, secret, replies, max_turns=4):
    """One episode of ``vf_guess``'s task of ``secret`` (its own data: the row's ``vf_task``) whose turn ``t``
    replies ``replies[t]``; returns it, the engine and the renderer."""
    from megarl.environments.verifiers import verifiers_rows

    row = verifiers_rows({"taskset": "vf_guess"})["train"][secret - 1]
    engine = ScriptedEngine(lambda p: _ids(tok, replies[tok.decode(p).count("<|im_start|>assistant") - 1])
                            + [tok.eos_token_id], [tok.eos_token_id])
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    out = run_episodes(engine, renderer, load_environment("verifiers", {"taskset": "vf_guess"}), [row], [[]],
                       SamplingConfig(n=1, seed=1), EpisodeSettings(max_turns=max_turns, max_turn_tokens=64))
    return out, engine, renderer


def _verifiers_score(messages, secret, turns_bonus: bool = True) -> tuple[float, dict]:
    """verifiers' own scoring of an exchange: a trace of the messages scored by the task (the rubric), plus the
    env's own reward as vf_guess.GuessEnv.run records it."""
    import vf_guess
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    task = vf_guess.GuessTask(vf_guess.GuessData(prompt="Guess my number from 1 to 9.",
                                                 system_prompt="Reply with one number.", answer=str(secret)))
    trace = vf.Trace(task=TraceTask(type="GuessTask", data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=vf.AgentConfig()))
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    for k, m in enumerate(messages):
        trace.nodes.append(MessageNode(parent=k - 1 if k else None, message=kinds[m["role"]](content=m["content"]),
                                       sampled=m["role"] == "assistant"))
    asyncio.run(task.score(trace))
    if turns_bonus:
        trace.record_reward("turns_bonus", 1.0 / len(trace.assistant_messages), 0.25)
    return trace.reward, {f"reward/{k}": r.score for k, r in trace.rewards.items()}


def test_rubric_reward_is_verifiers_own_scoring_and_each_reward_is_logged(tok):
    replies = {3: ["1", "5", "3"], 7: ["7"], 2: ["9", "the answer is 2"]}
    for secret, said in replies.items():
        out, _, _ = _episode(tok, secret, said)
        (e,) = out.episodes
        assert e.end == "done" and e.turns == len(said)
        reward, by_name = _verifiers_score(e.messages, secret)
        assert e.reward == pytest.approx(reward) and by_name["reward/correct"] == 1.0
        assert {k: v for k, v in e.metrics.items() if k.startswith("reward/")} == pytest.approx(by_name)
        assert e.metrics["verifiers/replies"] == e.turns
        m = out.metrics()
        assert m["reward/brevity"] == pytest.approx(1 / len(said[-1].split()))
    assert [m["content"] for m in e.messages[3::2]] == ["lower"]  # 9 then 2: the env's feedback as user turns


def test_an_episode_cut_by_megarls_turn_limit_is_scored_on_its_messages(tok):
    out, _, _ = _episode(tok, 8, ["1", "2", "3"], max_turns=2)
    (e,) = out.episodes
    assert e.end == "max_turns" and e.turns == 2
    reward, by_name = _verifiers_score(e.messages, 8)
    assert e.reward == pytest.approx(reward) and by_name["reward/correct"] == 0.0


def test_three_turn_verifiers_episode_is_token_exact(tok):
    replies = ["1", "5", "3"]
    out, engine, renderer = _episode(tok, 3, replies)
    (e,) = out.episodes
    (sample,) = e.samples
    rendered = _ids(tok, renderer.render(e.messages, add_generation_prompt=False))
    assert rendered[:len(sample.ids)] == sample.ids  # the history as the template renders it
    turns = [_ids(tok, r) + [tok.eos_token_id] for r in replies]
    pos = 0
    for ids in turns:  # the sampled ids as sampled, mask 1; everything between them mask 0
        start = sample.response_ids.index(ids[0], pos)
        assert sample.response_ids[start:start + len(ids)] == ids
        assert sample.mask[start:start + len(ids)] == [1] * len(ids)
        pos = start + len(ids)
    assert sum(sample.mask) == sum(map(len, turns))
    for before, after in zip(engine.added, engine.added[1:]):  # each turn's prompt extends the last
        assert after[:len(before)] == before
    assert sample.prompt_ids == _ids(tok, renderer.render(e.messages[:2]))


def test_bad_ids_and_a_missing_package_are_clear_errors():
    with pytest.raises(EnvError, match=r"rollout.multi_turn.env_kwargs: verifiers cannot load taskset 'vf_nope'"):
        load_environment("verifiers", {"taskset": "vf_nope"})
    with pytest.raises(EnvError, match=r"rollout.multi_turn.env_kwargs.taskset: name an installed"):
        load_environment("verifiers", {"taskset": ""})
    with pytest.raises(EnvError, match=r"x.y: needs the Python package 'nopkg', .*pip install nopkg==1.0"):
        import_package("nopkg_megarl_test", "nopkg==1.0", "x.y", EnvError)
    assert isinstance(load_environment("verifiers", {"taskset": "vf_guess"}), EnvironmentFactory)


def test_check_loads_the_taskset_of_data_prepare_and_writes_nothing(tmp_path):
    """``--check`` (``check_data(prepare=False)``) refuses a ``data.prepare=verifiers`` taskset that has fewer
    tasks than ``size + test_size`` (vf_guess has 9), as the run would, and writes no file either way."""
    from megarl.config import ConfigError, load_config
    from megarl.trainer.preflight import check_data

    folder = tmp_path / "verifiers"

    def cfg(size):
        return load_config(None, [f"data.train_files=[{folder / 'train.parquet'}]", "data.prepare=verifiers",
                                  f"data.prepare_kwargs={{taskset: vf_guess, size: {size}, test_size: 2}}",
                                  "validation.enabled=false"])
    with pytest.raises(ConfigError, match=r"data.prepare_kwargs.size: taskset 'vf_guess' has 9 tasks, fewer than "
                                          r"test_size \+ size = 12"):
        check_data(cfg(10), None, prepare=False)
    check_data(cfg(7), None, prepare=False)
    assert not folder.exists()
