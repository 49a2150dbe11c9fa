"""``megarl submit``: the batch scripts of 2- and 8-node GPU jobs against golden files, the job-shape check, and
a real 2-task job of the CPU default at PP=2 on a single-node SLURM cluster, then its resumption.

Regenerate the golden files after an intended change of the script with ``MEGARL_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import marked_processes
from tests.slurm_cluster import wait_for_job

ROOT = Path(__file__).parents[1]
GOLDEN = Path(__file__).parent / "golden"


def _megarl(*args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _submit_here(args, capsys, monkeypatch) -> tuple[int, str, str]:
    """``megarl submit ARGS`` in this process (from the checkout's root), its exit status, stdout and stderr."""
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    rc = main(["submit", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _normalised(script: str) -> str:
    """The script with this checkout's paths replaced, so the golden files hold on any machine."""
    return script.replace(sys.executable, "@PYTHON@").replace(str(ROOT), "@ROOT@")


@pytest.fixture(scope="module")
def qwen7b_config(tmp_path_factory):
    """A folder holding Qwen2.5-7B's config.json and a stand-in weights file: what the model checks read."""
    import torch
    from safetensors.torch import save_file

    from megarl.models.spec import PRESETS

    path = tmp_path_factory.mktemp("qwen2.5-7b")
    PRESETS["qwen2.5-7b"].to_hf_config().save_pretrained(str(path))
    save_file({"stand_in": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("name,args", [
    ("submit_2x8_qwen2.5-7b.sbatch",
     ["parallel_configs/gpu_8xh200_qwen2.5-7b.yaml", "actor.parallel.dp=8", "--nodes", "2", "--gpus-per-node", "8",
      "--partition", "batch", "--time", "04:00:00"]),
    ("submit_8x8_qwen2.5-7b.sbatch",
     ["parallel_configs/gpu_64xh200_qwen2.5-7b.yaml", "launch.env.NCCL_SOCKET_IFNAME=^lo,docker",
      "launch.env.NCCL_DEBUG=INFO", "--nodes", "8", "--gpus-per-node", "8", "--account", "rl", "--qos", "high",
      "--container-image", "nvcr.io/nvidia/pytorch:25.10-py3", "--container-mounts", "/lustre:/lustre",
      "--sbatch-arg=--exclusive", "--sbatch-arg=--mem=0"]),
])
def test_dry_run_scripts_match_the_golden_files(name, args, capsys, monkeypatch, qwen7b_config):
    monkeypatch.setenv("MODEL_PATH", str(qwen7b_config))  # submit reads the model's config, as train does
    rc, out, err = _submit_here([*args, "--dry-run"], capsys, monkeypatch)
    assert rc == 0, err
    script = _normalised(out)
    if os.environ.get("MEGARL_UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(script)
    assert script == (GOLDEN / name).read_text()
    # the parts the job relies on, checked by meaning as well as by the golden text
    nodes, ranks = (2, 8) if "2x8" in name else (8, 8)
    assert f"#SBATCH --nodes={nodes}" in script and f"#SBATCH --ntasks-per-node={ranks}" in script
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    assert "export NCCL_NVLS_ENABLE=0" in script and "SLURM_JOB_ID %" in script
    assert re.search(r"^srun .* -m megarl\.cli train parallel_configs/", script, re.M)
    assert not (ROOT / "runs" / "qwen2.5-7b-gsm8k-grpo-8xh200" / "job.sbatch").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args,flags,fields", [
    (["parallel_configs/gpu_64xh200_qwen2.5-7b.yaml"], ["--nodes", "2", "--gpus-per-node", "8"],
     ["actor.parallel.tp/pp/dp", "--nodes 2", "--gpus-per-node 8", "tp=4 x pp=2 x dp=8 = 64"]),
    (["parallel_configs/cpu_smollm2_pp2.yaml"], ["--ntasks-per-node", "3"],
     ["actor.parallel.tp/pp/dp", "--ntasks-per-node 3", "tp=1 x pp=2"]),
    (["parallel_configs/cpu_smollm2_pp2.yaml", "actor.parallel.pp=1", "actor.micro_batch_size=3"],
     ["--ntasks-per-node", "2"],
     ["actor.ppo_mini_batch_size", "16 is not a multiple of dp (2) x micro_batch_size (3)"]),
    ([], ["--nodes", "0"], ["--nodes", ">= 1"]),
    ([], ["--time", "4h"], ["--time '4h' is not a SLURM time limit", "04:00:00"]),
    ([], ["--gpus-per-node", "8", "--ntasks-per-node", "2"], ["--ntasks-per-node 2", "one rank per GPU"]),
    # what the model's config decides, as train and sweep --plan check it (Qwen2.5-7B has 28 heads)
    (["parallel_configs/gpu_8xh200_qwen2.5-7b.yaml", "model.path=preset:qwen2.5-7b", "actor.parallel.tp=8",
      "actor.parallel.dp=1"], ["--nodes", "1", "--gpus-per-node", "8"],
     ["actor.parallel.tp: tp=8 does not divide num_attention_heads=28"]),
    (["model.path=no/such/model"], [], ["model.path: model path 'no/such/model' does not exist"]),
])
def test_a_job_that_does_not_fit_the_config_fails_before_submitting(args, flags, fields, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch either
    rc, out, err = _submit_here([*args, f"run.output_dir={tmp_path}", *flags], capsys, monkeypatch)
    assert rc == 2, out + err
    assert err.startswith("megarl: error:"), err
    for f in fields:
        assert f in err, err
    assert not any(tmp_path.iterdir())  # no run folder, no script


def test_a_dry_run_without_model_path_names_the_variable(capsys, monkeypatch):
    """Issue 33 item 11: the README's ``submit ... --dry-run`` example on a GPU config with ``MODEL_PATH`` unset
    fails at the model check, and the error says to set ``MODEL_PATH`` (the config's default path does not
    exist here)."""
    monkeypatch.delenv("MODEL_PATH", raising=False)
    rc, _, err = _submit_here(["parallel_configs/gpu_64xh200_qwen2.5-7b.yaml", "--nodes", "8", "--gpus-per-node",
                               "8", "--partition", "batch", "--time", "04:00:00", "--dry-run"], capsys, monkeypatch)
    assert rc == 2, err
    assert "model.path: model path '/models/Qwen2.5-7B-Instruct' does not exist" in err, err
    assert "export MODEL_PATH=DIR" in err, err


def test_a_launch_whose_world_does_not_match_fails_before_any_model(tmp_path):
    """``megarl train`` started by srun with a task count its mesh cannot use stops at the config check. Its run
    folder is under ``tmp_path`` (issue 48: the checkout kept an empty ``runs/<name>/run.lock`` of this test)."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    checkout_run = ROOT / "runs" / "smollm2-arithmetic-grpo-pp2"
    before = checkout_run.exists()
    r = _megarl("train", "parallel_configs/cpu_smollm2_pp2.yaml", f"run.output_dir={tmp_path}", env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "megarl: error: actor.parallel" in r.stderr and "3 ranks" in r.stderr, r.stderr
    assert "dequantising" not in r.stderr
    assert checkout_run.exists() == before  # nothing written into the checkout


SMALL = ["trainer.steps=1", "trainer.save_every=1", "trainer.progress=false", "validation.enabled=false",
         "data.prompts_per_step=2", "data.train_files=[data/arithmetic/train.parquet]", "rollout.n=2",
         "rollout.max_new_tokens=8", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "trainer.report=false"]


@pytest.mark.slow
def test_submit_cpu_default_pp2_then_resume(slurm_cluster, tmp_path):
    """The CPU default at PP=2 (SmolLM2, the arithmetic task) as a real 2-task SLURM job for one step; ``--resume`` with
    ``trainer.steps=2`` then adds the second step from the first one's checkpoint. After each job, no process
    with the job's environment is left (issue 24: every rank left megatron-core's checkpoint-writer manager and
    its resource tracker running with parent 1, holding the job's output)."""
    import uuid

    mark = uuid.uuid4().hex
    env = {"MEGARL_TEST_MARK": mark}  # sbatch passes the environment to the job, srun to the ranks
    run = [f"run.output_dir={tmp_path}", "run.name=pp2"]
    r = _megarl("submit", "parallel_configs/cpu_smollm2_pp2.yaml", *SMALL, *run, "--ntasks-per-node", "2", env=env)
    assert r.returncode == 0, r.stderr
    job = re.search(r"submitted job (\d+)", r.stdout).group(1)
    run_dir = tmp_path / "pp2"
    assert (run_dir / "job.sbatch").is_file() and str(run_dir / "logs") in r.stdout
    state = wait_for_job(job)
    log = (run_dir / "logs" / f"megarl-pp2-{job}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-3000:]
    assert "megarl: job" in log and "2 ranks" in log  # the rendezvous line of the script
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["checkpoint"].endswith("step_000001")
    assert "megarl run finished at step 1" in log
    _assert_nothing_left(mark)

    r = _megarl("submit", "parallel_configs/cpu_smollm2_pp2.yaml", *SMALL, *run, "trainer.steps=2",
                "--ntasks-per-node", "2", "--resume", env=env)
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout and "step_000001" in r.stdout
    job2 = re.search(r"submitted job (\d+)", r.stdout).group(1)
    state = wait_for_job(job2)
    log = (run_dir / "logs" / f"megarl-pp2-{job2}.out").read_text(errors="replace")
    assert state == "COMPLETED", log[-3000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["checkpoint"].endswith("step_000002")
    assert "(1 step in this session" in log
    _assert_nothing_left(mark)


def _assert_nothing_left(mark: str) -> None:
    """No process of the ended job (environment ``MEGARL_TEST_MARK=mark``) runs any more."""
    deadline = time.monotonic() + 30  # the job's state changes as its last task ends; its helpers die with it
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = {}
    for pid in left:
        try:
            described[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200].decode()
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of the job left running: {described}"
