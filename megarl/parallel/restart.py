"""What a run's restarts agree on: exit statuses, the save-and-requeue signal, and the restart record.

A rank's exit status tells the process that restarts runs (:mod:`megarl.launch.supervise`: ``megarl train
--max-restarts N`` on one node, the batch script of ``megarl submit`` under SLURM) what happened:

    0                    the run finished its steps
    2                    a config, data or usage error (:data:`EXIT_USAGE`), or non-finite numbers that would
                         reach the weights (``megarl.algos.nonfinite``): never retried, it would fail again
    74                   a fault of the storage (:data:`EXIT_STORAGE`, BSD's EX_IOERR): a full disk or quota, a
                         read-only file system, a file where a folder must be (:mod:`megarl.storage`); never
                         retried, it would fail again until someone fixes it
    75                   the ranks saved a checkpoint on SIGUSR1 (SLURM's ``--signal=USR1@S`` before the time
                         limit) and ask to continue in a new job (:data:`EXIT_REQUEUE`, BSD's EX_TEMPFAIL)
    130                  the user interrupted the run (Ctrl-C): never retried
    anything else        a failure (a killed rank, a lost peer, a stalled rank, an NCCL error): retried from the
                         newest complete checkpoint, up to ``launch.max_restarts`` times

SIGUSR1 may reach the ranks at different moments; each notes it (:func:`watch_requeue_signal`), and the ranks
agree at the end of a step (the trainer reduces the flag over the world), save, and exit with
:data:`EXIT_REQUEUE` together. It may be sent to any process of the run: a rank (SLURM's ``--signal``), or the
``megarl train`` that the user started: a launcher passes it on to its ranks, the local restart supervisor to
its attempt, and a run of one rank is its own launcher. Whatever the launcher and the world size, the run
then ends with one line saying that it stopped for the requeue and what it saved (:func:`requeue_message`),
and status :data:`EXIT_REQUEUE`; the local supervisor does not run it again (nothing failed: a later
``--resume`` continues it), the SLURM one requeues the job.

Every restart is a line of ``<run folder>/restarts.jsonl`` (:func:`record_restart`): its time, the job, the
reason and the checkpoint it continues from; the run's summary lists them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from megarl.jsonl import append_records, read_records

EXIT_USAGE = 2
EXIT_STORAGE = 74
EXIT_REQUEUE = 75
EXIT_INTERRUPTED = 130
NOT_RETRIED = (EXIT_USAGE, EXIT_STORAGE)  # errors that a run started again would meet again
RESTARTS_FILE = "restarts.jsonl"
RESTART_ENV = "MEGARL_RESTART"  # the attempt's restart number (0: the first attempt), set by the supervisor

_requeue: list[int] = []  # SIGUSR1s this process received


class RequeueRequested(Exception):
    """The ranks saved a checkpoint on SIGUSR1 and end the job so that a new one continues the run."""


def watch_requeue_signal() -> None:
    """Note every SIGUSR1 this process gets (its default action would end it) for :func:`requeue_requested`,
    and pass it on to the megarl processes this one started and bound to itself (a launcher's ranks, the
    restart supervisor's attempt: :func:`megarl.parallel.lifecycle.bound_children`). Call from the main
    thread of a rank, of a launcher, of a supervisor."""
    from megarl.parallel.lifecycle import bound_children

    def on_usr1(signum, frame):
        _requeue.append(signum)
        for pid in bound_children():
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:  # it has just ended
                pass

    signal.signal(signal.SIGUSR1, on_usr1)


def requeue_message(checkpoint: str | os.PathLike | None) -> str:
    """The line of a run that stopped on SIGUSR1 for the requeue, having saved ``checkpoint`` (None: nothing
    was saved yet)."""
    if checkpoint is None:
        return "stopped for the requeue on SIGUSR1 before any checkpoint was saved; the run starts over"
    return (f"stopped for the requeue on SIGUSR1 (a job's time limit is near): saved {checkpoint}; the requeued "
            "job, or megarl train --resume, continues the run from it")


def requeue_stop(exit_codes) -> bool:
    """Whether the exit codes of a world's ranks (a torchrun failure's) are those of a stop for the requeue: a
    rank ended with :data:`EXIT_REQUEUE` (the ranks save together before any ends so) and the others did too or
    were stopped by their launcher after it (SIGTERM, SIGKILL: torchrun stops the ranks left once one ends)."""
    codes = set(exit_codes)
    return EXIT_REQUEUE in codes and codes <= {EXIT_REQUEUE, -signal.SIGTERM, -signal.SIGKILL}


def requeue_requested() -> bool:
    """Whether this process got a SIGUSR1 since :func:`watch_requeue_signal`."""
    return bool(_requeue)


def restart_number() -> int:
    """This attempt's restart number: 0 for a run's first attempt, k after k restarts (:data:`RESTART_ENV`)."""
    return int(os.environ.get(RESTART_ENV, "0") or 0)


def record_restart(run_dir: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    """Append one restart (``reason``, ``job``, ``checkpoint``, ``counted``, ...) with the time to the run
    folder's :data:`RESTARTS_FILE`; returns the record."""
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **fields}
    append_records(Path(run_dir) / RESTARTS_FILE, [rec])
    return rec


def read_restarts(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The restart records of a run folder, oldest first (none: an empty list; a torn line is skipped:
    :func:`megarl.jsonl.read_records`)."""
    return read_records(Path(run_dir) / RESTARTS_FILE)
