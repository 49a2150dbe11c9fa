"""Reward shaping by response length: DAPO's overlong penalty."""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, *, max_length: int, cache_length: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System
    at Scale", arXiv:2503.14476, sec. 3.4, eq. 13), added to each response's rule reward.

    With ``L_max = max_length`` and ``L_cache = cache_length``::

        R_length(y) = 0                                   if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                    = -1                                  if |y| > L_max

    times ``factor`` (the paper: 1; verl's ``overlong_buffer.penalty_factor``). The penalty falls linearly
    from 0 to -1 over the last ``L_cache`` tokens before the limit; a response cut at ``L_max`` gets -1.

    Args:
        response_lengths: ``[B]`` int or float response lengths, tokens.
        max_length: ``L_max`` (>= 1), tokens (the response length limit).
        cache_length: ``L_cache``, in [1, L_max], tokens.
        factor: scale of the penalty (>= 0).

    Returns:
        ``[B]`` float32 penalties, in ``[-factor, 0]``.

    Raises:
        ValueError: lengths outside their domain.
    """
    if not (max_length >= 1 and 1 <= cache_length <= max_length and factor >= 0):
        raise ValueError(f"overlong penalty needs max_length >= 1, 1 <= cache_length <= max_length and factor >= 0, "
                         f"got max_length={max_length}, cache_length={cache_length}, factor={factor}")
    expected = max_length - cache_length
    lengths = response_lengths.double()
    penalty = ((expected - lengths) / cache_length).clamp(min=-1.0, max=0.0)
    return (factor * penalty).float()
