"""Role placement: megatron-core's parallel state and the process groups of each role's pool, built once.

megatron-core holds one model-parallel state per process (``parallel_state``). Every Megatron role of the run
(actor, critic, reference) sits either on the whole world (every role takes turns in one layout: the state is
that layout, as before placement existed) or on pools of whole TP groups with ``pp = 1`` and one ``tp`` for
all roles (:func:`megarl.config.check_runnable` says so before any model is built). In that second, split
case the global state is ``tp x pp=1 x dp=world/tp``: its TP groups lie inside every pool and are each role's
own, and only the data-parallel groups differ by pool. Each pool gets its DP groups and one group of all its
ranks here, and its roles get megatron's process-group collection with those DP groups
(:meth:`PoolGroups.collection`) for DDP, the DistributedOptimizer and ``finalize_model_grads``.

Results a pool computes (log-probs, update metrics) reach the other ranks by :func:`share_tensor` and
:func:`share_object`, broadcasts from the pool's first rank.

The rollout engine runs on the whole world (taking turns with the Megatron roles) or on a pool of its own,
disjoint from every Megatron role's pool and from the reward's (:func:`check_rollout_pool`). Then the other
ranks, the *training ranks*, share their results over their own group (:func:`training_group`), never
waiting on the rollout ranks, which meet them only where :mod:`megarl.trainer.pipeline` says (the reshard,
the hand-over of a batch, checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from megarl.parallel.mesh import ParallelLayout


class RoleSpec(Protocol):
    """What placement reads of a role's layout (:class:`megarl.config.RoleLayout`)."""

    role: str
    pool: str
    ranks: tuple[int, ...]
    tp: int
    pp: int
    dp: int


MEGATRON_ROLES = ("actor", "critic", "reference")


@dataclass
class PoolGroups:
    """One Megatron role's pool as this rank sees it.

    Attributes:
        pool: the pool's name. ranks: its global ranks, ascending (mesh rank ``i`` is ``ranks[i]``).
        mesh: the role's TP x PP x DP layout on the pool.
        group: every rank of the pool (None: the pool is the world).
        dp: this rank's data-parallel group inside the pool (None: megatron's, the pool is the world).
    """

    pool: str
    ranks: tuple[int, ...]
    mesh: ParallelLayout
    group: Any = None
    dp: Any = None

    @property
    def holds_here(self) -> bool:
        """This rank is in the pool."""
        return dist.get_rank() in self.ranks

    @property
    def whole_world(self) -> bool:
        return self.group is None

    def collection(self):
        """megatron-core's process-group collection for this pool: ``parallel_state``'s groups with the
        pool's data-parallel groups (None on the whole world: megatron's defaults are the pool's)."""
        if self.whole_world:
            return None
        from megatron.core.process_groups_config import ProcessGroupCollection

        pgs = ProcessGroupCollection.use_mpu_process_groups(
            ["tp", "pp", "mp", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp", "embd", "pos_embd"])
        for name in ("dp", "dp_cp", "intra_dp_cp", "expt_dp", "intra_expt_dp"):
            setattr(pgs, name, self.dp)
        # the optimizer instance's ranks, over which the DistributedOptimizer reduces its gradient norm: the
        # whole pool (TP x DP), not its DP group (with tp > 1 each TP rank clipped by its own shard's norm, and
        # the TP ranks' copies of replicated weights drifted apart)
        pgs.intra_dist_opt = self.group
        pgs.tp_dp_cp = self.group  # pp = 1: TP x DP is the pool
        pgs.inter_dist_opt = None
        return pgs


def rollout_split(layouts: dict[str, RoleSpec], world_size: int) -> bool:
    """The rollout engine is on a pool of its own (not the whole world)."""
    return layouts["rollout"].ranks != tuple(range(world_size))


def check_rollout_pool(cfg, layouts: dict[str, RoleSpec], world_size: int) -> None:
    """A rollout pool other than the whole world holds no Megatron role and no reward scoring (its ranks only
    generate), and its size is a multiple of the actor's tp (megatron-core lays its state over every rank of
    the world: the rollout ranks form TP groups of their own in it, unused); ``trainer.mode=async`` needs such a
    pool, and validation is refused there (not built yet).

    Raises:
        ConfigError: naming the field (``placement.rollout``, ``placement.reward``, ``trainer.mode``,
            ``validation.enabled``), the pools and ranks, and the fix.
    """
    from megarl.config import ConfigError

    ro = layouts["rollout"]
    if not rollout_split(layouts, world_size):
        if cfg.trainer.mode == "async":
            raise ConfigError("trainer.mode: async overlaps generation with training on separate ranks, but the "
                              f"rollout is on {ro.describe()}, the whole world; put placement.rollout on a pool "
                              "of its own (e.g. placement.pools.gen=[2,3] placement.rollout=gen) or use "
                              "trainer.mode=sync")
        return
    for role in (*MEGATRON_ROLES, "reward"):
        lay = layouts.get(role)
        shared = sorted(set(lay.ranks) & set(ro.ranks)) if lay is not None else []
        if shared:
            raise ConfigError(f"placement.{role}: {role} on {lay.describe()} shares ranks {shared} with the rollout "
                              f"on {ro.describe()}: a rollout pool other than all only generates; put {role} on "
                              "a pool of the other ranks (or the rollout on all)")
    tp = layouts["actor"].tp
    if len(ro.ranks) % tp:
        raise ConfigError(f"placement.rollout: the rollout's {ro.describe()} has {len(ro.ranks)} ranks, not a "
                          f"multiple of the actor's tp={tp} (megatron-core's state covers every rank of the "
                          f"world in TP groups of {tp}); use a pool of a multiple of {tp} ranks")
    rt = cfg.rollout.tp
    blocks = [ro.ranks[i:i + rt] for i in range(0, len(ro.ranks), rt)]
    if cfg.rollout.engine == "vllm" and not all(b == tuple(range(b[0], b[0] + rt)) and b[0] % rt == 0 for b in blocks):
        raise ConfigError(f"placement.pools.{ro.pool}: vLLM lays its engines out as blocks of rollout.tp={rt} "
                          f"consecutive ranks starting at a multiple of {rt}, got ranks {list(ro.ranks)}")
    if cfg.validation.enabled:
        raise ConfigError(f"validation.enabled: validation with the rollout on {ro.describe()} (a pool of its own) "
                          "is not built yet; set validation.enabled=false, or placement.rollout=all")


def training_group(layouts: dict[str, RoleSpec], world_size: int):
    """The group of every rank outside a rollout pool of its own (None when the rollout is on the whole
    world: the training ranks are the world). Collective: call on every rank, in the same order."""
    if not rollout_split(layouts, world_size):
        return None
    rollout = set(layouts["rollout"].ranks)
    return dist.new_group([r for r in range(world_size) if r not in rollout])


def is_split(layouts: dict[str, RoleSpec], world_size: int) -> bool:
    """Some Megatron role is on a pool other than the whole world."""
    return any(lay.ranks != tuple(range(world_size)) for r, lay in layouts.items() if r in MEGATRON_ROLES)


def global_layout(layouts: dict[str, RoleSpec], world_size: int) -> ParallelLayout:
    """The layout megatron's ``parallel_state`` is set to: the actor's when every Megatron role is on the whole
    world, else ``tp x 1 x world/tp`` (see the module docstring)."""
    a = layouts["actor"]
    if not is_split(layouts, world_size):
        return ParallelLayout(tp=a.tp, pp=a.pp, dp=a.dp)
    return ParallelLayout(tp=a.tp, pp=1, dp=world_size // a.tp)


def build_pool_groups(layouts: dict[str, RoleSpec], world_size: int) -> dict[str, PoolGroups]:
    """The groups of every Megatron role's pool; call on every rank, in the same order (``new_group`` is
    collective), after ``torch.distributed`` is initialised.

    Returns:
        role -> :class:`PoolGroups` for each Megatron role in ``layouts`` (roles on one pool share them).
    """
    split = is_split(layouts, world_size)
    built: dict[tuple, PoolGroups] = {}
    out = {}
    for role in MEGATRON_ROLES:
        lay = layouts.get(role)
        if lay is None:
            continue
        mesh = ParallelLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp)
        key = (lay.ranks, lay.tp, lay.pp)
        if key not in built:
            groups = PoolGroups(lay.pool, lay.ranks, mesh)
            if split:
                groups.group = dist.new_group(list(lay.ranks))
                for tp_rank in range(mesh.tp):
                    for pp_rank in range(mesh.pp):
                        ranks = [lay.ranks[mesh.rank(tp_rank, pp_rank, d)] for d in range(mesh.dp)]
                        g = dist.new_group(ranks)
                        if dist.get_rank() in ranks:
                            groups.dp = g
            built[key] = groups
        out[role] = built[key]
    return out


def join_optimizer_setup() -> None:
    """On a rank outside a trained role's pool, take part in the world-wide collectives of megatron-core
    0.19's ``get_megatron_optimizer``: ``_get_param_groups`` all-gathers every rank's param-group keys over the
    whole world whatever ``pg_collection`` says, once for the dense and once for the expert parameters; this
    rank contributes no keys. Call where the pool's ranks build that role's optimizer."""
    for _ in ("dense", "expert"):
        dist.all_gather_object([None] * dist.get_world_size(), [])


def share_tensor(t: torch.Tensor | None, src_ranks: Sequence[int], shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, group=None) -> torch.Tensor:
    """``t`` (held by every rank of ``src_ranks``) on every rank of ``group`` (default: the world), broadcast
    from ``src_ranks[0]``; a no-op when ``src_ranks`` is the whole group. Call on every rank of the group.

    Args:
        t: the tensor on ranks of ``src_ranks`` (CPU; ignored elsewhere).
        shape / dtype: what the other ranks receive.
        group: the ranks that take part (:func:`training_group` with a rollout pool of its own).
    """
    if len(src_ranks) == dist.get_world_size(group):
        return t
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buf = (t.to(device, dtype) if dist.get_rank() in src_ranks else torch.empty(tuple(shape), dtype=dtype,
                                                                                device=device)).contiguous()
    dist.broadcast(buf, src=src_ranks[0], group=group)
    return buf.cpu()


def share_object(obj: Any, src_ranks: Sequence[int], group=None) -> Any:
    """A picklable object held by the ranks of ``src_ranks`` on every rank of ``group`` (default: the world;
    a no-op when ``src_ranks`` is the whole group)."""
    if len(src_ranks) == dist.get_world_size(group):
        return obj
    box = [obj if dist.get_rank() in src_ranks else None]
    dist.broadcast_object_list(box, src=src_ranks[0], group=group)
    return box[0]
