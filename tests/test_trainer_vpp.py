"""The RL trainer with virtual pipeline stages (``actor.parallel.vpp``, megatron's interleaved 1F1B schedule):
one PPO step (actor, critic, reference) at PP=2 x VPP=2 gives the metrics of PP=2 on the same rollouts, and its
checkpoint resumes at PP=2 x VPP=2 and at PP=2 (megatron's dist checkpointing keys carry global layer numbers)
where the uninterrupted PP=2 run goes; packed micro-batch counts, the memory estimate; config errors name the
field.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_each_on_rank, train_on_rank, write_prompts

# PPO with a critic and a reference policy (KL in the loss): 16 rollouts, 2 mini-batches of 8 (the second after
# an update), each 4 micro-batches of 2: a multiple of pp=2
TRAIN = ["trainer.steps=1", "trainer.save_every=1", "data.prompts_per_step=4", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.optim.lr=1e-2", "algorithm.name=ppo",
         "critic.ppo_mini_batch_size=8", "critic.micro_batch_size=2", "critic.parallel.pp=2",
         "algorithm.kl.coef=0.01", "algorithm.kl.in_loss=true"]
COMPARED = ["reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl", "actor/kl_loss",
            "actor/clipfrac", "actor/ppo_kl", "actor/approx_kl", "critic/vf_loss", "critic/grad_norm",
            "critic/vpred_mean"]
VPP2 = ["actor.parallel.pp=2", "actor.parallel.vpp=2", "critic.parallel.vpp=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model and prompts, and a function running one 2-rank trainer run with overrides."""
    root = tmp_path_factory.mktemp("vpp")
    model, data = make_tiny_model(root / "model", layers=4), write_prompts(root / "prompts.jsonl", 16)

    def run(name, extra):
        return run_world(train_on_rank, 2, task_overrides(model, data, root / "runs", name) + TRAIN + extra)[0]

    def run_each(runs):  # several runs in one world: one process start
        return [metrics for metrics, _ in run_world(train_each_on_rank, 2, [
            task_overrides(model, data, root / "runs", name) + TRAIN + extra for name, extra in runs])[0]]

    return root, run, run_each


@pytest.fixture(scope="module")
def runs(setup):
    """Two steps at PP=2 (saving each); step 1 at PP=2 x VPP=2 (saved); both in one world."""
    *_, run_each = setup
    pp2, vpp2 = run_each([("pp2", ["actor.parallel.pp=2", "trainer.steps=2"]), ("vpp2", VPP2)])
    return {"pp2": pp2, "vpp2": vpp2}


@pytest.fixture(scope="module")
def later_runs(setup, runs):
    """The PP=2 x VPP=2 run's step 2 resumed at PP=2 x VPP=2 and, from a copy of its checkpoint, at PP=2; step 1
    at PP=2 x VPP=2 with packed micro-batches."""
    import shutil

    root, run, _ = setup
    shutil.copytree(root / "runs" / "vpp2", root / "runs" / "vpp2_at_pp2")
    resume = ["trainer.steps=2", "trainer.resume=true"]
    out = {"vpp2 resumed": run("vpp2", VPP2 + resume),
           "vpp2 resumed at pp2": run("vpp2_at_pp2", ["actor.parallel.pp=2"] + resume)}
    # the actor's micro-batches packed by tokens: 3 rows of 4-7 tokens in 24, so each mini-batch's 3
    # micro-batches are split into 4 and the log-prob pass's 5 into 6 (multiples of pp=2)
    out["vpp2 packed"] = run("vpp2_packed", VPP2 + ["trainer.save_every=0", "actor.max_tokens_per_micro_batch=24",
                                                    "actor.sequence_packing=true"])
    return out


def test_ppo_step_at_pp2_vpp2_matches_pp2(runs):
    ref, vpp = runs["pp2"][0], runs["vpp2"][0]
    assert ref["actor/ppo_kl"] != 0 and ref["critic/vf_loss"] != 0  # the second mini-batch ran after an update
    assert ref["actor/kl"] == 0.0 and vpp["actor/kl"] == 0.0  # the reference starts as the actor's exact copy
    for key in COMPARED:
        assert vpp[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow  # three more 2-rank trainer runs (~1.5 minutes) for this test and the next
def test_packed_micro_batches_at_pp2_vpp2_match_the_padded_ones(runs, later_runs):
    padded, packed = runs["vpp2"][0], later_runs["vpp2 packed"][0]
    for key in COMPARED:
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vpp2 resumed", "vpp2 resumed at pp2"])
def test_a_pp2_vpp2_checkpoint_resumes_at_its_layout_and_at_pp2(runs, later_runs, name):
    """Step 2 of the resumed runs equals the uninterrupted PP=2 run's: weights, both optimizers' states and the
    RNG states came back (step 2's KL to the reference is not 0: the actor's weights are the updated ones)."""
    ref = runs["pp2"]
    assert [h["step"] for h in later_runs[name]] == [1, 2] and ref[1]["actor/kl"] != 0
    for key in COMPARED:
        assert later_runs[name][1][key] == pytest.approx(ref[1][key], rel=1e-4, abs=1e-6), key


def test_packed_micro_batch_counts_are_split_to_a_multiple_of_pp():
    from megarl.workers.packing import pack_shares

    lengths = torch.tensor([30, 5, 7, 12, 3, 9, 20, 4, 6, 8, 11, 2])
    for packed in (False, True):
        plain = pack_shares(lengths, 2, 64, packed=packed)
        shares = pack_shares(lengths, 2, 64, packed=packed, count_multiple=4)
        assert len(plain[0]) % 4 and [len(s) for s in shares] == [4, 4]  # split: the check can fail
        for share, before in zip(shares, plain):
            assert sorted(torch.cat(share).tolist()) == sorted(torch.cat(before).tolist())


def test_memory_estimate_adds_the_interleaved_schedules_activations():
    """Korthikanti et al. 2022 (Sec. 4.2.3): the first stage of the interleaved schedule holds
    ``1 + (pp - 1) / (pp * vpp)`` times the activations of 1F1B; the rest is unchanged."""
    from megarl.config import load_config
    from megarl.launch.memory import estimate_memory
    from megarl.models.spec import SpecError, preset

    spec = preset("qwen2.5-7b")  # 28 layers
    base = ["data.max_prompt_length=4096", "rollout.max_new_tokens=4096", "actor.micro_batch_size=1",
            "actor.kernels.chunked_logprob=false", "actor.parallel.pp=2", "actor.ppo_mini_batch_size=8"]
    pp2 = estimate_memory(load_config(overrides=base), spec, 2, gpu=True, device_bytes=0)
    vpp2 = estimate_memory(load_config(overrides=base + ["actor.parallel.vpp=2"]), spec, 2, gpu=True,
                           device_bytes=0)
    assert (vpp2.params, vpp2.grads, vpp2.optimizer) == (pp2.params, pp2.grads, pp2.optimizer)
    assert vpp2.activations == pytest.approx(pp2.activations * 1.25, rel=1e-6)
    with pytest.raises(SpecError, match=r"pp=2 x vpp=3 .*num_layers=28"):
        estimate_memory(load_config(overrides=base + ["actor.parallel.vpp=3"]), spec, 2, gpu=False)


def test_vpp_config_errors_name_the_field():
    from megarl.config import ConfigError, load_config
    from megarl.parallel.placement import validate_for_world

    def check(world, *overrides):
        validate_for_world(load_config(None, list(overrides)), world)

    base = ["data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2"]
    vpp2 = ["actor.parallel.pp=2", "actor.parallel.vpp=2"]
    check(2, *base, *vpp2)
    with pytest.raises(ConfigError, match=r"critic\.parallel\.vpp: 1 differs from actor\.parallel\.vpp=2"):
        check(2, *base, *vpp2, "algorithm.name=ppo", "critic.parallel.pp=2")
    with pytest.raises(ConfigError, match=r"placement\.reference_parallel\.vpp: 1 differs"):
        check(2, *base, *vpp2, "placement.reference_parallel.pp=2")
    with pytest.raises(ConfigError, match=r"actor\.micro_batch_size: 4 cuts each DP rank's 8 rows of a mini-batch "
                                          r"into 2 micro-batches.*pp=4.*use one of \[1, 2\]"):
        check(4, *base, "actor.micro_batch_size=4", "actor.parallel.pp=4", "actor.parallel.vpp=2")
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size: 6 gives each of dp=1 ranks 6 rows, not a "
                                          r"multiple of pp=4"):
        check(4, "data.prompts_per_step=3", "rollout.n=4", "actor.ppo_mini_batch_size=6",
              "actor.micro_batch_size=1", "actor.parallel.pp=4", "actor.parallel.vpp=2")
    with pytest.raises(ConfigError, match=r"data\.prompts_per_step: the rollout batch of 6 sequences"):
        check(4, "data.prompts_per_step=3", "rollout.n=2", "actor.ppo_mini_batch_size=2",
              "actor.micro_batch_size=1", "actor.parallel.pp=4", "actor.parallel.vpp=2")


def test_sweep_plans_vpp_layouts(tmp_path):
    """``actor.parallel.vpp`` as a sweep grid key: a VPP that does not divide the 7B model's 28 layers over PP is
    dropped with the field named, one that does is kept (its memory estimate with the interleaved penalty)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).parents[1]
    sweep = yaml.safe_load((root / "parallel_configs/sweeps/gpu_64xh200_qwen2.5-7b.yaml").read_text())
    sweep["grid"] = {"actor.parallel.tp": [4], "actor.parallel.pp": [2], "actor.parallel.vpp": [1, 2, 3]}
    (tmp_path / "vpp.yaml").write_text(yaml.safe_dump(sweep))
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "sweep", str(tmp_path / "vpp.yaml"), "--plan"],
                       capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    dropped = [line for line in r.stdout.splitlines() if "dropped " in line]
    assert len(dropped) == 1 and "vpp3" in dropped[0] and "actor.parallel.vpp" in dropped[0] \
        and "num_layers=28" in dropped[0], r.stdout
