"""Numbers that must never reach the weights: the rule for non-finite rollout log-probs, scores and losses.

The rollout engine and the reward are other programs, and one NaN in the loss makes every weight NaN after one
step: vLLM reports a NaN log-prob for a token sampled from NaN logits (TRL PRs #5001, #6693), and a reward
function, a reward model or a reward server may answer NaN, inf or null. The rule:

1. **Rollout log-probs.** A response token whose rollout log-prob is not finite (NaN, +inf or -inf) leaves
   the actor's loss (loss mask 0) and the rollout correction (its weights and its ``rollout_corr/*``
   statistics, :mod:`megarl.algos.rollout_correction`); the rest of its response stays. Counted per step:
   ``rollout/nonfinite_logprob_tokens``.
2. **Scores.** A sample whose score is not finite (a reward function's NaN, inf or None, a reward server's
   null, a reward model's NaN) is dropped from its group: the advantage estimator runs on the other samples
   (a group's baseline and standard deviation, a whitening over the batch are theirs: :func:`estimate_without`),
   the dropped sample gets advantage and return 0 and leaves the actor's and the critic's losses; the reward
   metrics are over the other samples. Counted per step: ``reward/nonfinite``.
3. **The threshold.** When more than ``algorithm.nonfinite.max_fraction`` of a step's samples carry a
   non-finite number of either kind (``nonfinite/sample_frac``), the step fails before any update with a
   :class:`NonFiniteError` naming the first such sample (its place in the batch, its prompt and dataset row,
   the field and the value): an engine or reward that returns them that often is broken, and training on what
   is left of such a batch would hide it.
4. **The update.** Everything else is the trainer's own arithmetic: a micro-batch's loss or a gradient that
   is not finite stops the update before ``optimizer.step()``, on every rank of the role alike (one
   all-reduce over the role's ranks decides), with a :class:`NonFiniteError` naming the role, the step, the
   mini-batch and the micro-batch (:meth:`megarl.workers.engine.MegatronWorker.train_minibatches`): the
   weights and the optimizer state stay those of the update before.

A :class:`NonFiniteError` is a ``ValueError``: ``megarl train`` prints it in one line and exits with status 2,
which ``--max-restarts`` does not retry (:mod:`megarl.parallel.restart`): the numbers are deterministic, and a
restart from the last checkpoint would generate, score and train on the same batch again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


class NonFiniteError(ValueError):
    """A non-finite number where the weights would take it in (module docstring: past the threshold, or in a
    loss or gradient)."""


@dataclass
class NonFinite:
    """The non-finite engine and reward numbers of a step's batch (:func:`find_nonfinite`).

    Attributes:
        tokens: ``[B, T]`` bool, the response tokens whose rollout log-prob is not finite.
        scores: ``[B]`` bool, the samples whose score is not finite.
    """

    tokens: torch.Tensor
    scores: torch.Tensor

    @property
    def samples(self) -> torch.Tensor:
        """``[B]`` bool: the samples with a non-finite number of either kind."""
        return self.tokens.any(-1) | self.scores

    @property
    def fraction(self) -> float:
        """The share of the batch's samples with a non-finite number (0 for an empty batch)."""
        return float(self.samples.float().mean()) if len(self.scores) else 0.0

    def metrics(self) -> dict[str, float]:
        """``rollout/nonfinite_logprob_tokens`` (tokens), ``reward/nonfinite`` (samples) and
        ``nonfinite/sample_frac`` (the share of samples with either, what the threshold reads)."""
        return {"rollout/nonfinite_logprob_tokens": float(self.tokens.sum()),
                "reward/nonfinite": float(self.scores.sum()), "nonfinite/sample_frac": self.fraction}


def find_nonfinite(rollout_logprob: torch.Tensor, response_mask: torch.Tensor,
                   scores: torch.Tensor) -> NonFinite:
    """The rollout log-probs and scores of a batch that are not finite (rules 1 and 2 of the module docstring).

    Args:
        rollout_logprob: ``[B, T]`` float, the rollout engine's log-prob of each sampled token.
        response_mask: ``[B, T]``, the response tokens (padding is never counted, whatever it holds).
        scores: ``[B]`` float, each sample's score.

    Returns:
        A :class:`NonFinite`.

    Raises:
        ValueError: shapes that are not ``[B, T]`` and ``[B]``.
    """
    if rollout_logprob.shape != response_mask.shape or rollout_logprob.dim() != 2 or \
            scores.shape != rollout_logprob.shape[:1]:
        raise ValueError(f"rollout_logprob and response_mask must be [B, T] and scores [B], got "
                         f"{[tuple(t.shape) for t in (rollout_logprob, response_mask, scores)]}")
    return NonFinite(tokens=response_mask.bool() & ~torch.isfinite(rollout_logprob),
                     scores=~torch.isfinite(scores))


def check_nonfinite(found: NonFinite, rollout_logprob: torch.Tensor, scores: torch.Tensor, *,
                    max_fraction: float, describe: Callable[[int], str] = lambda i: f"sample {i}") -> None:
    """Rule 3 of the module docstring: fail when more than ``max_fraction`` of the samples have a non-finite
    number.

    Args:
        found: :func:`find_nonfinite` of ``rollout_logprob`` and ``scores``.
        rollout_logprob: ``[B, T]`` float; scores: ``[B]`` float (for the message's values).
        max_fraction: the share of samples allowed, in [0, 1] (``algorithm.nonfinite.max_fraction``).
        describe: names sample ``i`` of the batch in the message (its prompt and dataset row).

    Raises:
        NonFiniteError: past the threshold, naming the first sample with a non-finite number, its field and value.
    """
    bad = found.samples.nonzero().flatten().tolist()
    if not bad or found.fraction <= max_fraction:
        return
    i = bad[0]
    if found.scores[i]:
        what = f"its score is {float(scores[i])}"
    else:
        t = int(found.tokens[i].nonzero()[0])
        what = f"the rollout log-prob of its response token {t} is {float(rollout_logprob[i, t])}"
    raise NonFiniteError(
        f"{len(bad)} of {len(scores)} samples ({found.fraction:.1%}) have non-finite rollout log-probs or scores "
        f"({int(found.tokens.sum())} tokens, {int(found.scores.sum())} scores), more than "
        f"algorithm.nonfinite.max_fraction={max_fraction}; the first, {describe(i)}: {what}. Check the rollout "
        "engine (rollout.engine, its dtype) and the reward (reward.fn, reward.kwargs); raise "
        "algorithm.nonfinite.max_fraction to train on the rest of such batches")


def estimate_without(dropped: torch.Tensor, estimator: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                     rewards: torch.Tensor, response_mask: torch.Tensor, *, values: torch.Tensor | None = None,
                     group_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An advantage estimator (:mod:`megarl.algos.advantages`' signature) on the samples not ``dropped``: their
    groups' statistics and any whitening over the batch are the kept samples' alone (rule 2 of the module
    docstring), as if the dropped ones had not been generated.

    Args:
        dropped: ``[B]`` bool, the samples left out.
        estimator: ``fn(rewards, response_mask, *, values, group_index) -> (advantages, returns)``.
        rewards: ``[B]`` scores or ``[B, T]`` token rewards; response_mask ``[B, T]``; values ``[B, T]`` or
            None; group_index ``[B]`` int64 or None (the estimator's arguments).

    Returns:
        ``(advantages, returns)`` ``[B, T]`` float32: the estimator's on the kept rows, 0 on the dropped ones.
    """
    if not dropped.any():
        return estimator(rewards, response_mask, values=values, group_index=group_index)
    kept = (~dropped).nonzero().flatten()
    adv = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    ret = torch.zeros_like(adv)
    if len(kept):
        a, r = estimator(rewards[kept], response_mask[kept], values=None if values is None else values[kept],
                         group_index=None if group_index is None else group_index[kept])
        adv[kept], ret[kept] = a.float(), r.float()
    return adv, ret
