"""Process lifetime: every process megarl starts ends with the process that started it, and a rank that loses
its peers stops with an error naming them.

Children. Every rank megarl starts calls :func:`exit_with_parent` first thing, which asks Linux to SIGKILL
it when its parent dies (``prctl(PR_SET_PDEATHSIG)``: it holds when the parent is SIGKILLed and needs no
cooperation from it), then checks that the parent is still the one expected (it may have died before the
``prctl``), and starts a thread that polls the parent's pid as a fallback (other systems, a failed ``prctl``).
``run_world`` passes its pid to its ranks; the torchrun relaunch of ``megarl train`` calls
:func:`mark_children` (its pid in :data:`PARENT_ENV`, consumed by the child so that grandchildren are not bound
by mistake) and its ranks call :func:`bind_to_launcher` in ``megarl.cli.main``, which also binds the ranks of
a torchrun or ``srun`` that the user started. What the kernel's rule implies: the signal fires when the parent
*thread* that started the child ends (torchrun and ``run_world`` start them from the main thread), and it is
not inherited across ``fork``.

Descendants. Processes that libraries start inside a megarl process are not bound that way: a
``multiprocessing`` manager (spawned, with its ``resource_tracker``) that is never stopped (megatron-core's
checkpoint writer started one per rank until megarl gave it a thread queue), torch's compile workers, ... They
hold the process's stdout and stderr, so a leftover keeps ``megarl train ... | cat`` (or an ``srun`` job's
output) open after the run. Two rules end them with the process
that started them, under the local launcher, torchrun and ``srun`` alike:

- :func:`own_descendants` (``megarl.cli.main``, before a command runs; ``run_world``'s ranks) puts a token of
  this process in its environment, :data:`OWNER_ENV`, which every process it starts from then on inherits, and
  starts a watchdog: a small process in a session of its own, reading a pipe whose only writer is this
  process. When this process ends, however it ends (``kill -9`` included), the watchdog SIGKILLs every process
  whose environment carries the token, and this process's group when it leads its own session (a torchrun
  worker, a ``run_world`` rank: their ``fork``-ed helpers carry the environment they were started with).
- :func:`end_descendants` (``megarl.cli``'s exit, after the command's work is written) stops them at a normal
  end, before the process leaves: SIGTERM, then SIGKILL after a grace period, to every descendant and every
  process with the token; ``multiprocessing``'s resource tracker, where this process started it, is stopped as
  ``multiprocessing`` stops it (it ignores SIGTERM and ends when its pipe closes, after cleaning up what it
  tracks). A ``run_world`` rank (spawned) shares its launcher's tracker and leaves it running: its own
  semaphores are released after this call, at its exit, through that tracker.

Peers. :func:`record_peers` notes every rank's host and pid once the process group is up, and :func:`phase`
marks what a rank is doing (the trainer's step phases, ``checkpoint``, ...). :func:`peer_failure` turns a
failed collective (gloo raises when a peer's socket closes, or when ``trainer.timeout_s`` passes without an
answer) into a :class:`PeerLostError` naming this rank, its phase and the peers at fault (gone, or stalled),
instead of a bare gloo message or a hang.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

PARENT_ENV = "MEGARL_PARENT_PID"
OWNER_ENV = "MEGARL_OWNER"  # <host>:<pid>:<start time> of the megarl process that started this one
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class PeerLostError(RuntimeError):
    """A collective failed because a peer rank died, stalled or cannot be reached."""


def mark_children() -> None:
    """Name this process, in :data:`PARENT_ENV`, as the parent that the processes it starts next must not
    outlive (they call :func:`exit_with_parent`)."""
    os.environ[PARENT_ENV] = str(os.getpid())


def exit_with_parent(parent_pid: int | None = None, poll_s: float = 1.0) -> None:
    """End this process (SIGKILL) as soon as ``parent_pid`` is gone.

    Args:
        parent_pid: the expected parent; None reads (and removes) :data:`PARENT_ENV` and returns when it is
            unset (a process not started by a megarl launcher).
        poll_s: period of the fallback parent watch, seconds.
    """
    if parent_pid is None:
        value = os.environ.pop(PARENT_ENV, None)
        if not value:
            return
        parent_pid = int(value)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watch thread below still applies
    if os.getppid() != parent_pid:  # the parent died before prctl: no signal will ever come
        os._exit(1)
    own_descendants()

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="megarl-exit-with-parent").start()


_under_megarl: list[bool] = []  # set by bind_to_launcher: this rank was started by megarl's own launcher


def bind_to_launcher() -> None:
    """:func:`exit_with_parent` for a rank of ``megarl train``, called first thing: bound to megarl's launcher
    when it marked this process (:data:`PARENT_ENV`), else to whatever started it when that is torchrun's
    agent (a torchrun the user started) or SLURM's step daemon (``srun``)."""
    if PARENT_ENV in os.environ:
        _under_megarl.append(True)
        exit_with_parent()
    elif "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_STEP_ID" in os.environ:
        exit_with_parent(os.getppid())


_interrupts: list[int] = []  # SIGINTs this process received (watch_interrupts)


def watch_interrupts() -> None:
    """Remember every SIGINT (Ctrl-C) this process gets, then raise ``KeyboardInterrupt`` as Python does: a
    library that swallows the exception (megatron-core's checkpoint writer logs it) does not hide that the
    user stopped the run, and a collective that fails because a peer stopped too is known for what it is
    (:func:`interrupted`). Call from the main thread."""
    def on_sigint(signum, frame):
        _interrupts.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)


def stop_on_sigterm() -> None:
    """A SIGTERM to this process (a launcher: ``kill PID``, a scheduler's stop) stops it as Ctrl-C does: a
    ``KeyboardInterrupt`` in the main thread, so the command ends with the message and status of an interrupt
    (130, never retried) instead of dying without a word. torchrun's agent does the same for the launcher of
    several ranks (its ``SignalException``); this covers the launcher that is itself the run's one rank, and the
    restart supervisor (which passes the stop on to its attempt). Call from the main thread."""
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)


def bound_children() -> list[int]:
    """This process's children that it bound to itself (:func:`mark_children`, :data:`PARENT_ENV` naming this
    process in the environment they started with): a launcher's ranks, a restart supervisor's attempt; not the
    helpers that libraries start. Linux only (``/proc``); elsewhere none."""
    me, found = os.getpid(), []
    entry = f"{PARENT_ENV}={me}".encode()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != me:
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    found.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def interrupted() -> bool:
    """Whether this process got a SIGINT since :func:`watch_interrupts`."""
    return bool(_interrupts)


def started_by_megarl() -> bool:
    """Whether this rank was started by megarl's own launcher (which speaks for the job), as
    :func:`bind_to_launcher` found."""
    return bool(_under_megarl)


_watchdog: list = []  # the watchdog's Popen, kept so its stdin pipe stays open for this process's life

# The watchdog (``python -I -S -c``, no megarl or torch import): waits for the end of file on its stdin, or
# for its parent to change (a ``fork``-ed helper may hold the pipe open), i.e. for this process to be gone;
# then SIGKILLs the processes whose environment holds argv[1] (the OWNER_ENV entry) and, when argv[2] is not 0,
# that process group.
_WATCHDOG = """
import os, select, signal, sys
owner = os.getppid()
while os.getppid() == owner:
    if select.select([0], [], [], 1.0)[0] and not os.read(0, 4096):
        break
entry, group = sys.argv[1].encode(), int(sys.argv[2])
if group:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
for pid in os.listdir("/proc"):
    try:
        if pid.isdigit() and entry in open(f"/proc/{pid}/environ", "rb").read().split(b"\\0"):
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
"""


def own_descendants() -> None:
    """Make every process that this one starts from now on end with it, however it ends (SIGKILL included):
    set this process's token in :data:`OWNER_ENV` (inherited by what it starts) and start the watchdog of the
    module docstring. Idempotent. Call :func:`end_descendants` at a normal end, before the process leaves."""
    if _watchdog:
        return
    os.environ[OWNER_ENV] = _token()
    import subprocess

    group = os.getpid() if os.getsid(0) == os.getpid() else 0  # a session leader's group holds only its own
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}  # the watchdog must not kill itself
    _watchdog.append(subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _WATCHDOG, f"{OWNER_ENV}={os.environ[OWNER_ENV]}", str(group)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        start_new_session=True))


def _token() -> str:
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time, clock ticks since boot
    except (OSError, IndexError):
        started = str(time.time_ns())
    return f"{socket.gethostname()}:{os.getpid()}:{started}"


def owned_processes() -> list[int]:
    """Live processes (other than this one) that this process started: its descendants, and every process
    whose environment carries this process's :data:`OWNER_ENV` token (those whose parent has gone, too)."""
    me = os.getpid()
    token = os.environ.get(OWNER_ENV) if _watchdog else None
    entry = f"{OWNER_ENV}={token}".encode() if token else None
    parent_of: dict[int, int] = {}
    owned: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent_of[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
            if entry is not None:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if entry in f.read().split(b"\0"):
                        owned.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    frontier = {me}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier and p not in owned}
        owned |= frontier
    return sorted(p for p in owned if process_alive(p))


def end_descendants(grace_s: float = 3.0) -> None:
    """End every process this one started (:func:`owned_processes`): SIGTERM, then SIGKILL to those left after
    ``grace_s`` seconds; then stop ``multiprocessing``'s resource tracker if this process started it (it ends
    once its pipe closes, after releasing what it tracks). Call at a normal end, once this process's own work is
    written: afterwards nothing it started holds its stdout or stderr. Linux only (``/proc``); elsewhere it does
    nothing.

    A process spawned by ``multiprocessing`` (a ``run_world`` rank) writes to its parent's tracker, which it did
    not start: closing its end of that pipe here made its exit, which releases its semaphores afterwards (tqdm's
    lock of a GGUF dequantisation), start a second tracker that had never seen them (a ``KeyError`` traceback),
    while the parent's reported them leaked at its exit (``megarl convert`` of a GGUF file; issue 48)."""
    if not os.path.isdir("/proc"):
        return
    from multiprocessing import resource_tracker

    keep = {w.pid for w in _watchdog} | {getattr(resource_tracker._resource_tracker, "_pid", None)}
    targets = [p for p in owned_processes() if p not in keep]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while targets and time.monotonic() < deadline:
            _reap_children()
            targets = [p for p in targets if process_alive(p)]
            if targets:
                time.sleep(0.02)
    tracker = resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)
    if stop is not None and getattr(tracker, "_pid", None) is not None:  # this process's own tracker
        try:
            stop()  # closes its pipe and waits for it
        except Exception:  # noqa: BLE001 (best effort: it also ends when this process does)
            pass


def _reap_children() -> None:
    """Collect ended children (a zombie holds no files but shows in ``/proc``)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs; a zombie (ended, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill(0) said it exists


# ------------------------------------------------------------------------------------------------ peers
_peers: list[tuple[str, int]] = []  # (host, pid) by rank, from record_peers
_phase = ["setup"]  # what this rank is doing, for error messages and the peers' reports
_phase_changes = [0]  # how often it changed: this rank's progress (megarl.parallel.watchdog)
STALLED = "megarl/stalled/"  # store keys: the phase of a rank its progress watch ended, set just before it ends
_BOARD = "megarl/phase/"  # store keys: each rank's current phase
_TIMED_OUT = "megarl/timed_out/"  # store keys: ranks whose collective timed out


def stalled_phase(store, rank: int) -> str | None:
    """The phase that ``rank`` stalled in (marked on the store by its progress watch,
    :mod:`megarl.parallel.watchdog`, before it ended), or None (also when the store is gone: the job is ending)."""
    try:
        return store.get(f"{STALLED}{rank}").decode() if store.check([f"{STALLED}{rank}"]) else None
    except Exception:  # noqa: BLE001
        return None


def _store():
    """The job's key-value store (the process group's TCPStore: hosted by torchrun's agent, or by rank 0),
    or None before initialisation. It answers while a rank's Python is stalled (a server thread)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def record_peers() -> None:
    """Note every rank's (host, pid) for :func:`peer_failure`. Collective (call once the process group is
    initialised)."""
    import torch.distributed as dist

    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    _peers[:] = table


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark what this rank does inside the block (e.g. ``actor_update``, ``checkpoint``), for the error of a
    failed collective; the name stays in force when the block raises. Publishes it on the job's store when
    the peers are recorded (one small write per phase)."""
    previous = _phase[0]
    _set_phase(name)
    yield
    _set_phase(previous)


def _set_phase(name: str) -> None:
    _phase[0] = name
    _phase_changes[0] += 1
    if _peers:
        try:
            _store().set(f"{_BOARD}{_rank()}", name)
        except Exception:  # noqa: BLE001 (best effort: the report below does without it)
            pass


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def peer_failure(exc: BaseException, timeout_s: float | None = None, wait_s: float = 5.0) -> PeerLostError | None:
    """A :class:`PeerLostError` explaining ``exc`` when it is a failed collective, else None.

    The message names this rank, its phase, and the peers at fault: on this host, peers whose process is gone
    ("lost"); after a timeout, peers that are alive but never timed out themselves, so were not waiting in a
    collective ("stalled", with the phase they published). Ranks whose collective timed out mark it on the
    job's store; this rank waits up to ``wait_s`` seconds for its peers' marks before judging (and, after a
    closed connection, up to 2 s for the peer's process to show as ended).

    Args:
        exc: what the failing call raised (``torch.distributed.DistError`` or gloo's ``RuntimeError``).
        timeout_s: the collective timeout in force (``trainer.timeout_s``), named in the message.
        wait_s: seconds to wait for the peers' timeout marks.
    """
    import torch.distributed as dist

    text = str(exc)
    if not _peers or not (isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in text)):
        return None  # not a collective's failure (gloo's are RuntimeErrors naming its sources)
    rank, where, host = _rank(), _phase[0], socket.gethostname()
    first = (text.strip().splitlines() or [type(exc).__name__])[0][:300]
    peers = [r for r in range(len(_peers)) if r != rank]
    timed_out = any(k in text.lower() for k in ("timed out", "timeout"))

    def gone() -> list[int]:
        return [r for r in peers if _peers[r][0] == host and not process_alive(_peers[r][1])]

    deadline = time.monotonic() + (0 if timed_out else min(wait_s, 2.0))
    while not (lost := gone()) and time.monotonic() < deadline:
        time.sleep(0.02)  # a peer's sockets close while it exits, a moment before it shows as ended
    within = f"within trainer.timeout_s={timeout_s:g} s" if timeout_s else "within the collective timeout"
    store = _store()
    ended = {r: stalled_phase(store, r) for r in peers} if store is not None else {}
    ended = {r: p for r, p in ended.items() if p is not None}  # peers whose progress watch ended them
    if ended:
        who = ", ".join(f"rank {r} (pid {_peers[r][1]} on {_peers[r][0]}, in phase '{p}')"
                        for r, p in ended.items())
        return PeerLostError(f"rank {rank} lost peer(s) {who} during phase '{where}': no progress {within}, the "
                             f"peer stalled and ended [{first}]")
    if lost:
        who = ", ".join(f"rank {r} (pid {_peers[r][1]})" for r in lost)
        return PeerLostError(f"rank {rank} lost peer(s) {who} during phase '{where}': the process is gone "
                             f"[{first}]")
    stalled: list[str] = []
    if timed_out and store is not None:
        try:
            store.set(f"{_TIMED_OUT}{rank}", where)
            deadline = time.monotonic() + wait_s
            waiting = peers
            while waiting and time.monotonic() < deadline:
                time.sleep(0.2)
                waiting = [r for r in waiting if not store.check([f"{_TIMED_OUT}{r}"])]
            for r in waiting:
                their = store.get(f"{_BOARD}{r}").decode() if store.check([f"{_BOARD}{r}"]) else "?"
                stalled.append(f"rank {r} (pid {_peers[r][1]} on {_peers[r][0]}, in phase '{their}')")
        except Exception:  # noqa: BLE001 (the store itself is gone: report what is known)
            stalled = []
    if stalled:
        return PeerLostError(f"rank {rank} lost peer(s) {', '.join(stalled)} during phase '{where}': no answer "
                             f"{within}, the peer stalled [{first}]")
    remote = [f"rank {r} ({_peers[r][0]})" for r in peers if _peers[r][0] != host]
    why = f"no answer {within}" if timed_out else "a peer's connection failed"
    suspects = f"; not checked from here: {', '.join(remote)}" if remote else ""
    return PeerLostError(f"rank {rank} lost its peers during phase '{where}': {why}{suspects} [{first}]")


@contextmanager
def peer_failures_named(timeout_s: float | None = None) -> Iterator[None]:
    """Re-raise a failed collective inside the block as :func:`peer_failure`'s :class:`PeerLostError`."""
    try:
        yield
    except Exception as e:
        err = peer_failure(e, timeout_s)
        if err is None:
            raise
        raise err from e
