"""Multi-process gloo worlds for the tests (see :mod:`megarl.parallel.launch`)."""

from megarl.parallel.launch import run_world  # noqa: F401
