"""The reshard executor: runs a :class:`~megarl.reshard.planner.Plan` on this rank, bucket by bucket, with the
transfers of one round overlapping the pack of the next and the unpack of the last.

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
  ``max(bucket_bytes, ROUND_MIN_BYTES)``;
- a round is: one batched box copy packing every staged send end, the round's messages in one
  ``torch.distributed.batch_isend_irecv`` (NCCL on GPU, gloo on CPU), one batched box copy unpacking every
  staged receive end into the destination tensors.

Overlap (CUDA): packs, messages and unpacks run on three streams, round ``k`` in staging buffer ``k % 2``;
the pack of round ``k + 1`` waits only for the unpack of round ``k - 1`` (its buffer's last user), so round
``k``'s messages overlap the pack of ``k + 1`` and the unpack of ``k - 1``. On CPU (and with ``profile``) the
same schedule runs in order.

Merged LoRA weights (a destination layout of :func:`~megarl.models.layout_lora.with_lora_merge`): the plan also fills
each merged tensor's auxiliary tensors (its rows of ``B``, its columns of ``A``, in the wire dtype, allocated
here), and once every transfer has landed each merge writes ``W + (alpha / r) B A`` into the engine's tensor in
place (:func:`megarl.models.lora.apply_merges`: fp64, one rounding to the tensor's dtype).

Block-FP8 destinations (:attr:`Plan.tiles <megarl.reshard.planner.Plan.tiles>`) run after the transfers: the
tiles a rank quantises for itself in one batched call (:class:`~megarl.reshard.quantize.QuantBatch`, straight
from the source tensors, or from the gather buffer for gathered tiles), the others in rounds of their own:
the quantising rank packs each tile's E4M3 bytes and float32 scale into its staging buffer (the quantisation
*is* the pack: one read of the source, one write of a byte an element), one message per peer and round
carries ``[scales | tile bytes ...]`` (each part 16-byte aligned), and the receiver copies bytes and scales
into the engine's tensors. A round stages at most ``bucket_bytes`` per rank, and at least one tile. So an
FP8 destination moves one byte an element (plus 4 bytes a 128 x 128 tile) instead of the source's two.

Extra memory of a rank: two staging buffers (one with a single round) of at most ``bucket_bytes`` each, plus
the descriptor tables of the copies (bookkeeping), with merges the auxiliary adapter tensors (adapter-sized)
and one merge chunk, and with gathered FP8 tiles their gather buffer (``Plan.gather_rows[rank] x 128``
elements), accounted in :class:`ReshardStats`. Bytes travel in the
wire dtype (the source tensors' dtype unless given); a destination of another dtype (e.g. fp32 master weights
into a bf16 engine) is cast on unpack, by torch, and then no end is direct (all ranks agree on that).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import torch
import torch.distributed as dist

from megarl.models.fp8 import FP8_DTYPE
from megarl.models.layout import LocalTensor
from megarl.models.lora import MERGE_CHUNK_BYTES, apply_merges
from megarl.reshard.boxcopy import Box, BoxBatch
from megarl.reshard.planner import GATHER, Plan, Tile, Transfer
from megarl.reshard.quantize import QuantBatch, TileJob

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20
MIN_BUCKET_BYTES = 64
ROUND_MIN_BYTES = 128 << 20  # a round may move this much per rank through direct ends, whatever the bucket
DIRECT_MIN_BYTES = 256 << 10  # smaller pieces travel staged, bundled per peer (one message each costs more)
LOCAL_PARTS = 64  # the same-rank copies are issued in at most this many parts, spread over the rounds
_SCAN = 32  # rounds a piece may be placed back from the newest open one (bounds the schedule's cost)

# dtypes the executor can agree on across ranks (by index); extend when a new wire dtype appears
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.int8, torch.uint8, torch.int32, torch.int64)

_logged_cast = False


@dataclass
class ReshardStats:
    """What one rank did in one :func:`execute_plan`.

    Attributes:
        rank: global rank.
        bytes_sent / bytes_received: bytes this rank moved to / from other ranks (wire dtype).
        bytes_copied_local: bytes of same-rank region copies (destination dtype).
        bytes_staged: bytes this rank packed plus unpacked (the rest of its traffic went direct).
        rounds: communication rounds this rank took part in (block-FP8 tile rounds included).
        tiles_quantized: block-FP8 tiles this rank quantised (for itself or for a peer).
        direct: whether direct ends were used (all ranks agree).
        peak_staging_bytes: bytes of this rank's staging buffers (two, double-buffered; one when it has one
            round), each at most the bucket.
        bookkeeping_bytes: largest descriptor tables allocated for the copies of one round (host and device).
        merge_bytes: the LoRA merges' auxiliary adapter tensors plus one fp64 merge chunk (0 without merges).
        times_s: wall seconds per phase: ``"local"``, ``"pack"``, ``"comm"``, ``"unpack"`` (summed over
            rounds; exact only with ``profile=True``, which runs the phases one after the other), ``"merge"``
            (the LoRA merges), ``"quantize"`` (the block-FP8 tiles, all of it) and ``"total"`` (always exact).
    """

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_local: int = 0
    bytes_staged: int = 0
    rounds: int = 0
    tiles_quantized: int = 0
    direct: bool = False
    peak_staging_bytes: int = 0
    bookkeeping_bytes: int = 0
    merge_bytes: int = 0
    times_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("local", "pack", "comm", "unpack", "merge", "quantize", "total"), 0.0))

    @property
    def peak_extra_bytes(self) -> int:
        """Peak memory beyond the source and destination tensors: staging, bookkeeping and the merges' adapter
        tensors, bytes."""
        return self.peak_staging_bytes + self.bookkeeping_bytes + self.merge_bytes


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


class _Round(NamedTuple):
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
    bucket), looking at most ``_SCAN`` rounds past the first one still open to both, else to a new round
    (then the first open round of an end that had room in none of them moves on by one). A round is open to a rank's direct end while it can
    move more, to a staged end while it can also stage more, so direct pieces fill the rounds whose staging is
    full."""
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
            stop = min(len(rounds), start + _SCAN)
            k = start
            while k < stop and not (room(k, ends[0], p.t.numel) and room(k, ends[1], p.t.numel)):
                k += 1
            if k == stop:
                if start + _SCAN <= len(rounds):  # an end that had room in none of them: its pointer moves on
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
def _rank_rounds(plan: Plan, rank: int, elem_size: int, bucket_bytes: int, direct_min_bytes: int | None = None
                 ) -> tuple[_Round, ...]:
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
        out.append(_Round(BoxBatch(pack), BoxBatch(unpack), tuple(messages), offset))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _local_parts(plan: Plan, rank: int, parts: int) -> tuple[BoxBatch, ...]:
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
        while first < len(rounds) and k - first > _SCAN:
            first += 1
    return tuple(tuple(r) for r in rounds)


def _part_key(name: str) -> tuple[str, str]:
    """The key a tile part's tensor is bound to: the gather buffer is a destination-side tensor."""
    return ("dst", GATHER) if name == GATHER else ("src", name)


def _tile_job(t: Tile, dst: Box, scale: Box) -> TileJob:
    return TileJob(dst, scale, tuple((Box(_part_key(p.src_name), p.src_start, p.size), p.offset) for p in t.parts))


class _TileRound(NamedTuple):
    """One round of remote tiles seen from one rank; offsets and sizes in bytes."""

    pack: QuantBatch  # source parts -> staging (E4M3 bytes and scales)
    unpack: BoxBatch  # staging -> the engine's E4M3 tensors (as uint8) and scale tensors
    messages: tuple[Message, ...]
    staging: int


@functools.lru_cache(maxsize=64)
def _rank_tiles(plan: Plan, rank: int, bucket_bytes: int) -> tuple[QuantBatch, tuple[_TileRound, ...]]:
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
        rounds.append(_TileRound(QuantBatch(pack), BoxBatch(unpack), tuple(messages), offset))
    return local, tuple(rounds)


def _check_fp8(dst_tensors: Mapping[str, torch.Tensor], tiles, rank: int) -> None:
    """Block-FP8 destinations are E4M3 (or raw uint8) and their scales float32."""
    for t in tiles:
        for name, ok, want in ((t.dst_name, (FP8_DTYPE, torch.uint8), "float8_e4m3fn"),
                               (t.scale_name, (torch.float32,), "float32")):
            if dst_tensors[name].dtype not in ok:
                raise ValueError(f"rank {rank}: block-FP8 destination tensor {name!r} is {dst_tensors[name].dtype}, "
                                 f"expected {want}")


def _run_tiles(plan: Plan, rank: int, bound: dict, group, device: torch.device, bucket_bytes: int,
               use_extension: bool | None, stats: "ReshardStats") -> None:
    """Quantise this rank's block-FP8 tiles (module docstring), on the current stream; updates ``stats``."""
    local, rounds = _rank_tiles(plan, rank, bucket_bytes)
    mine = plan.tiles_for(rank)
    booked = local.run(bound, use_extension)
    stats.tiles_quantized = len(mine.local) + len(mine.sends)
    stats.bytes_copied_local += sum(t.numel + 4 for t in mine.local)
    size = max((r.staging for r in rounds), default=0)
    if not rounds:
        stats.bookkeeping_bytes = max(stats.bookkeeping_bytes, booked)
        return
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    bound[STAGING] = buffer
    bound[STAGING_F32] = buffer[:size // 4 * 4].view(torch.float32)
    stats.peak_staging_bytes = max(stats.peak_staging_bytes, size)
    for rd in rounds:
        booked = max(booked, rd.pack.run(bound, use_extension))
        ops = [dist.P2POp(dist.isend if m.send else dist.irecv, buffer[m.offset:m.offset + m.elements], m.peer, group)
               for m in rd.messages]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for m in rd.messages:
            if m.send:
                stats.bytes_sent += m.elements
            else:
                stats.bytes_received += m.elements
        booked = max(booked, rd.unpack.run(bound, use_extension))
        stats.bytes_staged += rd.staging
    stats.rounds += len(rounds)
    stats.bookkeeping_bytes = max(stats.bookkeeping_bytes, booked)
    del bound[STAGING], bound[STAGING_F32]


def _check_tensors(given: Mapping[str, torch.Tensor], layout: Mapping[str, LocalTensor], names: set[str],
                   which: str, rank: int) -> None:
    for name in sorted(names):
        if name not in given:
            raise ValueError(f"rank {rank}: {which} tensor {name!r} of the plan is missing "
                             f"({len(given)} {which} tensors given)")
        t, want = given[name], layout[name].shape
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"rank {rank}: {which} tensor {name!r} has shape {tuple(t.shape)}, the layout says "
                             f"{tuple(want)}")
        if t.stride(-1) != 1:
            raise ValueError(f"rank {rank}: {which} tensor {name!r} has last-dim stride {t.stride(-1)}; the "
                             "reshard needs rows of contiguous elements")


def _agree_wire_dtype(dtypes: set[torch.dtype], group, device: torch.device, rank: int) -> torch.dtype:
    """The dtype every sending rank sends in: its source tensors' dtype, checked equal on all ranks of the
    group (one all-reduce of two int64)."""
    if len(dtypes) > 1:
        raise ValueError(f"rank {rank}: the source tensors to send have several dtypes {sorted(map(str, dtypes))}; "
                         "pass wire_dtype")
    unknown = [d for d in dtypes if d not in _WIRE_DTYPES]
    if unknown:
        raise ValueError(f"rank {rank}: source dtype {unknown[0]} is not a known wire dtype; pass wire_dtype")
    code = _WIRE_DTYPES.index(next(iter(dtypes))) + 1 if dtypes else 0
    codes = torch.tensor([code, -code if code else -len(_WIRE_DTYPES) - 1], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
    high, low = int(codes[0]), -int(codes[1])
    if high == 0:
        return torch.float32  # no rank sends anything
    if high != low:
        raise ValueError(f"the ranks send source tensors of different dtypes ({_WIRE_DTYPES[low - 1]} and "
                         f"{_WIRE_DTYPES[high - 1]}); convert them or pass one wire_dtype")
    return _WIRE_DTYPES[high - 1]


def _agree_direct(ok: bool, group, device: torch.device) -> bool:
    """True when every rank of the group can use its direct ends (one all-reduce of one int64)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag[0]) == 0


def _device_of(tensors: list[torch.Tensor], group) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the reshard's tensors on one rank must share a device, got {sorted(map(str, devices))}")
    if devices:
        return devices.pop()
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@functools.lru_cache(maxsize=8)
def _streams(device: torch.device) -> tuple:
    """The pack, message and unpack streams of a CUDA device (made once)."""
    return tuple(torch.cuda.Stream(device) for _ in range(3))


def execute_plan(plan: Plan, src_tensors: Mapping[str, torch.Tensor], dst_tensors: Mapping[str, torch.Tensor], *,
                 rank: int | None = None, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wire_dtype: torch.dtype | None = None, use_extension: bool | None = None,
                 direct_min_bytes: int | None = DIRECT_MIN_BYTES, profile: bool = False) -> ReshardStats:
    """Run this rank's part of ``plan``: write every destination block of this rank, in place.

    Call it on every rank of ``group`` (SPMD; ranks in neither layout return at once when ``wire_dtype`` is
    given and ``direct_min_bytes`` is None). With NCCL, the group must have run one collective before (a
    ``batch_isend_irecv`` rule); the agreements on the wire dtype and on direct ends are such collectives.

    Args:
        plan: from :func:`~megarl.reshard.planner.plan_reshard`.
        src_tensors: this rank's source tensors by local name, e.g. ``dict(model.named_parameters())`` of the
            unwrapped megatron ``GPTModel`` (``decoder.layers.0.self_attention.linear_qkv.weight`` ...); 1-D or
            2-D, last dim contiguous, shapes as in ``plan.src``.
        dst_tensors: this rank's destination tensors by local name (the rollout engine's own parameters),
            written in place; shapes as in ``plan.dst``, any dtype (cast where it differs from the source).
        rank: this process's global rank (default ``dist.get_rank()``).
        group: process group of the transfers (default: the world); ranks in the plan are global ranks.
        bucket_bytes: bound on the bytes a rank stages (packs for sending plus unpacks after receiving) in one
            round, hence on each of its two staging buffers; at least 64.
        wire_dtype: dtype of the bytes on the wire; None: the source tensors' dtype, agreed by one all-reduce
            over ``group``.
        use_extension: None: ``megarl._C`` where built; False: the pure-torch copies (tests).
        direct_min_bytes: pieces of at least this many bytes whose box is contiguous in a tensor are sent from
            it or received into it without staging (when every rank's such tensors are contiguous and of the
            wire dtype: one all-reduce decides); None: everything is staged.
        profile: run the phases one after the other, synchronising after each on CUDA, so that ``times_s``
            per phase is exact (no overlap: slower).

    Returns:
        This rank's :class:`ReshardStats`.

    Raises:
        ValueError: a tensor of the plan missing or of the wrong shape or layout, tensors on several devices,
            source dtypes that differ between ranks, ``bucket_bytes`` below 64.
    """
    global _logged_cast
    t_total = time.perf_counter()
    if bucket_bytes < MIN_BUCKET_BYTES:
        raise ValueError(f"bucket_bytes must be >= {MIN_BUCKET_BYTES}, got {bucket_bytes}")
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    stats = ReshardStats(rank)
    mine, tiles = plan.for_rank(rank), plan.tiles_for(rank)
    merges = plan.dst.merges.get(rank, ())
    aux = {n for m in merges for n in (m.a_aux, m.b_aux)}
    src_names = {t.src_name for t in mine.local + mine.sends} | \
        {p.src_name for t in tiles.local + tiles.sends for p in t.parts if p.src_name != GATHER}
    dst_names = {t.dst_name for t in mine.local + mine.recvs if t.dst_name != GATHER} | {m.tensor for m in merges} | \
        {n for t in tiles.local + tiles.recvs for n in (t.dst_name, t.scale_name)}
    _check_tensors(src_tensors, plan.src.tensors(rank), src_names, "source", rank)
    _check_tensors(dst_tensors, plan.dst.tensors(rank), dst_names - aux, "destination", rank)
    _check_fp8(dst_tensors, tiles.local + tiles.recvs, rank)
    device = _device_of([src_tensors[n] for n in src_names] + [dst_tensors[n] for n in dst_names - aux], group)
    if wire_dtype is None:
        wire_dtype = _agree_wire_dtype({src_tensors[t.src_name].dtype for t in mine.sends}, group, device, rank)
    elem = torch.empty((), dtype=wire_dtype).element_size()
    if aux:  # the merges' adapter rows and columns, in the wire dtype (what the sources hold)
        layout = plan.dst.tensors(rank)
        dst_tensors = {**dst_tensors, **{n: torch.empty(layout[n].shape, dtype=wire_dtype, device=device)
                                         for n in sorted(aux)}}
        stats.merge_bytes = sum(dst_tensors[n].numel() for n in aux) * elem + MERGE_CHUNK_BYTES
    gathered = {}
    if plan.gather_rows.get(rank):  # pieces of block-FP8 tiles that no source rank holds whole, then quantised
        local = [src_tensors[t.src_name].dtype for t in mine.local if t.dst_name == GATHER]
        dtype = wire_dtype if any(t.dst_name == GATHER for t in mine.recvs) or not local else local[0]
        gathered[GATHER] = torch.empty(plan.dst_shape(rank, GATHER), dtype=dtype, device=device)
        dst_names.add(GATHER)
    dst_tensors = {**dst_tensors, **gathered}
    if direct_min_bytes is not None:
        rounds = _rank_rounds(plan, rank, elem, bucket_bytes, direct_min_bytes)
        given = {**{("src", n): t for n, t in src_tensors.items()}, **{("dst", n): t for n, t in dst_tensors.items()}}
        ends = {given[m.key] for rd in rounds for m in rd.messages if m.key != STAGING}
        if not _agree_direct(all(t.is_contiguous() and t.dtype == wire_dtype for t in ends), group, device):
            direct_min_bytes = None
    rounds = _rank_rounds(plan, rank, elem, bucket_bytes, direct_min_bytes)
    stats.direct = direct_min_bytes is not None
    cuda = device.type == "cuda"
    overlap = cuda and not profile and bool(rounds)

    def phase_end(name: str, t0: float) -> None:
        if cuda and profile:
            torch.cuda.synchronize(device)
        stats.times_s[name] += time.perf_counter() - t0

    casts = {(src_tensors[t.src_name].dtype, dst_tensors[t.dst_name].dtype) for t in mine.local} | \
            {(wire_dtype, dst_tensors[t.dst_name].dtype) for t in mine.recvs}
    casts = {c for c in casts if c[1] != FP8_DTYPE}
    if any(a != b for a, b in casts) and not _logged_cast:
        log.info("reshard casts on copy/unpack (%s) with torch copy_",
                 sorted({f"{a}->{b}" for a, b in casts if a != b}))
        _logged_cast = True

    bound: dict = {("src", n): src_tensors[n] for n in src_names}
    bound.update({("dst", n): dst_tensors[n] for n in dst_names})
    flat = {key: bound[key].detach().view(-1).view(torch.uint8) for key in {m.key for rd in rounds for m in rd.messages}
            if key != STAGING}
    size = max((r.staging for r in rounds), default=0)
    buffers = [torch.empty(size, dtype=wire_dtype, device=device) for _ in range(min(2, len(rounds)))]
    stats.peak_staging_bytes = size * elem * len(buffers)
    wires = [b.view(torch.uint8) for b in buffers]
    parts = _local_parts(plan, rank, max(1, min(LOCAL_PARTS, len(rounds))))
    stats.bytes_copied_local = sum(t.numel * dst_tensors[t.dst_name].element_size() for t in mine.local)
    if not rounds:
        t0 = time.perf_counter()
        stats.bookkeeping_bytes = parts[0].run(bound, use_extension)
        phase_end("local", t0)

    if overlap:
        pack_s, comm_s, unpack_s = _streams(device)
        current = torch.cuda.current_stream(device)
        for s in (pack_s, comm_s, unpack_s):
            s.wait_stream(current)  # the source tensors were written on the current stream
        packed, moved, free = ([torch.cuda.Event() for _ in buffers] for _ in range(3))
        used = [False] * len(buffers)
    on = (lambda s: torch.cuda.stream(s)) if overlap else (lambda s: contextlib.nullcontext())
    next_part = 0
    for k, rd in enumerate(rounds):
        b = k % len(buffers)
        bound[STAGING] = buffers[b]
        booked = 0
        t0 = time.perf_counter()
        with on(pack_s if overlap else None):
            if overlap and used[b]:
                pack_s.wait_event(free[b])  # the unpack of the round before last, this buffer's last user
            booked += rd.pack.run(bound, use_extension)
            if overlap:
                packed[b].record(pack_s)
        phase_end("pack", t0)

        t0 = time.perf_counter()
        with on(comm_s if overlap else None):
            if overlap:
                comm_s.wait_event(packed[b])
            ops = []
            for m in rd.messages:
                buf = wires[b] if m.key == STAGING else flat[m.key]
                ops.append(dist.P2POp(dist.isend if m.send else dist.irecv,
                                      buf[m.offset * elem:(m.offset + m.elements) * elem], m.peer, group))
                if m.send:
                    stats.bytes_sent += m.elements * elem
                else:
                    stats.bytes_received += m.elements * elem
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # on CUDA: the message stream waits for NCCL's
            if overlap:
                moved[b].record(comm_s)
        phase_end("comm", t0)

        t0 = time.perf_counter()
        with on(unpack_s if overlap else None):
            if overlap:
                unpack_s.wait_event(moved[b])
            booked += rd.unpack.run(bound, use_extension)
            if overlap:
                free[b].record(unpack_s)
                used[b] = True
        phase_end("unpack", t0)
        stats.bytes_staged += rd.staging * elem

        t0 = time.perf_counter()
        while next_part < len(parts) and next_part * len(rounds) <= k * len(parts):
            with on(unpack_s if overlap else None):  # between unpacks: overlaps the next round's messages
                booked += parts[next_part].run(bound, use_extension)
            next_part += 1
        phase_end("local", t0)
        stats.bookkeeping_bytes = max(stats.bookkeeping_bytes, booked)
    stats.rounds = len(rounds)
    if overlap:
        for s in (pack_s, comm_s, unpack_s):
            current.wait_stream(s)
    if merges:
        t0 = time.perf_counter()
        apply_merges(merges, dst_tensors)
        phase_end("merge", t0)
    del buffers, wires
    if plan.tiles:
        t0 = time.perf_counter()
        bound.update({("src", n): src_tensors[n] for n in src_names})
        bound.update({("dst", n): dst_tensors[n] for n in dst_names})
        bound.update({("dst8", t.dst_name): dst_tensors[t.dst_name].view(torch.uint8) for t in tiles.recvs})
        _run_tiles(plan, rank, bound, group, device, bucket_bytes, use_extension, stats)
        phase_end("quantize", t0)
    if cuda:
        torch.cuda.synchronize(device)
    del bound, flat, gathered
    stats.times_s["total"] = time.perf_counter() - t_total
    return stats
