"""Stops driven by signals (issue 33 item 6): SIGUSR1 (save, then end for the requeue) under every launcher and
world size saves a checkpoint, says that the run stopped for the requeue, ends with status 75
(:data:`megarl.parallel.restart.EXIT_REQUEUE`) and is never counted as a failure by ``--max-restarts``; SIGTERM
to the supervisor stops the run as Ctrl-C does (status 130, never retried).

Real ``megarl train`` runs of the tiny model (:mod:`tests.rl_tasks`) at world sizes 1 and 2 (the local launcher,
gloo), and the supervisor with stand-in commands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

REPO = Path(__file__).resolve().parent.parent
SMALL = ["data.prompts_per_step=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.steps=50"]
WORLD = {1: ["actor.micro_batch_size=4"], 2: ["actor.micro_batch_size=2", "actor.parallel.dp=2"]}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 64)


def _train(task, name: str, world: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
    root, model, data = task
    return subprocess.Popen([sys.executable, "-m", "megarl.cli", "train",
                             *task_overrides(model, data, root / "runs", name), *SMALL, *WORLD[world], *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **(env or {})})


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int) -> None:
    """Wait until ``metrics`` records ``step`` (the run is past its start, its handlers installed)."""
    while not (metrics.is_file() and f'"step": {step}' in metrics.read_text()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def _assert_stopped_for_the_requeue(task, name: str, proc: subprocess.Popen, step: int | None = None) -> None:
    """The run ended with status 75 and one line saying that it saved its newest checkpoint (``step_<step>``
    when given) for the requeue; nothing reads as a failure, and nothing was restarted."""
    out, err = proc.communicate(timeout=600)
    run = task[0] / "runs" / name
    saved = sorted((run / "checkpoints").glob("step_*"))
    assert proc.returncode == 75, err[-3000:]
    assert saved and not saved[-1].name.endswith(".tmp"), err[-3000:]
    if step is not None:
        assert saved[-1].name == f"step_{step:06d}"
    assert err.strip().splitlines()[-1] == (
        f"megarl: stopped for the requeue on SIGUSR1 (a job's time limit is near): saved {saved[-1]}; the requeued "
        "job, or megarl train --resume, continues the run from it"), err[-3000:]
    assert err.count("stopped for the requeue") == 1, err[-3000:]
    assert not [x for x in err.splitlines() if "error" in x.lower() or "failed" in x.lower()], err[-3000:]
    assert "restart" not in err and not (run / "restarts.jsonl").exists(), err[-3000:]
    assert out.count("launching") <= 1  # one attempt


def test_sigusr1_to_a_run_of_one_rank_saves_and_ends_for_the_requeue(task):
    """World size 1: the launcher is the run's one rank; it had no SIGUSR1 handler and died of the signal
    (status -10) without a checkpoint. Now it saves after the step and ends with 75."""
    proc = _train(task, "w1", 1, env={"MEGARL_FAULT": "phase.actor_update@2:signal=USR1"})
    _assert_stopped_for_the_requeue(task, "w1", proc, step=2)


@pytest.mark.slow  # about a minute on a loaded machine; the stand-in supervisor test below is the fast one
def test_sigusr1_to_the_supervisor_of_two_ranks_reaches_them_and_is_not_a_failure(task):
    """``megarl train --max-restarts 2`` at world size 2, SIGUSR1 sent to the command the user started (the
    supervisor) after step 1: it passes the signal to its attempt, the launcher to its ranks; they save, the
    run ends with 75 and no restart is made or recorded (the supervisor had died of the signal, its ranks with
    it, no checkpoint)."""
    proc = _train(task, "w2-supervised", 2, "--max-restarts", "2")
    _wait_for_step(proc, task[0] / "runs" / "w2-supervised" / "metrics.jsonl", 1)
    proc.send_signal(signal.SIGUSR1)
    _assert_stopped_for_the_requeue(task, "w2-supervised", proc)


@pytest.mark.slow  # CI time (issue 33's 45 minutes): one of the 30 slowest
def test_sigusr1_to_one_rank_of_two_under_max_restarts_is_not_a_failure(task):
    """What SLURM's ``--signal=USR1@S`` does, under the local launcher: rank 0 alone gets SIGUSR1 in step 2;
    both ranks save step 2 and end with 75. The launcher printed ``megarl: error: megarl train failed on rank 0
    (exit code 75)`` and ended with 1, which ``--max-restarts`` counted and retried as a failure."""
    proc = _train(task, "w2-rank", 2, "--max-restarts", "1", env={"MEGARL_FAULT": "phase.actor_update@2:signal=USR1:0"})
    _assert_stopped_for_the_requeue(task, "w2-rank", proc, step=2)


_STAND_IN = """
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda s, f: sys.exit(75))  # as megarl train: saved, stopped for the requeue
signal.signal(signal.SIGINT, lambda s, f: sys.exit(130))  # as megarl train: interrupted
parent = os.getppid()
open(sys.argv[1], "a").write("ran ")
while os.getppid() == parent:  # ends with the supervisor, as megarl's attempts do
    time.sleep(0.05)
"""


@pytest.mark.parametrize("sig, status", [(signal.SIGUSR1, 75), (signal.SIGTERM, 130)])
def test_the_local_supervisor_passes_signals_on_and_never_retries_them(tmp_path, sig, status):
    """``python -m megarl.launch.supervise`` (what ``megarl train --max-restarts`` runs) over a stand-in
    attempt: SIGUSR1 to the supervisor reaches the attempt, whose 75 ends the supervisor with 75 (it restarted
    it, counted as a failure); SIGTERM stops it as Ctrl-C does (130; it died and left no word). Neither is
    run again or recorded as a restart."""
    ran = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-m", "megarl.launch.supervise", f"--run-dir={tmp_path / 'run'}",
                             "--max-restarts=3", "--", sys.executable, "-c", _STAND_IN, str(ran)],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    while not ran.is_file():  # the supervisor watched the signals before it started the attempt
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == status, err
    assert ran.read_text() == "ran ", err
    assert "restart" not in err and not (tmp_path / "run" / "restarts.jsonl").exists(), err


def test_a_stop_for_the_requeue_is_told_from_a_failure_by_the_ranks_exit_codes():
    """:func:`megarl.parallel.restart.requeue_stop`: a rank's 75 with the others' 75 or their launcher's
    SIGTERM/SIGKILL is a stop for the requeue; any other failure among them is a failure."""
    from megarl.parallel.restart import requeue_stop

    assert requeue_stop([75, 75]) and requeue_stop([75, -15]) and requeue_stop([75, -9])
    assert not requeue_stop([1, 75]) and not requeue_stop([-15]) and not requeue_stop([-10, 75])
