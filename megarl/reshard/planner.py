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

Block-FP8 destinations (a local tensor with :attr:`~megarl.models.layout.LocalTensor.scale`: vLLM's
``quantization: fp8``, :mod:`megarl.models.fp8`). A tile's scale is a function of all its elements, so a tile
is planned whole, as one :class:`Tile`: the pieces of source tensors that make it up (several boxes where it
spans blocks, e.g. two 64-row KV heads that Megatron keeps apart, or Q rows of two query groups) must be read
by one rank, which quantises them while packing. The planner picks, among the source ranks that hold every
piece of the tile, one by the rules above. Where no rank holds them all (the actor's TP split cuts the
tile: a Megatron TP rank ends inside a 128-row block, e.g. ``ffn 8960 / tp 4 = 2240 = 17.5 x 128``), each
piece is sent as is into a gather buffer of the destination rank (:data:`GATHER`, ``[rows, 128]``; the plan
records its rows per rank in :attr:`Plan.gather_rows`), and the destination quantises the gathered tile
itself: correct for every split, at the cost of that tile's unquantised bytes on the wire and
``rows x 128`` source-dtype elements of memory for the gathered tiles only.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from megarl.models.fp8 import BLOCK
from megarl.models.layout import Block, Layout, LocalTensor

GATHER = "megarl.reshard.gather"  # the destination's buffer of gathered block-FP8 tiles (Plan.gather_rows)


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


class TilePart(NamedTuple):
    """One box of a source tensor in a :class:`Tile`: ``size`` elements at ``src_start`` of ``src_name``, placed at
    ``offset`` (row, col) of the tile."""

    src_name: str
    src_start: tuple[int, int]
    size: tuple[int, int]
    offset: tuple[int, int]


class Tile(NamedTuple):
    """One 128 x 128 tile (cut at the tensor's edges) of a block-FP8 destination tensor, quantised by
    ``src_rank`` from its parts and written, E4M3 values and float32 scale, into ``dst_rank``'s tensors.

    Attributes:
        src_rank / dst_rank: global ranks; a gathered tile has ``src_rank == dst_rank`` and one part, read from
            :data:`GATHER`.
        dst_name / dst_start / size: the tile's box in the local E4M3 tensor (start a multiple of 128).
        scale_name / scale_index: the local scale tensor and the tile's element in it (``dst_start / 128``).
        parts: the source boxes.
        canonical: the canonical tensor(s) of the tile, for messages and statistics.
    """

    src_rank: int
    dst_rank: int
    dst_name: str
    dst_start: tuple[int, int]
    size: tuple[int, int]
    scale_name: str
    scale_index: tuple[int, int]
    parts: tuple[TilePart, ...]
    canonical: str

    @property
    def numel(self) -> int:
        return self.size[0] * self.size[1]


@dataclass(frozen=True, eq=False)
class Plan:
    """All transfers of one reshard (every rank's, in one deterministic order).

    Attributes:
        src / dst: the layouts.
        transfers: the transfers, ordered by destination rank, destination tensor (layout order), block;
            pieces of gathered block-FP8 tiles go to :data:`GATHER` of their destination rank.
        ranks_per_node: the node size the replica choice assumed (None: one node).
        tiles: the tiles of block-FP8 destination tensors, in the same order (after ``transfers`` run).
        gather_rows: rows of each rank's :data:`GATHER` buffer (``[rows, 128]``, source dtype; ranks without
            gathered tiles absent).
    """

    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]
    ranks_per_node: int | None
    tiles: tuple[Tile, ...] = ()
    gather_rows: dict = field(default_factory=dict)
    _by_rank: dict = field(default_factory=dict, repr=False, init=False)

    def dst_shape(self, rank: int, name: str) -> tuple[int, ...]:
        """The shape of destination tensor ``name`` of ``rank`` (the :data:`GATHER` buffer included)."""
        if name == GATHER:
            return self.gather_rows[rank], BLOCK
        return self.dst.tensors(rank)[name].shape

    def tiles_for(self, rank: int) -> RankPlan:
        """The tiles that involve ``rank``, as :class:`RankPlan` (``local``: quantised here for here; ``sends``:
        quantised here for another rank; ``recvs``: quantised elsewhere for here)."""
        key = ("tiles", rank)
        if key not in self._by_rank:
            self._by_rank[key] = RankPlan(
                tuple(t for t in self.tiles if t.src_rank == rank and t.dst_rank == rank),
                tuple(t for t in self.tiles if t.src_rank == rank and t.dst_rank != rank),
                tuple(t for t in self.tiles if t.dst_rank == rank and t.src_rank != rank))
        return self._by_rank[key]

    def for_rank(self, rank: int) -> RankPlan:
        """The transfers that involve ``rank`` (cached)."""
        if rank not in self._by_rank:
            self._by_rank[rank] = RankPlan(
                tuple(t for t in self.transfers if t.src_rank == rank and t.dst_rank == rank),
                tuple(t for t in self.transfers if t.src_rank == rank and t.dst_rank != rank),
                tuple(t for t in self.transfers if t.dst_rank == rank and t.src_rank != rank))
        return self._by_rank[rank]

    def elements(self, rank: int) -> dict[str, int]:
        """Elements ``rank`` sends, receives and copies (or quantises) locally: ``{"sent", "received", "local"}``
        (transfers and tiles)."""
        out = {}
        for part in (self.for_rank(rank), self.tiles_for(rank)):
            for key, items in zip(("local", "sent", "received"), part):
                out[key] = out.get(key, 0) + sum(t.numel for t in items)
        return {k: out[k] for k in ("sent", "received", "local")}


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
        src: where the weights are (e.g. :func:`~megarl.models.layout_megatron.megatron_layout`).
        dst: where they must go (e.g. :func:`~megarl.models.layout_vllm.vllm_layout`,
            :func:`~megarl.models.layout.hf_layout`); may share ranks with ``src`` (colocated) or not.
        ranks_per_node: ranks per node, for the same-node preference among replicas
            (:attr:`megarl.parallel.mesh.ParallelLayout.ranks_per_node`); None: all ranks on one node.

    Returns:
        The :class:`Plan`, cached per ``(src.key, dst.key, ranks_per_node)``. Elements of destination tensors
        covered by no block (vocab padding) are not written. Block-FP8 destination tensors are planned as
        :attr:`Plan.tiles` (module docstring).

    Raises:
        PlanError: a canonical tensor the destination needs is missing from the source or has another shape;
            a destination block is not covered by the source; two distinct source boxes overlap; a block lies
            outside its tensor; a block-FP8 destination tensor that is not 2-D or whose tiles its blocks do not
            cover. Layouts that do not fit the model fail earlier, when they are built
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

    def cover(name: str, start: tuple[int, ...], size: tuple[int, ...]):
        """The pieces of canonical box ``start, size`` of ``name``: ``(start, size, replicas)`` per source box
        it meets, and the elements covered."""
        end = _end(start, size)
        out, covered = [], 0
        for b_start, b_size, replicas in boxes.get(name, ()):
            lo = tuple(max(a, b) for a, b in zip(b_start, start))
            hi = tuple(min(a, b) for a, b in zip(_end(b_start, b_size), end))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            piece = tuple(h - l for l, h in zip(lo, hi))
            covered += math.prod(piece)
            out.append((lo, piece, replicas))
        return out, covered

    def local_start(rep: _Replica, lo: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(l - s + d for l, s, d in zip(lo, rep.block.src, rep.block.dst))

    def uncovered(blk: Block, lt: LocalTensor, dst_rank: int, covered: int, numel: int) -> PlanError:
        return PlanError(f"destination block {_describe(blk.src, blk.size)} of {blk.name!r} {dst.canonical[blk.name]} "
                         f"(in {lt.name!r} on rank {dst_rank}) is not covered by the source layout: {covered} of "
                         f"{numel} elements are")

    transfers: list[Transfer] = []
    tiles: list[Tile] = []
    gather_rows: dict[int, int] = defaultdict(int)

    def plan_tile(lt: LocalTensor, dst_rank: int, t_start: tuple[int, int], t_size: tuple[int, int]) -> None:
        t_end = _end(t_start, t_size)
        pieces = []  # (canonical name, canonical start, size, replicas, offset in the tile)
        for blk in lt.blocks:
            lo = tuple(max(a, b) for a, b in zip(blk.dst, t_start))
            hi = tuple(min(a, b) for a, b in zip(_end(blk.dst, blk.size), t_end))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            c_start = tuple(l - d + s for l, d, s in zip(lo, blk.dst, blk.src))
            found, covered = cover(blk.name, c_start, tuple(h - l for l, h in zip(lo, hi)))
            if covered != math.prod(h - l for l, h in zip(lo, hi)):
                raise uncovered(blk, lt, dst_rank, covered, math.prod(h - l for l, h in zip(lo, hi)))
            for p_lo, piece, replicas in found:
                offset = tuple(pl - cs + l - ts for pl, cs, l, ts in zip(p_lo, c_start, lo, t_start))
                pieces.append((blk.name, p_lo, piece, replicas, offset))
        if sum(math.prod(p[2]) for p in pieces) != math.prod(t_size):
            raise PlanError(f"tile {_describe(t_start, t_size)} of the block-FP8 tensor {lt.name!r} on rank {dst_rank} "
                            "is not covered by the tensor's blocks (every element of a quantised tensor must be)")
        canonical = "+".join(dict.fromkeys(p[0] for p in pieces))
        scale = (lt.scale, (t_start[0] // BLOCK, t_start[1] // BLOCK))
        holders = set.intersection(*({r.rank for r in p[3]} for p in pieces))
        if holders:
            chosen = choose([r for r in pieces[0][3] if r.rank in holders], dst_rank).rank
            if chosen != dst_rank:
                load[chosen] += math.prod(t_size)
            parts = []
            for name, p_lo, piece, replicas, offset in pieces:
                rep = next(r for r in replicas if r.rank == chosen)
                parts.append(TilePart(rep.local, local_start(rep, p_lo), piece, offset))
            tiles.append(Tile(chosen, dst_rank, lt.name, t_start, t_size, *scale, tuple(parts), canonical))
            return
        row = gather_rows[dst_rank]  # no rank holds the whole tile: gather its pieces on the destination
        gather_rows[dst_rank] += t_size[0]
        for name, p_lo, piece, replicas, offset in pieces:
            rep = choose(replicas, dst_rank)
            if rep.rank != dst_rank:
                load[rep.rank] += math.prod(piece)
            transfers.append(Transfer(rep.rank, dst_rank, rep.local, local_start(rep, p_lo), GATHER,
                                      (row + offset[0], offset[1]), piece, name))
        tiles.append(Tile(dst_rank, dst_rank, lt.name, t_start, t_size, *scale,
                          (TilePart(GATHER, (row, 0), t_size, (0, 0)),), canonical))

    for dst_rank in sorted(dst.ranks):
        for lt in dst.ranks[dst_rank].values():
            if lt.scale is not None:
                if len(lt.shape) != 2:
                    raise PlanError(f"block-FP8 tensor {lt.name!r} on rank {dst_rank} has shape {lt.shape}; block "
                                    "quantisation is defined for 2-D tensors")
                for r0 in range(0, lt.shape[0], BLOCK):
                    for c0 in range(0, lt.shape[1], BLOCK):
                        plan_tile(lt, dst_rank, (r0, c0), (min(BLOCK, lt.shape[0] - r0), min(BLOCK, lt.shape[1] - c0)))
                continue
            for blk in lt.blocks:
                found, covered = cover(blk.name, blk.src, blk.size)
                if covered != blk.numel:
                    raise uncovered(blk, lt, dst_rank, covered, blk.numel)
                for lo, piece, replicas in found:
                    rep = choose(replicas, dst_rank)
                    if rep.rank != dst_rank:
                        load[rep.rank] += math.prod(piece)
                    transfers.append(Transfer(rep.rank, dst_rank, rep.local, local_start(rep, lo), lt.name,
                                              tuple(l - s + d for l, s, d in zip(lo, blk.src, blk.dst)), piece,
                                              blk.name))
    return Plan(src, dst, tuple(_merge(transfers)), ranks_per_node, tuple(tiles), dict(gather_rows))
