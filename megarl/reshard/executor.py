"""The reshard executor: runs a :class:`~megarl.reshard.planner.Plan` on this rank, bucket by bucket, with the
transfers of one round overlapping the pack of the next and the unpack of the last.

Every rank knows the whole plan, so every rank derives the same schedule without talking
(:mod:`megarl.reshard.rounds`: same-rank copies spread over the rounds, remote transfers cut into pieces sent
direct or staged and assigned to rounds of at most ``bucket_bytes`` staged per rank). A round is: one batched
box copy packing every staged send end, the round's messages in one ``torch.distributed.batch_isend_irecv``
(NCCL on GPU, gloo on CPU), one batched box copy unpacking every staged receive end into the destination
tensors.

Overlap (CUDA): packs, messages and unpacks run on three streams, round ``k`` in staging buffer ``k % 2``;
the pack of round ``k + 1`` waits only for the unpack of round ``k - 1`` (its buffer's last user), so round
``k``'s messages overlap the pack of ``k + 1`` and the unpack of ``k - 1``. On CPU (and with ``profile``) the
same schedule runs in order.

Merged LoRA weights (a destination layout of :func:`~megarl.models.layout_lora.with_lora_merge`): the plan also fills
each merged tensor's auxiliary tensors (its rows of ``B``, its columns of ``A``, in the wire dtype, allocated
here), and once every transfer has landed each merge writes ``W + (alpha / r) B A`` into the engine's tensor in
place (:func:`megarl.models.lora.apply_merges`: fp64, one rounding to the tensor's dtype).

Block-FP8 destinations (:attr:`Plan.tiles <megarl.reshard.planner.Plan.tiles>`) run after the transfers: the
tiles a rank quantises for itself in one batched call, the others in rounds of their own, the quantisation
being the pack (:mod:`megarl.reshard.tile_rounds`).

Extra memory of a rank: two staging buffers (one with a single round) of at most ``bucket_bytes`` each, plus
the descriptor tables of the copies (bookkeeping), with merges the auxiliary adapter tensors (adapter-sized)
and one merge chunk, and with gathered FP8 tiles their gather buffer (``Plan.gather_rows[rank] x 128``
elements), accounted in :class:`ReshardStats`. Bytes travel in the
wire dtype (the source tensors' dtype unless given; sources of several dtypes, like a bf16 model's float32 router
bias, travel in one set of rounds per dtype, each tensor in its own: :func:`_wire_groups`); a destination of
another dtype (e.g. fp32 master weights into a bf16 engine) is cast on unpack, by torch, and then no end is direct
(all ranks agree on that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from megarl.models.fp8 import FP8_DTYPE
from megarl.models.layout import LocalTensor
from megarl.models.lora import MERGE_CHUNK_BYTES, apply_merges
from megarl.reshard.planner import GATHER, Plan
from megarl.reshard.rounds import STAGING, local_parts, rank_rounds
from megarl.reshard.tile_rounds import STAGING_F32, rank_tiles

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20
MIN_BUCKET_BYTES = 64
DIRECT_MIN_BYTES = 256 << 10  # smaller pieces travel staged, bundled per peer (one message each costs more)
LOCAL_PARTS = 64  # the same-rank copies are issued in at most this many parts, spread over the rounds

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


def _run_tiles(plan: Plan, rank: int, bound: dict, group, device: torch.device, bucket_bytes: int,
               use_extension: bool | None, stats: "ReshardStats") -> None:
    """Quantise this rank's block-FP8 tiles (:mod:`megarl.reshard.tile_rounds`), on the current stream; updates
    ``stats``."""
    local, rounds = rank_tiles(plan, rank, bucket_bytes)
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


def _check_fp8(dst_tensors: Mapping[str, torch.Tensor], tiles, rank: int) -> None:
    """Block-FP8 destinations are E4M3 (or raw uint8) and their scales float32."""
    for t in tiles:
        for name, ok, want in ((t.dst_name, (FP8_DTYPE, torch.uint8), "float8_e4m3fn"),
                               (t.scale_name, (torch.float32,), "float32")):
            if dst_tensors[name].dtype not in ok:
                raise ValueError(f"rank {rank}: block-FP8 destination tensor {name!r} is {dst_tensors[name].dtype}, "
                                 f"expected {want}")


def _wire_groups(plan: Plan, rank: int, src_tensors: Mapping[str, torch.Tensor], group,
                 device: torch.device) -> list[tuple[Plan, torch.dtype]]:
    """The plan's transfers by the dtype they travel in, each a sub-plan with its wire dtype, the group of the
    most elements sent first (it takes the same-rank copies): one group, the whole plan, where every rank sends
    source tensors of one dtype; where the sources mix dtypes (a bf16 model's float32 router bias,
    :func:`megarl.models.deepseek_moe_layers.freeze_expert_bias`), one group per dtype, each transfer in its
    source tensor's dtype: nothing rounded, nothing widened. One all-reduce of the elements sent per dtype over
    ``group``; with mixed dtypes one all-gather of each rank's sent tensors outside the first group (a few
    names); the sub-plans are cached with the plan.

    Raises:
        ValueError: a source tensor to send of a dtype not in :data:`_WIRE_DTYPES`.
    """
    mine = plan.for_rank(rank)
    counts = [0] * len(_WIRE_DTYPES)
    for t in mine.sends:
        dtype = src_tensors[t.src_name].dtype
        if dtype not in _WIRE_DTYPES:
            raise ValueError(f"rank {rank}: source dtype {dtype} is not a known wire dtype; pass wire_dtype")
        counts[_WIRE_DTYPES.index(dtype)] += t.numel
    summed = torch.tensor(counts, dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(summed, group=group)
    counts = summed.tolist()
    sent = sorted((i for i, n in enumerate(counts) if n), key=lambda i: (-counts[i], i))
    if len(sent) <= 1:
        return [(plan, _WIRE_DTYPES[sent[0]] if sent else torch.float32)]
    main = sent[0]
    others = sorted({(t.src_name, _WIRE_DTYPES.index(src_tensors[t.src_name].dtype)) for t in mine.sends} -
                    {(t.src_name, main) for t in mine.sends})
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (rank, tuple(others)), group=group)
    key = ("wire groups", main, tuple(sorted(reports)))
    if key not in plan._by_rank:
        code = {(r, name): i for r, names in reports for name, i in names}
        by: dict[int, list] = {i: [] for i in sent}
        for t in plan.transfers:
            by[main if t.src_rank == t.dst_rank else code.get((t.src_rank, t.src_name), main)].append(t)
        plan._by_rank[key] = [(dataclasses.replace(plan, transfers=tuple(by[i]), tiles=()), _WIRE_DTYPES[i])
                              for i in sent]
    return plan._by_rank[key]


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


def _phase_end(stats: ReshardStats, name: str, t0: float, sync: bool, device: torch.device) -> None:
    if sync:
        torch.cuda.synchronize(device)
    stats.times_s[name] += time.perf_counter() - t0


def _run_rounds(plan: Plan, rank: int, wire_dtype: torch.dtype, bound: dict, with_local: bool, *, group,
                device: torch.device, bucket_bytes: int, direct_min_bytes: int | None,
                use_extension: bool | None, profile: bool, stats: ReshardStats) -> None:
    """Run the transfers of ``plan`` (one wire dtype's, :func:`_wire_groups`) in rounds, with its same-rank
    copies spread over them when ``with_local``; adds to ``stats``. ``bound``: the source and destination
    tensors by ``("src" | "dst", name)``."""
    elem = torch.empty((), dtype=wire_dtype).element_size()
    if direct_min_bytes is not None:
        rounds = rank_rounds(plan, rank, elem, bucket_bytes, direct_min_bytes)
        ends = {bound[m.key] for rd in rounds for m in rd.messages if m.key != STAGING}
        if not _agree_direct(all(t.is_contiguous() and t.dtype == wire_dtype for t in ends), group, device):
            direct_min_bytes = None
    rounds = rank_rounds(plan, rank, elem, bucket_bytes, direct_min_bytes)
    stats.direct = stats.direct and direct_min_bytes is not None
    cuda = device.type == "cuda"
    overlap = cuda and not profile and bool(rounds)

    def phase_end(name: str, t0: float) -> None:
        _phase_end(stats, name, t0, cuda and profile, device)

    flat = {key: bound[key].detach().view(-1).view(torch.uint8) for key in {m.key for rd in rounds for m in rd.messages}
            if key != STAGING}
    size = max((r.staging for r in rounds), default=0)
    buffers = [torch.empty(size, dtype=wire_dtype, device=device) for _ in range(min(2, len(rounds)))]
    stats.peak_staging_bytes = max(stats.peak_staging_bytes, size * elem * len(buffers))
    wires = [b.view(torch.uint8) for b in buffers]
    parts = local_parts(plan, rank, max(1, min(LOCAL_PARTS, len(rounds)))) if with_local else ()
    if not rounds and parts:
        t0 = time.perf_counter()
        stats.bookkeeping_bytes = max(stats.bookkeeping_bytes, parts[0].run(bound, use_extension))
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
    stats.rounds += len(rounds)
    if overlap:
        for s in (pack_s, comm_s, unpack_s):
            current.wait_stream(s)
    if STAGING in bound:
        del bound[STAGING]


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
        wire_dtype: dtype of the bytes on the wire (every source tensor cast to it); None: each source tensor's
            own dtype, agreed over ``group`` (:func:`_wire_groups`: one all-reduce, one all-gather more where
            the sources mix dtypes, whose transfers then run in one set of rounds per dtype).
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
            a source dtype to send that is no known wire dtype, ``bucket_bytes`` below 64.
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
    groups = [(plan, wire_dtype)] if wire_dtype is not None else _wire_groups(plan, rank, src_tensors, group, device)
    wire_dtype = groups[0][1]  # the most elements' (and the sources') dtype: the merges' adapters, the FP8 gather
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
    casts = {(src_tensors[t.src_name].dtype, dst_tensors[t.dst_name].dtype) for t in mine.local} | \
            {(wire, dst_tensors[t.dst_name].dtype) for sub, wire in groups for t in sub.for_rank(rank).recvs}
    casts = {c for c in casts if c[1] != FP8_DTYPE}
    if any(a != b for a, b in casts) and not _logged_cast:
        log.info("reshard casts on copy/unpack (%s) with torch copy_",
                 sorted({f"{a}->{b}" for a, b in casts if a != b}))
        _logged_cast = True

    bound: dict = {("src", n): src_tensors[n] for n in src_names}
    bound.update({("dst", n): dst_tensors[n] for n in dst_names})
    stats.bytes_copied_local = sum(t.numel * dst_tensors[t.dst_name].element_size() for t in mine.local)
    stats.direct = direct_min_bytes is not None
    for k, (sub, wire) in enumerate(groups):  # the same-rank copies with the first
        _run_rounds(sub, rank, wire, bound, k == 0, group=group, device=device, bucket_bytes=bucket_bytes,
                    direct_min_bytes=direct_min_bytes, use_extension=use_extension, profile=profile, stats=stats)
    cuda = device.type == "cuda"
    if merges:
        t0 = time.perf_counter()
        apply_merges(merges, dst_tensors)
        _phase_end(stats, "merge", t0, cuda and profile, device)
    if plan.tiles:
        t0 = time.perf_counter()
        bound.update({("src", n): src_tensors[n] for n in src_names})
        bound.update({("dst", n): dst_tensors[n] for n in dst_names})
        bound.update({("dst8", t.dst_name): dst_tensors[t.dst_name].view(torch.uint8) for t in tiles.recvs})
        _run_tiles(plan, rank, bound, group, device, bucket_bytes, use_extension, stats)
        _phase_end(stats, "quantize", t0, cuda and profile, device)
    if cuda:
        torch.cuda.synchronize(device)
    del bound, gathered
    stats.times_s["total"] = time.perf_counter() - t_total
    return stats
