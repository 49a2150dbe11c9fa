"""Restart a run that failed, from its newest complete checkpoint: ``megarl train --max-restarts N`` on one
node, and the batch script of ``megarl submit`` under SLURM (``launch.max_restarts``,
``launch.save_before_end_s``).

The supervisor runs the run's command (``megarl train ...``, or ``srun ... megarl train ...`` in a batch job)
and acts on its exit status (:mod:`megarl.parallel.restart`):

- finished (0), a config or data error (2), a fault of the storage (74: a full disk, a read-only folder),
  interrupted (130): that is the supervisor's status; an error is never retried (it would fail again);
- saved on SIGUSR1 (75, the time limit is near): under SLURM the job is requeued (``scontrol requeue``) and
  the new allocation continues the run; it counts as a restart only when no newer checkpoint was written. On
  one node it is the supervisor's status, never a failure and never run again here (the signal asked the run
  to stop; whoever sent it requeues it, or ``--resume`` continues it); a SIGUSR1 to the supervisor is passed
  on to its attempt, and a SIGTERM stops it as Ctrl-C does;
- anything else is a failure: the run continues from its newest complete checkpoint (``--resume``; from step
  0 when none was written yet) by running the command again (under SLURM in the same allocation: no wait in
  the queue, which delays a requeued job by 2 minutes), up to ``launch.max_restarts`` times; then the
  supervisor gives up with the failed status.

Each restart is a line of ``<run folder>/restarts.jsonl``: time, job, reason, exit status, checkpoint, and
whether it counted against the limit. Under SLURM the count survives the requeues (the records of this job
id), and a requeue the supervisor did not ask for (a node failure or a preemption of a ``--requeue`` job:
``SLURM_RESTART_COUNT`` is higher than the requeues recorded) is recorded and counted when the requeued job
starts.

    python -m megarl.launch.supervise --run-dir DIR --max-restarts N [--slurm] -- COMMAND ...
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from megarl.models.checkpoint import latest_checkpoint
from megarl.parallel.restart import (EXIT_INTERRUPTED, EXIT_REQUEUE, NOT_RETRIED, RESTART_ENV, read_restarts,
                                     record_restart)


def failure_kind(status: int) -> str | None:
    """What an exit status asks for: None (finished, or an error or interrupt not to retry: a config, data or
    storage error, a Ctrl-C), ``"requeue"`` (saved on SIGUSR1) or ``"failure"`` (restart)."""
    if status in (0, *NOT_RETRIED, EXIT_INTERRUPTED, -signal.SIGINT):
        return None
    return "requeue" if status == EXIT_REQUEUE else "failure"


def _reason(kind: str, status: int, checkpoint: Path | None) -> str:
    if kind == "requeue":
        return f"the job's time limit is near (SIGUSR1): saved {checkpoint.name if checkpoint else 'nothing'}"
    what = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    return f"the run failed ({what})"


def _run(command: list[str], restart: int, *, bind: bool) -> int:
    """Run one attempt, this process's stdout and stderr its own, and wait for it to end.

    ``bind``: the attempt is a megarl launcher, bound to this process (:mod:`megarl.parallel.lifecycle`: it
    ends with it, SIGKILL included) and in a session of its own, so that every process it leaves behind (a
    library's helper) ends with it; a Ctrl-C here is passed on to it. Otherwise (``srun``, whose ranks SLURM
    binds to the job) it shares this process group and gets a Ctrl-C directly."""
    env = {**os.environ, RESTART_ENV: str(restart)}
    if bind:
        from megarl.parallel.lifecycle import PARENT_ENV

        env[PARENT_ENV] = str(os.getpid())  # megarl.parallel.lifecycle.mark_children, for this child only
    proc = subprocess.Popen(command, env=env, start_new_session=bind)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            if bind:
                proc.send_signal(signal.SIGINT)  # it ends with 130, saying how to go on


def _with_resume(command: list[str], resume_flag: str) -> list[str]:
    return command if resume_flag in command else [*command, resume_flag]


def supervise_local(command: list[str], run_dir: Path, max_restarts: int) -> int:
    """Run ``command`` (``megarl train ...``) and run it again with ``--resume`` after each failure, up to
    ``max_restarts`` times; returns the last attempt's exit status. A stop on SIGUSR1 (:data:`EXIT_REQUEUE`,
    or the attempt ended by the signal that this process passed on before it watched it) is not a failure: it
    ends here with :data:`EXIT_REQUEUE`, unrecorded."""
    from megarl.parallel.lifecycle import stop_on_sigterm
    from megarl.parallel.restart import requeue_message, requeue_requested, watch_requeue_signal

    watch_requeue_signal()  # passed on to the attempt (bound to this process)
    stop_on_sigterm()  # a KeyboardInterrupt in _run: passed on to the attempt as Ctrl-C
    restarts = 0
    while True:
        attempt = _with_resume(command, "--resume") if restarts and latest_checkpoint(run_dir) else command
        status = _run(attempt, restarts, bind=True)
        kind = failure_kind(status)
        if kind == "requeue" or requeue_requested() and status == -signal.SIGUSR1:
            if status != EXIT_REQUEUE:  # the attempt said nothing: SIGUSR1 reached it before it watched it
                print(f"megarl: {requeue_message(latest_checkpoint(run_dir))}", file=sys.stderr, flush=True)
            return EXIT_REQUEUE  # the attempt said what it saved; nothing failed, nothing to run again here
        if status == EXIT_INTERRUPTED:  # the attempt, bound to this process, leaves the word to it
            newest = latest_checkpoint(run_dir)
            how = f"--resume continues the run from {newest}" if newest else "no checkpoint was written yet"
            print(f"megarl: interrupted; {how}", file=sys.stderr, flush=True)
        if kind is None:
            return status
        newest = latest_checkpoint(run_dir)
        if restarts >= max_restarts:
            print(f"megarl: error: {_reason(kind, status, newest)}; not restarted: launch.max_restarts="
                  f"{max_restarts} restart(s) used", file=sys.stderr, flush=True)
            return status
        restarts += 1
        rec = record_restart(run_dir, restart=restarts, job=f"local:{os.getpid()}", status=status,
                             reason=_reason(kind, status, newest), checkpoint=str(newest) if newest else None,
                             counted=True)
        print(f"megarl: restart {restarts}/{max_restarts}: {rec['reason']}; continuing from "
              f"{newest or 'step 0 (no checkpoint yet)'}", file=sys.stderr, flush=True)


def supervise_slurm(command: list[str], run_dir: Path, max_restarts: int) -> int:
    """A SLURM batch job's body: run ``command`` (``srun ... megarl train ...``); after a failure run it again
    in this allocation, from the newest checkpoint (no wait in the queue), up to ``max_restarts`` times over
    the job's life; after a save on SIGUSR1 requeue the job (a new allocation, a new time limit)."""
    job = os.environ["SLURM_JOB_ID"]
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)  # meant for the ranks (--signal=USR1@S), not us
    mine = [r for r in read_restarts(run_dir) if r.get("job") == job]
    counted = sum(bool(r.get("counted")) for r in mine)
    requeues = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if requeues > sum(bool(r.get("requeued")) for r in mine):  # requeued by SLURM itself
        counted += 1
        mine.append(record_restart(run_dir, restart=counted, job=job, status=None, counted=True, requeued=True,
                                   reason="requeued by SLURM (a node failure, a preemption or scontrol requeue)",
                                   checkpoint=str(latest_checkpoint(run_dir) or "")))
        if counted > max_restarts:
            print(f"megarl: error: job {job} was requeued by SLURM; not run again: launch.max_restarts="
                  f"{max_restarts} restart(s) used", file=sys.stderr, flush=True)
            return 1
    while True:
        before = latest_checkpoint(run_dir)
        status = _run(_with_resume(command, "--resume") if mine and before else command, len(mine), bind=False)
        kind = failure_kind(status)
        if kind is None:
            return status
        newest = latest_checkpoint(run_dir)
        counts = kind == "failure" or newest == before  # a save on SIGUSR1 that wrote nothing new counts
        reason = _reason(kind, status, newest)
        if counts and counted >= max_restarts:
            print(f"megarl: error: {reason}; not restarted: launch.max_restarts={max_restarts} restart(s) used",
                  file=sys.stderr, flush=True)
            return status if status > 0 else 1
        counted += counts
        mine.append(record_restart(run_dir, restart=counted, job=job, status=status, reason=reason,
                                   checkpoint=str(newest) if newest else None, counted=counts,
                                   requeued=kind == "requeue"))
        start = newest or "step 0 (no checkpoint yet)"
        if kind == "failure":
            print(f"megarl: restart {counted}/{max_restarts} in job {job}: {reason}; continuing from {start}",
                  file=sys.stderr, flush=True)
            continue
        print(f"megarl: requeueing job {job}: {reason}; the requeued job continues from {start}", file=sys.stderr,
              flush=True)
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"megarl: error: scontrol requeue {job} failed: {r.stderr.strip()}", file=sys.stderr, flush=True)
            return 1
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megarl.launch.supervise", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--max-restarts", required=True, type=int)
    p.add_argument("--slurm", action="store_true", help="requeue the SLURM job instead of running again")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the run's command")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.slurm:
        return supervise_slurm(command, a.run_dir, a.max_restarts)
    return supervise_local(command, a.run_dir, a.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
