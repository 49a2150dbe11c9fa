"""Block-FP8 destinations in the reshard: each rank's tiles and tile rounds, compiled (cached with the plan) for
:func:`megarl.reshard.executor.execute_plan`.

Block-FP8 destinations (:attr:`Plan.tiles <megarl.reshard.planner.Plan.tiles>`) run after the transfers: the
tiles a rank quantises for itself in one batched call (:class:`~megarl.reshard.quantize.QuantBatch`, straight
from the source tensors, or from the gather buffer for gathered tiles), the others in rounds of their own:
the quantising rank packs each tile's E4M3 bytes and float32 scale into its staging buffer (the quantisation
*is* the pack: one read of the source, one write of a byte an element), one message per peer and round
carries ``[scales | tile bytes ...]`` (each part 16-byte aligned), and the receiver copies bytes and scales
into the engine's tensors. A round stages at most ``bucket_bytes`` per rank, and at least one tile. So an
FP8 destination moves one byte an element (plus 4 bytes a 128 x 128 tile) instead of the source's two.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import NamedTuple

from megarl.reshard.boxcopy import Box, BoxBatch
from megarl.reshard.planner import GATHER, Plan, Tile
from megarl.reshard.quantize import QuantBatch, TileJob
from megarl.reshard.rounds import SCAN, STAGING, Message

TILE_ALIGN = 16  # bytes: every part of a tile message starts at a multiple of this (vector copies, float32 scales)
STAGING_F32 = "staging.f32"  # the staging buffer seen as float32 (the tiles' scales)


def _aligned(n: int) -> int:
    return -(-n // TILE_ALIGN) * TILE_ALIGN


def _tile_bytes(t: Tile) -> int:
    """Staged bytes of one remote tile: its E4M3 values and its scale, each aligned."""
    return _aligned(t.numel) + TILE_ALIGN


@functools.lru_cache(maxsize=32)
def _tile_schedule(plan: Plan, bucket_bytes: int) -> tuple[tuple[Tile, ...], ...]:
    """Every rank's remote tiles assigned to rounds (the same on every rank), in plan order, first fit: each
    rank stages at most ``bucket_bytes`` (sends plus receives) a round, and a round takes at least one tile."""
    rounds: list[list[Tile]] = []
    staged: list[dict[int, int]] = []
    first = 0  # rounds before it are (almost) full for every rank
    for t in plan.tiles:
        if t.src_rank == t.dst_rank:
            continue
        n = _tile_bytes(t)
        k = first
        while k < len(rounds) and not all(staged[k][r] + n <= bucket_bytes for r in (t.src_rank, t.dst_rank)):
            k += 1
        if k == len(rounds):
            rounds.append([])
            staged.append(defaultdict(int))
        rounds[k].append(t)
        for r in (t.src_rank, t.dst_rank):
            staged[k][r] += n
        while first < len(rounds) and k - first > SCAN:
            first += 1
    return tuple(tuple(r) for r in rounds)


def _part_key(name: str) -> tuple[str, str]:
    """The key a tile part's tensor is bound to: the gather buffer is a destination-side tensor."""
    return ("dst", GATHER) if name == GATHER else ("src", name)


def _tile_job(t: Tile, dst: Box, scale: Box) -> TileJob:
    return TileJob(dst, scale, tuple((Box(_part_key(p.src_name), p.src_start, p.size), p.offset) for p in t.parts))


class TileRound(NamedTuple):
    """One round of remote tiles seen from one rank; offsets and sizes in bytes."""

    pack: QuantBatch  # source parts -> staging (E4M3 bytes and scales)
    unpack: BoxBatch  # staging -> the engine's E4M3 tensors (as uint8) and scale tensors
    messages: tuple[Message, ...]
    staging: int


@functools.lru_cache(maxsize=64)
def rank_tiles(plan: Plan, rank: int, bucket_bytes: int) -> tuple[QuantBatch, tuple[TileRound, ...]]:
    """This rank's block-FP8 work, compiled (cached with the plan): the tiles it quantises for itself, and its
    rounds of :func:`_tile_schedule` (staging layout: sends by peer ascending, then receives; each peer's
    message ``[scales | tile bytes ...]``)."""
    local = QuantBatch([_tile_job(t, Box(("dst", t.dst_name), t.dst_start, t.size),
                                  Box(("dst", t.scale_name), t.scale_index, (1, 1)))
                        for t in plan.tiles_for(rank).local])
    rounds = []
    for tiles in _tile_schedule(plan, bucket_bytes):
        by_peer: dict[bool, dict[int, list[Tile]]] = {True: defaultdict(list), False: defaultdict(list)}
        for t in tiles:
            if t.src_rank == rank:
                by_peer[True][t.dst_rank].append(t)
            elif t.dst_rank == rank:
                by_peer[False][t.src_rank].append(t)
        if not by_peer[True] and not by_peer[False]:
            continue
        offset, messages, pack, unpack = 0, [], [], []
        for send in (True, False):
            for peer in sorted(by_peer[send]):
                mine = by_peer[send][peer]
                start = offset
                scales = offset
                offset += _aligned(4 * len(mine))
                for i, t in enumerate(mine):
                    values = Box(STAGING, (offset,), t.size, True)
                    scale = Box(STAGING_F32, ((scales + 4 * i) // 4,), (1,), True)
                    if send:
                        pack.append(_tile_job(t, values, scale))
                    else:
                        unpack += [(values, Box(("dst8", t.dst_name), t.dst_start, t.size)),
                                   (scale, Box(("dst", t.scale_name), t.scale_index, (1, 1)))]
                    offset += _aligned(t.numel)
                messages.append(Message(send, peer, STAGING, start, offset - start))
        rounds.append(TileRound(QuantBatch(pack), BoxBatch(unpack), tuple(messages), offset))
    return local, tuple(rounds)
