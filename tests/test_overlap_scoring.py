"""``rollout.overlap_scoring`` (:mod:`megarl.rollout.overlap`): the step that scores finished groups while the
others generate gives the sequential step's results bit for bit, on two gloo ranks (TP=2, then DP=2), and the
combinations it does not cover are refused with one line naming the field."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_each_on_rank, write_prompts

# 4 prompts x 4 samples of up to 8 tokens, decoded 4 rows at a time (groups finish one after another), two
# mini-batches (the old-log-prob pass runs), the KL in the loss (the reference's pass runs); two steps
STEPS = ["trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
         "rollout.max_new_tokens=8", "rollout.max_batch_size=4", "actor.ppo_mini_batch_size=8",
         "actor.micro_batch_size=2", "actor.optim.lr=1e-2", "algorithm.kl.coef=0.01"]
TIMED = ("time/", "throughput/", "pool/", "overlap/", "offload/", "reshard/", "perf/", "mfu/", "memory/")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 16)


@pytest.mark.parametrize("layout", [["actor.parallel.tp=2"], ["actor.parallel.dp=2"]], ids=["tp2", "dp2"])
def test_overlap_gives_the_sequential_steps_metrics_and_weights_bit_for_bit(task, layout):
    root, model, data = task
    name = layout[0].split(".")[-1].replace("=", "")
    runs = run_world(train_each_on_rank, 2, [task_overrides(model, data, root / "runs", f"{name}-{mode}") + STEPS
                                             + layout + [f"rollout.overlap_scoring={mode == 'on'}"]
                                             for mode in ("off", "on")])
    (seq, seq_weights), (ovl, ovl_weights) = runs[0]
    assert len(seq) == len(ovl) == 2
    for a, b in zip(seq, ovl):
        assert b["overlap/units"] == 4 and b["overlap/early_units"] >= 1  # units of one group, some while generating
        assert "actor/kl" in a and a["actor/ppo_kl"] != 0  # the reference's and the old-log-prob passes ran
        same = {k: v for k, v in a.items() if not k.startswith(TIMED)}
        assert same == {k: b[k] for k in same}
    for rank in runs:
        assert rank[0][1].keys() == rank[1][1].keys()
        for n, t in rank[0][1].items():
            assert t.equal(rank[1][1][n]), n


@pytest.mark.parametrize("override,field", [
    ("rollout.multi_turn.enabled=true", "rollout.multi_turn.enabled"),
    ("algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.enabled"),
    ("trainer.mode=async", "trainer.mode"),
    ("placement.rollout=gen", "placement.rollout"),
    ("actor.offload=true", "actor.offload"),
    ("reward.fn=reward_model", "reward.fn"),
])
def test_what_overlap_does_not_cover_is_refused_naming_the_field(override, field):
    extra = (["placement.pools={all: all, gen: [1]}"] if "placement" in override else [])
    with pytest.raises(ConfigError, match=f"^{field}: .*rollout.overlap_scoring=false"):
        load_config(None, ["rollout.overlap_scoring=true", override] + extra)
