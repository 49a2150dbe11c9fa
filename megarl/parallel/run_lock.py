"""One run per run folder: ``<run folder>/run.lock``, held by rank 0 for the run's whole life.

The lock is an ``fcntl.flock`` on the open lock file (the kernel drops it when the holder ends, however it
ends, SIGKILL included), and the file holds the owner's host, pid, start time and command line. A second run
on the same folder fails at once with :class:`RunLockedError` naming that owner; ``megarl train`` checks it
before it starts any process (:func:`check_free`), and rank 0 takes the lock before the run writes anything
(:meth:`RunLock.acquire`, called before the process group is set up, so the other ranks wait for it).

A lock file that still names an owner but is not locked was left by a run that died: it is taken over, with a
message naming the old owner. On a clean end the owner lines are cleared (the file stays: unlinking a
locked file would let two runs lock two different files of the same name).

Network file systems: Linux passes ``flock`` on NFS to the server as a whole-file POSIX lock (NLM on NFSv3,
the protocol's own locks on NFSv4), so runs on different hosts exclude each other as long as the mount has
locking (not ``nolock`` / ``local_lock=flock``). Where it does not, locks are only seen on one host: taking
over a lock file whose owner is on another host is then reported as a warning that names that host and pid,
since this host cannot tell whether the run still lives.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from megarl.parallel.lifecycle import process_alive

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLockedError(RuntimeError):
    """The run folder is in use by another run (named in the message)."""


def _owner(text: str) -> dict | None:
    try:
        owner = json.loads(text)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) and "pid" in owner else None


def _describe(owner: dict | None) -> str:
    if owner is None:
        return "another process (the lock file names none)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner['pid']} on host {owner.get('host', '?')} (started {started}: {owner.get('command', '')})"


class RunLock:
    """The lock of one run folder, held from :meth:`acquire` until :meth:`release` or process exit."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock (creating the run folder if needed).

        Raises:
            RunLockedError: another live run holds it; the message names its host, pid and start time.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(self._in_use_message()) from None
        previous = _owner(os.pread(fd, 65536, 0).decode(errors="replace"))
        if previous is not None:
            here = previous.get("host") == socket.gethostname()
            if here and not process_alive(int(previous["pid"])):
                log.warning("run folder %s: taking over the lock of %s, which is gone", self.path.parent,
                            _describe(previous))
            else:
                log.warning("run folder %s: taking over a lock file that names %s; it holds no lock here%s",
                            self.path.parent, _describe(previous),
                            "" if here else " (on a file system without shared locks that run may still be "
                                            "alive: stop this one if it is)")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _in_use_message(self) -> str:
        owner = _owner(self.path.read_text(errors="replace")) if self.path.exists() else None
        return (f"run folder {self.path.parent} is in use by {_describe(owner)}; wait for that run to end or "
                f"stop it (then --resume continues it), or choose another run.name (lock file {self.path})")

    def release(self) -> None:
        """Clear the owner lines and drop the lock (also dropped by the kernel when the process ends)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def check_free(run_dir: str | os.PathLike) -> None:
    """Raise :class:`RunLockedError` (naming the owner) when a live run holds ``run_dir``'s lock; takes and
    keeps nothing, creates nothing."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RunLockedError(RunLock(run_dir)._in_use_message()) from None
    finally:
        os.close(fd)
