"""The trainer on multi-turn episodes (``rollout.multi_turn``), on the CPU with the tiny model: GRPO learns a task
whose reward needs the observation (:class:`tests.rl_tasks.SecretWord`), a run whose tools raise, hang and are
called with garbage finishes its steps, and the multi-turn settings are checked before a run starts."""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, multi_turn_overrides, train_on_rank, write_prompts

LEARN = ["trainer.save_every=0", "data.prompts_per_step=8", "rollout.n=8", "actor.ppo_mini_batch_size=32",
         "actor.micro_batch_size=16", "actor.optim.lr=5e-3", "algorithm.kl.coef=0"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 64)


def test_grpo_learns_to_use_the_observation(task):
    root, model, data = task
    history = run_world(train_on_rank, 1, multi_turn_overrides(model, data, root / "runs", "secret")
                        + LEARN + ["trainer.steps=12"])[0]
    rewards = [h["reward/mean"] for h in history]
    assert rewards[0] < 0.3, rewards  # a random policy says the secret first 1 time in 16
    assert max(rewards[-3:]) > 0.8, rewards  # saying one fixed secret scores 1/2: the policy reads the observation
    first = history[0]
    assert first["agent/turns_mean"] == 2 and first["agent/ended/done"] == 1.0
    assert first["agent/observation_tokens"] > 0 and first["agent/samples_split"] == 0


def test_a_run_with_failing_tools_and_garbage_calls_finishes_its_steps(task):
    root, model, data = task
    tools = ["rollout.multi_turn.env=tools", "rollout.multi_turn.tools=[tests.rl_tasks:explode,tests.rl_tasks:hang]",
             "rollout.multi_turn.tool_parser=tests.rl_tasks:WordCallParser", "rollout.multi_turn.max_turns=3",
             "rollout.multi_turn.tool_timeout_s=0.2", "rollout.max_new_tokens=3"]
    history = run_world(train_on_rank, 1, multi_turn_overrides(model, data, root / "runs", "tools") + tools + [
        "trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=16"])[0]
    assert [h["step"] for h in history] == [1, 2]
    total = {k: sum(h[f"agent/tool_errors/{k}"] for h in history) for k in
             ("exception", "timeout", "unknown_tool", "malformed")}
    assert all(v > 0 for v in total.values()), total
    assert all(h["agent/tool_calls_per_episode"] > 0 for h in history)


@pytest.mark.parametrize("override, message", [
    ("rollout.multi_turn.tools=[no_such_tool]", "rollout.multi_turn: unknown tool 'no_such_tool'"),
    ("rollout.multi_turn.env=no_such_env", "rollout.multi_turn: unknown environment 'no_such_env'"),
    ("rollout.multi_turn.tool_parser=llama3_json", "tool_parser: the 'llama3_json' parser reads"),
    ("rollout.multi_turn.max_turns=0", "rollout.multi_turn.max_turns: must be >= 1"),
    ("algorithm.overlong.buffer_tokens=1", "algorithm.overlong: buffer_tokens must be 0 and filter false"),
])
def test_bad_multi_turn_settings_are_refused_before_a_run(task, override, message):
    from megarl.config import ConfigError, load_config
    from megarl.trainer.preflight import preflight

    root, model, data = task
    overrides = multi_turn_overrides(model, data, root / "runs", "bad") + [
        "rollout.multi_turn.tools=[calculator]", override]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        cfg = load_config(None, overrides)
        preflight(cfg, 1, this_machine=False)
