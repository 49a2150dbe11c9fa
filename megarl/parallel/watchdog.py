"""Hang detection beyond collectives: a rank that makes no progress for ``trainer.timeout_s`` ends the job,
naming itself and its phase, so that the restart logic (:mod:`megarl.launch.supervise`) can act.

Progress is a change of the rank's phase (:func:`megarl.parallel.lifecycle.phase`: every step phase, the
checkpoint). During the training loop (:func:`progress_watched`) each rank runs a watch thread that notes its
progress and publishes the time of it on the job's store. When this rank has made none for ``timeout_s``, it
compares with its peers': a peer whose last progress is older is the one this rank waits for (in a
collective), so this rank leaves the verdict to that peer's watch, which fires first, or to the collective's
own timeout (:func:`~megarl.parallel.lifecycle.peer_failure` names the peer). Otherwise this rank is the one
that stalled, even outside any collective (a hung reward call, a dead-locked data loader, a single-rank run):
it says so on stderr, ``megarl: error: rank 1 (pid 4243 on node1) made no progress for trainer.timeout_s=20 s
in phase 'reward': it stalled``, marks itself on the store so that its peers' errors name it, and ends with
status 1 (a failure, restarted under ``launch.max_restarts``).

The watch is a Python thread: a rank stalled inside native code that holds the GIL is not seen by its own
watch; its peers' collectives still time out and name it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from typing import Iterator

from megarl.parallel import lifecycle

PROGRESS = "megarl/progress/"  # store keys: wall-clock time of each rank's last phase change

_started: list[threading.Thread] = []
_watching = threading.Event()  # set while the watch judges (the training loop); clear: it only notes progress


@contextlib.contextmanager
def progress_watched(timeout_s: float, poll_s: float | None = None) -> Iterator[None]:
    """Judge this rank's progress inside the block (the training loop: its setup, building and loading the
    models, may take long and is covered by the collectives' timeouts; so is the end of the run). Starts the
    watch thread on first use; call after :func:`~megarl.parallel.lifecycle.record_peers`.

    Args:
        timeout_s: seconds without progress after which a rank that waits for nobody ends the job.
        poll_s: how often the watch looks (default: ``timeout_s / 20``, between 0.2 and 10 s).
    """
    if not _started:
        poll = poll_s if poll_s is not None else min(max(timeout_s / 20, 0.2), 10.0)
        thread = threading.Thread(target=_watch, args=(timeout_s, poll), daemon=True, name="megarl-progress-watch")
        _started.append(thread)
        thread.start()
    _watching.set()
    try:
        yield
    finally:
        _watching.clear()


def _watch(timeout_s: float, poll_s: float) -> None:
    store, rank = lifecycle._store(), lifecycle._rank()
    world = len(lifecycle._peers)
    seen, since = -1, time.monotonic()
    while True:
        changes = lifecycle._phase_changes[0]
        if changes != seen or not _watching.is_set():
            seen, since = changes, time.monotonic()
            _try(lambda: store.set(f"{PROGRESS}{rank}", repr(time.time())))
        elif time.monotonic() - since >= timeout_s and not _waits_for_a_peer(store, rank, world, since):
            where = lifecycle._phase[0]
            _try(lambda: store.set(f"{lifecycle.STALLED}{rank}", where))
            print(f"megarl: error: rank {rank} (pid {os.getpid()} on {socket.gethostname()}) made no progress for "
                  f"trainer.timeout_s={timeout_s:g} s in phase '{where}': it stalled", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(poll_s)


def _waits_for_a_peer(store, rank: int, world: int, since: float) -> bool:
    """Whether a peer's last progress is older than this rank's (``since``, monotonic), on the store's record."""
    mine = time.time() - (time.monotonic() - since)
    for r in range(world):
        if r == rank:
            continue
        theirs = _try(lambda: float(store.get(f"{PROGRESS}{r}")) if store.check([f"{PROGRESS}{r}"]) else None)
        if theirs is not None and theirs < mine - 1.0:
            return True
    return False


def _try(fn):
    """``fn()``, or None where the store is gone (the job is ending): the watch must never raise."""
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None
