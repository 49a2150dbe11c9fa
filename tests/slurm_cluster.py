"""A real single-node SLURM cluster for the tests (slurmctld, slurmd and munged from Debian's packages).

The session fixture :func:`slurm_cluster` runs ``tests/slurm/start.sh`` (installs slurm-wlm and munge with
apt-get when missing, writes ``/etc/slurm/slurm.conf`` from ``tests/slurm/slurm.conf.template`` for this host,
starts the daemons, waits for a probe job: ~3 s when installed) and ``tests/slurm/stop.sh`` at the end (unless
the cluster was already running: another session may be using it). It
skips, with the reason, where it cannot: not root, or neither SLURM nor apt-get installed. A start that fails
on a machine that can run it fails the tests that need the cluster (with the daemons' logs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "slurm"
STATE = Path(os.environ.get("SLURM_LOCAL_STATE", "/tmp/megarl-slurm/state"))


def wait_for_job(job: str, timeout_s: float = 600.0, poll_s: float = 0.5) -> str:
    """Poll ``squeue -h -j JOB`` until the job (every task of an array) has left the queue; return
    ``scontrol show job``'s ``JobState``s (``COMPLETED``, ``FAILED``, ...; empty when already forgotten).

    Raises:
        TimeoutError: the job is still queued or running after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            raise TimeoutError(f"SLURM job {job} still queued after {timeout_s} s (cancelled)")
        time.sleep(poll_s)
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return " ".join(w.split("=", 1)[1] for w in out.split() if w.startswith("JobState="))


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node SLURM cluster (this machine); stopped at the end of the session."""
    if os.geteuid() != 0:
        pytest.skip("the SLURM tests start slurmctld/slurmd/munged and need root")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and there is no apt-get to install slurm-wlm and munge")
    env = {**os.environ, "SLURM_LOCAL_STATE": str(STATE)}
    r = subprocess.run(["bash", str(HERE / "start.sh")], capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"could not start the SLURM cluster (tests/slurm/start.sh):\n{r.stdout}\n{r.stderr}")
    yield STATE
    if "already running" not in r.stderr:  # stop only a cluster that this session started
        subprocess.run(["bash", str(HERE / "stop.sh")], capture_output=True, env=env, timeout=120)
