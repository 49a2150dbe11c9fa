"""Benchmarks of the reshard engine (``megarl bench reshard``; its flags and their defaults are in
:mod:`megarl.cli`, ``megarl bench reshard --help``).

Two modes:

- ``layout`` (default): a named model shape (:data:`megarl.models.spec.PRESETS`, optionally cut to fewer
  layers) on a Megatron TP x PP x DP mesh is resharded into vLLM TP shards or whole HF tensors on the same
  ranks, by the reshard engine and by two baselines measured in the same run:

  1. :func:`gather_full_then_slice`: every rank all-gathers every rank's shards, assembles the full model,
     then slices its destination tensors out of it;
  2. :func:`per_tensor_allgather`: verl's Megatron path: parameter by parameter, broadcast over PP from the
     owning stage, all-gather over TP, convert to HF tensors, and let each rank slice what it holds (the
     engine's ``load_weights``).

  Reported per rank: bytes sent/received, peak extra memory (bytes held beyond the source and destination
  tensors), wall seconds, destination GB/s (destination bytes written / wall), and whether the result is
  exact. Runs under torchrun/SLURM, or spawns ``--nproc`` local processes (gloo on CPU).
- ``micro``: one process, no megatron, no communication: the box-copy kernels of one rank's copies
  (same-rank copy of a whole Megatron TP=1 model into vLLM TP=1, i.e. the single-GPU hybrid engine; the pack
  and the unpack of a TP=1 -> TP=t reshard, t the smallest vLLM TP > 1 that the model admits: 2 for most, 3
  for SmolLM2's 9 heads) against one plain device copy of the same bytes, and against one torch ``copy_`` per
  box. GB/s count bytes once.

Prints what was measured (model, layouts, dtypes, bucket) and a table, and writes a JSON file (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from megarl.config import DTYPE_TABLE
from megarl.models.layout import Layout, canonical_shapes, hf_layout
from megarl.models.layout_megatron import megatron_layout, megatron_rank_tensors
from megarl.models.layout_vllm import check_vllm_tp, vllm_layout
from megarl.models.megatron import check_layout
from megarl.models.spec import ModelSpec, SpecError, preset
from megarl.output_folder import write_beside
from megarl.parallel.mesh import ParallelLayout
from megarl.reshard.boxcopy import Box, BoxBatch, extension_available
from megarl.reshard.executor import execute_plan
from megarl.reshard.planner import plan_reshard

DTYPES = {d.short: getattr(torch, name) for name, d in DTYPE_TABLE.items()}  # --dtype: bf16 -> torch.bfloat16


@dataclass
class BaselineStats:
    """What one rank did in one baseline run.

    Attributes:
        bytes_sent / bytes_received: bytes this rank moved (collectives counted as a ring algorithm moves
            them: an all-gather of n ranks sends and receives (n-1) shards per rank; a broadcast receives one
            copy on every other rank and sends one from every rank but the last of the ring).
        peak_extra_bytes: largest total of the temporary buffers alive at once (gather buffers, full
            tensors), bytes.
        seconds: wall time.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _slice_into(dst_tensors: Mapping[str, torch.Tensor], name: str, full: torch.Tensor,
                by_canonical: Mapping[str, list]) -> None:
    """Copy every destination block of canonical tensor ``name`` out of ``full`` (what ``load_weights`` does)."""
    for local, block in by_canonical.get(name, ()):
        dst_tensors[local][block.dst_box].copy_(full[block.src_box])


def _blocks_by_canonical(tensors: Mapping) -> dict[str, list]:
    out: dict[str, list] = {}
    for lt in tensors.values():
        for b in lt.blocks:
            out.setdefault(b.name, []).append((lt.name, b))
    return out


@torch.no_grad()
def gather_full_then_slice(src: Layout, dst: Layout, src_tensors: Mapping[str, torch.Tensor],
                           dst_tensors: Mapping[str, torch.Tensor], *, rank: int, dtype: torch.dtype,
                           group=None) -> BaselineStats:
    """Baseline 1: all-gather every rank's source tensors (flattened, padded to the largest rank), assemble
    every canonical tensor on every rank, then slice this rank's destination blocks out of them.

    Args:
        dtype: the source tensors' dtype (the same on every rank).
        group: must hold every rank of ``src`` and ``dst``; ``rank`` is the global rank.

    Returns:
        :class:`BaselineStats`; its ``peak_extra_bytes`` is at least the whole model's bytes.
    """
    t0 = time.perf_counter()
    world = dist.get_world_size(group)
    es = torch.empty((), dtype=dtype).element_size()
    most = max((src.local_bytes(r, es) for r in src.ranks), default=0)
    mine = src.tensors(rank)
    device = next(iter(dst_tensors.values())).device
    flat = torch.zeros(most, dtype=torch.uint8, device=device)
    offset = 0
    for name, lt in mine.items():
        n = math.prod(lt.shape) * es
        flat[offset:offset + n] = _as_bytes(src_tensors[name])
        offset += n
    gathered = [torch.empty(most, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    full = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in src.canonical.items()}
    filled = set()
    for r in src.ranks:
        buf, offset = gathered[ranks.index(r)], 0
        for lt in src.tensors(r).values():
            n = math.prod(lt.shape) * es
            local = buf[offset:offset + n].view(dtype).view(lt.shape)
            offset += n
            for b in lt.blocks:
                if (b.name, b.src, b.size) not in filled:
                    full[b.name][b.src_box] = local[b.dst_box]
                    filled.add((b.name, b.src, b.size))
    by_canonical = _blocks_by_canonical(dst.tensors(rank))
    for name, tensor in full.items():
        _slice_into(dst_tensors, name, tensor, by_canonical)
    extra = most * (world + 1) + sum(t.numel() for t in full.values()) * es
    return BaselineStats((world - 1) * most, (world - 1) * most, extra, time.perf_counter() - t0)


class MeshGroups:
    """The TP and PP process groups of a Megatron mesh placed on global ``ranks`` (created collectively:
    every rank of the world must construct it)."""

    def __init__(self, mesh: ParallelLayout, ranks: list[int]):
        self.mesh, self.ranks = mesh, list(ranks)
        self.tp: dict[int, object] = {}
        self.pp: dict[int, object] = {}
        for pp in range(mesh.pp):
            for dp in range(mesh.dp):
                members = [self.ranks[mesh.rank(t, pp, dp)] for t in range(mesh.tp)]
                g = dist.new_group(members)
                for m in members:
                    self.tp[m] = (g, members)
        for dp in range(mesh.dp):
            for t in range(mesh.tp):
                members = [self.ranks[mesh.rank(t, p, dp)] for p in range(mesh.pp)]
                g = dist.new_group(members)
                for m in members:
                    self.pp[m] = (g, members)


@torch.no_grad()
def per_tensor_allgather(spec: ModelSpec, groups: MeshGroups, dst: Layout, src_tensors: Mapping[str, torch.Tensor],
                         dst_tensors: Mapping[str, torch.Tensor], *, rank: int, dtype: torch.dtype) -> BaselineStats:
    """Baseline 2 (verl's Megatron path): for every parameter of every stage, broadcast it over the PP group
    from its stage, all-gather it over the TP group (TP-sharded parameters only), convert the TP shards into
    the full HF tensors and slice this rank's destination blocks out of them. One parameter's full tensors at
    a time.

    Args:
        groups: the source mesh's groups; the mesh must cover every rank that calls (colocated).
        dtype: the source tensors' dtype.
    """
    t0 = time.perf_counter()
    mesh, ranks = groups.mesh, groups.ranks
    me = mesh.coords(ranks.index(rank))
    tp_group, tp_members = groups.tp[rank]
    pp_group, pp_members = groups.pp[rank]
    es = torch.empty((), dtype=dtype).element_size()
    by_canonical = _blocks_by_canonical(dst.tensors(rank))
    shapes = canonical_shapes(spec)
    device = next(iter(dst_tensors.values())).device
    stats = BaselineStats()
    loaded: set[str] = set()
    for stage in range(mesh.pp):
        per_tp = [megatron_rank_tensors(spec, mesh, t, stage) for t in range(mesh.tp)]
        for name, lt in per_tp[me.tp].items():
            canonical = {b.name for t in per_tp for b in t[name].blocks}
            if canonical <= loaded:  # tied embeddings: the last stage's copy of the embedding
                continue
            if me.pp == stage:
                shard = src_tensors[name].contiguous()
                extra = 0
            else:
                shard = torch.empty(lt.shape, dtype=dtype, device=device)
                extra = shard.numel() * es
            if mesh.pp > 1:
                dist.broadcast(_as_bytes(shard), src=pp_members[stage], group=pp_group)
                nbytes = shard.numel() * es
                stats.bytes_received += nbytes if me.pp != stage else 0
                stats.bytes_sent += nbytes if pp_members.index(rank) != (stage - 1) % mesh.pp else 0
            sharded = any(per_tp[t][name].blocks != lt.blocks for t in range(mesh.tp))
            if sharded:
                shards = [torch.empty(lt.shape, dtype=dtype, device=device) for _ in range(mesh.tp)]
                dist.all_gather([_as_bytes(s) for s in shards], _as_bytes(shard), group=tp_group)
                stats.bytes_sent += (mesh.tp - 1) * shard.numel() * es
                stats.bytes_received += (mesh.tp - 1) * shard.numel() * es
                extra += mesh.tp * shard.numel() * es
            else:
                shards = [shard] * mesh.tp
            full = {n: torch.empty(shapes[n], dtype=dtype, device=device) for n in canonical}
            for t in range(mesh.tp):
                for b in per_tp[t][name].blocks:
                    full[b.name][b.src_box] = shards[t][b.dst_box]
            extra += sum(f.numel() for f in full.values()) * es
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
            for n, f in full.items():
                _slice_into(dst_tensors, n, f, by_canonical)
            loaded |= canonical
    stats.seconds = time.perf_counter() - t0
    return stats


# ------------------------------------------------------------------------------------------------ layout mode
def synthetic_box(name: str, box: tuple[slice, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """Deterministic values of a box of canonical tensor ``name`` (the same on every rank, without building
    the whole tensor): a hash of the name and the element's canonical index, in [-0.5, 0.5)."""
    seed = sum(ord(c) * 131 ** (i % 7) for i, c in enumerate(name)) % 65521
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, s in enumerate(box):
        shape = [1] * len(box)
        shape[d] = s.stop - s.start
        index = index * 1000003 + torch.arange(s.start, s.stop, dtype=torch.int64, device=device).view(shape)
    return (((index * 2654435761 + seed) % 65536).to(torch.float32) / 65536 - 0.5).to(dtype)


def _fill_synthetic(tensors: Mapping, dtype: torch.dtype, device: torch.device | str = "cpu"
                    ) -> dict[str, torch.Tensor]:
    out = {}
    for name, lt in tensors.items():
        t = torch.zeros(lt.shape, dtype=dtype, device=device)
        for b in lt.blocks:
            t[b.dst_box] = synthetic_box(b.name, b.src_box, dtype, device)
        out[name] = t
    return out


def _exact(tensors: Mapping, dst_tensors: Mapping[str, torch.Tensor], src_dtype: torch.dtype) -> bool:
    for name, lt in tensors.items():
        for b in lt.blocks:
            want = synthetic_box(b.name, b.src_box, src_dtype, dst_tensors[name].device).to(
                dst_tensors[name].dtype)
            if not torch.equal(dst_tensors[name][b.dst_box], want):
                return False
    return True


def bench_spec(args: argparse.Namespace) -> ModelSpec:
    """The benchmarked model: preset ``--model`` cut to ``--layers``.

    Raises:
        ValueError: an unknown ``--model`` (listing the known ones).
    """
    try:
        spec = preset(args.model)
    except SpecError as e:
        raise ValueError(f"--model: {e}") from None
    return spec.replace(num_layers=args.layers) if args.layers else spec


def check_layout_args(args: argparse.Namespace, world: int) -> None:
    """Check the layout mode's flags against the world and the model, before any rank starts.

    Raises:
        ValueError: naming the flag (``--nproc``, ``--src-tp``, ``--src-pp``, ``--layers``, ``--dst-tp``,
            ``--hf-ranks``, ``--ranks-per-node``), what does not divide or fit, and the sizes that would.
    """
    spec = bench_spec(args)
    for flag, layout in (("--src-tp", ParallelLayout(tp=args.src_tp)), ("--src-pp", ParallelLayout(pp=args.src_pp))):
        try:
            check_layout(spec, layout)
        except SpecError as e:
            raise ValueError(f"{flag} (model {args.model}{f', --layers {args.layers}' if args.layers else ''}): "
                             f"{e}") from None
    if world % (args.src_tp * args.src_pp):
        raise ValueError(f"--nproc: {world} ranks are not a multiple of --src-tp x --src-pp = {args.src_tp} x "
                         f"{args.src_pp} (the source's DP fills the world)")
    if args.dst == "vllm":
        if world % args.dst_tp:
            raise ValueError(f"--dst-tp {args.dst_tp} does not divide the {world} ranks (vLLM engines fill the world)")
        try:
            check_vllm_tp(spec, args.dst_tp)
        except SpecError as e:
            raise ValueError(f"--dst-tp: {e}") from None
    bad = [r for r in args.hf_ranks if not 0 <= r < world]
    if args.dst == "hf" and bad:
        raise ValueError(f"--hf-ranks: {bad} are not ranks of the world (0..{world - 1})")
    if args.ranks_per_node is not None and world % args.ranks_per_node:
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} does not divide the {world} ranks")


def _bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    spec = bench_spec(args)
    mesh = ParallelLayout(args.src_tp, args.src_pp, world // (args.src_tp * args.src_pp))
    src = megatron_layout(spec, mesh)
    dst = vllm_layout(spec, args.dst_tp, range(world)) if args.dst == "vllm" else hf_layout(spec, args.hf_ranks)
    dtype, dst_dtype = DTYPES[args.dtype], DTYPES[args.dst_dtype or args.dtype]
    groups = MeshGroups(mesh, list(range(world)))
    t0 = time.perf_counter()
    plan = plan_reshard(src, dst, args.ranks_per_node)
    plan_s = time.perf_counter() - t0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    src_tensors = _fill_synthetic(src.tensors(rank), dtype, device)
    dst_tensors = {n: torch.zeros(lt.shape, dtype=dst_dtype, device=device) for n, lt in dst.tensors(rank).items()}
    dst_bytes = sum(t.numel() * t.element_size() for t in dst_tensors.values())
    direct_min = None if args.direct_min_kb is None else int(args.direct_min_kb * 1024)

    def reshard(profile: bool = False):
        return execute_plan(plan, src_tensors, dst_tensors, rank=rank, bucket_bytes=int(args.bucket_mb * 2**20),
                            wire_dtype=dtype, direct_min_bytes=direct_min, profile=profile)

    methods = {
        "reshard": reshard,
        "gather_full": lambda: gather_full_then_slice(src, dst, src_tensors, dst_tensors, rank=rank, dtype=dtype),
        "per_tensor_allgather": lambda: per_tensor_allgather(spec, groups, dst, src_tensors, dst_tensors, rank=rank,
                                                             dtype=dtype),
    }
    out = {"rank": rank, "plan_s": plan_s, "dst_bytes": dst_bytes,
           "src_bytes": sum(t.numel() * t.element_size() for t in src_tensors.values()), "methods": {}}
    for name, run in methods.items():
        if name != "reshard" and not args.baselines:
            continue
        times, stats, exact = [], None, None
        for i in range(args.warmup + args.iters):
            for t in dst_tensors.values():
                t.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            stats = run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if i == 0:
                exact = _exact(dst.tensors(rank), dst_tensors, dtype)
            if i >= args.warmup:
                times.append(dt)
        wall = statistics.median(times)
        row = {"wall_s": wall, "exact": exact, "dst_GBps": dst_bytes / wall / 1e9}
        if name == "reshard":  # timed with overlap; the phases come from one more run without it
            dist.barrier()
            row.update(bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
                       bytes_copied_local=stats.bytes_copied_local, bytes_staged=stats.bytes_staged,
                       direct=stats.direct, peak_extra_bytes=stats.peak_extra_bytes,
                       peak_staging_bytes=stats.peak_staging_bytes, rounds=stats.rounds,
                       phases_s=reshard(profile=True).times_s)
        else:
            row.update(bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
                       peak_extra_bytes=stats.peak_extra_bytes)
        out["methods"][name] = row
    return out


def _layout_table(results: list[dict]) -> str:
    lines = [f"{'rank':>4} {'method':<21} {'sent MB':>9} {'recv MB':>9} {'extra MB':>9} {'wall ms':>9} "
             f"{'dst GB/s':>9} exact"]
    for r in results:
        for name, m in r["methods"].items():
            lines.append(f"{r['rank']:>4} {name:<21} {m['bytes_sent'] / 1e6:>9.1f} {m['bytes_received'] / 1e6:>9.1f} "
                         f"{m['peak_extra_bytes'] / 1e6:>9.1f} {m['wall_s'] * 1e3:>9.1f} {m['dst_GBps']:>9.2f} "
                         f"{m['exact']}")
    return "\n".join(lines)


def _run_layout(args: argparse.Namespace) -> dict:
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    check_layout_args(args, world)
    if "RANK" in os.environ or args.nproc == 1:
        from megarl.parallel.mesh import init_distributed

        info = init_distributed()
        mine = _bench_rank(info.rank, info.world_size, args)
        results = [None] * info.world_size
        dist.all_gather_object(results, mine)
        if info.rank != 0:
            return {}
    else:
        from megarl.parallel.launch import run_world

        results = run_world(_bench_rank, args.nproc, args)
    return {"mode": "layout", "config": vars(args), "extension": extension_available(), "ranks": results}


# ------------------------------------------------------------------------------------------------ micro mode
def _timed(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after one warm-up (CUDA events on GPU)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def _run_micro(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    spec = bench_spec(args)
    src = megatron_layout(spec, ParallelLayout())
    tensors = {("src", n): torch.randn(lt.shape, device=device).to(dtype) for n, lt in src.tensors(0).items()}
    cases = {}
    # same-rank copy of the whole model: the single-GPU hybrid engine (Megatron TP=1 -> vLLM TP=1)
    one = plan_reshard(src, vllm_layout(spec, 1, [0]))
    tensors.update({("one", n): torch.empty(lt.shape, dtype=dtype, device=device)
                    for n, lt in one.dst.tensors(0).items()})
    cases["local_copy"] = BoxBatch([(Box(("src", t.src_name), t.src_start, t.size),
                                     Box(("one", t.dst_name), t.dst_start, t.size)) for t in one.for_rank(0).local])
    # pack and unpack of a TP=1 -> TP=t reshard (rank 0 sends rank 1's share of every sharded tensor)
    split = split_tp(spec)
    two = plan_reshard(src, vllm_layout(spec, split, range(split)))
    sends = [t for t in two.for_rank(0).sends if t.dst_rank == 1]
    offsets = [0]
    for t in sends:
        offsets.append(offsets[-1] + t.numel)
    tensors["staging"] = torch.empty(offsets[-1], dtype=dtype, device=device)
    tensors.update({("two", n): torch.empty(lt.shape, dtype=dtype, device=device)
                    for n, lt in two.dst.tensors(1).items()})
    cases["pack"] = BoxBatch([(Box(("src", t.src_name), t.src_start, t.size), Box("staging", (off,), t.size, True))
                              for t, off in zip(sends, offsets)])
    cases["unpack"] = BoxBatch([(Box("staging", (off,), t.size, True), Box(("two", t.dst_name), t.dst_start, t.size))
                                for t, off in zip(sends, offsets)])
    out = {"mode": "micro", "config": vars(args), "extension": extension_available(), "split_tp": split,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "cases": {}}
    for name, batch in cases.items():
        nbytes = batch.total_elements() * tensors["staging"].element_size()
        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        row = {"boxes": len(batch), "bytes": nbytes}
        row["d2d_s"] = _timed(lambda: flat_dst.copy_(flat_src), device, args.iters)
        del flat_src, flat_dst
        if extension_available():
            row["kernel_s"] = _timed(lambda: batch.run(tensors, use_extension=True), device, args.iters)
        row["torch_per_box_s"] = _timed(lambda: batch.run(tensors, use_extension=False), device, args.iters)
        for k in ("d2d", "kernel", "torch_per_box"):
            if f"{k}_s" in row:
                row[f"{k}_GBps"] = nbytes / row[f"{k}_s"] / 1e9
        if "kernel_s" in row:
            row["kernel_vs_d2d"] = row["kernel_GBps"] / row["d2d_GBps"]
            written = [tensors[k] for k in batch.dst_keys()]
            batch.run(tensors, use_extension=True)
            by_kernel = [t.clone() for t in written]
            for t in written:
                t.zero_()
            batch.run(tensors, use_extension=False)
            row["kernel_equals_torch"] = all(torch.equal(a, b) for a, b in zip(by_kernel, written))
            del by_kernel
        out["cases"][name] = row
    return out


def split_tp(spec: ModelSpec) -> int:
    """The smallest vLLM TP > 1 that ``spec`` admits (its heads and KV heads), for the micro mode's pack and
    unpack case.

    Raises:
        ValueError: the model admits no TP > 1 (e.g. a single query head).
    """
    for t in range(2, spec.num_attention_heads + 1):
        try:
            check_vllm_tp(spec, t)
            return t
        except SpecError:
            continue
    raise ValueError(f"--model: {spec.num_attention_heads} query heads admit no vLLM TP > 1 for the pack/unpack case")


def _what(result: dict) -> str:
    """What a run measured, in words (the line above its table)."""
    c = result["config"]
    model = c["model"] + (f" cut to {c['layers']} layers" if c["layers"] else "")
    if result["mode"] == "micro":
        return (f"bench reshard micro: {model}, {c['dtype']}, on {result['device']}, median of {c['iters']} runs; "
                f"local_copy: the whole model Megatron TP=1 -> vLLM TP=1 on one device; pack/unpack: the pieces "
                f"rank 0 sends to rank 1 in Megatron TP=1 -> vLLM TP={result['split_tp']}")
    ranks = result["ranks"]
    world = len(ranks)
    dp = world // (c["src_tp"] * c["src_pp"])
    dst = (f"vLLM TP={c['dst_tp']} ({world // c['dst_tp']} engine(s))" if c["dst"] == "vllm"
           else f"whole HF tensors on rank(s) {c['hf_ranks']}")
    direct = "staged" if c["direct_min_kb"] is None else f"direct pieces >= {c['direct_min_kb']:g} KiB"
    return (f"bench reshard layout: {model}, {c['dtype']} -> {c['dst_dtype'] or c['dtype']}, Megatron TP={c['src_tp']}"
            f" x PP={c['src_pp']} x DP={dp} on {world} rank(s) -> {dst}; bucket {c['bucket_mb']:g} MiB, {direct}; "
            f"median of {c['iters']} runs after {c['warmup']} warm-up")


def _micro_table(result: dict) -> str:
    lines = [f"device: {result['device']}  extension: {result['extension']}",
             f"{'case':<11} {'boxes':>6} {'MB':>9} {'d2d GB/s':>9} {'kernel GB/s':>12} {'ratio':>6} "
             f"{'torch/box GB/s':>15} exact"]
    for name, r in result["cases"].items():
        lines.append(f"{name:<11} {r['boxes']:>6} {r['bytes'] / 1e6:>9.1f} {r['d2d_GBps']:>9.1f} "
                     f"{r.get('kernel_GBps', float('nan')):>12.1f} {r.get('kernel_vs_d2d', float('nan')):>6.2f} "
                     f"{r['torch_per_box_GBps']:>15.1f} {r.get('kernel_equals_torch', '-')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write ``--json``. Returns the exit status (1 if a result is not
    exact).

    Raises:
        ValueError: flags that do not fit the world or the model (:func:`check_layout_args`), before any rank
            starts; a ``--device`` that this machine lacks.
    """
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.mode == "micro" and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no GPU here; use --device cpu")
    result = _run_micro(args) if args.mode == "micro" else _run_layout(args)
    if not result:  # a torchrun rank other than 0
        return 0
    print(_what(result))
    print(_micro_table(result) if args.mode == "micro" else _layout_table(result["ranks"]))
    if args.json:  # claimed before any rank started (megarl.cli.bench)
        write_beside(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1, default=str)), "bench reshard")
    exact = all(m["exact"] for r in result.get("ranks", []) for m in r["methods"].values()) and \
        all(c.get("kernel_equals_torch", True) for c in result.get("cases", {}).values())
    return 0 if exact else 1
