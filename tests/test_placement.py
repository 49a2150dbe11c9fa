"""Role placement (``placement`` in the run config): each fault is one error naming the role, the pool and the
sizes, before any model is built; the start-up summary; runs placed on explicit pools (colocated or split)
equal the single-pool run; host offload moves every storage away and back, and changes no metric.
"""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.parallel.placement import placement_summary, role_layouts, validate_for_world
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

SPLIT = ["placement.pools.train=[0,1]", "placement.pools.score=[2,3]", "placement.actor=train",
         "placement.reference=score", "placement.reward=score"]

# (overrides, world size, what the one error must name: field, role, pool, sizes)
FAULTS = [
    (["placement.pools.big=[0,1,2,3,4]", "placement.actor=big"], 4,
     ["placement.pools.big", "has 5 ranks but the world has 4"]),
    (["placement.pools.far=[0,5]", "placement.actor=far"], 4,
     ["placement.pools.far", "ranks [5] are outside the world of 4 ranks"]),
    (["placement.pools.three=[0,1,2]", "placement.actor=three", "actor.parallel.tp=2"], 4,
     ["actor.parallel", "actor layout tp=2 x pp=1 does not divide its pool", "pool 'three'", "has 3 ranks"]),
    (["placement.pools.two=[2,3]", "placement.reference=two", "placement.reference_parallel.pp=4"], 4,
     ["placement.reference_parallel", "reference layout tp=1 x pp=4", "pool 'two'", "has 2 ranks"]),
    (["placement.pools.two=[0,1]", "placement.actor=two", "actor.parallel.dp=4"], 4,
     ["actor.parallel.dp", "actor dp=4", "= 4 != 2", "pool 'two'"]),
    (["placement.pools.half=[2,3]", "placement.reference=half"], 4,
     ["placement.reference", "reference (pool 'half' ranks 2-3 tp=1 pp=1 dp=2)",
      "actor (pool 'all' ranks 0-3 tp=1 pp=1 dp=4) share ranks [2, 3]"]),
    (["rollout.engine=vllm", "rollout.tp=2", "data.prompts_per_step=3", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=1"], 4,
     ["data.prompts_per_step", "3 prompts are not divisible by the rollout's dp=2", "pool 'all' of 4 ranks"]),
    (["rollout.engine=vllm", "rollout.tp=3"], 4, ["rollout.tp", "3 does not divide the rollout's pool 'all'", "of 4 ranks"]),
    (["placement.actor=nowhere"], 4, ["placement.actor", "unknown pool 'nowhere'"]),
    (["placement.pools.none=[]"], 4, ["placement.pools.none", "non-empty list"]),
    (["placement.pools.all=[0]"], 4, ["placement.pools.all", "is the whole world"]),
    (["placement.pools.twice=[1,1]", "placement.reward=twice"], 4, ["placement.pools.twice", "lists a rank twice"]),
    (SPLIT + ["actor.parallel.pp=2"], 4,
     ["placement.actor", "actor on pool 'train' ranks 0-1 tp=1 pp=2 dp=1", "split pools need pp=1"]),
    (SPLIT + ["actor.parallel.tp=2", "placement.reference_parallel.tp=1"], 4,
     ["placement.reference", "reference on pool 'score' ranks 2-3 tp=1 pp=1 dp=2", "the actor's tp=2"]),
    (["placement.pools.mid=[1,2]", "placement.pools.ends=[0,3]", "placement.actor=mid", "placement.reference=ends",
      "actor.parallel.tp=2"], 4, ["placement.pools.mid", "whole TP groups", "got ranks [1, 2]"]),
    (["placement.pools.train=[2,3]", "placement.pools.score=[0,1]", "placement.actor=train",
      "placement.reference=score"], 4, ["placement.actor", "pool 'train' ranks 2-3", "holds rank 0"]),
    (["placement.pools.low=[0]", "placement.rollout=low"], 4,
     ["placement.actor", "shares ranks [0] with the rollout on pool 'low' ranks 0 tp=1 dp=1"]),
]


@pytest.mark.parametrize("overrides,world,names", FAULTS, ids=[" ".join(f[0])[:60] for f in FAULTS])
def test_each_placement_fault_is_one_error_naming_role_pool_and_sizes(overrides, world, names):
    with pytest.raises(ConfigError) as err:
        validate_for_world(load_config(None, overrides), world)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_default_places_every_role_on_every_rank_and_summary_says_so():
    cfg = load_config(None, ["algorithm.name=ppo"])
    validate_for_world(cfg, 4)
    layouts = role_layouts(cfg, 4)
    assert set(layouts) == {"actor", "critic", "reference", "reward", "rollout"}
    assert all(lay.ranks == (0, 1, 2, 3) for lay in layouts.values())
    text = placement_summary(layouts)
    assert "actor     pool 'all' ranks 0-3 tp=1 pp=1 dp=4" in text
    assert "rollout   pool 'all' ranks 0-3 tp=1 dp=4" in text


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 16)


STEP = ["trainer.steps=1", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.optim.lr=1e-2"]
COMPARED = ["reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "actor/kl", "actor/clipfrac", "actor/ppo_kl", "advantages/mean"]


@pytest.mark.slow  # CI time (issue 33's 45 minutes): one of the 30 slowest
def test_colocated_and_split_pools_match_the_single_pool_run_at_step_1(task):
    """Against the default (every role on ``all``) on two ranks, the same step-1 metrics from (1) every role on
    an explicit pool of both ranks with the reward scored on rank 1 alone, and (2) the actor on rank 0, the
    reference and the reward on rank 1, the rollout on both (megatron's state plus the pools' DP groups), its
    weights sent to rank 1 with every piece staged (``reshard.direct_min_kb=null``) or every piece direct."""
    root, model, data = task
    base = task_overrides(model, data, root / "runs", "single") + STEP
    single = run_world(train_on_rank, 2, base)[0][0]
    placed = run_world(train_on_rank, 2, base + [
        "run.name=placed", "placement.pools.both=[0,1]", "placement.pools.one=[1]", "placement.actor=both",
        "placement.reference=both", "placement.rollout=both", "placement.reward=one"])[0][0]
    split = ["placement.pools.train=[0]", "placement.pools.score=[1]", "placement.actor=train",
             "placement.reference=score", "placement.reward=score"]
    # the actor's weights reach rank 1's engine over the wire: every piece staged, or every piece direct
    staged = run_world(train_on_rank, 2, base + split + ["run.name=staged", "reshard.direct_min_kb=null"])[0][0]
    direct = run_world(train_on_rank, 2, base + split + ["run.name=direct", "reshard.direct_min_kb=0.001"])[0][0]
    assert single["actor/ppo_kl"] != 0  # the second mini-batch ran after an update
    for other in (placed, staged, direct):
        for key in COMPARED:
            assert other[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
    assert staged["reshard/bytes_sent"] == direct["reshard/bytes_sent"] > 0
    assert staged["reshard/bytes_staged"] >= staged["reshard/bytes_sent"] > direct["reshard/bytes_staged"]


def _offload_round_trip(rank, world, model_dir):
    """Train one update, move the actor's storages to the host and back; return what was moved and whether
    every parameter, main gradient and Adam state tensor came back bit for bit."""
    import torch

    from megarl.config import ActorConfig, OptimConfig
    from megarl.models.checkpoint import source_spec
    from megarl.parallel.mesh import ParallelLayout, init_distributed, initialize_model_parallel
    from megarl.workers.offload import HostOffload
    from megarl.workers.actor import PolicyWorker

    init_distributed()
    mesh = ParallelLayout(dp=world)
    initialize_model_parallel(mesh)
    spec = source_spec(str(model_dir))[0]
    worker = PolicyWorker(spec, mesh, "actor", str(model_dir), torch.float32,
                          ActorConfig(optim=OptimConfig(lr=1e-2)), trainable=True, temperature=1.0)
    params = list(worker.model.parameters())
    for p in params:
        p.main_grad.normal_()
    worker.optimizer.step()  # creates Adam's state
    inner = worker.optimizer.chained_optimizers[0].optimizer if hasattr(worker.optimizer, "chained_optimizers") \
        else worker.optimizer.optimizer
    watched = [p.data for p in params] + [p.main_grad for p in params] + \
        [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    before = [t.clone() for t in watched]
    off = HostOffload(worker.model, worker.optimizer)
    off.to_host(("grads", "optimizer"))
    grads_away = all(p.main_grad.untyped_storage().nbytes() == 0 for p in params)
    params_stayed = all(p.untyped_storage().nbytes() > 0 for p in params)
    off.to_host(("params",))
    host_bytes = off.bytes_on_host
    all_away = all(t.untyped_storage().nbytes() == 0 for t in watched)
    off.to_device()
    same = all(torch.equal(a, b) for a, b in zip(watched, before))
    return grads_away, params_stayed, all_away, host_bytes, same


def test_offload_moves_params_grads_and_adam_state_and_back(task):
    root, model, data = task
    grads_away, params_stayed, all_away, host_bytes, same = run_world(_offload_round_trip, 1, model)[0]
    assert grads_away and params_stayed  # the reshard still reads the parameters
    assert all_away and host_bytes > 0
    assert same


@pytest.mark.slow  # CI time (issue 33's 45 minutes): one of the 30 slowest
def test_offload_on_and_off_give_the_same_step_2_metrics(task):
    root, model, data = task
    base = task_overrides(model, data, root / "runs", "resident") + STEP + ["trainer.steps=2"]
    resident = run_world(train_on_rank, 1, base)[0]
    offloaded = run_world(train_on_rank, 1, base + ["run.name=offloaded", "actor.offload=true"])[0]
    assert offloaded[1]["offload/host_bytes"] > 0 and resident[1]["offload/host_bytes"] == 0
    assert resident[1]["actor/pg_loss"] != resident[0]["actor/pg_loss"]
    for key in COMPARED:
        assert offloaded[1][key] == pytest.approx(resident[1][key], rel=1e-6, abs=1e-8), key


@pytest.mark.slow
def test_issue_layout_on_four_ranks_matches_the_single_pool_run_at_step_1(task):
    """The issue's layout: actor on ranks 0-1, reference and reward on ranks 2-3, rollout on all four."""
    root, model, data = task
    base = task_overrides(model, data, root / "runs", "single4") + STEP
    single = run_world(train_on_rank, 4, base)[0][0]
    split = run_world(train_on_rank, 4, base + ["run.name=split4"] + SPLIT)[0][0]
    for key in COMPARED:
        assert split[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_split_pools_resume_reproduces_the_uninterrupted_run(task):
    """PPO with the actor and critic on rank 0, the reference and the reward on rank 1: stopped after step 1
    and resumed, step 2 equals the uninterrupted run's (weights, both optimizers and LR schedules, the KL
    controller and the data position come back on each pool)."""
    root, model, data = task
    split = ["placement.pools.train=[0]", "placement.pools.score=[1]", "placement.actor=train",
             "placement.critic=train", "placement.reference=score", "placement.reward=score",
             "algorithm.name=ppo", "critic.ppo_mini_batch_size=8", "critic.micro_batch_size=2",
             "trainer.save_every=1"]
    straight = run_world(train_on_rank, 2, task_overrides(model, data, root / "runs", "straight") + STEP + split
                         + ["trainer.steps=2"])[0]
    stopped = task_overrides(model, data, root / "runs", "stopped") + STEP + split
    run_world(train_on_rank, 2, stopped)
    resumed = run_world(train_on_rank, 2, stopped + ["trainer.steps=2", "trainer.resume=true"])[0]
    assert [h["step"] for h in resumed] == [1, 2]
    assert straight[1]["actor/pg_loss"] != straight[0]["actor/pg_loss"]  # the steps differ: the check can fail
    for key in COMPARED + ["critic/vf_loss"]:
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-5, abs=1e-7), key
