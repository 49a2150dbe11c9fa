"""Per-token policy versions and the staleness bound.

Every sampled token carries the version (step) of the policy weights that sampled it: the engine stamps its
samples and completions with its ``policy_version`` (set by the reshard that wrote its weights), an episode's
samples keep each turn's stamp per token (:class:`~megarl.agents.episode.TokenSample`), and the batch holds them
as ``token_version`` ``[B, R]`` int64 in the response frame (-1 on observation tokens and padding). A token
trained at step ``t`` (by the weights of version ``t - 1``) has staleness ``t - 1 - version``.

The bound (``trainer.max_staleness`` = k with ``trainer.mode=async``, 0 with ``sync``) holds per token: a token
older than k is taken out of the actor's loss mask, so no token older than k is ever trained, whatever the
schedule did (AReaL's per-token versions and prime-rl's ``max_off_policy_steps``, applied where the loss reads
them). megarl's schedule (:mod:`megarl.trainer.pipeline`) gives the engine new weights between rollouts, or
with in-flight updates between the turns of a batch's episodes (:mod:`megarl.parallel.in_flight`: newer, never
older), so no token should be older than k; the bound is what guarantees it rather than the schedule.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megarl.data.batch import RolloutBatch

NO_VERSION = -1  # a token no policy sampled (an observation, padding), or an engine that stamped nothing


def stamp_token_versions(batch: RolloutBatch, versions: Sequence[Sequence[int] | int | None], default: int) -> None:
    """``batch["token_version"]`` ``[B, R]`` int64 from each row's stamps: per token (``len(response)`` of them,
    in the response frame; :data:`NO_VERSION` past them), or one version for the whole row (a single-turn
    sample), or None (none); a sampled token (``response_mask`` 1) without a stamp gets ``default`` (the version
    the schedule generated the batch with).

    Raises:
        ValueError: a row's stamps longer than the batch's response width.
    """
    mask = batch["response_mask"].bool()
    out = torch.full(mask.shape, NO_VERSION, dtype=torch.int64)
    for i, v in enumerate(versions):
        if v is None or isinstance(v, int):
            out[i] = NO_VERSION if v is None else v
            continue
        if len(v) > out.shape[1]:
            raise ValueError(f"row {i} has {len(v)} version stamps for a response width of {out.shape[1]}")
        out[i, :len(v)] = torch.tensor(list(v), dtype=torch.int64)
    out[mask & (out < 0)] = default
    out[~mask] = NO_VERSION
    batch["token_version"] = out


def oldest_versions(batch: RolloutBatch, default: int) -> list[int]:
    """Each row's oldest token version (``samples.jsonl``'s ``policy_version``); ``default`` for a row without a
    sampled token."""
    stamps = batch["token_version"]
    oldest = stamps.masked_fill(stamps < 0, torch.iinfo(torch.int64).max).min(dim=1).values
    return torch.where((stamps >= 0).any(dim=1), oldest, default).tolist()


def bound_token_staleness(batch: RolloutBatch, step: int, bound: int) -> dict[str, float]:
    """Take the tokens older than ``bound`` out of ``batch["loss_mask"]`` (staleness ``step - 1 - version`` at the
    1-based ``step``); returns ``rollout/token_staleness_{min,max,mean}`` over the sampled tokens (before the
    bound) and ``rollout/tokens_past_bound``, the sampled tokens the bound took out (a count)."""
    sampled = batch["response_mask"].bool() & (batch["token_version"] >= 0)
    age = step - 1 - batch["token_version"]
    stale = age[sampled].double()
    past = sampled & (age > bound)
    batch["loss_mask"] = batch["loss_mask"] * (~past).float()
    if not len(stale):
        return {"rollout/tokens_past_bound": 0.0}
    return {"rollout/token_staleness_min": stale.min().item(), "rollout/token_staleness_max": stale.max().item(),
            "rollout/token_staleness_mean": stale.mean().item(), "rollout/tokens_past_bound": float(past.sum())}


def trained_versions(batch: RolloutBatch, row: int) -> dict[str, int]:
    """``{version: tokens}`` of the tokens of ``row`` in the actor's loss (samples.jsonl's ``token_versions``)."""
    versions = batch["token_version"][row][batch["loss_mask"][row] > 0]
    found, counts = versions.unique(return_counts=True)
    return {str(v): c for v, c in zip(found.tolist(), counts.tolist())}
