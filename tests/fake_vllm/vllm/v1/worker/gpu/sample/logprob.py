"""The fake of ``vllm.v1.worker.gpu.sample.logprob``: ``compute_token_logprobs(logits, token_ids)``.

vLLM's is a Triton log-softmax at ``token_ids`` (``[rows, k]``); the fake runners' logits are log-probs already
(:mod:`vllm.runners`), so the fake gathers them.
"""

import torch


def compute_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, token_ids.to(torch.int64)).to(torch.float32)
