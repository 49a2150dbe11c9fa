"""Resume that changes the run (issue 23, issue 24): another TP/PP/DP layout, a longer run, changed optimizer
settings, and the refusals of what cannot be resumed.

Runs use the tiny model and synthetic task of :mod:`tests.rl_tasks`, fp32, each in its own spawned world.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_world
from tests.rl_tasks import (SPLIT_2, make_tiny_model, make_tiny_moe_model, task_overrides, train_on_rank,
                            train_until_requeued, write_prompts)

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


@pytest.fixture(scope="module")
def straight(task):
    """The uninterrupted single-rank run of 4 steps that the resumed and restarted runs must reproduce."""
    history = _run(task, "straight", extra=["trainer.steps=4"])[0]
    assert history[1]["actor/ppo_kl"] != history[2]["actor/ppo_kl"]  # the steps differ: the checks can fail
    return history


def test_a_checkpoint_resumes_at_another_tp_pp_and_dp_as_the_uninterrupted_run(task, straight):
    """One run, each step at another layout: TP=1 x PP=2 (step 1) -> TP=2 x PP=1 (step 2) -> DP=2 (step 3)
    -> DP=1 (step 4); every step's metrics equal the uninterrupted single-rank run's within 1e-4, the LR
    schedule and Adam's state included (an optimizer restarted from zero moves the weights by another amount
    in the first update after the resume, and the second update's metrics show it)."""
    chain = [(1, ["actor.parallel.pp=2"]), (2, ["actor.parallel.tp=2"]), (3, []), (4, [])]
    worlds = {1: 2, 2: 2, 3: 2, 4: 1}
    for step, layout in chain:
        resume = ["trainer.resume=true"] if step > 1 else []
        history = _run(task, "moved", worlds[step], [f"trainer.steps={step}", *resume, *layout])[0]
        assert [h["step"] for h in history] == list(range(1, step + 1))
        _assert_step_matches(history[step - 1], straight[step - 1], step)
    summary = json.loads((task[0] / "runs" / "moved" / "summary.json").read_text())
    assert summary["resumed"]["step"] == 3 and summary["resumed"]["changed"]["trainer.steps"] == [3, 4]


# ------------------------------------------------------------------ issue 32: MoE resume at any layout
# (tp, pp, dp, ep) of each step of the chain, every run on 2 ranks; each change below, from one step to the next,
# appears in both directions: PP 2->1 (1->2) and 1->2 (4->5), DP 1->2 and 2->1 (1->2, 2->3), EP 1->2 (1->2, 3->4)
# and 2->1 (2->3, 4->5), TP with sequence parallelism 1->2 (2->3) and 2->1 (4->5), and TP=2 x EP=2; the experts
# (actor.kernels.moe_experts) grouped <-> sequential at every step
MOE_CHAIN = [(1, 2, 1, 1, "grouped"), (1, 1, 2, 2, "sequential"), (2, 1, 1, 1, "grouped"),
             (2, 1, 1, 2, "sequential"), (1, 2, 1, 1, "grouped")]
MOE_COMPARED = [*COMPARED, "actor/moe_aux_loss", "actor/moe_expert_load_max", "actor/moe_expert_load_min"]


@pytest.fixture(scope="module")
def moe_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_moe")
    return root, make_tiny_moe_model(root / "model"), write_prompts(root / "prompts.jsonl", 64)


@pytest.mark.slow  # CI time: 140 s on a 2-core machine; the dense resume at another layout stays in CI
@pytest.mark.parametrize("distributed", [True, False])
def test_an_moe_checkpoint_resumes_at_another_tp_pp_dp_and_ep_as_the_uninterrupted_run(moe_task, distributed):
    """Issue 32: a Qwen3-MoE run (8 experts, top-2, the load-balancing loss on; the distributed optimizer, or the
    plain one) whose every step runs at another layout of :data:`MOE_CHAIN`, each change in both directions (the
    experts' optimizer of their own in the chain, where EP > 1 or TP > 1, or not; grouped and sequential experts
    in turn: their checkpoints, optimizer state included, are alike); every step's metrics, the aux
    loss and the experts' loads included, equal the uninterrupted single-rank run's within 1e-4, Adam's state
    included (the second update of each step)."""
    root, model, data = moe_task
    base = BASE + [f"actor.optim.distributed={str(distributed).lower()}"]
    straight = run_world(train_on_rank, 1, task_overrides(model, data, root / "runs", f"straight_{distributed}")
                         + base + [f"trainer.steps={len(MOE_CHAIN)}"])[0]
    assert straight[1]["actor/moe_aux_loss"] != straight[2]["actor/moe_aux_loss"]  # the checks can fail
    for step, (tp, pp, dp, ep, experts) in enumerate(MOE_CHAIN, start=1):
        layout = [f"actor.parallel.tp={tp}", f"actor.parallel.pp={pp}", f"actor.parallel.ep={ep}",
                  f"actor.parallel.sequence_parallel={str(tp > 1).lower()}", f"actor.kernels.moe_experts={experts}"]
        resume = ["trainer.resume=true"] if step > 1 else []
        history = run_world(train_on_rank, tp * pp * dp, task_overrides(model, data, root / "runs",
                                                                        f"moved_{distributed}")
                            + base + [f"trainer.steps={step}", *resume, *layout])[0]
        assert [h["step"] for h in history] == list(range(1, step + 1))
        for key in MOE_COMPARED:
            assert history[step - 1][key] == pytest.approx(straight[step - 1][key], rel=1e-4, abs=1e-6), \
                (step, (tp, pp, dp, ep, experts), key, history[step - 1][key], straight[step - 1][key])


def _train_then_optimizer(rank, world, overrides):
    """Train as :func:`tests.rl_tasks.train_on_rank` does; return the metrics and the actor optimizer's
    param groups' weight decay at the end (rank 0)."""
    from megarl.config import load_config
    from megarl.trainer.metrics import read_metrics
    from megarl.trainer.builders import seed_all
    from megarl.trainer.checkpointing import check_run_folder
    from megarl.trainer.loop import fit
    from megarl.trainer.trainer import Trainer

    cfg = load_config(None, overrides)
    seed_all(cfg.run.seed)
    check_run_folder(cfg, world)
    trainer = Trainer(cfg)
    fit(trainer)
    groups = trainer.actor.optimizer.param_groups
    return read_metrics(cfg.run.run_dir / "metrics.jsonl"), sorted({g["weight_decay"] for g in groups})


def _linear_lr(update, lr, min_lr, updates):
    """megatron's linear decay at 1-based ``update`` of ``updates`` (no warm-up): the scheduler has stepped
    ``update - 1`` times."""
    return lr - (lr - min_lr) * (update - 1) / updates


@pytest.mark.slow  # CI time (issue 33's 45 minutes): one of the 30 slowest
def test_an_extended_run_with_changed_optimizer_settings_follows_the_current_config(task):
    """Issue 24: 2 steps with a linear decay, then ``--resume trainer.steps=4`` with another ``actor.optim.lr``,
    ``min_lr`` and ``weight_decay``: the new steps run on the current config's schedule (the decay over 4
    steps' updates, from the update count reached; not at LR 0), megatron does not fail to pair the changed
    param groups (``KeyError``), the new weight decay holds after every update, and the summary names the
    changes."""
    root, model, data = task
    base = task_overrides(model, data, root / "runs", "extended") + BASE + [
        "actor.optim.warmup_steps=0", "actor.optim.decay=linear", "actor.optim.lr=1e-3"]
    # checkpoints by time alone (trainer.save_every=0: by step only at the end): 0.0001 minutes pass every step
    by_time = ["trainer.save_every=0", "trainer.save_every_min=0.0001", "trainer.keep_checkpoints=3"]
    first, _ = run_world(_train_then_optimizer, 1, base + by_time + ["trainer.steps=2"])[0]
    assert [h["actor/lr"] for h in first] == pytest.approx(
        [(_linear_lr(1, 1e-3, 0, 4) + _linear_lr(2, 1e-3, 0, 4)) / 2, _linear_lr(3.5, 1e-3, 0, 4)])
    # step 1's save's seconds, in step 2's metrics (a step's metrics are written before its checkpoint)
    assert "time/checkpoint_save" not in first[0] and first[1]["time/checkpoint_save"] > 0
    assert [p.name for p in sorted((root / "runs" / "extended" / "checkpoints").iterdir())] == \
        ["step_000001", "step_000002"]
    changed = ["trainer.steps=4", "trainer.resume=true", "actor.optim.lr=2e-3", "actor.optim.min_lr=1e-4",
               "actor.optim.weight_decay=0.1"]
    history, decays = run_world(_train_then_optimizer, 1, base + by_time + changed)[0]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    want = [(_linear_lr(u, 2e-3, 1e-4, 8) + _linear_lr(u + 1, 2e-3, 1e-4, 8)) / 2 for u in (5, 7)]
    assert [h["actor/lr"] for h in history[2:]] == pytest.approx(want, rel=1e-6)
    assert 0.1 in decays, decays  # megatron's groups: 0.1 where weights decay (0 for biases and norms, if any)
    summary = json.loads((root / "runs" / "extended" / "summary.json").read_text())
    assert summary["resumed"]["changed"] == {"actor.optim.lr": [1e-3, 2e-3], "actor.optim.min_lr": [0.0, 1e-4],
                                             "actor.optim.weight_decay": [0.0, 0.1], "trainer.steps": [2, 4]}

    from megarl.config import ConfigError, load_config
    from megarl.trainer.checkpointing import check_run_folder

    with pytest.raises(ConfigError, match=r"trainer.steps: the run in .* has finished its 4 steps .*"
                                          r"--resume trainer.steps=8"):
        check_run_folder(load_config(None, base + changed), 1)  # no model is loaded to train 0 steps


PPO = ["algorithm.name=ppo", "critic.warmup_steps=1", "critic.ppo_mini_batch_size=8", "critic.micro_batch_size=4",
       "critic.optim.lr=1e-2"]
PPO_COMPARED = [*COMPARED, "critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"]


def test_ppo_saves_inside_the_critics_warm_up_and_resumes_from_it_as_the_uninterrupted_run(task):
    """Issue 48: PPO with a critic warmed up alone for its first step saves a checkpoint after every step: the
    first inside the warm-up, when the actor's optimizer has never stepped (megatron-core's DistributedOptimizer
    asserted on its empty state), the next after it. A run stopped at the warm-up's checkpoint and resumed trains
    steps 2 and 3 as the uninterrupted run does: the actor's first updates start from Adam's initial state (zero
    moments, no step), two updates a step so the second reads the moments and the step count."""
    straight = _run(task, "ppo_straight", extra=[*PPO, "trainer.steps=3"])[0]
    assert [h["step"] for h in straight] == [1, 2, 3]
    assert "actor/grad_norm" not in straight[0] and "actor/grad_norm" in straight[1]  # step 1: the warm-up
    assert [p.name for p in (task[0] / "runs" / "ppo_straight" / "checkpoints").iterdir()] == ["step_000003"]
    _run(task, "ppo_resumed", extra=[*PPO, "trainer.steps=1"])
    resumed = _run(task, "ppo_resumed", extra=[*PPO, "trainer.steps=3", "trainer.resume=true"])[0]
    assert [h["step"] for h in resumed] == [1, 2, 3]
    for step in (2, 3):
        for key in PPO_COMPARED:
            got, want = resumed[step - 1][key], straight[step - 1][key]
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (step, key, got, want)


def test_resume_without_a_checkpoint_is_refused_before_any_process(task):
    """Issue 24 item 7: ``train --resume`` on a folder without a checkpoint (a mistyped ``run.name``) stops with
    an error, as ``submit --resume`` does, instead of training from step 0."""
    import subprocess
    import sys

    root, model, data = task
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train",
                        *task_overrides(model, data, root / "runs", "typo"), "--resume"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"megarl: error: trainer.resume: the run folder {root / 'runs' / 'typo'} holds no checkpoint to resume "
        "from; start the run without --resume, or check run.name and run.output_dir"), r.stderr[-2000:]
    assert not (root / "runs" / "typo" / "metrics.jsonl").exists()


def test_train_max_restarts_continues_a_killed_run_to_the_uninterrupted_metrics(task, straight):
    """``megarl train --max-restarts 1``: the rank is SIGKILLed in step 3's actor update (first attempt only);
    the launcher runs it again from step 2's checkpoint, and the run ends its 4 steps with the uninterrupted
    run's metrics; the restart is recorded with its reason in the run folder and the summary."""
    import os
    import subprocess
    import sys

    root, model, data = task
    args = [*task_overrides(model, data, root / "runs", "restarted"), *BASE, "trainer.steps=4"]
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "train", *args, "--max-restarts", "1"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MEGARL_FAULT": "phase.actor_update@3:kill:0:0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "megarl: restart 1/1: the run failed (killed by signal 9)" in r.stderr, r.stderr[-3000:]
    run = root / "runs" / "restarted"
    history = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by_step = {h["step"]: h for h in history}
    assert sorted(by_step) == [1, 2, 3, 4]
    _assert_step_matches(by_step[4], straight[3], 4)
    restarts = json.loads((run / "summary.json").read_text())["restarts"]
    assert [(x["restart"], x["status"], x["checkpoint"].endswith("step_000002")) for x in restarts] == [(1, -9, True)]


def test_the_supervisor_retries_failures_up_to_the_limit_and_never_a_config_error(tmp_path):
    """:func:`megarl.launch.supervise.supervise_local` with stand-in commands: a command that always fails
    runs 1 + N times, each restart recorded; a config error (status 2), a storage fault (74: a full disk, a
    read-only folder; issue 33 item 9) and an interrupt (130) run once."""
    import sys

    from megarl.launch.supervise import supervise_local
    from megarl.parallel.restart import read_restarts

    count = tmp_path / "count"
    fail = [sys.executable, "-c", f"import os, sys; open({str(count)!r}, 'a').write(os.environ['MEGARL_RESTART']); "
                                  "sys.exit(int(sys.argv[1]))"]
    assert supervise_local([*fail, "1"], tmp_path / "run", 2) == 1
    assert count.read_text() == "012"
    assert [(r["restart"], r["status"]) for r in read_restarts(tmp_path / "run")] == [(1, 1), (2, 1)]
    for status in (2, 74, 130):
        count.unlink()
        assert supervise_local([*fail, str(status)], tmp_path / f"run{status}", 2) == status
        assert count.read_text() == "0" and read_restarts(tmp_path / f"run{status}") == []


# ------------------------------------------------------------------ issue 33: resume whatever the options
# the rollout's seeds, prompts and samples after a resume: each case changes how many generate calls, prompts or
# samples a step uses; every per-step figure below is a function of the samples and the updates alone
EXACT = ["reward/mean", "reward/std", "response/length_mean", "response/length_max", "prompt/length_mean",
         "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/lr", "rollout/policy_version",
         "rollout/staleness", "data/epoch", "dynamic_sampling/rounds", "dynamic_sampling/groups_generated",
         "dynamic_sampling/groups_kept", "dynamic_sampling/groups_tied_kept", "val/accuracy", "val/reward_mean"]
# half the groups tied (tests.rl_tasks.half_tied): most steps draw 2-4 rounds of prompts
DYNAMIC = ["reward.fn=tests.rl_tasks:half_tied", "algorithm.dynamic_sampling.enabled=true",
           "algorithm.dynamic_sampling.max_extra_rounds=3"]
ASYNC = ["trainer.mode=async", "trainer.max_staleness=1", "algorithm.rollout_correction.preset=token_tis"]
RESUMED = {  # case: (world, steps, resumed after, overrides)
    "dynamic_sampling": (1, 2, 1, DYNAMIC),  # the fast one: the first resumed step
    "packing": (1, 3, 1, DYNAMIC + ["actor.max_tokens_per_micro_batch=64", "actor.sequence_packing=true"]),
    "validation": (1, 3, 1, DYNAMIC + ["validation.enabled=true", "validation.num_prompts=4", "validation.every=1"]),
    "multi_turn": (1, 3, 1, ["rollout.multi_turn.enabled=true", "rollout.multi_turn.env=tests.rl_tasks:SecretWord",
                             "rollout.multi_turn.max_turns=2", "rollout.max_new_tokens=1"]),
    "async_split": (2, 4, 2, SPLIT_2 + ASYNC),
}


def _records(run_dir, name):
    import json as _json

    return [_json.loads(line) for line in (run_dir / name).read_text().splitlines()]


@pytest.mark.parametrize("case", [
    pytest.param("dynamic_sampling", marks=pytest.mark.slow),  # CI time (45 minutes)
    pytest.param("packing", marks=pytest.mark.slow),
    pytest.param("validation", marks=pytest.mark.slow),
    pytest.param("multi_turn", marks=pytest.mark.slow),
    pytest.param("async_split", marks=pytest.mark.slow),
])
def test_a_resumed_run_samples_and_trains_as_the_uninterrupted_one(task, case, monkeypatch):
    """Issue 33: ``steps`` steps straight against a run of ``steps`` steps that saves and ends on SIGUSR1 in
    step ``k`` (as a SLURM job near its time limit), then ``--resume`` to the end, for each option
    that changes how many generate calls, prompts or samples a step uses: DAPO's dynamic sampling with extra
    rounds (the engine's call counter, the loader's position after the extra prompts), the same with packed
    micro-batches and with validation after every step (its generate calls between the steps), multi-turn
    episodes (every turn's and environment's seed) and split pools one step off (the batch in flight at the
    save, generated with the weights of the step before). Every step's figures, ``samples.jsonl`` (every
    response with its score, lengths and policy version) and ``val_samples.jsonl`` are the straight run's,
    exactly (the same computations on the same inputs on the CPU)."""
    world, steps, k, extra = RESUMED[case]
    root, model, data = task
    base = ["trainer.save_every=1", "trainer.log_samples=64", *extra]
    if case == "validation":
        base.append(f"validation.files=[{data}]")
    straight = _run(task, f"straight_{case}", world, [*base, f"trainer.steps={steps}"])[0]
    overrides = task_overrides(model, data, root / "runs", f"resumed_{case}") + BASE + [*base, f"trainer.steps={steps}"]
    monkeypatch.setenv("MEGARL_FAULT", f"phase.actor_update@{k}:signal=USR1:0")
    assert run_world(train_until_requeued, world, overrides) == ["requeued"] * world
    monkeypatch.delenv("MEGARL_FAULT")
    assert [p.name for p in (root / "runs" / f"resumed_{case}" / "checkpoints").iterdir()] == [f"step_{k:06d}"]
    resumed = _run(task, f"resumed_{case}", world, [*base, f"trainer.steps={steps}", "trainer.resume=true"])[0]
    first = 0 if case == "validation" else 1  # validation before step 1: its figures as step 0's
    assert [h["step"] for h in resumed] == [h["step"] for h in straight] == list(range(first, steps + 1))
    if case != "multi_turn" and not case.startswith("async"):  # the case changes what it names: the check can fail
        assert max(h.get("dynamic_sampling/rounds", 0) for h in straight[k:]) > 1, straight
    for got, want in zip(resumed, straight):
        for key in EXACT:
            assert got.get(key) == want.get(key), (case, got["step"], key, got.get(key), want.get(key))
    for name in ("samples.jsonl", "val_samples.jsonl"):
        if (root / "runs" / f"straight_{case}" / name).exists() or name == "samples.jsonl":
            assert _records(root / "runs" / f"resumed_{case}", name) == \
                _records(root / "runs" / f"straight_{case}", name), (case, name)
