"""One Python process that runs the ``python3`` calls of :mod:`tests.test_perf_scripts`'s GPU-script checks one
after another, so that each costs neither an interpreter start nor the imports of torch, transformers and
megarl (5-10 s a call on the 2-core CI machine, two or three calls a script).

A call is a folder ``REQ`` holding ``argv`` (what follows ``python3``, NUL-separated), ``cwd``, ``env``
(``KEY=VALUE``, NUL-separated) and, for ``python3 -``, ``stdin``; the caller writes its path as one line into
the server's FIFO. The server runs it in this process with that folder, environment (``PYTHONPATH``'s entries put before
``sys.path`` for the call, as a new interpreter would) and ``sys.argv``:
``-m megarl.cli ARGS`` through :func:`megarl.cli.main` (not ``entry``, which ends the process), ``-c CODE
ARGS`` and ``- ARGS`` through ``exec``; its stdout and stderr (file descriptors 1 and 2, so what libraries
write goes there too) into ``REQ/out``, then the exit status into ``REQ/rc``, last (written whole, renamed).

    python -m tests.python_server FIFO
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path


def _call(req: Path) -> int:
    argv = [a.decode() for a in (req / "argv").read_bytes().split(b"\0")[:-1]]
    env = (req / "env").read_bytes().decode().split("\0")
    os.environ.clear()
    os.environ.update(dict(e.split("=", 1) for e in env if "=" in e))
    os.chdir((req / "cwd").read_text().strip())
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # as a new interpreter
    if argv[:2] == ["-m", "megarl.cli"]:
        from megarl.cli import main

        sys.argv = ["megarl", *argv[2:]]
        return main(argv[2:])
    if argv[:1] == ["-c"]:
        code, sys.argv = argv[1], ["-c", *argv[2:]]
    elif argv[:1] == ["-"]:
        code, sys.argv = (req / "stdin").read_text(), ["-", *argv[1:]]
    else:
        raise ValueError(f"python3 {' '.join(argv)}: only -m megarl.cli, -c and - are served")
    exec(compile(code, sys.argv[0], "exec"), {"__name__": "__main__"})
    return 0


def run_call(req: Path) -> int:
    """Run the call in ``req`` (see the module docstring), with this process's folder and environment put back
    afterwards; returns its exit status (1 for an exception, whose traceback goes to ``REQ/out``)."""
    cwd, env, argv, path = os.getcwd(), dict(os.environ), sys.argv, list(sys.path)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out = os.open(req / "out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1), os.dup2(out, 2)
    try:
        status = _call(req)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (the call's failure is its exit status, as in its own process)
        traceback.print_exc()
        status = 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (out, *saved):
            os.close(fd)
        os.chdir(cwd), os.environ.clear(), os.environ.update(env)
        sys.argv, sys.path[:] = argv, path
    return status


def serve(fifo: Path) -> None:
    """Run the calls whose folders arrive as lines on ``fifo``, until the process or its parent (the test run,
    SIGKILL included) is ended."""
    import megarl.cli  # noqa: F401 (imported once, before the first call)
    from megarl.parallel.lifecycle import exit_with_parent

    exit_with_parent(os.getppid())

    while True:
        with open(fifo) as lines:  # blocks until a caller opens it; EOF when it closes
            for line in lines:
                req = Path(line.strip())
                status = run_call(req)
                (req / "rc.tmp").write_text(str(status))
                os.rename(req / "rc.tmp", req / "rc")


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
