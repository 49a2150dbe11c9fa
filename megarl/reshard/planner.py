"""The reshard planner: from a source and a destination :class:`~megarl.models.layout.Layout` to the list of
point-to-point box transfers that turns the one into the other.

Both layouts describe their local tensors as boxes (:class:`~megarl.models.layout.Block`) of canonical
(Hugging Face) tensors. For every canonical tensor the planner groups the source boxes into replica sets
(identical boxes held by several ranks: DP copies, the tied embeddings of the first and last PP stage),
checks that distinct source boxes do not overlap, intersects every destination block with the source boxes,
and picks one replica for every intersection:

1. the destination rank itself (a local copy, no network);
2. else a replica on the same node as the destination (``rank // ranks_per_node``);
3. else, and among several candidates of one class, the source rank with the fewest elements assigned to
   send so far (ties: the lowest rank).

The plan is deterministic (the same on every rank, so every rank can execute it without talking about it)
and cached per layout pair. Plans count elements, not bytes: dtypes are the executor's business.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from megarl.models.layout import Block, Layout


class PlanError(ValueError):
    """A pair of layouts that cannot be resharded into one another; the message names the tensor and sizes."""


class Transfer(NamedTuple):
    """One box moved from a source rank's local tensor into a destination rank's local tensor.

    Boxes are in local coordinates (one int per dim of the local tensors, which are 1-D or 2-D); the box has
    the same ``size`` on both sides. ``src_rank == dst_rank`` means a same-rank copy.

    Attributes:
        src_rank / dst_rank: global ranks.
        src_name / dst_name: local tensor names (e.g. ``decoder.layers.0.mlp.linear_fc1.weight`` on the
            source, ``model.layers.0.mlp.gate_up_proj.weight`` on the destination).
        src_start / dst_start: start of the box in the local source / destination tensor, elements.
        size: extent of the box, elements per dim.
        canonical: the canonical tensor the box belongs to (for messages and statistics).
    """

    src_rank: int
    dst_rank: int
    src_name: str
    src_start: tuple[int, ...]
    dst_name: str
    dst_start: tuple[int, ...]
    size: tuple[int, ...]
    canonical: str

    @property
    def numel(self) -> int:
        return math.prod(self.size)


class RankPlan(NamedTuple):
    """The part of a plan that involves one rank, each list in plan order.

    Attributes:
        local: transfers with ``src_rank == dst_rank == rank``.
        sends: transfers from ``rank`` to other ranks.
        recvs: transfers from other ranks into ``rank``.
    """

    local: tuple[Transfer, ...]
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


@dataclass(frozen=True, eq=False)
class Plan:
    """All transfers of one reshard (every rank's, in one deterministic order).

    Attributes:
        src / dst: the layouts.
        transfers: the transfers, ordered by destination rank, destination tensor (layout order), block.
        ranks_per_node: the node size the replica choice assumed (None: one node).
    """

    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]
    ranks_per_node: int | None
    _by_rank: dict = field(default_factory=dict, repr=False, init=False)

    def for_rank(self, rank: int) -> RankPlan:
        """The transfers that involve ``rank`` (cached)."""
        if rank not in self._by_rank:
            self._by_rank[rank] = RankPlan(
                tuple(t for t in self.transfers if t.src_rank == rank and t.dst_rank == rank),
                tuple(t for t in self.transfers if t.src_rank == rank and t.dst_rank != rank),
                tuple(t for t in self.transfers if t.dst_rank == rank and t.src_rank != rank))
        return self._by_rank[rank]

    def elements(self, rank: int) -> dict[str, int]:
        """Elements ``rank`` sends, receives and copies locally: ``{"sent", "received", "local"}``."""
        mine = self.for_rank(rank)
        return {"sent": sum(t.numel for t in mine.sends), "received": sum(t.numel for t in mine.recvs),
                "local": sum(t.numel for t in mine.local)}


class _Replica(NamedTuple):
    rank: int
    local: str
    block: Block


def _end(start: tuple[int, ...], size: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s + n for s, n in zip(start, size))


def _describe(start: tuple[int, ...], size: tuple[int, ...]) -> str:
    return " x ".join(f"[{s}, {s + n})" for s, n in zip(start, size))


def _check_blocks(layout: Layout, which: str) -> None:
    """Every block lies inside its canonical tensor and its local tensor, with matching ranks (dims)."""
    seen = set()
    for rank, tensors in layout.ranks.items():
        if id(tensors) in seen:  # ranks of one TP/PP coordinate share their tensor dict
            continue
        seen.add(id(tensors))
        for lt in tensors.values():
            for b in lt.blocks:
                shape = layout.canonical.get(b.name)
                if shape is None:
                    raise PlanError(f"{which} layout: local tensor {lt.name!r} on rank {rank} holds a block of "
                                    f"{b.name!r}, which is not among the layout's canonical tensors")
                if not (len(b.src) == len(b.size) == len(shape) and len(b.dst) == len(lt.shape)
                        and len(b.dst) == len(b.size)):
                    raise PlanError(f"{which} layout: block of {b.name!r} {shape} in {lt.name!r} {lt.shape} "
                                    f"on rank {rank} has src {b.src}, dst {b.dst}, size {b.size}: dims differ")
                if any(s < 0 or e > n for s, e, n in zip(b.src, _end(b.src, b.size), shape)) or \
                        any(s < 0 or e > n for s, e, n in zip(b.dst, _end(b.dst, b.size), lt.shape)):
                    raise PlanError(f"{which} layout: block {_describe(b.src, b.size)} of {b.name!r} {shape} "
                                    f"placed at {b.dst} in {lt.name!r} {lt.shape} on rank {rank} is out of "
                                    "bounds")


def _source_boxes(src: Layout) -> dict[str, list[tuple[tuple, tuple, list[_Replica]]]]:
    """Canonical name -> distinct source boxes ``(start, size, replicas)`` sorted by start; replicas sorted by
    rank.

    Raises:
        PlanError: two distinct boxes of one canonical tensor overlap.
    """
    boxes: dict[str, dict[tuple, list[_Replica]]] = defaultdict(dict)
    for rank in sorted(src.ranks):
        for lt in src.ranks[rank].values():
            for b in lt.blocks:
                boxes[b.name].setdefault((b.src, b.size), []).append(_Replica(rank, lt.name, b))
    out = {}
    for name, by_box in boxes.items():
        distinct = sorted((start, size, reps) for (start, size), reps in by_box.items())
        for i, (a_start, a_size, a_reps) in enumerate(distinct):
            a_end = _end(a_start, a_size)
            for b_start, b_size, b_reps in distinct[i + 1:]:
                if b_start[0] >= a_end[0]:
                    break
                if all(bs < ae and as_ < bs + bn for as_, ae, bs, bn in zip(a_start, a_end, b_start, b_size)):
                    raise PlanError(
                        f"source layout: boxes {_describe(a_start, a_size)} ({a_reps[0].local!r} on rank "
                        f"{a_reps[0].rank}) and {_describe(b_start, b_size)} ({b_reps[0].local!r} on rank "
                        f"{b_reps[0].rank}) of {name!r} {src.canonical[name]} overlap without being identical")
        out[name] = distinct
    return out


def _check_canonical(src: Layout, dst: Layout) -> None:
    needed = {b.name for tensors in dst.ranks.values() for lt in tensors.values() for b in lt.blocks}
    for name in sorted(needed):
        if name not in src.canonical:
            raise PlanError(f"tensor {name!r} {dst.canonical[name]} of the destination ({dst.kind}) is not held "
                            f"by the source layout ({src.kind}); e.g. tied vs untied embeddings differ")
        if tuple(src.canonical[name]) != tuple(dst.canonical[name]):
            raise PlanError(f"tensor {name!r} has canonical shape {tuple(src.canonical[name])} in the source "
                            f"({src.kind}) but {tuple(dst.canonical[name])} in the destination ({dst.kind})")


def _merge(transfers: list[Transfer]) -> list[Transfer]:
    """Join consecutive transfers that continue each other along dim 0 in both local tensors (same ranks,
    tensors and column range), e.g. the gate and up halves of ``linear_fc1`` -> ``gate_up_proj``."""
    out: list[Transfer] = []
    for t in transfers:
        if out:
            p = out[-1]
            if (p.src_rank, p.dst_rank, p.src_name, p.dst_name) == (t.src_rank, t.dst_rank, t.src_name, t.dst_name) \
                    and p.size[1:] == t.size[1:] and p.src_start[1:] == t.src_start[1:] \
                    and p.dst_start[1:] == t.dst_start[1:] \
                    and p.src_start[0] + p.size[0] == t.src_start[0] and p.dst_start[0] + p.size[0] == t.dst_start[0]:
                canonical = p.canonical if p.canonical == t.canonical else f"{p.canonical}+{t.canonical}"
                out[-1] = p._replace(size=(p.size[0] + t.size[0], *p.size[1:]), canonical=canonical)
                continue
        out.append(t)
    return out


@functools.lru_cache(maxsize=32)
def plan_reshard(src: Layout, dst: Layout, ranks_per_node: int | None = None) -> Plan:
    """Plan the transfers that fill every local tensor of ``dst`` from the local tensors of ``src``.

    Args:
        src: where the weights are (e.g. :func:`~megarl.models.layout.megatron_layout`).
        dst: where they must go (e.g. :func:`~megarl.models.layout.vllm_layout`,
            :func:`~megarl.models.layout.hf_layout`); may share ranks with ``src`` (colocated) or not.
        ranks_per_node: ranks per node, for the same-node preference among replicas
            (:attr:`megarl.parallel.mesh.ParallelLayout.ranks_per_node`); None: all ranks on one node.

    Returns:
        The :class:`Plan`, cached per ``(src.key, dst.key, ranks_per_node)``. Elements of destination tensors
        covered by no block (vocab padding) are not written.

    Raises:
        PlanError: a canonical tensor the destination needs is missing from the source or has another shape;
            a destination block is not covered by the source; two distinct source boxes overlap; a block lies
            outside its tensor. Layouts that do not fit the model fail earlier, when they are built
            (:class:`~megarl.models.spec.SpecError` from ``megatron_layout``/``vllm_layout``).
    """
    if ranks_per_node is not None and ranks_per_node < 1:
        raise PlanError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    _check_blocks(src, "source")
    _check_blocks(dst, "destination")
    _check_canonical(src, dst)
    boxes = _source_boxes(src)

    def node(rank: int) -> int:
        return rank // ranks_per_node if ranks_per_node else 0

    load: dict[int, int] = defaultdict(int)  # elements each source rank sends to other ranks

    def choose(replicas: list[_Replica], dst_rank: int) -> _Replica:
        for r in replicas:
            if r.rank == dst_rank:
                return r
        near = [r for r in replicas if node(r.rank) == node(dst_rank)]
        return min(near or replicas, key=lambda r: (load[r.rank], r.rank))

    transfers: list[Transfer] = []
    for dst_rank in sorted(dst.ranks):
        for lt in dst.ranks[dst_rank].values():
            for blk in lt.blocks:
                blk_end = _end(blk.src, blk.size)
                covered = 0
                for start, size, replicas in boxes.get(blk.name, ()):
                    lo = tuple(max(a, b) for a, b in zip(start, blk.src))
                    hi = tuple(min(a, b) for a, b in zip(_end(start, size), blk_end))
                    if any(h <= l for l, h in zip(lo, hi)):
                        continue
                    piece = tuple(h - l for l, h in zip(lo, hi))
                    covered += math.prod(piece)
                    rep = choose(replicas, dst_rank)
                    if rep.rank != dst_rank:
                        load[rep.rank] += math.prod(piece)
                    transfers.append(Transfer(
                        rep.rank, dst_rank,
                        rep.local, tuple(l - s + d for l, s, d in zip(lo, rep.block.src, rep.block.dst)),
                        lt.name, tuple(l - s + d for l, s, d in zip(lo, blk.src, blk.dst)),
                        piece, blk.name))
                if covered != blk.numel:
                    raise PlanError(
                        f"destination block {_describe(blk.src, blk.size)} of {blk.name!r} "
                        f"{dst.canonical[blk.name]} (in {lt.name!r} on rank {dst_rank}) is not covered by the "
                        f"source layout: {covered} of {blk.numel} elements are")
    return Plan(src, dst, tuple(_merge(transfers)), ranks_per_node)
