"""Runs that survive under SLURM (issue 23), on the real single-node cluster of :mod:`tests.slurm_cluster`
(run under ``flock /tmp/megarl-slurm.lock``): a job with a rank SIGKILLed is requeued and ends its steps with
the uninterrupted run's metrics; SIGUSR1 saves and requeues; a config error is not retried; the restart count
stops at ``launch.max_restarts``. Each job is 2 CPU ranks of the tiny model of :mod:`tests.rl_tasks`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts
from tests.slurm_cluster import wait_for_job

ROOT = Path(__file__).resolve().parents[1]
RUN = ["data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
       "actor.optim.lr=1e-2", "trainer.steps=3", "trainer.save_every=1", "algorithm.kl.coef=0"]
COMPARED = ["reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/lr"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("restarts")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 32)


def _submit(task, name, *extra, env=None):
    """``megarl submit`` of the task on 2 CPU ranks (DP=2); returns the job id."""
    root, model, data = task
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "submit", *task_overrides(model, data, root / "runs", name),
                        *RUN, *extra, "--ntasks-per-node", "2"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return re.search(r"submitted job (\d+)", r.stdout).group(1)


def _outcome(task, name, job):
    """The job's final state, its log, metrics by step and restart records."""
    state = wait_for_job(job)
    run = task[0] / "runs" / name
    log = (run / "logs" / f"megarl-{name}-{job}.out").read_text(errors="replace")
    metrics = {}
    if (run / "metrics.jsonl").is_file():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            metrics[json.loads(line)["step"]] = json.loads(line)
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()] \
        if (run / "restarts.jsonl").is_file() else []
    return state, log, metrics, restarts


@pytest.mark.slow
def test_a_job_with_a_killed_rank_is_requeued_and_ends_with_the_uninterrupted_metrics(slurm_cluster, task):
    """Rank 1 SIGKILLs itself in step 2's actor update (first attempt only): srun ends the step, the
    supervisor runs it again in the allocation from step 1's checkpoint, and the job ends all 3 steps with
    the metrics of an uninterrupted run of the same layout; the restart's reason is in the run folder and the
    summary."""
    root, model, data = task
    straight = run_world(train_on_rank, 2, task_overrides(model, data, root / "runs", "straight") + RUN)[0]
    job = _submit(task, "killed", "--max-restarts", "2", env={"MEGARL_FAULT": "phase.actor_update@2:kill:1:0"})
    state, log, metrics, restarts = _outcome(task, "killed", job)
    assert state == "COMPLETED", log[-4000:]
    assert "fault injected: kill at phase.actor_update" in log and f"megarl: restart 1/2 in job {job}" in log, log[-4000:]
    assert sorted(metrics) == [1, 2, 3]
    for key in COMPARED:
        assert metrics[3][key] == pytest.approx(straight[2][key], rel=1e-5, abs=1e-7), key
    assert [(r["job"], r["restart"], r["counted"], r["checkpoint"].endswith("step_000001")) for r in restarts] == \
        [(job, 1, True, True)]
    assert restarts[0]["reason"].startswith("the run failed"), restarts
    summary = json.loads((root / "runs" / "killed" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["restarts"] == restarts


@pytest.mark.slow
def test_a_job_given_sigusr1_saves_requeues_and_finishes(slurm_cluster, task):
    """SIGUSR1 (what ``--signal=USR1@S`` sends before the time limit) during step 2: the ranks finish the
    step, save it, end with status 75, and the requeued job runs step 3 from that checkpoint; such a requeue
    does not count against ``launch.max_restarts`` (0 here)."""
    job = _submit(task, "signalled", "trainer.save_every=10", "launch.save_before_end_s=60",
                  env={"MEGARL_FAULT": "phase.reward@2:sleep=20:*:0"})  # a pause in step 2 to signal in
    metrics = task[0] / "runs" / "signalled" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, "step 1 never finished"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    deadline = time.monotonic() + 300
    while "JobState=PENDING" not in subprocess.run(["scontrol", "show", "job", job], capture_output=True,
                                                   text=True).stdout:  # requeued: SLURM holds it 2 minutes
        assert time.monotonic() < deadline, "the job was not requeued"
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)  # skip the wait
    state, log, metrics, restarts = _outcome(task, "signalled", job)
    assert state == "COMPLETED", log[-4000:]
    assert "--signal=USR1@60" in (task[0] / "runs" / "signalled" / "job.sbatch").read_text()
    assert "on SIGUSR1" in log and f"megarl: requeueing job {job}" in log, log[-4000:]
    assert sorted(metrics) == [1, 2, 3]
    assert [(r["counted"], r["status"], r["checkpoint"].endswith("step_000002")) for r in restarts] == \
        [(False, 75, True)], restarts
    assert "time limit" in restarts[0]["reason"]


@pytest.mark.slow
def test_a_config_error_is_not_retried_and_the_restart_count_stops_at_n(slurm_cluster, task):
    """A data error found in the job (the train file lost its prompts while the job was held) ends it at
    once, not retried; a rank killed in every attempt is restarted ``launch.max_restarts`` = 1 time, then the
    job fails."""
    root, model, data = task
    bad = write_prompts(root / "swapped.jsonl", 32)
    held = _submit(task, "bad_data", f"data.train_files=[{bad}]", "--max-restarts", "3", "--sbatch-arg=--hold")
    write_prompts(bad, 32, field="prompt")  # no 'question' field any more
    subprocess.run(["scontrol", "release", held], check=True)
    always = _submit(task, "always_killed", "--max-restarts", "1", env={"MEGARL_FAULT": "phase.actor_update@1:kill:1"})
    state, log, metrics, restarts = _outcome(task, "bad_data", held)
    assert state == "FAILED" and "megarl: error:" in log and "no field 'question'" in log, log[-4000:]
    assert restarts == [] and "megarl: restart" not in log, log[-4000:]
    state, log, metrics, restarts = _outcome(task, "always_killed", always)
    assert state == "FAILED", log[-4000:]
    assert [(r["restart"], r["counted"]) for r in restarts] == [(1, True)], restarts
    assert log.count("fault injected: kill") == 2 and "not restarted: launch.max_restarts=1" in log, log[-4000:]


def test_the_batch_script_of_a_job_that_survives(capsys, monkeypatch):
    """``--max-restarts`` and ``launch.save_before_end_s`` make the job requeueable, its log appended to,
    SIGUSR1 asked for before the time limit, and ``srun`` run under the supervisor; without them the script
    is the plain one (the golden files of tests/test_submit.py)."""
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["submit", "launch.save_before_end_s=120", "--max-restarts", "2", "--ntasks-per-node", "1",
                 "--time", "01:00:00", "--dry-run"]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --signal=USR1@120"):
        assert line in script.splitlines(), script
    body = script.strip().splitlines()[-1]
    assert re.match(r"\S+ -m megarl\.launch\.supervise --run-dir=\S+ --max-restarts=2 --slurm -- srun ", body), body
    assert body.endswith("train launch.save_before_end_s=120 launch.max_restarts=2"), body
