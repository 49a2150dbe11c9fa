"""Next-token selection from logits: temperature, top-k, top-p, greedy, and the sampled tokens' log-probs.

The reported log-prob is that of ``softmax(logits / temperature)`` over the full vocab (``softmax(logits)``
when greedy), before top-k/top-p truncation: the distribution the actor's teacher-forced log-probs compute
(:func:`megarl.models.logprobs.vocab_parallel_logprobs`). In vLLM 0.24.0 terms (read in
``vllm/v1/sample/sampler.py``, ``vllm/v1/sample/ops/topk_topp_sampler.py`` and
``vllm/v1/worker/gpu/sample/sampler.py`` of the 0.24.0 wheel): ``logprobs_mode="raw_logprobs"`` (the default)
is ``log_softmax`` of the logits before temperature, so it matches only at temperature 1;
``"processed_logprobs"`` is ``log_softmax`` after penalties, temperature, min-p and top-k/top-p (truncated
tokens at -inf, the rest renormalised), so it matches at every temperature when top-k and top-p are off, and
with truncation it reports the truncated distribution instead (greedy rows: ``log_softmax(logits)`` in both).
The vLLM engine therefore runs with ``processed_logprobs``.

Random draws use the exponential race (``argmax p / q`` with ``q ~ Exp(1)``, vLLM's native sampler), one
``torch.Generator`` per row, so a row's token does not depend on the other rows of the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megarl.rollout.base import SamplingConfig


def truncate_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k and then the top-p nucleus to -inf.

    Top-p keeps the smallest set of most likely tokens (under the top-k-truncated distribution) whose
    probability reaches ``top_p``; the most likely token is always kept.

    Args:
        logits: ``[b, v]`` float32 (already divided by the temperature).
        top_k: -1 = off, else >= 1.
        top_p: in (0, 1], 1 = off.

    Returns:
        ``[b, v]`` float32, a new tensor when anything is truncated, else ``logits`` itself.
    """
    if top_k == -1 and top_p >= 1:
        return logits
    ordered, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(ordered, dtype=torch.bool)
    if top_k != -1:
        drop[:, top_k:] = True
    if top_p < 1:
        probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        drop |= mass_before >= top_p
    return logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig,
                  generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row and its log-prob (module docstring).

    Args:
        logits: ``[b, v]`` next-token logits (any float dtype; computed in float32).
        sampling: temperature, top-k, top-p (greedy when ``sampling.temperature == 0``).
        generators: ``b`` generators on ``logits.device``, one per row (unused when greedy).

    Returns:
        ``(tokens [b] int64, logprobs [b] float32)``.
    """
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        logprobs = scaled.log_softmax(dim=-1)
        probs = truncate_top_k_top_p(scaled, sampling.top_k, sampling.top_p).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator)
        tokens = (probs / noise).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
