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


def rollout_dp_group(tp: int):
    """This rank's rollout data-parallel group for engines of ``tp`` consecutive ranks (engine ``k`` is ranks
    ``[k*tp, (k+1)*tp)``, as vLLM's external launcher lays them out): the ranks with this rank's TP rank, one
    per engine (``{rank % tp + k*tp}``). The ranks of one engine generate the same prompts and get the same
    samples, so prompts are split and samples gathered over this group only.

    Collective (``dist.new_group``): every rank of the world calls it with the same ``tp``.

    Returns:
        The group, or None (the whole world) when ``tp == 1``.

    Raises:
        ValueError: ``tp`` does not divide the world size.
    """
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"rollout tp={tp} does not divide the world size {world}")
    if tp == 1:
        return None
    mine = None
    for tp_rank in range(tp):
        group = dist.new_group(list(range(tp_rank, world, tp)))
        if dist.get_rank() % tp == tp_rank:
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


def gather_shares(local: Any, ranks: Sequence[int] | None = None) -> list[Any]:
    """The :func:`map_share` results of ``ranks``, in rank order, on every rank (all ranks must call this)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return [parts[r] for r in sorted(range(len(parts)) if ranks is None else ranks)]
