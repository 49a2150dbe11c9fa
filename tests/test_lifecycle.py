"""Process lifetime, run-folder ownership and faults, on real 2-rank runs (``megarl train``, PP=2, CPU).

Each run is the tiny model and task of :mod:`tests.rl_tasks`, 2 steps with a checkpoint after each, started
as a user would (``python -m megarl.cli train ...``, which relaunches itself with torchrun). Faults are
injected with ``MEGARL_FAULT`` (:mod:`megarl.parallel.faults`): a rank SIGKILLs itself or stalls at a named
point, so every run fails at the same place each time. One uninterrupted run is the reference that every
resumed run must equal at the step after its last checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.parallel.lifecycle import PeerLostError, phase, process_alive
from megarl.trainer.metrics import read_metrics
from tests.distributed import marked_processes, run_world
from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

REPO = Path(__file__).resolve().parents[1]
RUN = ["data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
       "actor.optim.lr=1e-3", "actor.parallel.pp=2", "trainer.steps=2", "trainer.save_every=1"]
COMPARED = ["reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
            "actor/kl", "actor/clipfrac", "actor/ppo_kl"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("lifecycle")
    return root, make_tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 32)


def _args(task, name, *extra):
    root, model, data = task
    return [sys.executable, "-m", "megarl.cli", "train", *task_overrides(model, data, root / "runs", name), *RUN,
            *extra]


def _env(fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_FAULT"}
    return env | {"MEGARL_FAULT": fault} if fault else env


def _cli(task, name, *extra, fault=None):
    """Run ``megarl train`` to its end; stdout and stderr together."""
    r = subprocess.run(_args(task, name, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=240, cwd=REPO, env=_env(fault))
    return r.returncode, r.stdout


def _run_dir(task, name) -> Path:
    return task[0] / "runs" / name


def _metrics(task, name) -> list[dict]:
    return read_metrics(_run_dir(task, name) / "metrics.jsonl")


def _assert_step_equals(history, reference, step):
    got, want = history[step - 1], reference[step - 1]
    assert got["step"] == want["step"] == step
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.fixture(scope="module")
def reference(task):
    """The uninterrupted run's metrics, by step."""
    code, out = _cli(task, "reference")
    assert code == 0, out[-3000:]
    history = _metrics(task, "reference")
    assert [h["step"] for h in history] == [1, 2]
    assert history[0]["actor/pg_loss"] != history[1]["actor/pg_loss"]  # the steps differ: comparisons can fail
    return history


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and process_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, theirs, ...)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent_of[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier and process_alive(p)]
        found += kids
        frontier = kids
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _is_watchdog(pid: int) -> bool:
    """``pid`` is a megarl process's watchdog (``python -I -S -c``,
    :func:`megarl.parallel.lifecycle.own_descendants`)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:4] == [b"-I", b"-S", b"-c"]


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of a run folder: (size, mtime in ns)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_launcher_sigkill_ends_its_ranks_and_a_second_run_is_refused_then_resume(task, reference):
    """Issue 13: a SIGKILLed ``megarl train`` takes its ranks with it and nothing is written after the kill;
    a second run on a folder in use stops at once naming the owner, touching nothing; ``--resume`` then
    continues the killed run to the uninterrupted run's metrics."""
    name = "killed"
    run_dir = _run_dir(task, name)
    first = subprocess.Popen(_args(task, name), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=REPO, env=_env("checkpoint.saved@1:sleep"))  # both ranks stall after step 1
    try:
        _wait_for(lambda: (run_dir / "checkpoints/step_000001/megarl.json").exists()
                  and len(_metrics(task, name)) == 1, 180, "step 1's checkpoint")
        time.sleep(1.0)  # both ranks are past the save, asleep
        ranks = [p for p in _descendants(first.pid) if _parent(p) == first.pid and not _is_watchdog(p)]
        assert len(ranks) == 2, ranks
        started = _descendants(first.pid)  # the ranks, and what they started (their watchdogs: grandchildren
        assert len(started) > 2, started   # that end with them too)
        before = _files(run_dir)

        code, out = _cli(task, name, "run.seed=2")  # a second run on the same folder
        assert code == 2, out[-3000:]
        owner = next(line for line in out.splitlines() if line.startswith("megarl: error:"))
        assert "in use by pid" in owner and f"on host {socket.gethostname()}" in owner, owner
        assert int(owner.split("in use by pid ")[1].split()[0]) in ranks, (owner, ranks)  # rank 0 owns it
        assert "launching" not in out  # it stopped before starting any process
        assert _files(run_dir) == before  # the first run's files are untouched

        first.send_signal(signal.SIGKILL)  # the launcher alone: its ranks run in sessions of their own
        killed_at = time.time_ns()
        _wait_for(lambda: not any(process_alive(p) for p in started), 10, "the ranks and their children to end")
        assert _processes_naming(str(run_dir)) == []  # no megarl process of this run is left
        time.sleep(2.0)
        after = _files(run_dir)
        assert after == before, "a file was written after the kill"
        assert all(mtime < killed_at for _, mtime in after.values())
    finally:
        for pid in [first.pid, *_descendants(first.pid), *_processes_naming(str(run_dir))]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        first.stdout.close()
        first.wait()

    code, out = _cli(task, name, "--resume")
    assert code == 0, out[-3000:]
    assert "taking over the lock of pid" in out, out[-3000:]  # the dead run's lock, with a message
    assert "resumed from" in out and "step_000001" in out
    _assert_step_equals(_metrics(task, name), reference, 2)


@pytest.mark.slow
def test_kill_9_of_one_rank_mid_step_then_resume_matches_the_uninterrupted_run(task, reference):
    """Issue 8: rank 1 SIGKILLed in step 2's actor update (PP=2) ends the run; ``--resume`` redoes step 2 from
    step 1's checkpoint with the uninterrupted run's metrics."""
    name = "rank_killed"
    code, out = _cli(task, name, fault="phase.actor_update@2:kill:1")
    assert code != 0 and "fault injected: kill at phase.actor_update" in out, out[-3000:]
    assert sorted(p.name for p in (_run_dir(task, name) / "checkpoints").iterdir()) == ["step_000001"]
    assert [h["step"] for h in _metrics(task, name)] == [1]  # rank 0 did not train on alone
    code, out = _cli(task, name, "--resume")
    assert code == 0, out[-3000:]
    _assert_step_equals(_metrics(task, name), reference, 2)


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_save_resumes_from_the_last_complete_one(task, reference):
    """Issue 8: rank 0 SIGKILLed while saving step 2 (every shard and megarl.json written, not yet renamed):
    ``--resume`` takes step 1's checkpoint, never the partial one, and step 2 then equals the reference."""
    name = "save_killed"
    code, out = _cli(task, name, fault="checkpoint.before_rename@2:kill:0")
    assert code != 0 and "fault injected: kill at checkpoint.before_rename" in out, out[-3000:]
    ckpts = _run_dir(task, name) / "checkpoints"
    assert (ckpts / "step_000002.tmp" / "megarl.json").is_file()  # the partial save looks complete inside
    assert not (ckpts / "step_000002").exists()
    code, out = _cli(task, name, "--resume")
    assert code == 0, out[-3000:]
    assert f"resumed from {ckpts / 'step_000001'}" in out, out[-3000:]
    _assert_step_equals(_metrics(task, name), reference, 2)
    assert (ckpts / "step_000002" / "megarl.json").is_file() and not (ckpts / "step_000002.tmp").exists()


@pytest.mark.slow
def test_a_stalled_rank_ends_the_run_within_the_timeout_naming_rank_and_phase(task):
    """Issue 8/13: rank 1 stalls at the start of step 1's reward phase; rank 0, waiting in the next collective
    (the scores are gathered with the log-prob pass's results, so that is after its own reward phase), stops
    after ``trainer.timeout_s`` with an error naming rank 1 and the phase rank 1 stalled in, never hangs."""
    code, out = _cli(task, "stalled", "trainer.timeout_s=20", fault="phase.reward@1:sleep:1")
    assert code == 1, out[-3000:]
    # rank 1's progress watch (megarl.parallel.watchdog) names it first; rank 0, waiting for it, leaves it the
    # verdict, and names it too when it speaks before torchrun stops it
    error = next(line for line in out.splitlines() if line.startswith("megarl: error: rank 1"))
    assert "made no progress for trainer.timeout_s=20 s in phase 'reward': it stalled" in error, error
    for line in (x for x in out.splitlines() if x.startswith("megarl: error: rank 0")):
        assert "lost peer(s) rank 1" in line and "in phase 'reward'" in line, line
        assert "during phase '" in line and "trainer.timeout_s=20" in line, line  # and where rank 0 waited
    assert "megarl: error: megarl train failed on rank" in out  # the launcher too, naming it


def test_a_single_rank_stalled_outside_any_collective_is_named_within_the_timeout(task):
    """Issue 23: with no peer whose collective could time out, the rank's own progress watch ends the run
    after ``trainer.timeout_s`` without progress, naming the rank and its phase, with a failure's status (a
    restart under ``launch.max_restarts``)."""
    code, out = _cli(task, "stalled1", "actor.parallel.pp=1", "trainer.timeout_s=10", fault="phase.reward@1:sleep")
    assert code == 1, out[-3000:]
    assert "made no progress for trainer.timeout_s=10 s in phase 'reward': it stalled" in out, out[-3000:]
    assert "megarl: error: rank 0 (pid " in out, out[-3000:]


def _lose_a_peer(rank, world):
    import torch
    import torch.distributed as dist

    with phase("exchange"):
        dist.all_reduce(torch.ones(1))
        if rank == 1:
            os._exit(3)  # a crash without a word
        dist.all_reduce(torch.ones(1))
    return "unreachable"


def test_a_rank_whose_peer_dies_names_it_and_the_phase():
    with pytest.raises(RuntimeError) as e:
        run_world(_lose_a_peer, 2, timeout_s=120)
    text = str(e.value)
    assert PeerLostError.__name__ in text and "rank 0 lost peer(s) rank 1 (pid" in text, text[-3000:]
    assert "during phase 'exchange'" in text, text[-3000:]


def _sleep_with_a_child(rank, world, pid_dir):
    child = subprocess.Popen(["sleep", "600"])  # a process the rank starts (as libraries do)
    (Path(pid_dir) / f"rank{rank}").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def test_a_spawned_world_ends_with_its_parent_sigkill_included(tmp_path):
    """Issue 13: the ranks of ``run_world`` (``megarl convert``, benchmarks, tests), and what they start, end
    when the process that spawned them is SIGKILLed."""
    script = ("from megarl.parallel.launch import run_world; from tests.test_lifecycle import _sleep_with_a_child; "
              f"run_world(_sleep_with_a_child, 2, {str(tmp_path)!r})")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    pids: list[int] = []
    try:
        _wait_for(lambda: len(list(tmp_path.glob("rank*"))) == 2, 120, "both ranks")
        pids += [int(p) for f in tmp_path.glob("rank*") for p in f.read_text().split()]
        assert all(process_alive(p) for p in pids)
        parent.kill()
        parent.wait()
        _wait_for(lambda: not any(process_alive(p) for p in pids), 10, "the ranks and their children to end")
    finally:
        for pid in [parent.pid, *_descendants(parent.pid), *pids]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_run_lock_names_its_owner_and_takes_over_a_dead_ones(tmp_path, caplog):
    import json

    from megarl.parallel.run_lock import LOCK_FILE, RunLock, RunLockedError, check_free

    run_dir = tmp_path / "run"
    first = RunLock(run_dir).acquire()
    with pytest.raises(RunLockedError, match=rf"in use by pid {os.getpid()} on host {socket.gethostname()}"):
        RunLock(run_dir).acquire()  # another open file: flock refuses it, even in the same process
    with pytest.raises(RunLockedError, match="run.name"):
        check_free(run_dir)
    first.release()
    check_free(run_dir)
    assert (run_dir / LOCK_FILE).read_text() == ""  # a clean end leaves no owner

    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 0}))
    with caplog.at_level("WARNING"):
        lock = RunLock(run_dir).acquire()
    assert f"taking over the lock of pid {dead.pid}" in caplog.text and "which is gone" in caplog.text
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()

    (run_dir / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
    caplog.clear()
    with caplog.at_level("WARNING"):
        RunLock(run_dir).acquire().release()
    assert "host elsewhere" in caplog.text and "may still be alive" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["actor.parallel.pp=1"], []], ids=["one-process", "pp2-torchrun"])
def test_ctrl_c_ends_the_run_in_one_line_then_resume_continues(task, layout):
    """Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it) after step 1's checkpoint:
    exit status 130, one ``megarl: interrupted`` line naming that checkpoint and no traceback, from one process
    and from megarl's launcher with its two PP ranks; nothing left running, the run folder free for --resume."""
    name = f"ctrl_c_{len(layout)}"
    run_dir = _run_dir(task, name)
    extra = [*layout, "trainer.steps=50"]  # far more steps than run before the interrupt
    proc = subprocess.Popen(_args(task, name, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=_env("checkpoint.saved@1:sleep"), start_new_session=True)
    try:
        _wait_for(lambda: (run_dir / "checkpoints/step_000001/megarl.json").exists(), 180, "step 1's checkpoint")
        time.sleep(1.0)  # every rank is past the save, asleep
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("megarl:")]
    assert lines == [f"megarl: interrupted; --resume continues the run from {run_dir / 'checkpoints/step_000001'}"], \
        err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert _processes_naming(str(run_dir)) == []
    code, out = _cli(task, name, *layout, "trainer.steps=2", "--resume")
    assert code == 0 and "resumed from" in out, out[-3000:]


# a megarl process that starts what libraries start and never stop: megatron-core's checkpoint writer's spawned
# multiprocessing manager (with its resource tracker), and an orphan (a double fork, parent 1); then it ends
# as megarl.cli ends, or is SIGKILLed (argv[1] "kill": it waits)
_HELPERS = """
import subprocess, sys, time
import multiprocessing as mp
from megarl.parallel.lifecycle import own_descendants
own_descendants()
queue = mp.get_context("spawn").Manager().Queue()
subprocess.Popen(["sh", "-c", "sleep 600 &"]).wait()
print("started", flush=True)
if sys.argv[1] == "kill":
    time.sleep(600)
from megarl.cli import end_process
end_process(0)
"""


@pytest.mark.parametrize("how", ["end", "kill"])
def test_what_a_megarl_process_starts_ends_with_it_and_releases_its_output(how):
    """Issue 24: helpers that libraries start inside a rank (megatron-core's multiprocessing manager and its
    resource tracker, left with parent 1 by every SLURM rank) and orphans end with the megarl process, at a
    normal end and at ``kill -9``: its piped output reaches its end (``megarl train ... | cat`` ends) and no
    process with its environment is left."""
    import uuid

    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", _HELPERS, how], stdout=subprocess.PIPE, cwd=REPO,
                            env=os.environ | {"MEGARL_TEST_MARK": mark})
    try:
        assert proc.stdout.readline() == b"started\n"
        assert len(marked_processes(mark)) >= 4  # itself, the manager, the resource tracker, the orphan
        if how == "kill":
            proc.kill()
        proc.communicate(timeout=60)  # the end of the output: every holder of the pipe is gone
        assert proc.returncode == (0 if how == "end" else -signal.SIGKILL)
        _wait_for(lambda: not marked_processes(mark), 10, "the processes it started to end")
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)
