"""Role placement (``placement`` in the run config): each fault is one error naming the role, the pool and the
sizes, before any model is built; the start-up summary; runs placed on explicit pools equal the single-pool run.
"""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config, placement_summary, role_layouts, validate_for_world
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

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
    (["rollout.tp=2", "data.prompts_per_step=3", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=1"], 4,
     ["data.prompts_per_step", "3 prompts are not divisible by the rollout's dp=2", "pool 'all' of 4 ranks"]),
    (["rollout.tp=3"], 4, ["rollout.tp", "3 does not divide the rollout's pool 'all'", "of 4 ranks"]),
    (["placement.actor=nowhere"], 4, ["placement.actor", "unknown pool 'nowhere'"]),
    (["placement.pools.none=[]"], 4, ["placement.pools.none", "non-empty list"]),
    (["placement.pools.all=[0]"], 4, ["placement.pools.all", "is the whole world"]),
    (["placement.pools.twice=[1,1]", "placement.reward=twice"], 4, ["placement.pools.twice", "lists a rank twice"]),
    (["placement.pools.low=[0]", "placement.rollout=low"], 4,
     ["placement.rollout", "rollout on pool 'low' ranks 0 tp=1 dp=1", "the whole world of 4 ranks"]),
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


def _train(rank, world, overrides):
    from megarl.config import load_config
    from megarl.trainer.metrics import read_metrics
    from megarl.trainer.trainer import train

    cfg = load_config(None, overrides)
    summary = train(cfg)
    return read_metrics(cfg.run.run_dir / "metrics.jsonl") if rank == 0 else summary


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("task")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 16)


STEP = ["trainer.steps=1", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.optim.lr=1e-2"]
COMPARED = ["reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "actor/kl", "actor/clipfrac", "actor/ppo_kl", "advantages/mean"]


def test_colocated_pool_and_reward_pool_match_the_single_pool_run_at_step_1(task):
    """Every role on an explicit pool of both ranks, the reward scored on rank 1 alone, against the default
    (every role on ``all``): the same step-1 metrics."""
    root, model, data = task
    base = task_overrides(model, data, root / "runs", "single") + STEP
    single = run_world(_train, 2, base)[0][0]
    placed = run_world(_train, 2, base + [
        "run.name=placed", "placement.pools.both=[0,1]", "placement.pools.one=[1]", "placement.actor=both",
        "placement.reference=both", "placement.rollout=both", "placement.reward=one"])[0][0]
    assert single["actor/ppo_kl"] != 0  # the second mini-batch ran after an update
    for key in COMPARED:
        assert placed[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
