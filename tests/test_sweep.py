"""``megarl sweep``: pruning with reasons (model shape, world, batch sizes, memory), the memory estimate's
parameter count, and a sweep of a tiny model through a real SLURM cluster as one job array (table, CSV, plot,
a failing point recorded while the others finish, a second run that starts no job)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

ROOT = Path(__file__).parents[1]


def _sweep(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "megarl.cli", "sweep", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def test_stage_params_count_every_weight_once():
    """At TP=1 x PP=1 the estimate's parameter count is the model's (independently: the HF tensor shapes);
    TP shards divide the split weights, PP stages hold their layers plus the embedding or the output layer."""
    from megarl.launch.memory import stage_params
    from megarl.models.spec import preset

    for name in ("smollm2-135m", "qwen2.5-7b", "tiny-llama", "qwen3-0.6b", "qwen3-32b", "phi-4"):
        spec = preset(name)
        assert stage_params(spec, 1, 1) == spec.num_params(), name
    spec = preset("qwen2.5-7b")  # untied, vocab 152064 = 1188 x 128: no padding at TP <= 128
    n, h, v = spec.num_params(), spec.hidden_size, spec.vocab_size
    norms = (2 * spec.num_layers + 1) * h  # replicated on every TP rank
    assert stage_params(spec, 4, 1) == (n - norms) // 4 + norms
    layer = (n - 2 * v * h - h) // spec.num_layers
    assert stage_params(spec, 1, 2) == 14 * layer + v * h + h  # the last stage: output layer and final norm


def test_plan_drops_points_with_reasons():
    """The 64-GPU 7B sweep, planned: TP=8 cannot split 28 heads, and layouts without recompute at TP=1 are
    estimated over the H200's memory; nothing runs."""
    r = _sweep("parallel_configs/sweeps/gpu_64xh200_qwen2.5-7b.yaml", "--plan")
    assert r.returncode == 0, r.stderr
    dropped = {line.split(":")[0].split()[-1]: line for line in r.stdout.splitlines() if "dropped " in line}
    assert "tp8_pp1_recomputetrue" in dropped and "num_attention_heads=28" in dropped["tp8_pp1_recomputetrue"]
    assert "estimated memory" in dropped["tp1_pp1_recomputefalse"]
    assert "tp4_pp2_recomputetrue" not in dropped  # the shipped 64-GPU layout fits
    assert "24 points" in r.stdout


def test_a_mistyped_grid_key_or_a_sweep_that_drops_every_point_fails(tmp_path):
    """Issue 24: a typo in a grid key dropped every point and exited 0 (``--local`` wrote an empty table)."""
    base = {"name": "typo", "output": str(tmp_path / "sweeps"), "job": {"ntasks_per_node": 1}}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump({**base, "grid": {"actor.paralel.tp": [1, 2]}}))
    r = _sweep(str(path), "--local")
    assert r.returncode == 2 and "grid.actor.paralel.tp: actor.paralel is not a config field" in r.stderr, r.stderr
    assert "parallel" in r.stderr  # the fields that exist there
    path.write_text(yaml.safe_dump({**base, "grid": {"actor.parallel.tp": [2, 4]}}))  # a 1-rank job: none fits
    r = _sweep(str(path), "--local")
    assert r.returncode == 2 and "every point was dropped" in r.stderr, r.stderr
    assert not (tmp_path / "sweeps" / "typo" / "results.md").exists()


def test_check_alone_checks_every_point_and_a_missing_mode_is_named(tmp_path):
    """README's ``megarl sweep FILE --check`` needs no mode (argparse refused it without one): it lists the
    dropped points and exits 1, running nothing; no mode and no ``--check`` is one error line naming the flags."""
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({"name": "one", "output": str(tmp_path / "sweeps"), "job": {"ntasks_per_node": 1},
                                    "grid": {"actor.parallel.tp": [2, 4]}}))
    r = _sweep(str(path), "--check")
    assert r.returncode == 1 and "check failed; nothing was run" in r.stdout, r.stderr
    assert "dropped tp2" in r.stdout and not (tmp_path / "sweeps").exists()
    r = _sweep(str(path))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "megarl: error: sweep: give one of --slurm, --local or --plan (or --check alone to check every point and "
        "run nothing); see megarl sweep --help"], r.stderr


def test_slurm_without_sbatch_says_where_the_script_is(tmp_path, monkeypatch):
    """Issue 24: the error suggested a --dry-run that sweep does not have and did not say where sweep.sbatch
    went."""
    from megarl.config import ConfigError
    from megarl.launch.submit import sbatch

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on it
    script = tmp_path / "sweep.sbatch"
    with pytest.raises(ConfigError) as e:
        sbatch(script, written="sweep.sbatch")
    assert f"sweep.sbatch is written at {script}" in str(e.value) and "--dry-run" not in str(e.value)


def test_the_job_does_not_carry_the_submitting_process_token(tmp_path, monkeypatch):
    """sbatch hands its environment to the job: with megarl's owner token in it, the submitting command (and
    its watchdog) ended the job's processes when it left, where the job ran on its own host."""
    from megarl.launch.submit import sbatch
    from megarl.parallel.lifecycle import OWNER_ENV

    fake = tmp_path / "sbatch"
    fake.write_text(f"#!/bin/sh\nenv > {tmp_path / 'env.txt'}\necho 42\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv(OWNER_ENV, "host:1:2")
    assert sbatch(tmp_path / "job.sbatch") == "42"
    assert f"{OWNER_ENV}=" not in (tmp_path / "env.txt").read_text()


@pytest.mark.slow
def test_sweep_of_a_tiny_model_as_a_job_array(slurm_cluster, tmp_path):
    model = make_tiny_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 32)
    sweep = {
        "name": "tiny", "output": str(tmp_path / "sweeps"),
        "overrides": task_overrides(model, data, tmp_path / "runs", "sweep")
        + ["data.prompts_per_step=4", "rollout.n=2", "actor.ppo_mini_batch_size=4"],
        "grid": {"actor.parallel.tp": [1, 2, 4], "actor.parallel.pp": [1, 2], "actor.micro_batch_size": [1, 3]},
        # a point that passes every check but fails when it runs: no prompt is as short as 2 tokens
        "points": [{"actor.parallel.tp": 1, "actor.parallel.pp": 2, "actor.micro_batch_size": 1,
                    "data.max_prompt_length": 2}],
        "job": {"nodes": 1, "gpus_per_node": 0, "ntasks_per_node": 2},
        "bench": {"steps": 1, "warmup": 0},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    r = _sweep(str(path), "--slurm")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "sweeps" / "tiny"
    assert "submitted job array" in r.stdout and "13 points, 5 valid" in r.stdout, r.stdout

    rows = list(csv.DictReader((out / "results.csv").open()))
    by_name = {row["point"]: row for row in rows}
    assert len(rows) == 5
    failed = by_name["tp1_pp2_micro_batch_size1_max_prompt_length2"]
    assert failed["status"] != "ok" and "max_prompt_length" in failed["reason"], failed
    assert by_name["tp2_pp1_micro_batch_size1"]["status"] == "ok"  # TP = 2 over the job's 2 ranks, DP = 1
    ok = [row for row in rows if row["status"] == "ok"]
    assert len(ok) == 4 and all(float(row["tokens_per_s"]) > 0 for row in ok), rows
    speeds = [float(row["tokens_per_s"]) for row in ok]
    assert speeds == sorted(speeds, reverse=True)  # best first
    assert {row["world_size"] for row in ok} == {"2"}

    md = (out / "results.md").read_text()
    assert "## Dropped before running (8)" in md
    assert "`tp4_pp1_micro_batch_size1`: actor.parallel.tp: tp=4 does not divide the query groups num_kv_heads=2" in md
    assert "`tp2_pp2_micro_batch_size1`: actor.parallel.tp/pp/dp" in md  # 4 ranks on a 2-rank job
    assert "`tp1_pp2_micro_batch_size3`: actor.ppo_mini_batch_size" in md  # 4 sequences, micro-batch 3
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in ok:
        res = json.loads((out / "results" / f"{row['point']}.json").read_text())
        assert res["status"] == "ok" and res["phases"]["generate"]["time_s"] > 0

    again = _sweep(str(path), "--slurm")  # its table, CSV, plot and script are there: refused (issue 48)
    assert again.returncode == 2 and "results.csv" in again.stderr and "--overwrite" in again.stderr, again.stderr
    again = _sweep(str(path), "--slurm", "--overwrite")
    assert again.returncode == 0, again.stderr
    assert "5 points already have results, 0 to run" in again.stdout and "submitted" not in again.stdout


def test_a_vllm_engine_whose_weights_overflow_its_reservation_is_dropped():
    """Qwen3-32B's bf16 weights (32.76B x 2 bytes = 61.0 GiB) on one vLLM GPU do not fit the 0.4 x 140 = 56 GiB it
    reserves, whatever the actor's layout (the planner kept such points); at rollout.tp=2 (30.5 GiB) they do."""
    from megarl.launch.memory import GIB
    from megarl.launch.submit import JobShape
    from megarl.launch.sweep import Point, SweepSpec, check_point

    spec = SweepSpec(base=str(ROOT / "parallel_configs/gpu_64xh200_qwen2.5-7b.yaml"),
                     overrides=["model.path=preset:qwen3-32b", "actor.parallel.dp=0", "actor.parallel.tp=8",
                                "actor.parallel.pp=2"])
    shape, memory = JobShape(8, 8), 140 * GIB
    weights = 32_762_123_264 * 2 / GIB  # Qwen3-32B's parameters (test_stage_params_count_every_weight_once)
    one, two = Point("tp1", {}, ["rollout.tp=1"]), Point("tp2", {}, ["rollout.tp=2"])
    assert check_point(spec, one, shape, memory) is None
    assert one.reason.startswith(f"rollout.tp: vLLM's weights are {weights:.1f} GiB per GPU at rollout.tp=1")
    assert "56.0 GiB it reserves" in one.reason and one.estimate.total < memory  # the training part fits
    assert check_point(spec, two, shape, memory) is not None and two.reason is None


def test_the_shipped_moe_sweep_keeps_its_tensor_parallel_points():
    """The 8-GPU Qwen3-30B-A3B sweep dropped all 24 points: megatron-core's MoE layer refuses TP > 1 without
    sequence parallelism, and every TP = 1 point is over the H200's memory. The sweep now sets it: its TP = 2
    and TP = 4 points at EP = 8 with recompute fit (estimate under 140 GiB), the TP = 1 ones are still dropped."""
    from megarl.launch.memory import GIB
    from megarl.launch.submit import JobShape
    from megarl.launch.sweep import check_point, expand, load_sweep

    spec = load_sweep(ROOT / "parallel_configs/sweeps/gpu_8xh200_qwen3-30b-a3b.yaml")
    spec.base = str(ROOT / spec.base)
    shape = JobShape(spec.job.nodes, spec.job.gpus_per_node)
    points = {p.name: p for p in expand(spec)}
    for name in ("tp2_ep8_recomputetrue", "tp4_ep8_recomputetrue", "tp1_ep8_recomputetrue"):
        check_point(spec, points[name], shape, int(spec.device_memory_gib * GIB))
    assert points["tp2_ep8_recomputetrue"].reason is None and points["tp4_ep8_recomputetrue"].reason is None
    assert points["tp2_ep8_recomputetrue"].estimate.total < 140 * GIB
    assert "estimated memory" in points["tp1_ep8_recomputetrue"].reason
