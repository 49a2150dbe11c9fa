"""Faults of the storage that megarl writes to: a full disk or quota, a read-only file system, a file too large
for the system's limit, a file standing where a folder must be, a folder without write permission.

They are faults of the machine, not of the run: running again fails the same way until someone frees space or
fixes the folder. megarl reports one as :class:`StorageError`, one line naming the folder or file and the cause,
ends with exit status :data:`megarl.parallel.restart.EXIT_STORAGE`, and is never restarted by
``--max-restarts`` (:mod:`megarl.launch.supervise`). :func:`storage_cause` finds the fault behind an exception;
:func:`check_writable` looks for one before a run starts.
"""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.ENOTDIR, errno.EISDIR,
                            errno.EEXIST, errno.EACCES, errno.EPERM})


class StorageError(OSError):
    """A folder or file that megarl must write cannot be written (module docstring); the message names it, the
    cause and the way out. ``errno`` is the cause's, where known."""

    def __init__(self, message: str, cause_errno: int | None = None):
        super().__init__(message)
        self.errno = cause_errno


def is_storage_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is itself a storage fault: a :class:`StorageError`, or an ``OSError`` whose errno is one of
    :data:`STORAGE_ERRNOS`."""
    return isinstance(exc, StorageError) or isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS


def storage_cause(exc: BaseException | None) -> OSError | None:
    """The storage fault (:func:`is_storage_fault`) that ``exc`` is or was raised from (its ``__cause__`` and
    ``__context__`` chain), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if is_storage_fault(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def describe(e: OSError) -> str:
    """``e`` in words: its cause and the path it names (``No space left on device (ENOSPC): /runs/x/...``)."""
    if isinstance(e, StorageError):
        return str(e)
    what = e.strerror or str(e)
    name = errno.errorcode.get(e.errno or -1)
    return f"{what}{f' ({name})' if name else ''}{f': {e.filename}' if e.filename else ''}"


def write_fault(path: str | os.PathLike, *, failed: bool = False) -> OSError | None:
    """The fault that writes at ``path`` (or its nearest existing folder) meet now, or None: a read-only file
    system (EROFS), one with no space left for this user (ENOSPC), or, after a write there ``failed``, a limit on
    the size of this process's files (EFBIG: ``ulimit -f``, ``RLIMIT_FSIZE``)."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder))
    if st.f_bavail == 0:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if failed and limit != resource.RLIM_INFINITY:
        return OSError(errno.EFBIG, f"{os.strerror(errno.EFBIG)} for this process's limit of {limit} bytes "
                       "(ulimit -f)", str(folder))
    return None


def check_writable(folder: str | os.PathLike, field: str) -> None:
    """Check, creating nothing, that ``folder`` can be made (where missing) and written: no file stands at it or
    at a folder above it, and the nearest existing folder is writable on a writable file system.

    Raises:
        StorageError: naming ``field`` (the config field that chose the folder), the path and the cause.
    """
    path = Path(folder).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StorageError(f"{field}: {existing} is a file, so the folder {path} cannot be made there; name another "
                           "folder, or move the file", errno.ENOTDIR if existing != path else errno.EEXIST)
    fault = write_fault(existing)
    if fault is None and not os.access(existing, os.W_OK | os.X_OK):
        fault = OSError(errno.EACCES, os.strerror(errno.EACCES), str(existing))
    if fault is not None:
        raise StorageError(f"{field}: the folder {path} cannot be written: {describe(fault)}; name another folder, or "
                           "make this one writable", fault.errno)
