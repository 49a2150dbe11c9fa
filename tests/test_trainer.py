"""The RL trainer end to end on the CPU: learning (GRPO, PPO+GAE), resume, layout invariance, bad configs.

All runs use the tiny model and synthetic task of :mod:`tests.rl_tasks` (answer with the target word), each
in its own spawned world but the layout comparison's, which share one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed import run_world
from tests.rl_tasks import (make_tiny_model, make_tiny_moe_model, task_overrides, train_each_on_rank, train_on_rank,
                            write_prompts)

COMPARED = ["reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "actor/kl", "actor/clipfrac", "actor/ppo_kl"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    model = make_tiny_model(root / "model")
    data = write_prompts(root / "prompts.jsonl", 64)
    return root, model, data


def _run(task, name, world=1, extra=()):
    root, model, data = task
    return run_world(train_on_rank, world, task_overrides(model, data, root / "runs", name) + list(extra))


LEARN = ["trainer.steps=12", "trainer.save_every=0", "data.prompts_per_step=8", "rollout.n=8",
         "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=16", "actor.optim.lr=3e-3",
         "algorithm.kl.coef=0"]


def test_grpo_learns_the_task(task):
    history = _run(task, "grpo", extra=LEARN)[0]
    rewards = [h["reward/mean"] for h in history]
    assert rewards[0] < 0.3, rewards  # a random policy rarely answers with the target
    assert max(rewards[-3:]) > 0.8, rewards


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_grpo_learns_the_task_with_a_moe_actor_at_ep2(tmp_path):
    """A Qwen3-MoE actor (8 experts, top-2) on 2 ranks with its experts split over them (actor.parallel.ep=2):
    the reshard moves each rank's experts into both ranks' transformers engines, and GRPO learns; every step
    reports the load-balancing loss of its mini-batches and the experts' loads (megarl.models.moe_router)."""
    model = make_tiny_moe_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 64)
    history = run_world(train_on_rank, 2, task_overrides(model, data, tmp_path / "runs", "moe")
                        + LEARN + ["actor.parallel.ep=2"])[0]
    rewards = [h["reward/mean"] for h in history]
    assert rewards[0] < 0.3, rewards
    assert max(rewards[-3:]) > 0.8, rewards
    for h in history:  # the switch loss is about 1 when balanced, the shares of 8 experts around 1/8
        assert 0.5 <= h["actor/moe_aux_loss"] < 8.0 and "actor/moe_z_loss" not in h, h
        assert 0.0 <= h["actor/moe_expert_load_min"] <= 1 / 8 <= h["actor/moe_expert_load_max"] <= 1.0, h


def test_ppo_with_gae_learns_the_task(task):
    ppo = LEARN + ["algorithm.name=ppo", "algorithm.lam=0.95", "critic.optim.lr=1e-2",
                   "critic.ppo_mini_batch_size=32", "critic.micro_batch_size=16"]
    history = _run(task, "ppo", extra=ppo)[0]
    rewards = [h["reward/mean"] for h in history]
    assert rewards[0] < 0.3, rewards
    assert max(rewards[-3:]) > 0.8, rewards
    assert all("critic/vf_loss" in h for h in history)
    # actor and critic (and both optimizers) share one checkpoint; a resumed run loads both and goes on
    resumed = _run(task, "ppo", extra=ppo + ["trainer.steps=13", "trainer.resume=true"])[0]
    assert [h["step"] for h in resumed] == list(range(1, 14)) and resumed[-1]["reward/mean"] > 0.8


RESUME = ["data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
          "actor.optim.lr=1e-3", "trainer.save_every=1"]


@pytest.mark.slow  # CI time (issue 33's 45 minutes): one of the 30 slowest
def test_resume_reproduces_the_uninterrupted_run(task):
    straight = _run(task, "straight", extra=RESUME + ["trainer.steps=3"])[0]
    _run(task, "stopped", extra=RESUME + ["trainer.steps=2"])
    resumed = _run(task, "stopped", extra=RESUME + ["trainer.steps=3", "trainer.resume=true"])[0]
    assert [h["step"] for h in resumed] == [1, 2, 3]
    assert all("time/old_logprobs" in h for h in straight)  # two mini-batches: the pass is kept (auto)
    assert straight[1]["actor/pg_loss"] != straight[2]["actor/pg_loss"]  # the steps differ: the check can fail
    for key in COMPARED:
        assert resumed[2][key] == pytest.approx(straight[2][key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_a_run_folder_with_checkpoints_takes_only_its_own_run_resumed_at_its_layout(task):
    """A new run on a folder that holds an earlier run's checkpoints is refused (a later --resume would have
    loaded the older weights), and so is a resume that changes what cannot change (the model's dtype); both
    before any process starts. Another layout or placement is accepted (tests/test_resume.py resumes them)."""
    from megarl.config import ConfigError, load_config
    from megarl.trainer.checkpointing import check_run_folder

    root, model, data = task
    base = task_overrides(model, data, root / "runs", "owned") + RESUME + ["trainer.steps=1"]
    _run(task, "owned", extra=RESUME + ["trainer.steps=1"])
    again = _cli(*base)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"megarl: error: run.name: the run folder {root / 'runs/owned'} holds checkpoints of an earlier run (newest "
        "step_000001); continue that run with --resume (trainer.resume=true), or start this one under another "
        "run.name (or delete the folder)"), again.stderr[-2000:]
    other = _cli(*base, "trainer.steps=2", "model.dtype=bfloat16", "actor.parallel.pp=2", "--resume")
    assert other.returncode == 2, other.stderr[-2000:]
    line = other.stderr.strip().splitlines()[-1]
    assert line.startswith("megarl: error: trainer.resume: ") and "cannot be resumed with a changed model.dtype" \
        in line and "model.path=" in line, line
    assert "launching" not in other.stdout  # no process started
    check_run_folder(load_config(None, base + ["trainer.resume=true", "trainer.steps=2"]), 1)  # the same layout
    check_run_folder(load_config(None, base + ["trainer.resume=true", "trainer.steps=2", "actor.parallel.pp=2"]), 2)
    from megarl.parallel.run_lock import RunLock

    lock = RunLock(root / "runs" / "owned").acquire()  # another run owns the folder: a config error still shows
    try:
        bad = _cli(*base, "trainer.steps=2", "actor.parallel.tp=3", "--resume")
        locked = _cli(*base, "trainer.steps=2", "--resume")
    finally:
        lock.release()
    assert bad.returncode == 2 and "megarl: error: actor.parallel.tp" in bad.stderr, bad.stderr[-2000:]
    assert locked.returncode == 2 and "in use by pid" in locked.stderr, locked.stderr[-2000:]
    resumed = _cli(*base, "trainer.steps=2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "Warning" not in resumed.stderr, resumed.stderr  # no torch noise
    # eval of the run's checkpoint prompts and scores as the run did (the default config's chat template and
    # GSM8K reward would fail on this tokenizer)
    ev = subprocess.run([sys.executable, "-m", "megarl.cli", "eval", str(root / "runs/owned/checkpoints/step_000002"),
                         f"validation.files=[{data}]", "validation.num_prompts=4", f"--out={root / 'eval_owned'}"],
                        capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0 and f"the run's config {root / 'runs/owned/config.json'}" in ev.stdout, ev.stderr[-2000:]
    assert json.loads((root / "eval_owned" / "eval.json").read_text())["reward"] == "tests.rl_tasks:says_target"
    check_run_folder(load_config(None, base + ["trainer.resume=true", "trainer.steps=3", "placement.pools.one=[0]",
                                               "placement.reward=one"]), 1)  # another placement resumes too
    with pytest.raises(ConfigError, match="trainer.steps: the run in .* has finished its 2 steps"):
        check_run_folder(load_config(None, base + ["trainer.resume=true"]), 1)  # trainer.steps=1 < 2 done


LAYOUT = ["trainer.steps=1", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
          "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.optim.lr=1e-2"]


def test_tp2_pp2_and_sequence_parallel_match_tp1_at_step_1(task):
    """DP=2, then TP=2, PP=2 and TP=2 with sequence parallelism: the same step-1 metrics. The four runs share one
    2-rank world (:func:`tests.rl_tasks.train_each_on_rank`: each run builds its trainer and megatron's parallel
    state anew; one process start instead of four)."""
    root, model, data = task
    layouts = {"tp1dp2": [], "tp2": ["actor.parallel.tp=2"], "pp2": ["actor.parallel.pp=2"],
               "tp2sp": ["actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"]}
    runs = run_world(train_each_on_rank, 2, [task_overrides(model, data, root / "runs", name) + LAYOUT + layout
                                             for name, layout in layouts.items()])[0]
    ref, tp2, pp2, sp = (history[0] for history, _ in runs)
    assert ref["actor/ppo_kl"] != 0  # the second mini-batch ran after an update: the losses are not trivial
    assert ref["actor/kl"] == 0.0  # the reference policy starts as an exact copy of the actor
    for other in (tp2, pp2, sp):
        for key in COMPARED:
            assert other[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "megarl.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.mark.parametrize("override,field", [
    ("algorithm.name=ppo2", "algorithm.name"),
    ("actor.ppo_mini_batch_size=6", "actor.ppo_mini_batch_size"),
    ("actor.parallel.dp=2", "actor.ppo_mini_batch_size"),  # 16 is not a multiple of dp 2 x micro-batch 3
    ("rollout.top_p=1.5", "rollout.top_p"),
    ("actor.optim.lr=fast", "actor.optim.lr"),
])
def test_bad_config_fails_before_any_model_naming_the_field(override, field):
    extra = ["actor.micro_batch_size=3"] if "dp=2" in override else []
    r = _cli(override, *extra)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "megarl: error:" in r.stderr and field in r.stderr, r.stderr[-2000:]
    assert "dequantising" not in r.stderr  # no model was loaded


def test_missing_dataset_field_fails_before_any_model(task):
    root, model, data = task
    bad = write_prompts(root / "bad.jsonl", 8, field="prompt")
    r = _cli(*task_overrides(model, bad, root / "runs", "bad"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "no field 'question'" in r.stderr and "prompt_key" in r.stderr, r.stderr[-2000:]


SMOLLM2 = ["trainer.steps=1", "trainer.save_every=0", "trainer.progress=false", "data.prompts_per_step=2",
           "data.train_files=[data/arithmetic/train.parquet]", "rollout.n=2", "rollout.max_new_tokens=12",
           "actor.ppo_mini_batch_size=2", "actor.micro_batch_size=1", "actor.optim.lr=1e-5",
           "reward.fn=tests.rl_tasks:digit_share", "validation.enabled=false",
           "trainer.report=false"]


@pytest.mark.slow
def test_cpu_default_pp2_matches_dp2_at_step_1(tmp_path):
    """The CPU default itself (SmolLM2-135M from its GGUF, the arithmetic task's prompts, chat template, GRPO; a
    dense reward instead of the task's, so that every sample has a gradient) at PP=2 against the same two ranks as data
    parallelism (SmolLM2's 9 heads admit no TP=2)."""
    runs = [f"run.output_dir={tmp_path}"]
    dp2 = run_world(train_on_rank, 2, SMOLLM2 + runs + ["run.name=dp2"])[0][0]
    pp2 = run_world(train_on_rank, 2, SMOLLM2 + runs + ["run.name=pp2", "actor.parallel.pp=2"])[0][0]
    assert dp2["actor/ppo_kl"] != 0  # the second mini-batch ran after an update
    for key in COMPARED:
        assert pp2[key] == pytest.approx(dp2[key], rel=1e-4, abs=1e-6), key
