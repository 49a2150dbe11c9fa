"""A rollout pool of its own and asynchronous RL (issue 19), on the CPU with gloo and the transformers engine.

The schedule both groups of ranks walk (every batch generated once, before it trains, by weights at most k
updates old); the placement faults; the reshard from the actor's Megatron shards on ranks 0-1 (TP=2, and
DP=2) into the engines on ranks 2-3, bitwise against the independent reference slicer of
``tests/test_reshard_exact.py``, moving exactly the bytes the destination lacks within two staging buckets;
``trainer.mode=sync`` on split pools equal to the colocated run; ``trainer.mode=async`` (k = 1) learning the
synthetic task with every sample's policy version recorded and its staleness at most k; an async run killed
with SIGKILL and resumed; an async run given SIGUSR1 saved and ended, then resumed with checkpoints by time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.parallel.placement import validate_for_world
from megarl.trainer.metrics import read_metrics
from megarl.trainer.pipeline import generating_versions, schedule, staleness
from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts
from tests.test_reshard_exact import MODELS, hf_weights, megatron_coords, missing_elements, ref_megatron, ref_vllm

REPO = Path(__file__).resolve().parents[1]
# actor and reference on ranks 0-1 (TP=2), the reward scored there, the rollout on ranks 2-3
SPLIT = ["placement.pools.train=[0,1]", "placement.pools.gen=[2,3]", "placement.actor=train",
         "placement.reference=train", "placement.reward=train", "placement.rollout=gen", "actor.parallel.tp=2"]


# ------------------------------------------------------------------------------ the schedule
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("start", [0, 2])
def test_schedule_generates_each_batch_once_before_it_trains_at_most_k_updates_stale(k, start):
    steps = 7
    groups = schedule(start, steps, k, lambda s: s % 3 == 0)
    assert [t for t, _ in groups] == list(range(start + 1, steps + 1))
    events = [e for _, evs in groups for e in evs]
    at = {(e.kind, e.step): i for i, e in enumerate(events)}
    assert len(at) == len(events)  # no event twice
    versions = generating_versions(groups)
    for t in range(start + 1, steps + 1):
        assert at[("generate", t)] < at[("batch", t)] < at[("train", t)]
        assert 0 <= staleness(t, versions[t]) <= k
        # the weights that generated it exist: made by the update of step `version` (or loaded at `start`)
        assert versions[t] == start or at[("train", versions[t])] < at[("reshard", versions[t])] < at[("generate", t)]
        if t - 1 - k >= start:  # once the pipeline is full the staleness is exactly k: the check can fail
            assert staleness(t, versions[t]) == k
    # saves where due, each after its step's update; the first event is the reshard of the start weights
    assert [e.step for e in events if e.kind == "save"] == [s for s in range(start + 1, steps + 1) if s % 3 == 0]
    assert all(at[("train", s)] < at[("save", s)] for s in range(start + 1, steps + 1) if s % 3 == 0)
    assert events[0] == ("reshard", start)
    if k:  # while step t trains the rollout pool generates ahead: a generate between the hand-over and the train
        assert any(at[("batch", t)] < at[("generate", t + 1)] < at[("train", t)] for t in range(start + 1, steps))


# ------------------------------------------------------------------------------ placement
@pytest.mark.parametrize("extra,world,names", [
    (["trainer.mode=async", "placement.rollout=all"], 4, ["trainer.mode", "the whole world"]),
    (["placement.reward=all"], 4, ["placement.reward", "shares ranks [2, 3] with the rollout"]),
    (["placement.pools.gen=[1,2,3]"], 4,
     ["placement.actor", "shares ranks [1] with the rollout"]),
    (["validation.enabled=true"], 4, ["validation.enabled", "not built yet"]),
    (["algorithm.dynamic_sampling.enabled=true"], 4, ["algorithm.dynamic_sampling.enabled", "a pool of its own"]),
    (["placement.pools.gen=[2]"], 3, ["placement.rollout", "not a multiple of the actor's tp=2"]),
    (["rollout.engine=vllm", "rollout.tp=2", "placement.pools.gen=[3,4]", "placement.pools.train=[0,1]"], 6,
     ["placement.pools.gen", "blocks of rollout.tp=2", "got ranks [3, 4]"]),
])
def test_a_bad_rollout_pool_is_one_error_naming_the_field(extra, world, names):
    cfg = load_config(None, SPLIT + ["validation.enabled=false"] + extra)
    with pytest.raises(ConfigError) as err:
        validate_for_world(cfg, world)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_a_rollout_pool_of_its_own_validates_and_submits_on_its_world():
    from megarl.launch.submit import JobShape, check_job_shape

    cfg = load_config(None, SPLIT + ["validation.enabled=false", "trainer.mode=async"])
    validate_for_world(cfg, 4)
    check_job_shape(cfg, JobShape(nodes=2, gpus_per_node=2))  # megarl submit's check: 4 ranks, two pools
    with pytest.raises(ConfigError, match="placement.pools.gen"):  # a pool outside the job's world
        check_job_shape(cfg, JobShape(nodes=1, gpus_per_node=2))


def test_memory_estimate_is_per_pool_with_a_rollout_pool_of_its_own():
    """Training ranks hold the actor and reference (their optimizer over the actor pool's dp=1, not the
    world's), no rollout; the rollout ranks the engine alone, decoding half the step each; the busier counts."""
    from megarl.launch.memory import estimate_memory, stage_params
    from megarl.models.spec import ModelSpec

    fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS["gqa_tied"]
    spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
    cfg = load_config(None, SPLIT + ["validation.enabled=false", "model.dtype=float32"])
    est = estimate_memory(cfg, spec, 4, gpu=False)
    n = stage_params(spec, 2, 1)
    assert est.rollout_pool and est.params == n * 4 and est.optimizer == n * 8  # Adam's moments, dp = 1
    assert est.pools["train"] == est.params + est.grads + est.optimizer + est.reference + est.activations + est.runtime
    assert est.pools["rollout"] == est.runtime + est.rollout
    assert est.total == max(est.pools.values()) and "rollout ranks" in est.describe()
    whole = estimate_memory(load_config(None, ["actor.parallel.tp=2", "actor.parallel.dp=2", "model.dtype=float32"]),
                            spec, 4, gpu=False)
    assert not whole.rollout_pool and whole.optimizer == n * 8 // 2  # the DistributedOptimizer over dp=2
    assert whole.pools["train"] == whole.pools["rollout"] == whole.total


# ------------------------------------------------------------------------------ the reshard across pools
BUCKET = 4000  # bytes: many rounds


def _reshard_across_pools(rank: int, world: int) -> dict:
    """The actor's Megatron shards (cut by the reference slicer) on ranks 0-1 into (1) the transformers engine
    on ranks 2-3 through its ``update_weights`` (the trainer's path) and (2) vLLM TP=2 shards on ranks 2-3."""
    from megarl.config import load_config as load
    from megarl.models.layout import megatron_layout
    from megarl.models.spec import ModelSpec
    from megarl.parallel.mesh import ParallelLayout, init_distributed
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from megarl.rollout.hf_engine import HFRolloutEngine
    from megarl.trainer.builders import rollout_layout

    init_distributed()
    actor, pool = [0, 1], [2, 3]
    model = "gqa_tied"
    fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
    spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
    w = hf_weights(model, seed=3)
    out = {}
    for tp, dp in ((2, 1), (1, 2)):
        mesh = ParallelLayout(tp, 1, dp)
        src_layout = megatron_layout(spec, mesh, ranks=actor, role="actor")
        src = {}
        if rank in actor:
            r, stage = megatron_coords(actor.index(rank), tp, dp)
            src = ref_megatron(model, w, tp, 1, r, stage)
        for engine in ("hf", "vllm"):
            cfg = load(None, [f"rollout.engine={engine}", f"rollout.tp={2 if engine == 'vllm' else 1}"])
            dst_layout = rollout_layout(cfg, spec, pool)
            plan = plan_reshard(src_layout, dst_layout)
            label = f"tp{tp} dp{dp} -> {engine}"
            if rank in pool and engine == "hf":
                hf = HFRolloutEngine(spec)
                stats = hf.update_weights(lambda dst: execute_plan(plan, src, dst, bucket_bytes=BUCKET))
                got = dict(hf.model.named_parameters())
                wrong = [n for n in got if not torch.equal(got[n].detach(), w[n])]
            elif rank in pool:
                want = ref_vllm(model, w, 2, pool.index(rank))
                got = {n: torch.zeros(t.shape) for n, t in want.items()}
                stats = execute_plan(plan, src, got, bucket_bytes=BUCKET)
                wrong = [n for n in want if not torch.equal(got[n], want[n])]
            else:
                stats, wrong = execute_plan(plan, src, {}, bucket_bytes=BUCKET), []
            out[label] = {"wrong": wrong, "received": stats.bytes_received, "sent": stats.bytes_sent,
                          "lower_bound": 4 * missing_elements(src_layout, dst_layout, rank),
                          "staging": stats.peak_staging_bytes, "extra": stats.peak_extra_bytes,
                          "bookkeeping": stats.bookkeeping_bytes, "rounds": stats.rounds}
    return out


def test_reshard_across_pools_is_exact_moves_the_lower_bound_within_two_buckets():
    results = run_world(_reshard_across_pools, 4, timeout_s=600)
    for label in results[0]:
        per_rank = [r[label] for r in results]
        for rank, m in enumerate(per_rank):
            assert m["wrong"] == [], (label, rank, m["wrong"])
            assert m["received"] == m["lower_bound"], (label, rank, m)  # every byte the rank lacks, once
            assert m["staging"] <= 2 * BUCKET and m["extra"] <= 2 * BUCKET + m["bookkeeping"], (label, rank, m)
        assert per_rank[0]["received"] == per_rank[1]["received"] == 0  # the actor's ranks only send
        assert per_rank[2]["received"] > 0 and per_rank[2]["rounds"] > 1, label
        assert sum(m["sent"] for m in per_rank) == sum(m["received"] for m in per_rank), label


# ------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 64)


STEPS2 = ["trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
          "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.optim.lr=1e-2"]
COMPARED = ["reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "actor/kl", "actor/clipfrac", "actor/ppo_kl", "advantages/mean"]


@pytest.mark.slow
def test_sync_on_split_pools_equals_the_colocated_run_at_steps_1_and_2(task):
    """Colocated on 2 ranks (actor and reference TP=2, both ranks generating) against the split layout on 4
    (actor and reference TP=2 on ranks 0-1, rollout on ranks 2-3): the same prompts, samples and updates."""
    root, model, data = task
    base = task_overrides(model, data, root / "runs", "colocated") + STEPS2 + ["actor.parallel.tp=2"]
    colocated = run_world(train_on_rank, 2, base)[0]
    split = run_world(train_on_rank, 4, base + SPLIT + ["run.name=split_sync"])[0]
    assert colocated[1]["actor/pg_loss"] != colocated[0]["actor/pg_loss"]  # the steps differ: the check can fail
    assert split[0]["reshard/bytes_sent"] > 0  # rank 0 sends its shards to the rollout ranks
    for step in (0, 1):
        for key in COMPARED:
            assert split[step][key] == pytest.approx(colocated[step][key], rel=1e-5, abs=1e-7), (step, key)
        assert split[step]["rollout/staleness"] == 0
        assert {"pool/train/busy_s", "pool/rollout/busy_s", "pool/train/idle_s", "time/wait_rollout"} <= set(split[step])


LEARN = ["trainer.steps=12", "trainer.save_every=0", "data.prompts_per_step=8", "rollout.n=8",
         "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=16", "actor.optim.lr=3e-3",
         "algorithm.kl.coef=0", "trainer.log_samples=64"]
ASYNC = ["trainer.mode=async", "trainer.max_staleness=1", "algorithm.rollout_correction.preset=token_tis"]


def test_async_one_step_off_learns_the_task_with_staleness_at_most_1_recorded_per_sample(task):
    root, model, data = task
    history = run_world(train_on_rank, 4, task_overrides(model, data, root / "runs", "async") + LEARN + SPLIT
                        + ASYNC)[0]
    rewards = [h["reward/mean"] for h in history]
    assert rewards[0] < 0.3, rewards  # a random policy rarely answers with the target
    assert max(rewards[-3:]) > 0.8, rewards
    assert [h["rollout/staleness"] for h in history] == [0] + [1] * 11  # one step off once the pipeline is full
    samples = [json.loads(line) for line in (root / "runs" / "async" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12 * 64  # every sample, each with the version of the weights that generated it
    for s in samples:
        assert 0 <= s["step"] - 1 - s["policy_version"] <= 1, s
    # each step's pools: the rollout pool generates the next batch during steps 1-11, nothing during the last
    assert [h["pool/rollout/busy_s"] > 0 for h in history] == [True] * 11 + [False]
    assert all(h["pool/train/busy_s"] > 0 for h in history)


# the actor, reference and reward on rank 0, the rollout on rank 1
SPLIT_2 = ["placement.pools.train=[0]", "placement.pools.gen=[1]", "placement.actor=train", "placement.reference=train",
           "placement.reward=train", "placement.rollout=gen"]


def _train_until_requeued(rank, world, overrides):
    """:func:`train_on_rank` with SIGUSR1 watched as a job's rank watches it; ``"requeued"`` when the run saved
    and ended on it."""
    from megarl.parallel.restart import RequeueRequested, watch_requeue_signal

    watch_requeue_signal()
    try:
        return train_on_rank(rank, world, overrides)
    except RequeueRequested:
        return "requeued"


def test_async_run_saves_and_ends_on_sigusr1_and_checkpoints_by_time_on_resume(task, monkeypatch):
    """Split pools, one step off: SIGUSR1 on rank 0 in step 2's update (what SLURM sends before the time
    limit): both pools save step 2 and end to be requeued; the resumed run with ``trainer.save_every_min``
    (and ``save_every=0``) checkpoints after every step."""
    root, model, data = task
    base = (task_overrides(model, data, root / "runs", "requeued") + STEPS2 + SPLIT_2 + ASYNC
            + ["trainer.steps=4", "trainer.keep_checkpoints=4"])
    run_dir = root / "runs" / "requeued"
    monkeypatch.setenv("MEGARL_FAULT", "phase.actor_update@2:signal=USR1:0")
    assert run_world(_train_until_requeued, 2, base) == ["requeued", "requeued"]
    assert [h["step"] for h in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000002"]
    monkeypatch.delenv("MEGARL_FAULT")
    history = run_world(train_on_rank, 2, base + ["trainer.resume=true", "trainer.save_every_min=0.0001"])[0]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        ["step_000002", "step_000003", "step_000004"]  # step 3 by time, step 4 the last


def test_bench_step_runs_split_async_and_reports_each_pools_busy_and_idle_seconds(task):
    """``megarl bench step`` on 2 ranks: the actor on rank 0, the rollout on rank 1, one step off."""
    root, model, data = task
    out = root / "bench_async.json"
    args = [sys.executable, "-m", "megarl.cli", "bench", "step", *task_overrides(model, data, root / "runs", "bench"),
            *SPLIT_2, *ASYNC,
            "data.prompts_per_step=4", "rollout.n=2", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2",
            "--steps", "2", "--warmup", "0", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)  # relaunched under torchrun
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["world_size"] == 2
    assert r["config"]["layout"]["mode"] == "async" and r["config"]["layout"]["max_staleness"] == 1
    assert set(r["pools"]) == {"train", "rollout"} and r["pools"]["rollout"]["busy_s"] > 0
    assert {"generate", "wait_rollout", "actor_update"} <= set(r["phases"])
    assert "pools (s/step): rollout busy" in proc.stdout


@pytest.mark.slow
def test_async_run_killed_with_sigkill_resumes_and_finishes_its_steps(task):
    """Rank 0 SIGKILLed in step 3's actor update (batch 4 generated or being generated meanwhile): the resumed
    run continues from step 2's checkpoint, generates the batches in flight again and finishes step 4."""
    root, model, data = task
    args = [sys.executable, "-m", "megarl.cli", "train", *task_overrides(model, data, root / "runs", "killed"),
            *STEPS2, *SPLIT, *ASYNC, "trainer.steps=4", "trainer.save_every=1"]
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_FAULT"}
    first = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400, cwd=REPO,
                           env=env | {"MEGARL_FAULT": "phase.actor_update@3:kill:0"})
    assert first.returncode != 0 and "fault injected: kill at phase.actor_update" in first.stdout, first.stdout[-3000:]
    run_dir = root / "runs" / "killed"
    assert [h["step"] for h in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    second = subprocess.run(args + ["--resume"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=400, cwd=REPO, env=env)
    assert second.returncode == 0, second.stdout[-3000:]
    history = read_metrics(run_dir / "metrics.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    # step 3's batch was in flight at the kill: generated again with the checkpoint's weights (version 2)
    assert [h["rollout/policy_version"] for h in history] == [0, 0, 2, 2]
    assert all(0 <= h["rollout/staleness"] <= 1 for h in history)
    meta = json.loads((run_dir / "checkpoints" / "step_000004" / "megarl.json").read_text())
    assert meta["policy_version"] == 4
