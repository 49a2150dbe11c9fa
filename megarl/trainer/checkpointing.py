"""A run's checkpoints: what the run folder allows (:func:`check_run_folder`, before any rank starts), saving
the trained roles and the run's progress (:meth:`Checkpointer.save` of a :class:`~megarl.trainer.run_state.
RunState`) and resuming them (:meth:`Checkpointer.resume`), and what a resumed run changed (:func:`config_changes`).

A checkpoint (``runs/<name>/checkpoints/step_N``, :mod:`megarl.models.checkpoint` writes it atomically) holds a
megatron dist checkpoint of the trained roles (the actor and its optimizer, the critic), the LR schedules, the
data position (the steps trained, with every prompt dynamic sampling's extra rounds drew), the KL controller,
the policy version, every rank's RNG states (Python's, numpy's, torch's CPU and CUDA generators, megatron's
model-parallel CUDA RNG tracker) and, with a rollout pool of its own, the batches in flight. The optimizer state is in
megatron-core's layout-free format, so a run resumes at any TP x PP x DP x EP and placement. A LoRA actor's checkpoint
holds its adapters and their optimizer state, and names its base (``megarl.json``'s ``lora.base``: the run's
``model.path``), which a resume loads again.

What a resumed run samples: every rollout seed is a function of the run's seed, the step, dynamic sampling's
round, the prompt and the sample alone (:meth:`~megarl.trainer.trainer.Trainer.generate` sets the engine's call
counter from the step, whatever ran before), so the checkpoint's step restores the rollout's seeds, and the
loader's position the prompts of the next step and of its extra rounds; nothing else carries over between
steps (dynamic sampling keeps no groups beyond its step). With a rollout pool of its own
(:func:`~megarl.trainer.loop.fit_split`) the checkpoint of step ``s`` means the state after ``save s`` of the
schedule (:mod:`megarl.trainer.pipeline`): the weights of step ``s``, the data position of the steps trained,
and the batches of steps ``s+1 .. s+k`` that the rollout pool had generated ahead with older weights and
handed over (``ranks/in_flight_<rank>.pt``, written by the first training rank): a resume trains on them as the
uninterrupted run did, instead of generating them again with newer weights. So a resumed run reproduces the
uninterrupted one's samples and metrics exactly at the same layout on the CPU (``tests/test_resume.py``), up to
float rounding at another layout; vLLM with ``rollout.request_seeds=false`` samples from its own generator,
whose state no checkpoint holds (a resumed run samples other responses).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megarl.config import Config, ConfigError, to_dict
from megarl.models import checkpoint as ck
from megarl.models.megatron import padded_vocab_size
from megarl.parallel.lifecycle import phase
from megarl.parallel.placement import PoolGroups, share_object
from megarl.trainer.run_state import RunState
from megarl.workers.actor import PolicyWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.offload import RoleOffloads
from megarl.workers.optimizer import LEGACY_OPTIMIZER_FORMAT, OPTIMIZER_CHAIN_PREFIX, OPTIMIZER_FORMAT

log = logging.getLogger(__name__)


def check_run_folder(cfg: Config, world_size: int) -> None:
    """What the run folder's checkpoints allow: a new run needs a folder without any (else a later ``--resume``
    would load an older run's weights); a resumed run needs one, with fewer steps than ``trainer.steps``, that
    this run can load. A checkpoint resumes at any TP x PP x DP x EP and placement (megatron-core's dist-checkpoint
    resharding, the optimizer state in its layout-free format keyed by parameter name, whether the experts have an
    optimizer of their own or not); what cannot change is refused: the model's dtype, a distributed optimizer
    for a plain one, an MoE model's layer spec (TE's grouped experts or the local spec's sequential ones), a
    critic the checkpoint lacks, a TP whose padded vocabulary differs, any layout of a checkpoint written
    before that format (``dp_reshardable``), and for an MoE checkpoint written before its optimizer state was
    keyed by name (``optimizer_chain_prefix``) a TP or EP that gives the experts an optimizer of their own or
    takes it away (TP or EP above 1 on one side only); for a LoRA actor the adapters' shape (``actor.lora``
    rank, alpha, target modules, experts: dropout and sync may change) and its base (``model.path``).

    Raises:
        ConfigError: naming ``run.name`` (a new run on an earlier run's checkpoints), ``trainer.resume`` (no
            checkpoint, or none sound: :func:`resumable_checkpoint`), ``trainer.steps`` (the run has finished) or the field that cannot change, with the fix.
    """
    found = ck.run_checkpoints(cfg.run.run_dir)
    if not cfg.trainer.resume:
        if found:
            raise ConfigError(f"run.name: the run folder {cfg.run.run_dir} holds checkpoints of an earlier run "
                              f"(newest {found[-1].name}); continue that run with --resume (trainer.resume=true), "
                              "or start this one under another run.name (or delete the folder)")
        return
    if not found:
        raise ConfigError(f"trainer.resume: the run folder {cfg.run.run_dir} holds no checkpoint to resume from; "
                          "start the run without --resume, or check run.name and run.output_dir")
    newest = resumable_checkpoint(cfg)
    done = int(newest.name.removeprefix(ck.CHECKPOINT_PREFIX))
    if done >= cfg.trainer.steps:
        raise ConfigError(f"trainer.steps: the run in {cfg.run.run_dir} has finished its {done} steps (newest "
                          f"checkpoint {newest.name}); to train on, raise trainer.steps (e.g. --resume "
                          f"trainer.steps={done + cfg.trainer.steps})")
    meta = ck.read_meta(newest)
    then, now = meta.get("config") or {}, to_dict(cfg)
    if meta.get("optimizer_format") is None:  # written before the reshardable format: its own layout only
        before = _layout_record(then, meta.get("world_size"))
        after = _layout_record(now, world_size)
        if before != after:
            changed = ", ".join(f"{k} {before.get(k)} -> {after.get(k)}" for k in after
                                if before.get(k) != after.get(k))
            raise ConfigError(f"trainer.resume: {newest} was written by an earlier megarl at another layout "
                              f"({changed}) in an optimizer format that does not reshard: resume with the layout "
                              f"it was written at, or start a new run from its weights alone (model.path={newest})")
        return
    fixed = ("model.dtype", "actor.optim.distributed", "critic.optim.distributed",
             "actor.lora.rank", "actor.lora.alpha", "actor.lora.target_modules", "actor.lora.experts")
    refused = [f for f in fixed if _field(then, f) != _field(now, f) and (f != "critic.optim.distributed" or
                                                                           "critic" in then)]
    if "lora" in meta and _field(then, "model.path") != _field(now, "model.path"):
        refused.append(f"model.path (the base the LoRA adapters were trained on: {_field(then, 'model.path')})")
    if cfg.algorithm.uses_critic and meta.get("critic_scheduler") is None:
        refused.append("algorithm.name (a critic the checkpoint does not hold)")
    is_moe = ck.checkpoint_spec(newest).is_moe
    if is_moe and ck.checkpoint_uses_te(newest) != cfg.actor.kernels.transformer_engine:
        refused.append("actor.kernels.transformer_engine (an MoE model's experts load only under the layer spec "
                       "that wrote them)")
    vocab = meta["hf_config"]["vocab_size"]
    for role in ("actor", "critic") if cfg.algorithm.uses_critic else ("actor",):
        if is_moe and meta.get("optimizer_chain_prefix", True):
            chained = [{k: _field(c, k) or 1 for k in (f"{role}.parallel.tp", "actor.parallel.ep")}  # every role's EP
                       for c in (then, now)]
            if (max(chained[0].values()) > 1) != (max(chained[1].values()) > 1):  # _in_current_chain
                refused.append(" and ".join(f"{k} ({chained[0][k]} -> {chained[1][k]})" for k in chained[0]
                                            if chained[0][k] != chained[1][k])
                               + " (the experts' optimizer state, in the keys of a checkpoint written by an earlier "
                               "megarl: keep tp and ep both 1 or not both 1)")
        tp_then, tp_now = _field(then, f"{role}.parallel.tp"), _field(now, f"{role}.parallel.tp")
        if tp_then and tp_now and padded_vocab_size(vocab, tp_then) != padded_vocab_size(vocab, tp_now):
            refused.append(f"{role}.parallel.tp ({tp_then} -> {tp_now} pads the vocabulary of {vocab} to "
                           f"{padded_vocab_size(vocab, tp_then)} -> {padded_vocab_size(vocab, tp_now)})")
    if refused:
        raise ConfigError(f"trainer.resume: {newest} cannot be resumed with a changed {', '.join(refused)}: "
                          "keep the checkpoint's value, or start a new run from its weights alone "
                          f"(model.path={newest})")


_warned: set[str] = set()  # damaged checkpoints this process has warned of (check_run_folder runs twice in one)


def resumable_checkpoint(cfg: Config, failed: ck.CheckpointDamagedError | None = None) -> Path:
    """The checkpoint a resume of ``cfg``'s run loads: its newest one whose files are sound
    (:func:`megarl.models.checkpoint.sound_checkpoint`, checked before any rank loads it); after ``failed``, the
    load of a checkpoint that did not load, the newest sound one older than it. Newer ones found damaged are
    passed over with a warning naming the file and the cause (once per job: megarl's launcher speaks for its
    ranks; a failed load, which only the ranks meet, rank 0 names).

    Raises:
        ConfigError: naming ``trainer.resume``, the damaged checkpoint, its file and the cause, when no sound
            checkpoint is left (``trainer.keep_checkpoints`` may have kept only that one) and how to go on. Its
            status (2) is never retried by ``--max-restarts``: a restart would meet the same files.
    """
    from megarl.parallel.lifecycle import started_by_megarl

    path, damaged = ck.sound_checkpoint(cfg.run.run_dir, failed and failed.path)
    damaged = [(failed.path, failed.fault), *damaged] if failed else damaged
    if path is None:
        newest, fault = damaged[0]
        older = (f"; the older ones are damaged too: " + ", ".join(f"{p.name} ({f})" for p, f in damaged[1:])
                 if len(damaged) > 1 else f"; no older checkpoint is kept (trainer.keep_checkpoints="
                 f"{cfg.trainer.keep_checkpoints})")
        raise ConfigError(f"trainer.resume: the checkpoint {newest} is damaged: {fault}{older}. Restore the file, "
                          f"or start the run over without --resume after moving {cfg.run.run_dir / 'checkpoints'} "
                          "aside (or under another run.name)")
    # a rank of megarl's launcher leaves it to the launcher; a launcher that --max-restarts started warns itself
    rank_of_megarl = started_by_megarl() and "RANK" in os.environ
    for p, fault in damaged:
        if str(p) not in _warned and (failed and dist.get_rank() == 0 or not failed and not rank_of_megarl):
            log.warning("the checkpoint %s is damaged: %s; resuming from the older %s instead (the steps after it "
                        "are trained again)", p, fault, path.name)
        _warned.add(str(p))
    return path


def _field(config: dict[str, Any], dotted: str) -> Any:
    """The value of a dotted field in a config as plain data, or None."""
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def config_changes(then: dict[str, Any], now: dict[str, Any], prefix: str = "") -> dict[str, list]:
    """``{dotted field: [old, new]}`` of every field that differs between two configs as JSON data (a
    checkpoint's ``config``, :func:`~megarl.config.to_dict` through JSON), ``trainer.resume`` aside: what a
    resumed run changed."""
    out: dict[str, list] = {}
    for k in sorted(set(then) | set(now)):
        a, b, name = then.get(k), now.get(k), f"{prefix}{k}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, f"{name}."))
        elif a != b and name != "trainer.resume":
            out[name] = [a, b]
    return out


def _layout_record(config: dict[str, Any], world_size: int | None) -> dict[str, Any]:
    """What a ``dp_reshardable`` checkpoint's sharding depends on, from a config as plain data."""
    def mesh(section: dict[str, Any] | None) -> str | None:  # ep (experts' optimizer shards) where it is not 1
        if not section:
            return None
        ep, cp, vpp = section.get("ep") or 1, section.get("cp") or 1, section.get("vpp") or 1
        return (f"tp={section.get('tp')} pp={section.get('pp')}" + (f" ep={ep}" if ep != 1 else "")
                + (f" cp={cp}" if cp != 1 else "") + (f" vpp={vpp}" if vpp != 1 else ""))

    placement = dict(config.get("placement") or {})
    return {"world_size": world_size, "actor.parallel": mesh(config.get("actor", {}).get("parallel")),
            "critic.parallel": mesh(config.get("critic", {}).get("parallel")),
            "placement.reference_parallel": mesh(placement.pop("reference_parallel", None)),
            "placement": placement}



def rng_states() -> dict[str, Any]:
    """This rank's RNG states: Python's, numpy's, torch's CPU generator, and where there is a GPU every CUDA
    device's generator and megatron's model-parallel CUDA RNG tracker (dropout's streams)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        states["cuda"] = torch.cuda.get_rng_state_all()
        states["megatron_tracker"] = get_cuda_rng_tracker().get_states()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore :func:`rng_states`; the CUDA ones where this rank has a GPU and as many devices as the saving
    rank (a checkpoint written on the CPU, or by an earlier megarl, has none: those generators keep their seeds)."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if torch.cuda.is_available() and "cuda" in states:
        if len(states["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states["cuda"])
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        if set(states["megatron_tracker"]) == set(tracker.get_states()):
            tracker.set_states(states["megatron_tracker"])



class Checkpointer:
    """Saves and resumes one run's checkpoints on this rank (every rank calls, in the same order): the trained
    roles' weights, optimizer state and LR schedules, the run's progress (:class:`~megarl.trainer.run_state.
    RunState`, passed to :meth:`save` and :meth:`resume`), every rank's RNG states and, with a rollout pool of its
    own, the batches in flight.

    Args:
        cfg: the run's config.
        actor / critic: the trained roles' workers on this rank (None where their pool does not hold it, or
            without a critic).
        pools: the Megatron roles' pools (:func:`~megarl.parallel.placement.build_pool_groups`).
        rollout_ranks: the rollout engine's ranks (the whole world, or a pool of its own).
        offloads: the trained roles' host offloads (their state is saved and loaded on the device).
        model_meta: the model's part of ``megarl.json`` (:func:`~megarl.models.checkpoint.model_meta`).
    """

    def __init__(self, cfg: Config, *, actor: PolicyWorker | None, critic: CriticWorker | None,
                 pools: dict[str, PoolGroups], rollout_ranks: tuple[int, ...], offloads: RoleOffloads,
                 model_meta: dict[str, Any]):
        self.cfg, self.actor, self.critic, self.pools = cfg, actor, critic, pools
        self.rollout_ranks, self.offloads, self.model_meta = rollout_ranks, offloads, model_meta
        self.split_rollout = tuple(rollout_ranks) != tuple(range(dist.get_world_size()))

    def _sharded_state(self, is_loading: bool, optimizer_format: str = OPTIMIZER_FORMAT,
                       chain_prefix: bool = OPTIMIZER_CHAIN_PREFIX) -> dict[str, Any]:
        """The sharded state of the trained roles held on this rank (none on a pool of other roles)."""
        state = ({"actor": self.actor.sharded_state_dict(is_loading, optimizer_format, chain_prefix)}
                 if self.actor is not None else {})
        if self.critic is not None:
            state["critic"] = self.critic.sharded_state_dict(is_loading, optimizer_format, chain_prefix)
        return state

    def save(self, state: RunState, in_flight: dict[int, tuple[Any, int]] | None = None) -> Path:
        """Checkpoint the run after ``state.step`` steps: actor (+ optimizer), critic, LR schedules, the run's
        progress (:meth:`~megarl.trainer.run_state.RunState.state_dict`; the data position the training ranks'),
        RNG states and the batches in flight; the oldest checkpoints beyond ``trainer.keep_checkpoints`` are
        deleted. Sets ``state.last_checkpoint`` and ``state.saved_at``; returns the checkpoint's folder.

        Args:
            in_flight: with a rollout pool of its own, ``{step: (RolloutOutput, policy version)}`` of the batches
                generated ahead and handed over, on the training ranks (None on the rollout ranks and
                colocated); the first training rank writes them, and the meta's ``in_flight`` names their steps
                and that rank.
        """
        cfg, pools = self.cfg, self.pools
        rank, world = dist.get_rank(), dist.get_world_size()
        path = cfg.run.run_dir / "checkpoints" / f"{ck.CHECKPOINT_PREFIX}{state.step:06d}"
        flight_rank = next(r for r in range(world) if r not in self.rollout_ranks) if self.split_rollout else None
        flight_steps = share_object(sorted(in_flight or {}), [flight_rank]) if self.split_rollout else []
        progress = state.state_dict()
        # the training ranks' data position (a rollout pool of its own draws the batches it generates ahead)
        progress["loader"] = share_object(progress["loader"], pools["actor"].ranks)
        meta = {**self.model_meta, **progress,
                "in_flight": {"steps": flight_steps, "rank": flight_rank} if flight_steps else None,
                "actor_scheduler": share_object(self.actor and self.actor.scheduler.state_dict(),
                                                pools["actor"].ranks),
                "critic_scheduler": share_object(self.critic and self.critic.scheduler.state_dict(),
                                                 pools["critic"].ranks) if "critic" in pools else None,
                "config": to_dict(cfg), "world_size": world, "optimizer_format": OPTIMIZER_FORMAT,
                "optimizer_chain_prefix": OPTIMIZER_CHAIN_PREFIX}
        per_rank = {"rng": rng_states()}
        if flight_steps and rank == flight_rank:
            per_rank["in_flight"] = in_flight
        self.offloads.to_device()  # an offloaded optimizer state is saved from the device, then back to the host
        with phase("checkpoint"):
            ck.save_checkpoint(path, self._sharded_state(is_loading=False), meta, per_rank=per_rank)
        self.offloads.to_host(("grads", "optimizer"))
        state.last_checkpoint = path
        state.saved_at = time.monotonic()
        if rank == 0:
            for p in ck.run_checkpoints(cfg.run.run_dir)[:-cfg.trainer.keep_checkpoints]:
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
        return path

    def resume(self, state: RunState) -> None:
        """Load the run folder's newest checkpoint (:func:`check_run_folder` found one this run can load) into
        the trained roles and ``state``, at this run's layout: weights, optimizer state, the run's progress (data
        position, KL controller, step, policy version), RNG states and, with a rollout pool of its own, the
        batches in flight (``state.in_flight``, for :func:`~megarl.trainer.loop.fit_split`). The LR schedule
        follows the current config from the checkpoint's update count on; what the config changed since the
        checkpoint is logged and kept for the summary (``state.resumed``). A checkpoint that does not load (bytes
        overwritten, its files' sizes unchanged) is passed over for the older sound one, with a warning naming
        its file (:func:`resumable_checkpoint`); with none left, a ConfigError (status 2, never retried)."""
        rank = dist.get_rank()
        path = resumable_checkpoint(self.cfg)  # the newest sound one (check_run_folder warned of damaged ones)
        self.offloads.to_device()
        while True:
            try:
                meta = ck.read_meta(path)
                with phase("resume"):
                    loaded = ck.load_checkpoint(path, self._sharded_state(
                        is_loading=True, optimizer_format=meta.get("optimizer_format", LEGACY_OPTIMIZER_FORMAT),
                        chain_prefix=meta.get("optimizer_chain_prefix", True)))
                # each rank's RNG states; a rank the checkpoint's world did not have takes rank 0's
                rng = ck.load_per_rank(path, "rng", rank) or ck.load_per_rank(path, "rng", 0)
                break
            except ck.CheckpointDamagedError as e:
                path = resumable_checkpoint(self.cfg, e)
        if self.actor is not None:
            self.actor.load_sharded_state(loaded["actor"])
            self.actor.resume_schedule(meta["actor_scheduler"]["num_steps"])
        if self.critic is not None:
            self.critic.load_sharded_state(loaded["critic"])
            self.critic.resume_schedule(meta["critic_scheduler"]["num_steps"])
        state.load_state_dict(meta)
        if rng is not None:
            set_rng_states(rng)
        elif rank == 0:
            log.warning("the checkpoint %s holds no RNG states (ranks/rng_<rank>.pt: an older or hand-made "
                        "checkpoint); the run goes on from the generators' seeds, so it will not reproduce the "
                        "uninterrupted run", path)
        flight = meta.get("in_flight")  # the batches a rollout pool of its own had generated ahead
        if flight and self.split_rollout:
            held = None if rank in self.rollout_ranks else ck.load_per_rank(path, "in_flight", flight["rank"])
            state.in_flight = {int(s): held and held[int(s)] for s in flight["steps"]}
        elif flight:
            log.warning("resuming without a rollout pool of its own: the batches of steps %s, in flight at the "
                        "save, are generated again with the checkpoint's weights", flight["steps"])
        self.offloads.to_host(("grads", "optimizer"))
        state.last_checkpoint = path
        changed = config_changes(meta.get("config") or {}, json.loads(json.dumps(to_dict(self.cfg), default=str)))
        state.resumed = {"checkpoint": str(path), "step": state.step, "changed": changed}
        log.info("resumed from %s at step %d%s", path, state.step,
                 "; changed since: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
                 if changed else "")
