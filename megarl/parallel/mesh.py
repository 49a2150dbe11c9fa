"""Parallel layouts (TP x CP x PP x DP meshes) and the process-group set-up of one training world.

Rank order follows megatron-core's default ``order="tp-cp-ep-dp-pp"`` (TP fastest, then CP, then DP, then PP),
so the coordinates computed here are the ones ``parallel_state`` reports:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Context parallelism (CP) splits each sequence over ``cp`` ranks that hold the same weights (the CP peers of a
DP replica); with ``cp = 1`` the order is megatron's ``tp + tp * (dp + dp * pp)``.

Expert parallelism (EP, for mixture-of-experts models) splits each MoE layer's experts over ``ep`` ranks with
expert TP = 1: megatron's expert mesh orders the ``tp * dp`` ranks of a pipeline stage EP-fastest, so

    ep_rank = (tp_rank + tp * dp_rank) % ep

(the EP group of TP=2 x DP=2 at EP=2 is a TP group; at EP=4, the whole stage).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist


log = logging.getLogger(__name__)


class LayoutError(ValueError):
    """A parallel layout that does not fit the job or the model."""


class RankCoords(NamedTuple):
    """Position of one rank in a TP x CP x PP x DP mesh."""

    tp: int
    pp: int
    dp: int
    cp: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """A Megatron mesh: tensor-, context-, pipeline- and data-parallel sizes (world = tp * cp * pp * dp), and the
    virtual pipeline stages of each pipeline rank.

    Attributes:
        tp: tensor-parallel size (splits heads, FFN and vocab).
        pp: pipeline-parallel size (splits layers into stages).
        dp: data-parallel size (replicas).
        ranks_per_node: GPUs (or CPU processes) per node; the reshard planner prefers same-node peers.
        ep: expert-parallel size (MoE layers' experts split over ``ep`` ranks of a stage; must divide
            ``tp * dp``); 1 for dense models.
        cp: context-parallel size (each sequence split over ``cp`` ranks holding the same weights); 1 = off.
        vpp: virtual pipeline stages per pipeline rank (megatron's interleaved 1F1B schedule): each rank holds
            ``vpp`` model chunks (:meth:`chunk_layers`); 1 = no interleaving. Needs ``pp > 1``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ranks_per_node: int | None = None
    ep: int = 1
    cp: int = 1
    vpp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "cp", "vpp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel layout: {name} must be >= 1, got {getattr(self, name)}")
        if self.cp > 1 and self.ep > 1:
            raise LayoutError(f"parallel layout: cp={self.cp} with ep={self.ep} is not supported (context "
                              "parallelism runs dense models only; set cp=1 or ep=1)")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"parallel layout: vpp={self.vpp} interleaves pipeline stages and needs pp > 1 "
                              "(megatron's interleaved schedule); set vpp=1 or pp >= 2")
        if (self.tp * self.dp) % self.ep:
            raise LayoutError(f"parallel layout: ep={self.ep} does not divide the tp={self.tp} x dp={self.dp} ranks "
                              "of a pipeline stage (experts are split over ranks of one stage, expert TP = 1)")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def coords(self, rank: int) -> RankCoords:
        """Mesh coordinates of a global rank (megatron's tp-cp-dp-pp order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        rest = rank // self.tp
        return RankCoords(tp=rank % self.tp, cp=rest % self.cp, dp=(rest // self.cp) % self.dp,
                          pp=rest // (self.cp * self.dp))

    def ep_rank(self, rank: int) -> int:
        """Expert-parallel rank of a global rank (which slice of the experts it holds)."""
        c = self.coords(rank)
        return (c.tp + self.tp * c.dp) % self.ep

    def rank(self, tp: int, pp: int, dp: int, cp: int = 0) -> int:
        """Global rank at mesh coordinates (inverse of :meth:`coords`)."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def chunk_layers(self, num_layers: int, pp_rank: int) -> list[range]:
        """Global indices of the decoder layers of each model chunk on pipeline rank ``pp_rank``.

        The model is cut into ``pp * vpp`` virtual stages of ``num_layers / (pp * vpp)`` layers each; chunk ``c``
        of pipeline rank ``p`` is virtual stage ``v = c * pp + p`` and holds layers ``[v * L/(pp*vpp),
        (v + 1) * L/(pp*vpp))`` (megatron-core's ``get_transformer_layer_offset`` with an even split). Without
        VPP, one chunk: the rank's whole stage.

        Returns:
            ``vpp`` ranges, chunk 0 first.

        Raises:
            LayoutError: ``pp * vpp`` does not divide ``num_layers``.
        """
        stages = self.pp * self.vpp
        if num_layers % stages:
            fits = [v for v in range(1, num_layers // self.pp + 1) if num_layers % (self.pp * v) == 0]
            raise LayoutError(f"pp={self.pp} x vpp={self.vpp} = {stages} virtual pipeline stages do not divide "
                              f"num_layers={num_layers}; vpp sizes that fit pp={self.pp}: {fits}")
        per = num_layers // stages
        return [range((c * self.pp + pp_rank) * per, (c * self.pp + pp_rank + 1) * per) for c in range(self.vpp)]

    @property
    def microbatch_multiple(self) -> int:
        """What the number of micro-batches of one pipeline-schedule call must be a multiple of: ``pp`` for
        megatron's interleaved schedule (VPP, :meth:`check_num_microbatches`), else 1."""
        return self.pp if self.vpp > 1 else 1

    def check_num_microbatches(self, num_microbatches: int) -> None:
        """Check that megatron's interleaved schedule runs ``num_microbatches`` micro-batches (with VPP).

        With its default ``microbatch_group_size_per_vp_stage = pp`` (a depth-first schedule),
        ``forward_backward_pipelining_with_interleaving`` needs at least ``pp`` micro-batches and a remainder
        of 0 or at least ``pp`` when divided by ``pp``: a multiple of ``pp``. Without VPP, any count runs.

        Raises:
            LayoutError: naming the count, ``pp`` and what to change.
        """
        if self.vpp > 1 and (num_microbatches < self.pp or num_microbatches % self.pp):
            raise LayoutError(f"{num_microbatches} micro-batches: megatron's interleaved schedule (vpp={self.vpp}) "
                              f"needs a multiple of pp={self.pp} micro-batches per step; make each DP rank's "
                              f"micro-batch count a multiple of {self.pp} (the mini-batch size over dp and "
                              "micro_batch_size), or set vpp=1")


class LaunchInfo(NamedTuple):
    """Where this process sits in the job, from torchrun's or SLURM's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_info() -> LaunchInfo:
    """Read rank, world size and rendezvous address from torchrun (``RANK``...) or SLURM (``SLURM_PROCID``...).

    Without either, a single-process world on localhost, on ``MASTER_PORT`` or a free port (so that plain runs
    side by side do not collide on one port). Under SLURM the master address is the first host of
    ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``) and the port is derived from the job id unless
    ``MASTER_PORT`` is set.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                          env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR")
        if addr is None:
            nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1")
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True)
            addr = out.stdout.split()[0] if out.returncode == 0 and out.stdout.strip() else "127.0.0.1"
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return LaunchInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                          addr, port)
    return LaunchInfo(0, 1, 0, "127.0.0.1", int(env["MASTER_PORT"]) if "MASTER_PORT" in env else free_port())


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it), for a local world's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_per_node(world_size: int | None = None) -> int | None:
    """Ranks per node of this job, for the reshard planner's same-node preference: torchrun's
    ``LOCAL_WORLD_SIZE``, else SLURM's ``SLURM_NTASKS_PER_NODE`` (its first count, e.g. ``8`` of ``8(x2)``),
    else the GPUs this process sees; None without any of them (a CPU job: one node).

    Args:
        world_size: the job's ranks; the result is capped at it.
    """
    env = os.environ
    value = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0].split(",")[0]
    count = int(value) if value.strip().isdigit() and int(value) > 0 else None
    if count is None and torch.cuda.is_available():
        count = torch.cuda.device_count()
    if count is not None and world_size is not None:
        count = min(count, world_size)
    return count


def init_distributed(timeout_s: float = 1800.0) -> LaunchInfo:
    """Initialise ``torch.distributed`` once (NCCL with a GPU, gloo without) from :func:`launch_info`.

    Returns:
        The launch info used. Idempotent: a second call returns without re-initialising.
    """
    info = launch_info()
    if dist.is_initialized():
        return info
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                            rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return info


def initialize_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: float = 1800.0) -> None:
    """Set megatron-core's ``parallel_state`` to ``layout`` and seed its RNG tracker; its process groups
    time out after ``timeout_s`` seconds.

    Requires ``torch.distributed`` to be initialised with ``layout.world_size`` ranks; applies the CPU patches
    first where no GPU exists.

    Raises:
        LayoutError: the world size differs from ``layout.world_size``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megarl.parallel.megatron_cpu import apply_cpu_patches

    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(f"the job has {world} ranks but the layout tp={layout.tp} x cp={layout.cp} x "
                          f"pp={layout.pp} x dp={layout.dp} needs {layout.world_size}")
    apply_cpu_patches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                             pipeline_model_parallel_size=layout.pp,
                                             context_parallel_size=layout.cp,
                                             virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1
                                             else None,
                                             expert_model_parallel_size=layout.ep,
                                             expert_tensor_parallel_size=1,
                                             distributed_timeout_minutes=timeout_s / 60)
    model_parallel_cuda_manual_seed(seed)
