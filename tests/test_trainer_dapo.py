"""The trainer's DAPO pieces and checks end to end on the CPU, with the tiny model and synthetic task of
:mod:`tests.rl_tasks`: dynamic sampling (refill, round cap), first-step exactness on TP=2 and PP=2 (gloo),
metrics independent of the micro-batch layout, rollout correction, overlong shaping and filtering."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_each_on_rank, train_on_rank, write_prompts

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


def test_dynamic_sampling_refills_the_tied_groups_with_rollout_correction_and_overlong_shaping(task):
    m = _run(task, "refill", DYNAMIC + ["algorithm.dynamic_sampling.max_extra_rounds=4",
                                        "algorithm.rollout_correction.preset=seq_mis",
                                        "algorithm.rollout_correction.cap=1.0001",
                                        "algorithm.overlong.buffer_tokens=2", "algorithm.overlong.filter=true"])[0]
    assert m["dynamic_sampling/rounds"] >= 2, m  # the first round had tied groups: more prompts were drawn
    assert m["dynamic_sampling/groups_generated"] == 4 * m["dynamic_sampling/rounds"]
    assert m["dynamic_sampling/groups_kept"] == 4 and m["dynamic_sampling/groups_short"] == 0
    assert m["dynamic_sampling/groups_tied_kept"] == 0
    assert m["reward/std"] > 0 and m["reward/mean"] != 0.5
    for key in ("kl_k3", "ratio_mean", "ratio_min", "ratio_max", "truncated_frac", "masked_frac"):
        assert f"rollout_corr/{key}" in m, key
    assert m["rollout_corr/truncated_frac"] == 0  # mask mode
    assert m["rollout_corr/ratio_min"] <= m["rollout_corr/ratio_mean"] <= m["rollout_corr/ratio_max"]
    assert m["reward/overlong_penalty_mean"] < 0  # responses of 2 or 3 tokens against a limit of 3, buffer 2
    assert 0 < m["response/overlong_filtered"] <= 1


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


@pytest.mark.parametrize("layout,passes", [(["actor.parallel.tp=2"], ["always"]),
                                           (["actor.parallel.pp=2", "trainer.steps=2"], ["always", "auto"])],
                         ids=["tp2", "pp2"])
def test_first_step_update_logprobs_equal_the_old_ones_bit_for_bit(task, layout, passes):
    """One mini-batch, one epoch: the update's log-probs are those of the old-log-prob pass exactly
    (``actor.old_logprob_pass=always``), so the first mini-batch's PPO-KL is exactly 0 (slime's CI check). At
    PP=2, 2 steps without the pass (``auto``: the update's first forward gives the old log-probs, from the last
    stage) have no old-log-prob phase, the same metrics and the same weights on every rank."""
    root, model, data = task
    name = "first_" + layout[0].split(".")[-1].replace("=", "")
    ranks = run_world(train_each_on_rank, 2, [task_overrides(model, data, root / "runs", f"{name}_{p}") + STEP
                                              + FIRST_STEP + layout + [f"actor.old_logprob_pass={p}"]
                                              for p in passes])
    always = ranks[0][0][0]
    m = always[0]
    assert m["actor/log_ratio_absmax_first_minibatch"] == 0.0
    assert m["actor/ppo_kl_first_minibatch"] == 0.0 and m["actor/clipfrac"] == 0.0
    assert m["actor/approx_kl"] == 0.0
    if passes == ["always"]:
        return
    auto = ranks[0][1][0]
    assert all("time/old_logprobs" in h for h in always) and all("time/old_logprobs" not in h for h in auto)
    assert always[1]["actor/kl"] > 0 and always[1]["actor/rollout_vs_old_logprob_diff"] > 0  # the checks can fail
    for a, b in zip(auto, always, strict=True):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl", "actor/kl_loss",
                    "actor/ppo_kl", "actor/rollout_vs_old_logprob_diff", "rollout_corr/kl_k3"):
            assert a[key] == b[key], key
    for (_, always_weights), (_, auto_weights) in ranks:
        assert all(torch.equal(w, auto_weights[n]) for n, w in always_weights.items())


def test_update_metrics_do_not_depend_on_the_micro_batch_layout(task):
    """Same data, micro-batches of 1 and of 4 rows: the per-update metrics are token-weighted means, equal up to
    rounding (issue 24: means of micro-batch means gave 0.0044 vs 0.0067)."""
    two = ["actor.ppo_mini_batch_size=8", "rollout.max_new_tokens=6"]  # 2 mini-batches: the 2nd has ppo_kl != 0
    small = _run(task, "micro1", two + ["actor.micro_batch_size=1"])[0]
    large = _run(task, "micro4", two + ["actor.micro_batch_size=4"])[0]
    assert small["actor/ppo_kl"] != 0 and small["response/length_mean"] == large["response/length_mean"]
    for key in ("actor/ppo_kl", "actor/approx_kl", "actor/clipfrac", "actor/entropy", "actor/pg_loss"):
        assert small[key] == pytest.approx(large[key], rel=1e-4, abs=1e-7), key

