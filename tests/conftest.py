"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch

from tests.slurm_cluster import slurm_cluster  # noqa: F401  (session fixture: one SLURM cluster for all tests)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: on the 2-core CI machine shared with other test runs, two OpenMP
    threads made small matmuls ~20x slower (spinning on an oversubscribed CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

