"""Multi-process gloo worlds for the tests (see :mod:`megarl.parallel.launch`)."""

from megarl.parallel.launch import run_world  # noqa: F401


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment holds ``MEGARL_TEST_MARK=mark``: everything a test started with that
    variable set, however deep and whatever became of its parents (zombies excluded)."""
    from pathlib import Path

    from megarl.parallel.lifecycle import process_alive

    entry, found = f"MEGARL_TEST_MARK={mark}".encode(), []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return [p for p in found if process_alive(p)]
