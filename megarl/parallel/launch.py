"""Spawning a local multi-process world: one process per rank, gloo on CPU (NCCL where GPUs exist).

Used by single-node tools (``megarl convert``, benchmarks) and by the tests, which start one world per test
module and run many checks in it: a process start with torch and megatron-core imports costs ~5 s on a
2-core CPU machine. Multi-node jobs are launched by torchrun or SLURM instead (:mod:`megarl.parallel.mesh`
reads their environment)."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import traceback

import torch
import torch.multiprocessing as mp

from megarl.parallel.lifecycle import end_descendants, exit_with_parent, peer_failures_named, record_peers
from megarl.parallel.mesh import free_port, init_distributed


def _worker(rank: int, world_size: int, port: int, parent: int, fn, args, queue) -> None:
    os.setsid()  # a session of its own, whose processes end with it (lifecycle's group watchdog)
    exit_with_parent(parent)  # an interrupted test run or tool takes its ranks with it, SIGKILL included
    threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    from megarl.console import QUIET_ENV, quiet_libraries

    if os.environ.get(QUIET_ENV):
        quiet_libraries()
    try:
        init_distributed(timeout_s=300)
        record_peers()
        with peer_failures_named(timeout_s=300):
            result = fn(rank, world_size, *args)
        queue.put((rank, "ok", _to_bytes(result)))
    except BaseException as e:  # report every failure to the parent, which raises it
        queue.put((rank, "error", (traceback.format_exc(), _exception_bytes(e))))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        end_descendants()  # what the rank started ends with it


def _to_bytes(result) -> bytes:
    """``result`` serialised whole. torch's queue would pass tensors as shared-memory file descriptors, which the
    parent can only open while this rank lives; a rank that exits first leaves it a dangling socket."""
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _exception_bytes(e: BaseException) -> bytes | None:
    """``e`` pickled for the parent, or None where it does not pickle."""
    try:
        return pickle.dumps(e)
    except Exception:  # noqa: BLE001 (an exception holding what cannot be pickled: the traceback text stays)
        return None


def run_world(fn, world_size: int, *args, timeout_s: float = 900.0,
              reraise: tuple[type[BaseException], ...] = ()) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled) and return something picklable.

    Raises:
        RuntimeError: with the failing rank's traceback, if any rank fails; where that rank raised an instance of
            ``reraise`` (that unpickles), that exception itself, the traceback text chained as its cause, so a
            command's one-line errors (a damaged checkpoint, a missing file) stay one line.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, os.getpid(), fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors, own = [], None
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                text, raised = payload
                errors.append(f"rank {rank} failed:\n{text}")
                with contextlib.suppress(Exception):
                    own = pickle.loads(raised) if raised is not None else None
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
        queue.close()
        del queue  # its semaphores go now, not at exit (a raised error's frame would hold them: a leak warning)
    if errors:
        if isinstance(own, reraise):
            raise own from RuntimeError("\n".join(errors))
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
