"""The fake of ``vllm.sampling_params``: ``RequestOutputKind`` (0.24.0's members) and ``SamplingParams``."""

from enum import Enum

from vllm import SamplingParams  # noqa: F401  (vLLM defines it here and exports it at the top)


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
