"""The reshard executor: runs a :class:`~megarl.reshard.planner.Plan` on this rank, bucket by bucket.

Every rank knows the whole plan, so every rank derives the same schedule without talking:

- transfers whose source and destination are this rank are copied region to region (one batched box copy,
  no staging buffer);
- the other transfers are cut into pieces of at most ``bucket_bytes / 2`` and assigned, in plan order, to
  rounds, first fit, such that in every round every rank sends plus receives at most ``bucket_bytes``;
- in a round, a rank packs the pieces for each peer into one contiguous region of its staging buffer (one
  batched box copy for all peers), moves them with ``torch.distributed.batch_isend_irecv`` (NCCL on GPU,
  gloo on CPU) and unpacks what it received straight into the destination tensors (one batched box copy).

The extra memory of a rank is one staging buffer of at most ``bucket_bytes`` plus the descriptor tables of
the copies (bookkeeping), accounted in :class:`ReshardStats`. Bytes travel in the wire dtype (the source
tensors' dtype unless given); a destination of another dtype (e.g. fp32 master weights into a bf16 engine) is
cast on unpack, by torch.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import torch
import torch.distributed as dist

from megarl.models.layout import LocalTensor
from megarl.reshard.boxcopy import Box, BoxBatch
from megarl.reshard.planner import Plan, Transfer

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20
MIN_BUCKET_BYTES = 64
_SCAN = 16  # rounds a piece may be placed back from the newest open one (bounds the schedule's cost)

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
        rounds: communication rounds this rank took part in.
        peak_staging_bytes: size of this rank's staging buffer (send + receive regions of its largest
            round); at most the bucket size.
        bookkeeping_bytes: largest descriptor tables allocated for one batched copy (host and device).
        times_s: wall seconds per phase: ``"local"``, ``"pack"``, ``"comm"``, ``"unpack"`` (summed over
            rounds; on CUDA exact only with ``profile=True``) and ``"total"`` (always exact).
    """

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_local: int = 0
    rounds: int = 0
    peak_staging_bytes: int = 0
    bookkeeping_bytes: int = 0
    times_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("local", "pack", "comm", "unpack", "total"), 0.0))

    @property
    def peak_extra_bytes(self) -> int:
        """Peak memory beyond the source and destination tensors: staging plus bookkeeping, bytes."""
        return self.peak_staging_bytes + self.bookkeeping_bytes


STAGING = "staging"  # the key of the staging buffer in the copy batches


class _Round(NamedTuple):
    """One round seen from one rank; offsets and sizes in wire elements of the staging buffer."""

    pack: BoxBatch  # source boxes -> staging
    unpack: BoxBatch  # staging -> destination boxes
    sends: tuple[tuple[int, int, int], ...]  # (peer, offset, elements), one per peer
    recvs: tuple[tuple[int, int, int], ...]
    staging: int  # elements


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


@functools.lru_cache(maxsize=32)
def _schedule(plan: Plan, elem_size: int, bucket_bytes: int) -> tuple[tuple[Transfer, ...], ...]:
    """Every rank's remote pieces assigned to rounds (the same on every rank), in plan order: each piece goes
    to the first round where both its ranks still have room (each rank sends plus receives at most
    ``bucket_bytes`` per round), looking at most ``_SCAN`` rounds past the first one still open to both, else
    to a new round (the first open round of both then moves on by one)."""
    cap = bucket_bytes // elem_size
    max_elems = max(1, cap // 2)
    nearly_full = cap - max(1, max_elems // 16)
    rounds: list[list[Transfer]] = []
    used: list[dict[int, int]] = []
    first_open: dict[int, int] = defaultdict(int)  # per rank: rounds before it have (almost) no room left
    for t in plan.transfers:
        if t.src_rank == t.dst_rank:
            continue
        for p in _split(t, max_elems):
            n = p.numel
            k = max(first_open[p.src_rank], first_open[p.dst_rank])
            stop = min(len(rounds), k + _SCAN)
            while k < stop and (used[k][p.src_rank] + n > cap or used[k][p.dst_rank] + n > cap):
                k += 1
            if k == stop:
                start = max(first_open[p.src_rank], first_open[p.dst_rank])
                if start + _SCAN <= len(rounds):
                    first_open[p.src_rank] = first_open[p.dst_rank] = start + 1
                k = len(rounds)
                rounds.append([])
                used.append(defaultdict(int))
            rounds[k].append(p)
            for r in (p.src_rank, p.dst_rank):
                used[k][r] += n
                while first_open[r] < len(rounds) and used[first_open[r]][r] > nearly_full:
                    first_open[r] += 1
    return tuple(tuple(r) for r in rounds)


@functools.lru_cache(maxsize=64)
def _rank_rounds(plan: Plan, rank: int, elem_size: int, bucket_bytes: int) -> tuple[_Round, ...]:
    """The rounds of :func:`_schedule` in which ``rank`` sends or receives, with its staging layout: send
    regions by peer (ascending), then receive regions by peer, pieces in schedule order within a peer; its
    pack and unpack copies compiled (cached with the plan)."""
    out = []
    for pieces in _schedule(plan, elem_size, bucket_bytes):
        to_peer: dict[int, list[Transfer]] = defaultdict(list)
        from_peer: dict[int, list[Transfer]] = defaultdict(list)
        for p in pieces:
            if p.src_rank == rank:
                to_peer[p.dst_rank].append(p)
            elif p.dst_rank == rank:
                from_peer[p.src_rank].append(p)
        if not to_peer and not from_peer:
            continue
        offset = 0
        spans: dict[str, list[tuple[int, int, int]]] = {"send": [], "recv": []}
        placed: dict[str, list[tuple[Transfer, int]]] = {"send": [], "recv": []}
        for kind, by_peer in (("send", to_peer), ("recv", from_peer)):
            for peer in sorted(by_peer):
                start = offset
                for p in by_peer[peer]:
                    placed[kind].append((p, offset))
                    offset += p.numel
                spans[kind].append((peer, start, offset - start))
        pack = BoxBatch([(Box(("src", p.src_name), p.src_start, p.size), Box(STAGING, (off,), p.size, True))
                         for p, off in placed["send"]])
        unpack = BoxBatch([(Box(STAGING, (off,), p.size, True), Box(("dst", p.dst_name), p.dst_start, p.size))
                           for p, off in placed["recv"]])
        out.append(_Round(pack, unpack, tuple(spans["send"]), tuple(spans["recv"]), offset))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _local_batch(plan: Plan, rank: int) -> BoxBatch:
    """The same-rank copies of ``rank``, compiled (cached with the plan)."""
    return BoxBatch([(Box(("src", t.src_name), t.src_start, t.size), Box(("dst", t.dst_name), t.dst_start, t.size))
                     for t in plan.for_rank(rank).local])


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


def _device_of(tensors: list[torch.Tensor], group) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the reshard's tensors on one rank must share a device, got {sorted(map(str, devices))}")
    if devices:
        return devices.pop()
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def execute_plan(plan: Plan, src_tensors: Mapping[str, torch.Tensor], dst_tensors: Mapping[str, torch.Tensor], *,
                 rank: int | None = None, group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 wire_dtype: torch.dtype | None = None, use_extension: bool | None = None,
                 profile: bool = False) -> ReshardStats:
    """Run this rank's part of ``plan``: write every destination block of this rank, in place.

    Call it on every rank of ``group`` (SPMD; ranks in neither layout return at once when ``wire_dtype`` is
    given). With NCCL, the group must have run one collective before (a ``batch_isend_irecv`` rule); the
    wire-dtype agreement is one.

    Args:
        plan: from :func:`~megarl.reshard.planner.plan_reshard`.
        src_tensors: this rank's source tensors by local name, e.g. ``dict(model.named_parameters())`` of the
            unwrapped megatron ``GPTModel`` (``decoder.layers.0.self_attention.linear_qkv.weight`` ...); 1-D or
            2-D, last dim contiguous, shapes as in ``plan.src``.
        dst_tensors: this rank's destination tensors by local name (the rollout engine's own parameters),
            written in place; shapes as in ``plan.dst``, any dtype (cast where it differs from the source).
        rank: this process's global rank (default ``dist.get_rank()``).
        group: process group of the transfers (default: the world); ranks in the plan are global ranks.
        bucket_bytes: bound on the bytes a rank sends plus receives in one round, hence on its staging buffer;
            at least 64.
        wire_dtype: dtype of the bytes on the wire; None: the source tensors' dtype, agreed by one all-reduce
            over ``group``.
        use_extension: None: ``megarl._C`` where built; False: the pure-torch copies (tests).
        profile: on CUDA, synchronise after every phase so that ``times_s`` per phase is exact.

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
    mine = plan.for_rank(rank)
    src_names = {t.src_name for t in mine.local + mine.sends}
    dst_names = {t.dst_name for t in mine.local + mine.recvs}
    _check_tensors(src_tensors, plan.src.tensors(rank), src_names, "source", rank)
    _check_tensors(dst_tensors, plan.dst.tensors(rank), dst_names, "destination", rank)
    device = _device_of([src_tensors[n] for n in src_names] + [dst_tensors[n] for n in dst_names], group)
    if wire_dtype is None:
        wire_dtype = _agree_wire_dtype({src_tensors[t.src_name].dtype for t in mine.sends}, group, device, rank)
    cuda = device.type == "cuda"

    def phase_end(name: str, t0: float) -> None:
        if cuda and profile:
            torch.cuda.synchronize(device)
        stats.times_s[name] += time.perf_counter() - t0

    casts = {(src_tensors[t.src_name].dtype, dst_tensors[t.dst_name].dtype) for t in mine.local} | \
            {(wire_dtype, dst_tensors[t.dst_name].dtype) for t in mine.recvs}
    if any(a != b for a, b in casts) and not _logged_cast:
        log.info("reshard casts on copy/unpack (%s) with torch copy_",
                 sorted({f"{a}->{b}" for a, b in casts if a != b}))
        _logged_cast = True

    t0 = time.perf_counter()
    bound: dict = {("src", n): src_tensors[n] for n in src_names}
    bound.update({("dst", n): dst_tensors[n] for n in dst_names})
    stats.bookkeeping_bytes = _local_batch(plan, rank).run(bound, use_extension)
    stats.bytes_copied_local = sum(t.numel * dst_tensors[t.dst_name].element_size() for t in mine.local)
    phase_end("local", t0)

    elem = torch.empty((), dtype=wire_dtype).element_size()
    rounds = _rank_rounds(plan, rank, elem, bucket_bytes)
    staging = torch.empty(max((r.staging for r in rounds), default=0), dtype=wire_dtype, device=device)
    stats.peak_staging_bytes = staging.numel() * elem
    bound[STAGING] = staging
    wire = staging.view(torch.uint8)
    for rd in rounds:
        t0 = time.perf_counter()
        stats.bookkeeping_bytes = max(stats.bookkeeping_bytes, rd.pack.run(bound, use_extension))
        phase_end("pack", t0)

        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend, wire[off * elem:(off + n) * elem], peer, group) for peer, off, n in rd.sends]
        ops += [dist.P2POp(dist.irecv, wire[off * elem:(off + n) * elem], peer, group) for peer, off, n in rd.recvs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        phase_end("comm", t0)

        t0 = time.perf_counter()
        stats.bookkeeping_bytes = max(stats.bookkeeping_bytes, rd.unpack.run(bound, use_extension))
        phase_end("unpack", t0)
        stats.bytes_sent += sum(n for _, _, n in rd.sends) * elem
        stats.bytes_received += sum(n for _, _, n in rd.recvs) * elem
    stats.rounds = len(rounds)
    del staging, wire, bound
    if cuda:
        torch.cuda.synchronize(device)
    stats.times_s["total"] = time.perf_counter() - t_total
    return stats
