"""The reshard's schedule: a :class:`~megarl.reshard.planner.Plan`'s transfers assigned to communication
rounds, and each rank's part of every round compiled into box copies and messages (cached with the plan); run by
:func:`megarl.reshard.executor.execute_plan`.

Every rank knows the whole plan, so every rank derives the same schedule without talking:

- transfers whose source and destination are this rank are copied region to region (batched box copies, no
  staging buffer), spread over the rounds so that they overlap the transfers too;
- the other transfers are cut into pieces and assigned, in plan order, first fit, to rounds. A piece's end
  (its box in the source or the destination tensor) is *direct* when the box is one contiguous run of
  memory (whole rows, or one row) and the piece is at least ``direct_min_bytes``: it is sent straight from
  the source tensor or received straight into the destination tensor, as one message of its own. Every
  other end is *staged*: packed into (or unpacked out of) the rank's staging buffer, and the pieces staged
  at both ends travel as one message per peer. In every round every rank stages at most ``bucket_bytes``
  (sends plus receives; staged pieces are at most half of that) and moves at most
  ``max(bucket_bytes, ROUND_MIN_BYTES)``.

The executor runs a round as one batched box copy packing every staged send end, the round's messages, one
batched box copy unpacking every staged receive end (:class:`Round`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import NamedTuple

from megarl.reshard.boxcopy import Box, BoxBatch
from megarl.reshard.planner import GATHER, Plan, Transfer

ROUND_MIN_BYTES = 128 << 20  # a round may move this much per rank through direct ends, whatever the bucket
SCAN = 32  # rounds a piece may be placed back from the newest open one (bounds the schedule's cost)
STAGING = "staging"  # the key of the staging buffer in the copy batches


class Piece(NamedTuple):
    """One scheduled piece of a remote transfer and how each of its ends travels.

    Attributes:
        t: the box (a transfer or a part of one).
        src_direct / dst_direct: the end is sent from the source tensor / received into the destination
            tensor as is (else packed / unpacked through the staging buffer).
    """

    t: Transfer
    src_direct: bool
    dst_direct: bool

    @property
    def own_message(self) -> bool:
        """The piece travels as a message of its own (else bundled with the peer's other staged pieces)."""
        return self.src_direct or self.dst_direct


class Message(NamedTuple):
    """One send or receive of a round on one rank: ``elements`` (wire dtype) at ``offset`` of the tensor bound
    to ``key`` (the staging buffer, or a direct source / destination tensor taken flat)."""

    send: bool
    peer: int
    key: object
    offset: int
    elements: int


class Round(NamedTuple):
    """One round seen from one rank; offsets and sizes in wire elements."""

    pack: BoxBatch  # source boxes -> staging
    unpack: BoxBatch  # staging -> destination boxes
    messages: tuple[Message, ...]  # per peer in order: the bundle of staged pieces, then pieces of their own
    staging: int  # elements (packed plus unpacked)


def _split(t: Transfer, max_elems: int) -> list[Transfer]:
    """Cut a transfer into boxes of at most ``max_elems`` elements: groups of whole rows, or pieces of one
    row where a row alone is larger."""
    if t.numel <= max_elems:
        return [t]
    r, d, sn, dn, c = t.src_rank, t.dst_rank, t.src_name, t.dst_name, t.canonical
    if len(t.size) == 1:
        (s0,), (d0,), (n,) = t.src_start, t.dst_start, t.size
        return [Transfer(r, d, sn, (s0 + i,), dn, (d0 + i,), (min(max_elems, n - i),), c)
                for i in range(0, n, max_elems)]
    rows, cols = t.size
    (s0, s1), (d0, d1) = t.src_start, t.dst_start
    if cols <= max_elems:
        step = max_elems // cols
        return [Transfer(r, d, sn, (s0 + i, s1), dn, (d0 + i, d1), (min(step, rows - i), cols), c)
                for i in range(0, rows, step)]
    return [Transfer(r, d, sn, (s0 + i, s1 + j), dn, (d0 + i, d1 + j), (1, min(max_elems, cols - j)), c)
            for i in range(rows) for j in range(0, cols, max_elems)]


def _contiguous(size: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A box of ``size`` in a (row-major, contiguous) local tensor of ``shape`` is one run of memory."""
    return len(shape) == 1 or size[0] == 1 or size[1] == shape[1]


def _pieces(plan: Plan, t: Transfer, elem_size: int, cap: int, vcap: int, direct_min_bytes: int | None
            ) -> list[Piece]:
    """The pieces of a remote transfer: at most ``cap / 2`` elements where an end is staged, ``vcap / 2``
    where both are direct."""
    src_ok = dst_ok = False
    src_shape = plan.src.tensors(t.src_rank)[t.src_name].shape
    dst_shape = plan.dst_shape(t.dst_rank, t.dst_name)
    if direct_min_bytes is not None and t.numel * elem_size >= direct_min_bytes:
        src_ok = _contiguous(t.size, src_shape)
        dst_ok = _contiguous(t.size, dst_shape)
    if src_ok and dst_ok:
        return [Piece(p, True, True) for p in _split(t, max(1, vcap // 2))]
    return [Piece(p, src_ok and _contiguous(p.size, src_shape), dst_ok and _contiguous(p.size, dst_shape))
            for p in _split(t, max(1, cap // 2))]


@functools.lru_cache(maxsize=32)
def _schedule(plan: Plan, elem_size: int, bucket_bytes: int, direct_min_bytes: int | None = None
              ) -> tuple[tuple[Piece, ...], ...]:
    """Every rank's remote pieces assigned to rounds (the same on every rank), in plan order: each piece goes
    to the first round where both its ranks still have room (each rank stages at most ``bucket_bytes`` and
    moves at most ``max(bucket_bytes, ROUND_MIN_BYTES)`` per round; without direct ends both bounds are the
    bucket), looking at most ``SCAN`` rounds past the first one still open to both, else to a new round
    (then the first open round of an end that had room in none of them moves on by one). A round is open to a
    rank's direct end while it can move more, to a staged end while it can also stage more, so direct pieces fill
    the rounds whose staging is full."""
    cap = bucket_bytes // elem_size
    vcap = cap if direct_min_bytes is None else max(bucket_bytes, ROUND_MIN_BYTES) // elem_size
    slack = max(1, cap // 32)
    rounds: list[list[Piece]] = []
    staged: list[dict[int, int]] = []
    moved: list[dict[int, int]] = []
    # per (rank, staged end?): the rounds before it have (almost) no room left for such an end
    first_open: dict[tuple[int, bool], int] = defaultdict(int)

    def room(k: int, end: tuple[int, bool], n: int) -> bool:
        r, is_staged = end
        return moved[k][r] + n <= vcap and (not is_staged or staged[k][r] + n <= cap)

    for t in plan.transfers:
        if t.src_rank == t.dst_rank:
            continue
        for p in _pieces(plan, t, elem_size, cap, vcap, direct_min_bytes):
            ends = ((p.t.src_rank, not p.src_direct), (p.t.dst_rank, not p.dst_direct))
            start = max(first_open[e] for e in ends)
            stop = min(len(rounds), start + SCAN)
            k = start
            while k < stop and not (room(k, ends[0], p.t.numel) and room(k, ends[1], p.t.numel)):
                k += 1
            if k == stop:
                if start + SCAN <= len(rounds):  # an end that had room in none of them: its pointer moves on
                    for e in ends:
                        if not any(room(j, e, p.t.numel) for j in range(start, stop)):
                            first_open[e] = max(first_open[e], start + 1)
                k = len(rounds)
                rounds.append([])
                staged.append(defaultdict(int))
                moved.append(defaultdict(int))
            rounds[k].append(p)
            for r, is_staged in ends:
                moved[k][r] += p.t.numel
                staged[k][r] += p.t.numel if is_staged else 0
                for kind in (False, True):
                    e = (r, kind)
                    while first_open[e] < len(rounds) and (moved[first_open[e]][r] > vcap - slack or
                                                           (kind and staged[first_open[e]][r] > cap - slack)):
                        first_open[e] += 1
    return tuple(tuple(r) for r in rounds)


def _flat_offset(start: tuple[int, ...], shape: tuple[int, ...]) -> int:
    return start[0] if len(shape) == 1 else start[0] * shape[1] + start[1]


@functools.lru_cache(maxsize=64)
def rank_rounds(plan: Plan, rank: int, elem_size: int, bucket_bytes: int, direct_min_bytes: int | None = None
                 ) -> tuple[Round, ...]:
    """The rounds of :func:`_schedule` in which ``rank`` sends or receives: its staging layout (send ends by
    peer ascending, each peer's bundle then its own-message pieces, then the receive ends likewise), its
    messages and its pack and unpack copies compiled (cached with the plan)."""
    out = []
    src_shapes = {n: lt.shape for n, lt in plan.src.tensors(rank).items()}
    dst_shapes = {n: lt.shape for n, lt in plan.dst.tensors(rank).items()}
    if rank in plan.gather_rows:
        dst_shapes[GATHER] = plan.dst_shape(rank, GATHER)
    for pieces in _schedule(plan, elem_size, bucket_bytes, direct_min_bytes):
        by_peer: dict[bool, dict[int, list[Piece]]] = {True: defaultdict(list), False: defaultdict(list)}
        for p in pieces:
            if p.t.src_rank == rank:
                by_peer[True][p.t.dst_rank].append(p)
            elif p.t.dst_rank == rank:
                by_peer[False][p.t.src_rank].append(p)
        if not by_peer[True] and not by_peer[False]:
            continue
        offset = 0
        messages: list[Message] = []
        pack, unpack = [], []
        for send in (True, False):
            for peer in sorted(by_peer[send]):
                mine = by_peer[send][peer]
                bundle = [p for p in mine if not p.own_message]
                if bundle:
                    messages.append(Message(send, peer, STAGING, offset, sum(p.t.numel for p in bundle)))
                for p in bundle + [p for p in mine if p.own_message]:
                    t = p.t
                    direct = p.src_direct if send else p.dst_direct
                    if direct:
                        name, start, shapes = (t.src_name, t.src_start, src_shapes) if send else \
                            (t.dst_name, t.dst_start, dst_shapes)
                        messages.append(Message(send, peer, ("src" if send else "dst", name),
                                                _flat_offset(start, shapes[name]), t.numel))
                        continue
                    if p.own_message:
                        messages.append(Message(send, peer, STAGING, offset, t.numel))
                    staged = Box(STAGING, (offset,), t.size, True)
                    if send:
                        pack.append((Box(("src", t.src_name), t.src_start, t.size), staged))
                    else:
                        unpack.append((staged, Box(("dst", t.dst_name), t.dst_start, t.size)))
                    offset += t.numel
        out.append(Round(BoxBatch(pack), BoxBatch(unpack), tuple(messages), offset))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def local_parts(plan: Plan, rank: int, parts: int) -> tuple[BoxBatch, ...]:
    """The same-rank copies of ``rank`` in ``parts`` batches of about equal elements (whole transfers, plan
    order), compiled (cached with the plan)."""
    local = plan.for_rank(rank).local
    total = sum(t.numel for t in local)
    batches: list[list[tuple[Box, Box]]] = [[] for _ in range(parts)]
    done = 0
    for t in local:
        part = min(parts - 1, done * parts // max(total, 1))
        batches[part].append((Box(("src", t.src_name), t.src_start, t.size),
                              Box(("dst", t.dst_name), t.dst_start, t.size)))
        done += t.numel
    return tuple(BoxBatch(b) for b in batches)
