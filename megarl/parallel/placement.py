"""Role placement: which ranks hold which role in which layout, checked before any model is built, then
megatron-core's parallel state and the process groups of each role's pool, built once.

:func:`role_layouts` turns ``placement`` and the roles' parallel sections of a :class:`~megarl.config.Config`
into one :class:`RoleLayout` per role; :func:`check_turns` and :func:`check_runnable` say which layouts the
trainer runs, and :func:`validate_for_world` checks everything that depends on the world size (batch sizes
against each role's DP size). These read only the config: ``megarl train``, ``submit``, ``sweep`` and preflight
call them before a rank starts.

megatron-core holds one model-parallel state per process (``parallel_state``). Every Megatron role of the run
(actor, critic, reference) sits either on the whole world (every role takes turns in one layout: the state is
that layout, as before placement existed) or on pools of whole TP groups with ``pp = 1`` and one ``tp`` for
all roles (:func:`check_runnable` says so before any model is built). In that second, split
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

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megarl.algos.registry import ADVANTAGES
from megarl.config import MEGATRON_ROLES, Config, ConfigError, require
from megarl.parallel.mesh import LayoutError, ParallelLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleLayout:
    """Where one role runs: its pool's name and global ranks, and its layout there (``pp = dp = 1`` and no
    optimizer for the reward function; ``pp = 1`` for the rollout engine, whose ``dp`` is its replicas).
    ``vpp``: the virtual pipeline stages per pipeline rank (model chunks), the same for every Megatron role."""

    role: str
    pool: str
    ranks: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1

    def describe(self) -> str:
        """``pool 'NAME' ranks 0-3 tp=.. pp=.. dp=..`` (the layout as it applies to the role)."""
        r = self.ranks
        span = f"{r[0]}-{r[-1]}" if len(r) > 1 and list(r) == list(range(r[0], r[-1] + 1)) else ",".join(map(str, r))
        layout = {"reward": "", "rollout": f" tp={self.tp} dp={self.dp}"}.get(
            self.role, f" tp={self.tp} pp={self.pp} dp={self.dp}" + (f" cp={self.cp}" if self.cp > 1 else "")
            + (f" vpp={self.vpp}" if self.vpp > 1 else ""))
        return f"pool {self.pool!r} ranks {span}{layout}"


def role_layouts(cfg: Config, world_size: int) -> dict[str, RoleLayout]:
    """The layout of every role the run builds (the critic with a critic-based algorithm, the reference with
    ``algorithm.kl.coef > 0`` or the distillation's teacher in its slot), in a world of ``world_size`` ranks.

    Raises:
        ConfigError: a pool larger than the world or naming ranks outside it; a layout that does not fit its
            pool (tp * pp not dividing its size, or an explicit dp other than size / (tp * pp)); naming the
            role, the pool and the sizes; a role's ``vpp`` other than the actor's (megatron-core keeps one
            virtual pipeline size per process, in ``parallel_state``).
    """
    pl = cfg.placement
    for name, ranks in pl.pools.items():
        if ranks == "all":
            continue
        require(len(ranks) <= world_size, f"placement.pools.{name}",
                 f"has {len(ranks)} ranks but the world has {world_size}")
        outside = [r for r in ranks if r >= world_size]
        require(not outside, f"placement.pools.{name}",
                 f"ranks {outside} are outside the world of {world_size} ranks (0..{world_size - 1})")
    megatron = {"actor": cfg.actor.parallel}
    if cfg.algorithm.uses_critic:
        megatron["critic"] = cfg.critic.parallel
    if cfg.algorithm.uses_reference:
        megatron["reference"] = pl.reference_parallel or dataclasses.replace(cfg.actor.parallel, dp=0)
    out = {}
    for role, p in megatron.items():
        ranks = pl.ranks(getattr(pl, role), world_size)
        where = f"pool {getattr(pl, role)!r} (placement.{role}) has {len(ranks)} ranks"
        field_name = "placement.reference_parallel" if role == "reference" else f"{role}.parallel"
        cp = f" x cp={p.cp}" if p.cp > 1 else ""
        require(len(ranks) % p.replica_size == 0, field_name,
                 f"{role} layout tp={p.tp}{cp} x pp={p.pp} does not divide its pool: {where}")
        dp = len(ranks) // p.replica_size
        require(p.dp in (0, dp), f"{field_name}.dp", f"{role} dp={p.dp} but tp={p.tp}{cp} x pp={p.pp} x dp={p.dp} "
                 f"= {p.replica_size * p.dp} != {len(ranks)}: {where}; set dp to {dp} or 0 to derive it")
        vpp = cfg.actor.parallel.vpp
        require(p.vpp == vpp, f"{field_name}.vpp", f"{p.vpp} differs from actor.parallel.vpp={vpp}: every "
                 "Megatron role runs the same virtual pipeline stages (megatron-core keeps one VPP size per "
                 f"process); set {field_name}.vpp={vpp}")
        out[role] = RoleLayout(role, getattr(pl, role), tuple(ranks), p.tp, p.pp, dp, p.cp, p.vpp)
    out["reward"] = RoleLayout("reward", pl.reward, tuple(pl.ranks(pl.reward, world_size)))
    ranks = pl.ranks(pl.rollout, world_size)
    tp = cfg.rollout.tp
    require(len(ranks) % tp == 0, "rollout.tp", f"{tp} does not divide the rollout's pool {pl.rollout!r} "
             f"(placement.rollout) of {len(ranks)} ranks")
    out["rollout"] = RoleLayout("rollout", pl.rollout, tuple(ranks), tp, 1, len(ranks) // tp)
    return out


GSPO_CLIP = 0.01  # above this a GSPO clip range is PPO-sized: GSPO clips a sequence's ratio, 3e-4 / 4e-4 in the paper


def warn_ineffective(cfg: Config, layouts: dict[str, RoleLayout], world_size: int) -> None:
    """Warn, one line each naming the field, about settings that the run accepts but that do not do what they
    say: GSPO (the sequence-level ratio of Zheng et al. 2025, arXiv:2507.18071) with a loss aggregation other
    than ``seq-mean-token-mean`` (its objective: each sequence's mean, then the mean over sequences) or with
    clip ranges above :data:`GSPO_CLIP` (the paper's are 3e-4 and 4e-4: PPO's 0.2 leaves the sequence ratio
    unclipped); ``sequence_parallel`` at ``tp=1`` (it shards over TP ranks: nothing to shard); placement pools
    that leave ranks of the world to no role (they start, then wait through the run)."""
    alg = cfg.algorithm
    if alg.policy_loss == "gspo":
        if alg.loss_agg_mode != "seq-mean-token-mean":
            log.warning("algorithm.loss_agg_mode=%s with algorithm.policy_loss=gspo: GSPO's objective averages each "
                        "sequence's tokens, then the sequences; set algorithm.loss_agg_mode=seq-mean-token-mean",
                        alg.loss_agg_mode)
        wide = {f: v for f in ("clip_ratio_low", "clip_ratio_high") if (v := getattr(alg, f)) > GSPO_CLIP}
        if wide:
            log.warning("algorithm.%s with algorithm.policy_loss=gspo: PPO-sized clip ranges (> %g) barely clip a "
                        "sequence-level ratio; the GSPO paper uses clip_ratio_low=3e-4, clip_ratio_high=4e-4",
                        " and algorithm.".join(f"{f}={v:g}" for f, v in wide.items()), GSPO_CLIP)
    fields = {"actor.parallel": ("actor", cfg.actor.parallel), "critic.parallel": ("critic", cfg.critic.parallel),
              "placement.reference_parallel": ("reference", cfg.placement.reference_parallel)}
    for field_name, (role, p) in fields.items():  # a reference without a layout of its own has the actor's
        if role in layouts and p is not None and p.sequence_parallel and layouts[role].tp == 1:
            log.warning("%s.sequence_parallel=true has no effect at tp=1 (it shards activations over the tensor-"
                        "parallel ranks); set it to false, or use tp > 1", field_name)
    idle = sorted(set(range(world_size)) - {r for lay in layouts.values() for r in lay.ranks})
    if idle:
        log.warning("placement.pools: ranks %s of the world of %d run no role (placement.actor, .rollout, .reward, "
                    "...); they wait through the run: give them to a pool or start fewer ranks", idle, world_size)


def check_context_parallel(rc, role: str) -> None:
    """What context parallelism (``{role}.parallel.cp > 1``) runs with: the "sdpa" attention of the local
    spec (:mod:`megarl.kernels.context_parallel`; megatron's local attention has none), micro-batches of whole rows
    (the batch's width padded to a multiple of ``8 * tp * cp``), a dense model (checked with the model,
    :func:`megarl.models.megatron.check_layout`).

    Raises:
        ConfigError: naming the field and the fix.
    """
    cp = rc.parallel.cp
    if cp == 1:
        return
    require(rc.kernels.attention == "sdpa", f"{role}.kernels.attention",
            f"{rc.kernels.attention!r} has no context parallelism ({role}.parallel.cp={cp}); use sdpa or cp=1")
    require(not rc.max_tokens_per_micro_batch, f"{role}.max_tokens_per_micro_batch",
            f"micro-batches by token count are not supported with {role}.parallel.cp={cp} (each sequence must "
            "split into 2 * cp equal chunks); set it to 0 or use cp=1")


def check_virtual_pipeline(cfg: Config, rc, role: str, lay: RoleLayout) -> None:
    """With VPP (``{role}.parallel.vpp > 1``) megatron's interleaved schedule runs a multiple of ``pp``
    micro-batches per call (:meth:`~megarl.parallel.mesh.ParallelLayout.check_num_microbatches`): each DP rank's
    rows of a mini-batch (the update) and of the rollout batch (log-probs, values) come in multiples of ``pp``,
    and with fixed-size micro-batches ``micro_batch_size`` cuts a mini-batch's rows into a multiple of ``pp``.
    The forward passes pick their micro-batch size to fit (:meth:`~megarl.workers.engine.MegatronWorker.
    forward_micro_batch_size`), and micro-batches by token count are split until their count fits
    (:func:`~megarl.workers.packing.pack_shares`).

    Raises:
        ConfigError: naming the field (``data.prompts_per_step``, ``{role}.ppo_mini_batch_size``,
            ``{role}.micro_batch_size``) and the sizes that fit.
    """
    if lay.vpp == 1:
        return
    pp, dp = lay.pp, lay.dp
    why = f"megatron's interleaved schedule ({role}.parallel.vpp={lay.vpp}) runs a multiple of pp={pp} micro-batches"
    require(cfg.rollout_batch_size // dp % pp == 0, "data.prompts_per_step",
            f"the rollout batch of {cfg.rollout_batch_size} sequences gives each of {role}'s dp={dp} ranks "
            f"{cfg.rollout_batch_size // dp} rows, not a multiple of pp={pp} ({why}); use prompts_per_step x "
            f"rollout.n a multiple of {dp * pp}")
    rows = rc.ppo_mini_batch_size // dp
    require(rows % pp == 0, f"{role}.ppo_mini_batch_size", f"{rc.ppo_mini_batch_size} gives each of dp={dp} ranks "
            f"{rows} rows, not a multiple of pp={pp} ({why}); use a multiple of {dp * pp}")
    mbs = rc.update_micro_batch_size(dp)
    if not rc.max_tokens_per_micro_batch and (rows // mbs) % pp:
        fits = [m for m in range(1, rows + 1) if rows % m == 0 and (rows // m) % pp == 0]
        raise ConfigError(f"{role}.micro_batch_size: {rc.micro_batch_size} cuts each DP rank's {rows} rows of a "
                          f"mini-batch into {rows // mbs} micro-batches, not a multiple of pp={pp} "
                          f"({why}); use one of {fits}")


def check_turns(layouts: dict[str, RoleLayout]) -> None:
    """Megatron roles whose pools share ranks must take turns in one layout (megatron-core holds one model-
    parallel state per process): the same ranks and the same tp, pp, dp.

    Raises:
        ConfigError: naming both roles, their pools, ranks and layouts.
    """
    roles = [layouts[r] for r in MEGATRON_ROLES if r in layouts]
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            shared = sorted(set(a.ranks) & set(b.ranks))
            if shared and (a.ranks, a.tp, a.pp, a.dp, a.cp, a.vpp) != (b.ranks, b.tp, b.pp, b.dp, b.cp, b.vpp):
                raise ConfigError(
                    f"placement.{b.role}: {b.role} ({b.describe()}) and {a.role} ({a.describe()}) share ranks {shared} but not one "
                    f"layout: roles on shared ranks take turns only on the same pool with the same tp, pp and dp "
                    f"(megatron-core holds one model-parallel layout per process); put {b.role} on "
                    f"{a.role}'s pool with its layout, or on a pool of other ranks")


def check_runnable(layouts: dict[str, RoleLayout], world_size: int) -> None:
    """What the trainer runs (:mod:`megarl.parallel.placement`): the rollout engine on the whole world or on a
    pool of its own (:func:`check_rollout_pool`); the Megatron roles on the whole world in any layout, or split over pools with ``pp = 1``, one ``tp`` for
    all, each pool made of whole TP groups (consecutive ranks from a multiple of tp), the actor's holding rank
    0 (which writes the metrics and the checkpoints' metadata). The reward function scores on any pool.

    Raises:
        ConfigError: naming the role, its pool, its ranks and layout.
    """
    world = tuple(range(world_size))
    megatron = [layouts[r] for r in MEGATRON_ROLES if r in layouts]
    if all(lay.ranks == world for lay in megatron):
        return
    tp = layouts["actor"].tp
    for lay in megatron:
        where = f"{lay.role} on {lay.describe()} while a Megatron role is on a pool other than all"
        require(lay.cp == 1, f"placement.{lay.role}", f"{where}: context parallelism (cp={lay.cp}) needs every "
                 "Megatron role on the whole world (placement all); use cp=1 or drop the pools")
        require(lay.pp == 1, f"placement.{lay.role}", f"{where}: roles on split pools need pp=1 (megatron-core "
                 "holds one pipeline layout per process); use pp=1 or put every Megatron role on all")
        require(lay.tp == tp, f"placement.{lay.role}", f"{where}: roles on split pools share one tp, the "
                 f"actor's tp={tp}; use tp={tp}")
        blocks = [lay.ranks[i:i + tp] for i in range(0, len(lay.ranks), tp)]
        require(all(b == tuple(range(b[0], b[0] + tp)) and b[0] % tp == 0 for b in blocks),
                 f"placement.pools.{lay.pool}", f"{where}: a pool of tp={tp} roles holds whole TP groups "
                 f"(runs of {tp} consecutive ranks starting at a multiple of {tp}), got ranks {list(lay.ranks)}")
    actor = layouts["actor"]
    require(0 in actor.ranks, "placement.actor", f"actor on {actor.describe()}: on split pools the actor's pool "
             "holds rank 0 (it writes the metrics and the checkpoints' metadata)")


def placement_summary(layouts: dict[str, RoleLayout]) -> str:
    """The run's start-up lines: which ranks hold which role, in which layout."""
    return "placement:\n" + "\n".join(f"  {lay.role:<9} {lay.describe()}" for lay in layouts.values())


def validate_for_world(cfg: Config, world_size: int, *, warn: bool = True) -> None:
    """Check what depends on the number of ranks, before any model is built; with ``warn``, also log one
    warning for each setting that is accepted but does nothing or works against itself (:func:`warn_ineffective`,
    a token budget below one row). ``megarl train``'s pre-run checks warn; the trainer's own call passes
    ``warn=False`` (in a one-process run both run in one process, and the warnings came twice).

    Raises:
        ConfigError: a pool or a mesh that does not fit the world (:func:`role_layouts`), roles that cannot take
            turns (:func:`check_turns`), an ``actor.parallel.ep`` that megatron's layout cannot hold
            (:func:`global_layout`), batch sizes that a DP size does not divide, or with VPP micro-batch
            counts that are not a multiple of PP (:func:`check_virtual_pipeline`).
    """
    layouts = role_layouts(cfg, world_size)
    check_turns(layouts)
    check_runnable(layouts, world_size)
    try:  # megatron's own layout, as the ranks set it (expert parallelism over the ranks of a stage)
        global_layout(layouts, world_size, cfg.actor.parallel.ep)
    except LayoutError as e:
        raise ConfigError(f"actor.parallel.ep: {e}") from None
    check_rollout_pool(cfg, layouts, world_size)
    roles = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.algorithm.uses_critic else [])
    for role, rc in roles:
        p, dp = rc.parallel, layouts[role].dp
        require(cfg.rollout_batch_size % rc.ppo_mini_batch_size == 0, f"{role}.ppo_mini_batch_size",
                 f"{rc.ppo_mini_batch_size} does not divide the rollout batch data.prompts_per_step * rollout.n "
                 f"= {cfg.rollout_batch_size}")
        if rc.max_tokens_per_micro_batch:  # micro-batches by token count: any number of rows each
            require(rc.ppo_mini_batch_size % dp == 0, f"{role}.ppo_mini_batch_size",
                     f"{rc.ppo_mini_batch_size} is not a multiple of dp ({dp})")
        else:
            mbs = rc.update_micro_batch_size(dp)
            require(rc.ppo_mini_batch_size % (dp * mbs) == 0, f"{role}.ppo_mini_batch_size",
                     f"{rc.ppo_mini_batch_size} is not a multiple of dp ({dp}) x micro_batch_size "
                     f"({mbs}); use a multiple of {dp * mbs}")
        require(not (rc.max_tokens_per_micro_batch and not rc.sequence_packing and p.pp > 1),
                 f"{role}.max_tokens_per_micro_batch", f"needs {role}.parallel.pp=1 (megatron's pipeline schedule "
                 f"sends one activation shape for every micro-batch); set it to 0, use pp=1 or set "
                 f"{role}.sequence_packing=true (packed micro-batches of one shape)")
        longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
        if warn and 0 < rc.max_tokens_per_micro_batch < longest:
            log.warning("%s.max_tokens_per_micro_batch=%d is below one row of up to %d tokens (data.max_prompt_length"
                        " + rollout.max_new_tokens): a longer row gets a micro-batch of its own, over the budget; set "
                        "it to at least %d", role, rc.max_tokens_per_micro_batch, longest, longest)
        check_context_parallel(rc, role)
        check_virtual_pipeline(cfg, rc, role, layouts[role])
    if warn:
        warn_ineffective(cfg, layouts, world_size)
    for role in MEGATRON_ROLES:
        if role in layouts:
            lay = layouts[role]
            require(cfg.rollout_batch_size % lay.dp == 0, "data.prompts_per_step",
                     f"the rollout batch ({cfg.rollout_batch_size} sequences) is not divisible by {role} "
                     f"dp={lay.dp} (pool {lay.pool!r})")
    if cfg.algorithm.uses_critic:
        a, c = layouts["actor"], layouts["critic"]
        require((c.ranks, c.tp, c.pp, c.dp, c.cp, c.vpp) == (a.ranks, a.tp, a.pp, a.dp, a.cp, a.vpp), "critic.parallel",
                 f"the critic runs on the actor's ranks and mesh: set placement.critic={a.pool!r} and tp={a.tp}, "
                 f"pp={a.pp}, dp={a.dp}, cp={a.cp} (got {c.describe()})")
    ro = layouts["rollout"]
    require(cfg.rollout.tp == 1 or cfg.data.prompts_per_step % ro.dp == 0, "data.prompts_per_step",
             f"{cfg.data.prompts_per_step} prompts are not divisible by the rollout's dp={ro.dp} (pool "
             f"{ro.pool!r} of {len(ro.ranks)} ranks / rollout.tp={ro.tp}); megarl pads no batch: use a multiple "
             f"of {ro.dp}")
    if "group_index" in ADVANTAGES.entry(cfg.algorithm.name).needs:
        require(cfg.rollout.n >= 2, "rollout.n", f"{cfg.algorithm.name} compares samples of a prompt: use n >= 2")




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


def rollout_split(layouts: dict[str, RoleLayout], world_size: int) -> bool:
    """The rollout engine is on a pool of its own (not the whole world)."""
    return layouts["rollout"].ranks != tuple(range(world_size))


def check_rollout_pool(cfg: Config, layouts: dict[str, RoleLayout], world_size: int) -> None:
    """A rollout pool other than the whole world holds no Megatron role and no reward scoring (its ranks only
    generate), and its size is a multiple of the actor's tp (megatron-core lays its state over every rank of
    the world: the rollout ranks form TP groups of their own in it, unused); ``trainer.mode=async`` needs such a
    pool, and validation and DAPO's dynamic sampling are refused there (not built yet).

    Raises:
        ConfigError: naming the field (``placement.rollout``, ``placement.reward``, ``trainer.mode``,
            ``validation.enabled``, ``algorithm.dynamic_sampling.enabled``), the
            pools and ranks, and the fix.
    """
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
    if cfg.algorithm.dynamic_sampling.enabled:
        raise ConfigError(f"algorithm.dynamic_sampling.enabled: with the rollout on {ro.describe()} (a pool of its "
                          "own) the rollout ranks cannot score the extra rounds it needs; set it to false, or "
                          "placement.rollout=all")
    if cfg.validation.enabled:
        raise ConfigError(f"validation.enabled: validation with the rollout on {ro.describe()} (a pool of its own) "
                          "is not built yet; set validation.enabled=false, or placement.rollout=all")


def training_group(layouts: dict[str, RoleLayout], world_size: int):
    """The group of every rank outside a rollout pool of its own (None when the rollout is on the whole
    world: the training ranks are the world). Collective: call on every rank, in the same order."""
    if not rollout_split(layouts, world_size):
        return None
    rollout = set(layouts["rollout"].ranks)
    return dist.new_group([r for r in range(world_size) if r not in rollout])


def is_split(layouts: dict[str, RoleLayout], world_size: int) -> bool:
    """Some Megatron role is on a pool other than the whole world."""
    return any(lay.ranks != tuple(range(world_size)) for r, lay in layouts.items() if r in MEGATRON_ROLES)


def global_layout(layouts: dict[str, RoleLayout], world_size: int, ep: int = 1) -> ParallelLayout:
    """The layout megatron's ``parallel_state`` is set to: the actor's when every Megatron role is on the whole
    world, else ``tp x 1 x world/tp`` (see the module docstring). ``ep`` (``actor.parallel.ep``) splits the
    experts of a mixture-of-experts model over the ranks of each stage.

    Raises:
        ConfigError: ``ep > 1`` with Megatron roles on split pools, or an ``ep`` that does not divide the
            actor's ``tp * dp``.
    """
    a = layouts["actor"]
    if not is_split(layouts, world_size):
        dp = ep // math.gcd(a.tp, ep)  # the least dp whose tp x dp ranks ep divides
        require(ep == 1 or (a.tp * a.dp) % ep == 0, "actor.parallel.ep",
                f"{ep} does not divide the actor's tp={a.tp} x dp={a.dp} ranks of a pipeline stage (expert "
                f"parallelism splits the experts over a stage's tp x dp ranks: dp must be a multiple of "
                f"{'ep' if dp == ep else dp}); set actor.parallel.dp={dp} (or a multiple: the job runs on "
                f"{a.tp * a.pp * a.cp * dp} ranks at dp={dp}) or actor.parallel.ep=1")
        return ParallelLayout(tp=a.tp, pp=a.pp, dp=a.dp, ep=ep, cp=a.cp, vpp=a.vpp)
    require(ep == 1, "actor.parallel.ep", f"{ep}: expert parallelism needs every Megatron role on the whole "
            "world (no placement pools); set ep=1 or drop the pools")
    return ParallelLayout(tp=a.tp, pp=1, dp=world_size // a.tp)


def build_pool_groups(layouts: dict[str, RoleLayout], world_size: int, ep: int = 1) -> dict[str, PoolGroups]:
    """The groups of every Megatron role's pool; call on every rank, in the same order (``new_group`` is
    collective), after ``torch.distributed`` is initialised. ``ep``: the expert-parallel size of every role's
    mesh (only with all roles on the whole world, :func:`global_layout`).

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
        mesh = ParallelLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=ep, cp=lay.cp, vpp=lay.vpp)
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
