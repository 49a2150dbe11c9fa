"""Fault injection for the fault tests: a rank kills itself or stalls at a named point of a run.

Set ``MEGARL_FAULT`` to one or more comma-separated ``POINT[@N]:ACTION[:RANK[:RESTART]]``:

    POINT   a name passed to :func:`fault_point`: ``phase.<name>`` at the start of each step phase
            (``phase.reward``, ``phase.actor_update``, ...; see :class:`megarl.measure.timers.PhaseTimer`),
            ``checkpoint.before_rename`` (every shard and ``megarl.json`` written, the directory still
            ``step_N.tmp``), ``checkpoint.saved`` (the checkpoint complete)
    N       act on the N-th time this process reaches the point (default 1)
    ACTION  ``kill`` (SIGKILL itself, as ``kill -9`` would), ``sleep`` (stall for an hour), ``sleep=S``
            (pause S seconds) or ``signal=NAME`` (send itself that signal, e.g. ``signal=USR1``: what SLURM's
            ``--signal=USR1@S`` sends before a job's time limit)
    RANK    only on this global rank (default: every rank; ``*``: every rank)
    RESTART only in this attempt of a restarted run (0: the first; :func:`megarl.parallel.restart.
            restart_number`; default: every attempt)

e.g. ``MEGARL_FAULT=phase.actor_update@2:kill:1`` kills rank 1 in the second step's actor update. Unset (the
normal case) every point is a dictionary look-up and nothing else.
"""

from __future__ import annotations

import os
import signal
import time

FAULT_ENV = "MEGARL_FAULT"
_reached: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Act on the :data:`FAULT_ENV` entries naming this point (see the module docstring)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    _reached[name] = _reached.get(name, 0) + 1
    for entry in spec.split(","):
        point, action, *where = entry.strip().split(":")
        point, _, nth = point.partition("@")
        if point != name or _reached[name] != int(nth or 1):
            continue
        me = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))  # torchrun's or srun's rank
        if where and where[0] != "*" and int(where[0]) != me:
            continue
        if len(where) > 1 and int(where[1]) != int(os.environ.get("MEGARL_RESTART", "0") or 0):
            continue
        print(f"megarl: fault injected: {action} at {name} (#{_reached[name]}, rank {me}, pid {os.getpid()})",
              flush=True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "sleep" or action.startswith("sleep="):
            time.sleep(float(action.partition("=")[2] or 3600))
        elif action.startswith("signal=") and hasattr(signal, sig := "SIG" + action.partition("=")[2].upper()):
            os.kill(os.getpid(), getattr(signal, sig))
        else:
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {entry!r}; use kill, sleep or signal=NAME "
                             "(a signal name, e.g. USR1)")
