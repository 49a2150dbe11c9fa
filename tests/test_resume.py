"""Resume that changes the run (issue 23, issue 24): another TP/PP/DP layout, a longer run, changed optimizer
settings, and the refusals of what cannot be resumed.

Runs use the tiny model and synthetic task of :mod:`tests.rl_tasks`, fp32, each in its own spawned world.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

COMPARED = ["reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "actor/clipfrac", "actor/ppo_kl", "actor/lr"]
# two optimizer updates per step at a high LR, warming up over 3 updates: the second update of a step, and
# every step after the first, depend on Adam's moments and step count and on the schedule's position
BASE = ["data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
        "actor.optim.lr=1e-2", "actor.optim.warmup_steps=3", "trainer.save_every=1", "algorithm.kl.coef=0"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    model = make_tiny_model(root / "model")
    data = write_prompts(root / "prompts.jsonl", 64)
    return root, model, data


def _run(task, name, world=1, extra=()):
    root, model, data = task
    return run_world(train_on_rank, world, task_overrides(model, data, root / "runs", name) + BASE + list(extra))


def _assert_step_matches(got, want, step):
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key, got[key], want[key])


def test_a_checkpoint_resumes_at_another_tp_pp_and_dp_as_the_uninterrupted_run(task):
    """One run, each step at another layout: TP=1 x PP=2 (step 1) -> TP=2 x PP=1 (step 2) -> DP=2 (step 3)
    -> DP=1 (step 4); every step's metrics equal the uninterrupted single-rank run's within 1e-4, the LR
    schedule and Adam's state included (an optimizer restarted from zero moves the weights by another amount
    in the first update after the resume, and the second update's metrics show it)."""
    straight = _run(task, "straight", extra=["trainer.steps=4"])[0]
    assert straight[1]["actor/ppo_kl"] != straight[2]["actor/ppo_kl"]  # the steps differ: the check can fail
    chain = [(1, ["actor.parallel.pp=2"]), (2, ["actor.parallel.tp=2"]), (3, []), (4, [])]
    worlds = {1: 2, 2: 2, 3: 2, 4: 1}
    for step, layout in chain:
        resume = ["trainer.resume=true"] if step > 1 else []
        history = _run(task, "moved", worlds[step], [f"trainer.steps={step}", *resume, *layout])[0]
        assert [h["step"] for h in history] == list(range(1, step + 1))
        _assert_step_matches(history[step - 1], straight[step - 1], step)
    summary = json.loads((task[0] / "runs" / "moved" / "summary.json").read_text())
    assert summary["resumed"]["step"] == 3 and summary["resumed"]["changed"]["trainer.steps"] == [3, 4]
