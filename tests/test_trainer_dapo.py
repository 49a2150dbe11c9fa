"""The trainer's DAPO pieces and checks end to end on the CPU, with the tiny model and synthetic task of
:mod:`tests.rl_tasks`: dynamic sampling (refill, round cap), first-step exactness on TP=2 and PP=2 (gloo),
metrics independent of the micro-batch layout, rollout correction, overlong shaping and filtering."""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

STEP = ["trainer.steps=1", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
        "actor.optim.lr=1e-2"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("dapo")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 64)


def _run(task, name, extra, world=1):
    root, model, data = task
    return run_world(train_on_rank, world, task_overrides(model, data, root / "runs", name) + STEP + list(extra))[0]


DYNAMIC = ["reward.fn=tests.rl_tasks:half_tied", "algorithm.dynamic_sampling.enabled=true",
           "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4"]


def test_dynamic_sampling_refills_the_tied_groups(task):
    m = _run(task, "refill", DYNAMIC + ["algorithm.dynamic_sampling.max_extra_rounds=4"])[0]
    assert m["dynamic_sampling/rounds"] >= 2, m  # the first round had tied groups: more prompts were drawn
    assert m["dynamic_sampling/groups_generated"] == 4 * m["dynamic_sampling/rounds"]
    assert m["dynamic_sampling/groups_kept"] == 4 and m["dynamic_sampling/groups_short"] == 0
    assert m["dynamic_sampling/groups_tied_kept"] == 0
    assert m["reward/std"] > 0 and m["reward/mean"] != 0.5


@pytest.mark.parametrize("mini", [8, 16])
def test_dynamic_sampling_round_cap_trains_on_fewer_groups_and_says_so(task, mini):
    m = _run(task, f"capped{mini}", DYNAMIC + ["algorithm.dynamic_sampling.max_extra_rounds=0",
                                               f"actor.ppo_mini_batch_size={mini}"])[0]
    signal = m["dynamic_sampling/groups_with_signal"]
    assert m["dynamic_sampling/rounds"] == 1 and 2 <= signal < 4, m
    if mini == 8:  # whole mini-batches of 8 rows = 2 groups of 4: the groups with signal, cut to a multiple of 2
        assert m["dynamic_sampling/groups_kept"] == 2 and m["dynamic_sampling/groups_tied_kept"] == 0
    else:  # not one mini-batch (4 groups) with signal: all of them, and tied groups to fill it
        assert m["dynamic_sampling/groups_kept"] == signal
        assert m["dynamic_sampling/groups_tied_kept"] == 4 - signal
    assert m["dynamic_sampling/groups_short"] == 4 - m["dynamic_sampling/groups_kept"]
    assert "actor/pg_loss" in m


FIRST_STEP = ["actor.ppo_mini_batch_size=16", "actor.micro_batch_size=4", "algorithm.kl.coef=0.001"]


@pytest.mark.parametrize("layout", [["actor.parallel.tp=2"], ["actor.parallel.pp=2"]], ids=["tp2", "pp2"])
def test_first_step_update_logprobs_equal_the_old_ones_bit_for_bit(task, layout):
    """One mini-batch, one epoch: the update's log-probs are the old log-probs exactly, so the first
    mini-batch's PPO-KL is exactly 0 (slime's CI check)."""
    m = _run(task, "first_" + layout[0].split(".")[-1].replace("=", ""), FIRST_STEP + layout, world=2)[0]
    assert m["actor/log_ratio_absmax_first_minibatch"] == 0.0
    assert m["actor/ppo_kl_first_minibatch"] == 0.0 and m["actor/clipfrac"] == 0.0
    assert m["actor/approx_kl"] == 0.0


def test_update_metrics_do_not_depend_on_the_micro_batch_layout(task):
    """Same data, micro-batches of 1 and of 4 rows: the per-update metrics are token-weighted means, equal up to
    rounding (issue 24: means of micro-batch means gave 0.0044 vs 0.0067)."""
    two = ["actor.ppo_mini_batch_size=8", "rollout.max_new_tokens=6"]  # 2 mini-batches: the 2nd has ppo_kl != 0
    small = _run(task, "micro1", two + ["actor.micro_batch_size=1"])[0]
    large = _run(task, "micro4", two + ["actor.micro_batch_size=4"])[0]
    assert small["actor/ppo_kl"] != 0 and small["response/length_mean"] == large["response/length_mean"]
    for key in ("actor/ppo_kl", "actor/approx_kl", "actor/clipfrac", "actor/entropy", "actor/pg_loss"):
        assert small[key] == pytest.approx(large[key], rel=1e-4, abs=1e-7), key


def test_rollout_correction_overlong_shaping_and_filtering_in_a_step(task):
    m = _run(task, "corrected", ["actor.ppo_mini_batch_size=16", "algorithm.rollout_correction.preset=seq_mis",
                                 "algorithm.rollout_correction.cap=1.0001",
                                 "algorithm.overlong.buffer_tokens=2", "algorithm.overlong.filter=true"])[0]
    for key in ("kl_k3", "ratio_mean", "ratio_min", "ratio_max", "truncated_frac", "masked_frac"):
        assert f"rollout_corr/{key}" in m, key
    assert m["rollout_corr/truncated_frac"] == 0  # mask mode
    assert m["rollout_corr/ratio_min"] <= m["rollout_corr/ratio_mean"] <= m["rollout_corr/ratio_max"]
    assert m["reward/overlong_penalty_mean"] < 0  # responses of 2 or 3 tokens against a limit of 3, buffer 2
    assert 0 < m["response/overlong_filtered"] <= 1
