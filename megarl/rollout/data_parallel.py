"""Rollout data parallelism: each engine replica generates a contiguous share of the prompts, then every rank
gets all samples back in prompt order.

Samples are seeded by their global prompt index (:func:`megarl.rollout.base.sample_seed`), so the gathered
output equals one engine generating every prompt (up to float rounding between batch shapes).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.distributed as dist

from megarl.rollout.base import RolloutEngine, RolloutOutput, RolloutStats, SamplingConfig, check_prompts


def shard_bounds(num_prompts: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the contiguous share of ``rank`` among ``world_size``: shares differ by at most one
    prompt, the first ``num_prompts % world_size`` ranks taking one more (a share may be empty)."""
    per, extra = divmod(num_prompts, world_size)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


def gather_outputs(local: RolloutOutput, group=None) -> RolloutOutput:
    """Concatenate every rank's output in rank order (``all_gather_object``), on every rank of ``group``.

    Stats: tokens summed over ranks, seconds of the slowest rank.
    """
    parts: list[RolloutOutput | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return RolloutOutput(
        samples=[s for part in parts for s in part.samples],
        n=local.n,
        stats=RolloutStats(prompt_tokens=sum(p.stats.prompt_tokens for p in parts),
                           generated_tokens=sum(p.stats.generated_tokens for p in parts),
                           seconds=max(p.stats.seconds for p in parts)),
    )


def rollout_dp_group(tp: int, ranks: Sequence[int] | None = None):
    """This rank's rollout data-parallel group for engines of ``tp`` consecutive ranks of the rollout pool
    ``ranks`` (default: the whole world; engine ``k`` is ``ranks[k*tp:(k+1)*tp]``, as vLLM's external launcher
    lays them out): the pool's ranks with this rank's TP rank, one per engine. The ranks of one engine generate
    the same prompts and get the same samples, so prompts are split and samples gathered over this group only.

    Collective (``dist.new_group``): every rank of the world calls it with the same arguments.

    Returns:
        The group; None for the whole world (``tp == 1`` and the pool is the world) and on a rank outside the
        pool (which generates nothing).

    Raises:
        ValueError: ``tp`` does not divide the pool's size.
    """
    world = dist.get_world_size()
    ranks = list(range(world)) if ranks is None else sorted(ranks)
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"rollout tp={tp} does not divide the rollout pool's {len(ranks)} ranks")
    if tp == 1 and len(ranks) == world:
        return None
    mine = None
    for tp_rank in range(tp):
        members = ranks[tp_rank::tp]
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = group
    return mine


def generate_data_parallel(engine: RolloutEngine, prompt_token_ids: Sequence[Sequence[int]],
                           sampling: SamplingConfig, group=None) -> RolloutOutput:
    """Generate this rank's share of the prompts (:func:`shard_bounds` by its rank in ``group``) and gather
    all samples, prompt-major over the whole prompt list, on every rank of ``group``.

    Every rank of ``group`` must call this with the same prompts and sampling. With engines of TP > 1, pass
    the group of ranks with the same TP rank across engines (one rank per engine).

    Args:
        group: the rollout data-parallel process group (default: the whole world).

    Raises:
        RolloutError: a bad prompt (checked on every rank before sharding, so all ranks raise), or from the
            engine (sleeping, no weights).
    """
    check_prompts(prompt_token_ids, max_context=engine.spec.max_position_embeddings,
                  vocab_size=engine.spec.vocab_size)
    start, stop = shard_bounds(len(prompt_token_ids), dist.get_rank(group), dist.get_world_size(group))
    local = engine.generate(list(prompt_token_ids[start:stop]), sampling, prompt_offset=start)
    return gather_outputs(local, group)


def map_data_parallel(fn: Callable[..., Any], *columns: Sequence[Any], ranks: Sequence[int] | None = None) -> list[Any]:
    """Call ``fn`` on this rank's contiguous share (:func:`shard_bounds`) of equally long ``columns``, the
    shares split over ``ranks`` (default: the whole world; the other ranks call nothing), and gather the
    results of ``ranks``, in rank order, on every rank (all ranks of the world must call this), e.g. a reward
    function over the samples: ``torch.cat(map_data_parallel(reward_fn, prompts, responses, truths))``.
    :func:`map_share` and :func:`gather_shares` are its two halves, for work in between."""
    return gather_shares(map_share(fn, *columns, ranks=ranks), ranks)


def map_share(fn: Callable[..., Any], *columns: Sequence[Any], ranks: Sequence[int] | None = None) -> Any:
    """``fn`` on this rank's share of ``columns`` among ``ranks`` (None on a rank outside them); no collective."""
    ranks = list(range(dist.get_world_size()) if ranks is None else ranks)
    if dist.get_rank() not in ranks:
        return None
    lo, hi = shard_bounds(len(columns[0]), ranks.index(dist.get_rank()), len(ranks))
    return fn(*(c[lo:hi] for c in columns))


def gather_shares(local: Any, ranks: Sequence[int] | None = None, group=None) -> list[Any]:
    """The :func:`map_share` results of ``ranks``, in rank order, on every rank of ``group`` (default: the
    world; all its ranks must call this, and ``ranks`` lie in it)."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    members = list(range(len(parts))) if group is None else dist.get_process_group_ranks(group)
    by_rank = dict(zip(members, parts))
    return [by_rank[r] for r in sorted(members if ranks is None else ranks)]
