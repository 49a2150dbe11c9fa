"""The RL trainer: ``megarl train`` runs :func:`train` on every rank (SPMD, launched by torchrun or SLURM).

One step (:meth:`Trainer.step`) reads top to bottom:

    reshard actor -> rollout engine | generate | score | old, reference log-probs (values)
    | advantages | critic update | actor update | metrics (| validation | checkpoint)

and :meth:`Trainer.fit` validates before the first step and after the last one (:mod:`.validation`).

Every rank holds the whole step's batch (prompts and responses are small next to the models); the Megatron
workers compute on their data-parallel shares and gather the results, so the advantage estimators see every
sample of a group and every rank agrees on them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megarl.algos.aggregation import masked_mean, masked_var
from megarl.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from megarl.algos.registry import ADVANTAGES
from megarl.algos.rollout_correction import rollout_correction
from megarl.algos.shaping import overlong_penalty
from megarl.measure.flops import peak_bf16_flops
from megarl.measure.throughput import step_perf_metrics
from megarl.measure.timers import PhaseTimer
from megarl.config import MEGATRON_ROLES, Config, ConfigError, absolute_paths, to_dict
from megarl.data.dataset import PromptDataset
from megarl.data.loader import PromptBatch, PromptLoader
from megarl.models import checkpoint as ck
from megarl.models.hf_io import load_tokenizer
from megarl.models.layout import hf_layout, megatron_layout, vllm_layout
from megarl.models.megatron import padded_vocab_size
from megarl.models.spec import ModelSpec
from megarl.parallel.lifecycle import peer_failures_named, phase, record_peers
from megarl.parallel.mesh import init_distributed, initialize_model_parallel, launch_info, ranks_per_node
from megarl.parallel.placement import (build_pool_groups, global_layout, join_optimizer_setup, placement_summary,
                                      role_layouts, rollout_split, share_object, share_tensor, training_group,
                                      validate_for_world)
from megarl.parallel.restart import RequeueRequested, read_restarts, requeue_requested
from megarl.parallel.watchdog import progress_watched
from megarl.reshard.executor import execute_plan
from megarl.reshard.planner import plan_reshard
from megarl.rewards.registry import load_reward_fn
from megarl.rollout.base import RolloutOutput, RolloutStats, SamplingConfig
from megarl.rollout.data_parallel import (gather_shares, generate_data_parallel, map_data_parallel, map_share,
                                          rollout_dp_group)
from megarl.trainer.batch import RolloutBatch, build_batch
from megarl.trainer.metrics import MetricsLogger, read_metrics, summary_text
from megarl.trainer.offload import HostOffload
from megarl.trainer.pipeline import schedule, staleness
from megarl.trainer.preflight import (check_files, prepare_files, read_prompts, tokenizer_source,
                                      validate_for_model)
from megarl.trainer.run_lock import RunLock
from megarl.trainer.validation import Validation, append_samples
from megarl.trainer.workers import LEGACY_OPTIMIZER_FORMAT, OPTIMIZER_FORMAT, CriticWorker, PolicyWorker

log = logging.getLogger(__name__)


def prepare_data(cfg: Config, files: list[str], field: str = "data.train_files") -> list[str]:
    """Data files (``field`` of the config), prepared first when missing and ``data.prepare`` makes them
    (:func:`~megarl.trainer.preflight.prepare_files`; ``megarl train`` has done so before any rank started).

    Raises:
        ConfigError: a missing file and nothing to prepare it from.
    """
    check_files(cfg, field, files)
    # Rank 0 alone looks and prepares; every rank then waits at the barrier. (A rank that looked for itself and
    # found the files rank 0 had just written skipped the barrier that rank 0 then waited at forever.)
    if dist.get_rank() == 0:
        prepare_files(cfg, files)
    dist.barrier()
    still = [f for f in files if not Path(f).is_file()]
    if still:
        raise ConfigError(f"{field}: {still} still missing after preparing GSM8K into {Path(still[0]).parent}")
    return list(files)


def load_prompts(cfg: Config, tokenizer, files: list[str] | None = None,
                 field: str = "data.train_files") -> PromptDataset:
    """Tokenised, templated, length-filtered prompts of ``files`` (default: the train files;
    :func:`~megarl.trainer.preflight.read_prompts`)."""
    return read_prompts(cfg, tokenizer, prepare_data(cfg, list(cfg.data.train_files if files is None else files),
                                                     field), field)


def resolve_eos(spec: ModelSpec, tokenizer, source: str, generation_config: dict | None = None) -> ModelSpec:
    """``spec`` with every token that ends a response: the config's EOS ids, then those of the model's
    ``generation_config.json`` that the config lacks (Llama-3-Instruct ends a chat turn with ``<|eot_id|>``,
    named only there; vLLM and ``generate`` stop at both too); where neither names one (``eos_token_id: null``,
    a checkpoint saved without generation settings), the tokenizer's EOS, said in a warning.

    Raises:
        ConfigError: naming ``model.path`` and the fix, when neither the configs nor the tokenizer names one.
    """
    extra = (generation_config or {}).get("eos_token_id")
    extra = [extra] if isinstance(extra, int) else list(extra or [])
    ids = tuple(dict.fromkeys([*spec.eos_token_ids, *(int(i) for i in extra)]))
    if ids:
        return spec.replace(eos_token_ids=ids) if ids != spec.eos_token_ids else spec
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"model.path: neither the config of {source} (eos_token_id: null) nor its tokenizer "
                          "names an end-of-sequence token, so responses could not end; set eos_token_id in its "
                          "config.json or eos_token in its tokenizer_config.json")
    log.warning("the config of %s has no eos_token_id: responses end at the tokenizer's EOS %r (id %d)", source,
                tokenizer.eos_token, eos)
    return spec.replace(eos_token_ids=(int(eos),))


def check_run_folder(cfg: Config, world_size: int) -> None:
    """What the run folder's checkpoints allow: a new run needs a folder without any (else a later ``--resume``
    would load an older run's weights); a resumed run needs one, with fewer steps than ``trainer.steps``, that
    this run can load. A checkpoint resumes at any TP x PP x DP and placement (megatron-core's dist-checkpoint
    resharding, the optimizer state in its layout-free format); what cannot change is refused: the model's
    dtype, a distributed optimizer for a plain one, the experts' EP (not resharded yet), an MoE model's layer
    spec (TE's grouped experts or the local spec's sequential ones), a critic the checkpoint lacks, a TP whose padded vocabulary differs, and any layout of a checkpoint written before that
    format (``dp_reshardable``).

    Raises:
        ConfigError: naming ``run.name`` (a new run on an earlier run's checkpoints), ``trainer.resume`` (no
            checkpoint), ``trainer.steps`` (the run has finished) or the field that cannot change, with the fix.
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
    newest = found[-1]
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
    refused = [f for f in ("model.dtype", "actor.optim.distributed", "critic.optim.distributed", "actor.parallel.ep")
               if _field(then, f) != _field(now, f) and (f != "critic.optim.distributed" or "critic" in then)]
    if cfg.algorithm.uses_critic and meta.get("critic_scheduler") is None:
        refused.append("algorithm.name (a critic the checkpoint does not hold)")
    if ck.checkpoint_spec(newest).is_moe and ck.checkpoint_uses_te(newest) != cfg.actor.kernels.transformer_engine:
        refused.append("actor.kernels.transformer_engine (an MoE model's experts load only under the layer spec "
                       "that wrote them)")
    vocab = meta["hf_config"]["vocab_size"]
    for role in ("actor", "critic"):
        tp_then, tp_now = _field(then, f"{role}.parallel.tp"), _field(now, f"{role}.parallel.tp")
        if tp_then and tp_now and padded_vocab_size(vocab, tp_then) != padded_vocab_size(vocab, tp_now):
            refused.append(f"{role}.parallel.tp ({tp_then} -> {tp_now} pads the vocabulary of {vocab} to "
                           f"{padded_vocab_size(vocab, tp_then)} -> {padded_vocab_size(vocab, tp_now)})")
    if refused:
        raise ConfigError(f"trainer.resume: {newest} cannot be resumed with a changed {', '.join(refused)}: "
                          "keep the checkpoint's value, or start a new run from its weights alone "
                          f"(model.path={newest})")


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


def load_validation(cfg: Config, tokenizer, score, spec) -> Validation:
    """The held-out evaluation of ``cfg.validation``, its prompts templated and filtered like the training
    prompts (:func:`load_prompts`), scored by ``score(prompts, responses, ground_truths) -> [B] scores``."""
    return Validation(cfg.validation, load_prompts(cfg, tokenizer, cfg.validation.files, "validation.files"),
                      score=score, tokenizer=tokenizer, seed=cfg.run.seed,
                      max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=tuple(spec.eos_token_ids))


def make_engine(cfg: Config, spec):
    """The rollout engine of ``rollout.engine``, without weights: transformers on this rank's CPU, or vLLM on
    its GPU (the trainer builds it after the Megatron roles, so its memory budget sees them on the GPU; its
    weights arrive by reshard from the actor's GPU shards). vLLM engines of ``rollout.tp`` consecutive ranks
    each; prompts are split over the rollout data-parallel group
    (:func:`~megarl.rollout.data_parallel.rollout_dp_group`).
    """
    r = cfg.rollout
    if r.engine == "hf":
        from megarl.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(spec, max_batch_size=r.max_batch_size)
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(spec, tp=r.tp, gpu_memory_utilization=r.gpu_memory_utilization,
                             enforce_eager=r.enforce_eager, max_model_len=r.max_model_len, seed=cfg.run.seed)


def rollout_layout(cfg: Config, spec: ModelSpec, ranks) -> "Layout":
    """The engines' weight layout on the rollout pool's ``ranks`` (what the reshard writes), known on every
    rank, engine or not: whole HF tensors for transformers (experts fused, as
    :meth:`~megarl.rollout.hf_engine.HFRolloutEngine.weight_layout` holds them), vLLM's TP shards of ``rollout.tp``."""
    if cfg.rollout.engine == "hf":
        return hf_layout(spec, ranks, fused_experts=True)
    return vllm_layout(spec, cfg.rollout.tp, ranks)


class Trainer:
    """The state of one RL run on this rank: workers, rollout engine, reshard engine, data and logger.

    Raises:
        ConfigError: from :func:`~megarl.parallel.placement.validate_for_world` and data loading, before any model is
            built.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg = absolute_paths(cfg)  # what the run records resolves the same from any folder
        validate_for_world(cfg, launch_info().world_size)  # before the rendezvous: a wrong world stops here
        info = init_distributed(timeout_s=cfg.trainer.timeout_s)
        record_peers()
        self.rank, self.world = info.rank, info.world_size
        self.layouts = role_layouts(cfg, self.world)
        if self.rank == 0:
            log.info("%s", placement_summary(self.layouts))
        self.run_dir = cfg.run.run_dir
        self.spec, _, tok_source = ck.source_spec(None if cfg.model.path == "default" else cfg.model.path)
        validate_for_model(cfg, self.spec)
        self.source_config = ck.source_config(None if cfg.model.path == "default" else cfg.model.path)
        self.generation_config = ck.source_generation_config(None if cfg.model.path == "default" else cfg.model.path)
        self.tokenizer_source = tokenizer_source(cfg, tok_source)
        self.tokenizer = load_tokenizer(self.tokenizer_source)
        self.spec = resolve_eos(self.spec, self.tokenizer, cfg.model.path, self.generation_config)
        self.prompts = load_prompts(cfg, self.tokenizer)  # bad data fails before any model is built
        self.reward_ranks = self.layouts["reward"].ranks  # a reward model is loaded on its pool only
        self.reward_fn = load_reward_fn(cfg.reward.fn, cfg.reward.kwargs) if self.rank in self.reward_ranks else None
        self.validation = None
        if cfg.validation.enabled:
            self.validation = load_validation(cfg, self.tokenizer, self._rewards, self.spec)
            self.validation.hold_out(self.prompts)
        ds = cfg.algorithm.dynamic_sampling
        rounds = 1 + (ds.max_extra_rounds if ds.enabled else 0)  # prompt batches a step may draw
        epochs = max(1, math.ceil(cfg.trainer.steps * rounds * cfg.data.prompts_per_step / len(self.prompts)))
        self.loader = PromptLoader(self.prompts, cfg.data.prompts_per_step, shuffle=cfg.data.shuffle,
                                   seed=cfg.run.seed, epochs=epochs)
        pad = self.spec.pad_token_id
        self.pad_id = pad if pad is not None else self.spec.eos_token_ids[0]

        # Megatron roles on their pools (megarl.parallel.placement; the critic on the actor's): a role is built
        # on the ranks of its pool only, None elsewhere
        self.mesh = global_layout(self.layouts, self.world, cfg.actor.parallel.ep)
        initialize_model_parallel(self.mesh, seed=cfg.run.seed, timeout_s=cfg.trainer.timeout_s)
        self.pools = build_pool_groups(self.layouts, self.world, self.mesh.ep)
        dtype = ck.DTYPES[cfg.model.dtype]
        source = None if cfg.model.path == "default" else cfg.model.path
        updates = cfg.trainer.steps * cfg.actor.ppo_epochs * (cfg.rollout_batch_size // cfg.actor.ppo_mini_batch_size)
        self.actor = self.ref = self.critic = None
        pools = self.pools
        if pools["actor"].holds_here:
            self.actor = PolicyWorker(self.spec, pools["actor"].mesh, "actor", source, dtype, cfg.actor,
                                      trainable=True, total_updates=updates, temperature=cfg.rollout.temperature,
                                      pool=pools["actor"])
        else:
            join_optimizer_setup()
        if "reference" in pools and pools["reference"].holds_here:  # a copy of the actor where it is here
            self.ref = PolicyWorker(self.spec, pools["reference"].mesh, "actor", self.actor or source, dtype,
                                    cfg.actor, trainable=False, temperature=cfg.rollout.temperature,
                                    pool=pools["reference"])
        if "critic" in pools and pools["critic"].holds_here:
            self.critic = CriticWorker(self.spec, pools["critic"].mesh, "critic", source, dtype, cfg.critic,
                                       trainable=True, total_updates=cfg.trainer.steps * cfg.critic.ppo_epochs
                                       * (cfg.rollout_batch_size // cfg.critic.ppo_mini_batch_size),
                                       pool=pools["critic"])
        elif "critic" in pools:
            join_optimizer_setup()
        kl = cfg.algorithm.kl
        self.kl_ctl = (AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.target
                       else FixedKLController(kl.coef))

        # host offload of the trained roles that ask for it; the engine starts with their idle state away
        self.offloads = [HostOffload(w.model, w.optimizer) for w in (self.actor, self.critic)
                         if w is not None and w.rc.offload]
        self.offload_s = {"to_host": sum(o.to_host(("grads", "optimizer")) for o in self.offloads),
                          "to_device": 0.0}

        # rollout engine on its pool (the whole world, or ranks of its own: megarl.trainer.pipeline), fed by the
        # reshard engine; the training ranks share results over their own group, without the rollout ranks
        self.train_group = training_group(self.layouts, self.world)
        self.rollout_ranks = self.layouts["rollout"].ranks
        self.split_rollout = rollout_split(self.layouts, self.world)
        if self.rank in self.rollout_ranks:
            self.engine = make_engine(cfg, self.spec)
        else:
            self.engine = None
            if cfg.rollout.engine == "vllm":  # vLLM's construction is world-wide: the other ranks join it
                from megarl.rollout.vllm_engine import join_engine_construction

                join_engine_construction(cfg.rollout.tp)
        self.rollout_group = rollout_dp_group(cfg.rollout.tp if cfg.rollout.engine == "vllm" else 1,
                                              self.rollout_ranks)
        actor_ranks = pools["actor"].ranks
        src_layout = megatron_layout(self.spec, pools["actor"].mesh, ranks=actor_ranks, role="actor",
                                     use_te=cfg.actor.kernels.transformer_engine,
                                     padded_vocab=share_object(
                                         self.actor and ck.as_chunks(self.actor.model)[0].vocab_size, actor_ranks))
        dst_layout = rollout_layout(cfg, self.spec, self.rollout_ranks)
        self.reshard_plan = plan_reshard(src_layout, dst_layout, ranks_per_node(self.world))
        self.sampling = dict(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                             top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                             stop_token_ids=tuple(self.spec.eos_token_ids))
        self.timer = PhaseTimer()
        self.peak_flops = peak_bf16_flops()  # MFU's denominator per GPU; None on the CPU
        if cfg.trainer.mode == "async" and not cfg.algorithm.rollout_correction.enabled and self.rank == 0:
            log.warning("trainer.mode=async trains on samples of older weights without correcting for them: set "
                        "algorithm.rollout_correction (e.g. preset=token_tis, README 'Asynchronous RL')")
        self.step_idx = 0
        self.policy_version = 0  # the step whose weights the engines hold (or last got)
        self.last_checkpoint: Path | None = None
        self.resumed: dict[str, Any] | None = None  # the checkpoint, step and config changes of a resume
        if cfg.trainer.resume:
            self._resume()

    # ------------------------------------------------------------------ one RL step
    def step(self, prompts, more_prompts=None) -> dict[str, Any]:
        """One RL step on a batch of prompts with the rollout engine on every rank (colocated, synchronous);
        returns its metrics (identical on every rank). ``more_prompts()``: the next batch of prompts, for
        dynamic sampling's extra rounds. A rollout pool of its own runs :meth:`fit_split`."""
        cfg, alg, t = self.cfg, self.cfg.algorithm, self.timer
        step_start = time.perf_counter()

        with t("wake_up"):  # the engine's memory back: vLLM maps its weights and KV cache again (sleep level 2)
            self.engine.wake_up()
        with t("reshard"):  # the weights alone
            stats = self._reshard_actor_to_engine()
        self.policy_version = self.step_idx
        self._offload(("params",))  # read by the reshard: the engine generates alone
        offloaded_bytes = sum(o.bytes_on_host for o in self.offloads)
        sampling_metrics, known_scores = {}, None
        with t("generate"):
            out = self._generate(prompts, 0)
            if alg.dynamic_sampling.enabled:
                prompts, out, known_scores, sampling_metrics = self._dynamic_sampling(prompts, out, more_prompts)
            in_use = _device_bytes_in_use()  # the engine's weights and cache, and what training left resident
            self.engine.sleep(level=2)  # the next reshard rewrites every weight: nothing to keep
        self._reload()
        train_start = time.perf_counter()
        metrics, batch = self._train_on(prompts, out, self.policy_version, known_scores)
        metrics.update(sampling_metrics)
        busy = {"train": time.perf_counter() - train_start, "rollout": out.stats.seconds}
        metrics.update({"offload/host_bytes": offloaded_bytes, "offload/device_used_bytes": in_use})
        metrics.update(self._timing_metrics(batch, out, stats, busy, time.perf_counter() - step_start))
        return metrics

    def _train_on(self, prompts, out, version: int, known_scores: torch.Tensor | None = None
                  ) -> tuple[dict[str, Any], RolloutBatch]:
        """Everything of one step after generation, on the training ranks (every rank when colocated): score,
        log-probs, advantages, updates; results shared over the training ranks' group. ``version``: the policy
        version (step) whose weights generated ``out``, recorded with every sample; ``known_scores``: its
        ``[B]`` scores where dynamic sampling already computed them.

        Returns:
            The step's metrics without its timings (:meth:`_timing_metrics`), and the batch.
        """
        cfg, alg, t = self.cfg, self.cfg.algorithm, self.timer
        group = self.train_group
        with t("reward"):
            batch, scores = self._score(prompts, out, known_scores)
        batch.meta["policy_version"] = [version] * len(batch)
        # each role on its pool (at the same time where the pools are disjoint), then shared with every rank
        with t("old_logprobs"):
            old = self.actor.compute_logprobs(batch)["logprobs"] if self.actor else None
        if "reference" in self.pools:
            with t("reference"):
                ref = self.ref.compute_logprobs(batch)["logprobs"] if self.ref else None
        if "critic" in self.pools:
            with t("values"):
                values = self.critic.compute_values(batch) if self.critic else None
        with t("share"):
            self._gather_scores(batch, scores, known_scores)
            self._shape_rewards(batch)
            frame = batch["response_mask"].shape
            batch["old_logprobs"] = share_tensor(old, self.pools["actor"].ranks, frame, group=group)
            if "reference" in self.pools:
                batch["ref_logprobs"] = share_tensor(ref, self.pools["reference"].ranks, frame, group=group)
            if "critic" in self.pools:
                batch["values"] = share_tensor(values, self.pools["critic"].ranks, frame, group=group)
        self._log_samples(prompts, batch)
        with t("advantages"):
            kl_metrics = self._advantages(batch)
            loss_metrics = self._loss_mask(batch)

        metrics: dict[str, Any] = {}
        seed = cfg.run.seed * 7919 + self.step_idx
        if "critic" in self.pools:
            with t("critic_update"):
                history = (self.critic.update(batch, alg, seed=seed, norm_tokens=cfg.loss_norm_tokens)
                           if self.critic else None)
                metrics.update(_mean_over_updates("critic", share_object(history, self.pools["critic"].ranks,
                                                                         group=group)))
        if "critic" not in self.pools or self.step_idx >= cfg.critic.warmup_steps:
            with t("actor_update"):
                history = (self.actor.update(batch, alg, seed=seed, norm_tokens=cfg.loss_norm_tokens)
                           if self.actor else None)
                history = share_object(history, self.pools["actor"].ranks, group=group)
                metrics.update(_mean_over_updates("actor", history))
                # first-step exactness: with one mini-batch and one epoch, both are exactly 0 (slime's CI check)
                metrics["actor/ppo_kl_first_minibatch"] = history[0]["ppo_kl"]
                metrics["actor/log_ratio_absmax_first_minibatch"] = history[0]["log_ratio_absmax"]
        self._offload(("grads", "optimizer"))  # idle until the next step's updates

        mask = batch["response_mask"]
        scores = batch["scores"]
        metrics.update({
            "reward/mean": scores.mean().item(),
            "reward/std": masked_var(scores[None], torch.ones(1, len(scores))).sqrt().item(),  # 0 when tied
            "reward/accuracy": float(np.mean(batch.meta["correct"])),
            "response/length_mean": mask.sum(-1).mean().item(), "response/length_max": mask.sum(-1).max().item(),
            "response/clip_ratio": float(np.mean([r == "length" for r in batch.meta["finish_reason"]])),
            "prompt/length_mean": batch["prompt_lens"].float().mean().item(),
            **kl_metrics, **loss_metrics,
            "actor/rollout_vs_old_logprob_diff": masked_mean((batch["rollout_logprobs"] - batch["old_logprobs"])
                                                             .abs(), mask).item(),
            "rollout/policy_version": version, "rollout/staleness": staleness(self.step_idx + 1, version),
            "data/epoch": self.loader.epoch,
        })
        return metrics, batch

    def _timing_metrics(self, batch: RolloutBatch, out, stats, busy: dict[str, float], step_s: float
                        ) -> dict[str, Any]:
        """The step's seconds per phase, throughput, reshard and offload figures, and each pool's busy and
        idle seconds: ``busy["train"]`` (score, log-probs, advantages, updates) and ``busy["rollout"]``
        (generation); idle = the step's seconds less the pool's busy ones and the reshard's (colocated: each
        pool idles while the other works)."""
        phases = self.timer.reset()
        phases.setdefault("generate", out.stats.seconds)  # on a pool of its own: the rollout ranks' seconds
        moves, self.offload_s = self.offload_s, {"to_host": 0.0, "to_device": 0.0}
        reshard_s = phases.get("reshard", 0.0)
        return {
            "offload/to_host_s": moves["to_host"], "offload/to_device_s": moves["to_device"],
            "reshard/bytes_sent": getattr(stats, "bytes_sent", 0), "reshard/peak_extra_bytes":
                getattr(stats, "peak_extra_bytes", 0), "reshard/bytes_staged": getattr(stats, "bytes_staged", 0),
            **{f"time/{k}": v for k, v in phases.items()}, "time/step": step_s,
            **{f"pool/{p}/busy_s": b for p, b in busy.items()},
            **{f"pool/{p}/idle_s": max(0.0, step_s - b - reshard_s) for p, b in busy.items()},
            "throughput/generate_tokens_per_s": out.stats.generated_tokens / max(phases["generate"], 1e-9),
            **self._perf_metrics(batch, phases, step_s),
        }

    def _offload(self, kinds: tuple[str, ...]) -> None:
        """Move ``kinds`` of the offloaded roles to host memory (:mod:`megarl.trainer.offload`), timed into
        ``offload/to_host_s``."""
        self.offload_s["to_host"] += sum(o.to_host(kinds) for o in self.offloads)

    def _reload(self) -> None:
        """Bring everything the offloaded roles moved back to the device, timed into ``offload/to_device_s``."""
        self.offload_s["to_device"] += sum(o.to_device() for o in self.offloads)

    def _perf_metrics(self, batch: RolloutBatch, phases: dict[str, float], step_s: float) -> dict[str, float]:
        """Tokens/s/GPU, MFU and peak memory of the step and of each phase (:mod:`megarl.measure.throughput`)."""
        return step_perf_metrics(self.spec, batch["prompt_lens"], batch["response_lens"], seconds=phases,
                                 peak_bytes=self.timer.reset_peaks(), step_s=step_s, world=self.world,
                                 epochs={"actor_update": self.cfg.actor.ppo_epochs,
                                         "critic_update": self.cfg.critic.ppo_epochs},
                                 peak_flops=self.peak_flops)

    def _reshard_actor_to_engine(self):
        """Wake the rollout engine and write the actor's current weights into it (every rank: a rank without
        an engine sends its shards or just takes part); returns this rank's reshard stats."""
        rc = self.cfg.reshard

        def write(dst: dict[str, torch.Tensor]):
            return execute_plan(self.reshard_plan, self.actor.source_tensors() if self.actor else {}, dst,
                                bucket_bytes=int(rc.bucket_mb * 2**20),
                                direct_min_bytes=None if rc.direct_min_kb is None else
                                math.ceil(rc.direct_min_kb * 2**10))

        if self.engine is None:
            return write({})
        self.engine.wake_up()
        return self.engine.update_weights(write)

    def validate(self) -> dict[str, Any]:
        """Validation metrics (``val/...``) of the current actor; its responses go to ``val_samples.jsonl``.

        The engine's call counter (part of every training sample's seed) is restored afterwards, so training
        samples do not depend on when, or whether, the run validates.
        """
        calls = self.engine.calls
        if self.rank == 0:  # minutes on a CPU: say what runs (the step bar waits meanwhile)
            log.info("validating at step %d: %s", self.step_idx, self.validation.describe())
        start = time.perf_counter()
        self._reshard_actor_to_engine()
        metrics, records = self.validation.run(self.engine, group=self.rollout_group)
        if self.rank == 0:
            log.info("validation at step %d: accuracy %.3f, mean reward %.3f (%.0f s)", self.step_idx,
                     metrics.get("val/accuracy", float("nan")), metrics.get("val/reward_mean", float("nan")),
                     time.perf_counter() - start)
        self.engine.sleep(level=2)
        self.engine.calls = calls
        if self.rank == 0:
            append_samples(self.run_dir / "val_samples.jsonl", records, step=self.step_idx)
        return metrics

    def _rewards(self, prompts: list[str], responses: list[str], truths: list[str | None]) -> torch.Tensor:
        """``[B]`` float32 scores of ``B`` responses on every rank: the reward pool scores, each rank a share."""
        return torch.cat(map_data_parallel(self.reward_fn, prompts, responses, truths, ranks=self.reward_ranks))

    def _score(self, prompts, out, known: torch.Tensor | None = None) -> tuple[RolloutBatch, Any]:
        """Decode and pack the rollout into a batch, and score this rank's share of it (the reward pool's ranks
        a share each, None elsewhere; no collective, so the other pools go on meanwhile);
        :meth:`_gather_scores` puts every score into the batch. With ``known`` (the ``[B]`` scores, already
        computed on every rank: dynamic sampling) nothing is scored."""
        n = out.n
        samples = out.samples
        texts = self.tokenizer.batch_decode([list(s.token_ids) for s in samples], skip_special_tokens=True)
        raw = [prompts.raw_prompt[s.prompt_index] for s in samples]
        truths = [prompts.ground_truth[s.prompt_index] for s in samples]
        local = None if known is not None else map_share(self.reward_fn, raw, texts, truths,
                                                          ranks=self.reward_ranks)
        batch = build_batch([prompts.input_ids[s.prompt_index] for s in samples], [s.token_ids for s in samples],
                            [s.logprobs for s in samples], [s.prompt_index for s in samples],
                            pad_token_id=self.pad_id, seq_multiple=8 * self.mesh.tp * self.mesh.cp,
                            meta={"response": texts, "finish_reason": [s.finish_reason for s in samples],
                                  "index": [prompts.index[s.prompt_index] for s in samples]})
        assert len(batch) == len(prompts.input_ids) * n
        return batch, local

    def _gather_scores(self, batch: RolloutBatch, local: Any, known: torch.Tensor | None = None) -> None:
        """Every reward rank's share of the scores (:meth:`_score`) as ``batch["scores"]`` ``[B]`` float32 and
        ``batch.meta["correct"]`` (score >= 1), on every rank (``known``: all of them, already on every rank)."""
        scores = known if known is not None else torch.cat(gather_shares(local, self.reward_ranks,
                                                                         group=self.train_group))
        batch["scores"] = scores
        batch.meta["correct"] = (scores >= 1.0).tolist()

    def _generate(self, prompts: PromptBatch, round_idx: int, step: int | None = None) -> RolloutOutput:
        """Generate ``rollout.n`` responses to each prompt, over the rollout data-parallel group. Round
        ``round_idx`` of a step (dynamic sampling's extra rounds) has its own sampling seed; the engine's call
        counter advances once per step, whatever the rounds, so a resumed run samples as the straight one.
        ``step``: the (1-based) step whose batch this is, when not the one after ``step_idx`` (a rollout pool
        of its own generates ahead)."""
        calls = self.engine.calls
        index = self.step_idx if step is None else step - 1
        out = generate_data_parallel(self.engine, prompts.input_ids,
                                     SamplingConfig(seed=self.cfg.run.seed * 1_000_003 + index
                                                    + round_idx * 7_919_993, **self.sampling),
                                     group=self.rollout_group)
        self.engine.calls = calls + 1
        return out

    def _dynamic_sampling(self, prompts: PromptBatch, out: RolloutOutput, more_prompts
                          ) -> tuple[PromptBatch, RolloutOutput, torch.Tensor, dict[str, float]]:
        """DAPO's dynamic sampling (``algorithm.dynamic_sampling``; Yu et al. 2025, arXiv:2503.14476, sec.
        3.2): score each round's responses, keep the groups whose scores are not all equal (the reward
        function's scores, before overlong shaping), and generate ``data.prompts_per_step`` more prompts until
        ``data.prompts_per_step`` groups have signal or ``max_extra_rounds`` extra rounds ran. The kept groups
        are cut to the first ``prompts_per_step``, or, short of that, to a whole number of mini-batches
        (:meth:`_group_unit`); with not one mini-batch's worth, the step trains on one mini-batch of them filled
        with tied groups (advantage 0: they add only to the KL and entropy terms and the normalisers).

        The rounds' scoring counts in the generate phase, and the output's stats are every round's (the
        generation throughput counts every token generated).

        Returns:
            ``(prompts, out, scores [B] float32, metrics)`` of the kept groups: ``dynamic_sampling/rounds``
            (generation rounds), ``.../groups_generated``, ``.../groups_with_signal`` (all rounds),
            ``.../groups_kept`` (with signal, in the step), ``.../groups_tied_kept`` and ``.../groups_short``
            (``prompts_per_step`` minus groups with signal kept).
        """
        cfg = self.cfg
        want, n = cfg.data.prompts_per_step, out.n
        kept: list[tuple[PromptBatch, int, list, torch.Tensor]] = []  # (prompts, prompt k, samples, scores)
        tied: list[tuple[PromptBatch, int, list, torch.Tensor]] = []
        generated = signal = rounds = prompt_tokens = new_tokens = 0
        seconds = 0.0
        while True:
            rounds += 1
            generated += out.num_prompts
            seconds += out.stats.seconds
            prompt_tokens += out.stats.prompt_tokens
            new_tokens += out.stats.generated_tokens
            texts = self.tokenizer.batch_decode([list(s.token_ids) for s in out.samples], skip_special_tokens=True)
            scores = self._rewards([prompts.raw_prompt[s.prompt_index] for s in out.samples], texts,
                                   [prompts.ground_truth[s.prompt_index] for s in out.samples]).float()
            for k in range(out.num_prompts):
                group = scores[k * n:(k + 1) * n]
                spread = bool((group != group[0]).any())
                signal += spread
                (kept if spread else tied).append((prompts, k, out.group(k), group))
            if len(kept) >= want or rounds > cfg.algorithm.dynamic_sampling.max_extra_rounds:
                break
            prompts = more_prompts()
            out = self._generate(prompts, rounds)
        unit = self._group_unit()
        signalled, kept = kept, kept[:want] if len(kept) >= want else kept[:len(kept) // unit * unit]
        if not kept:  # not one mini-batch with signal: one mini-batch of them, filled with tied groups
            kept = (signalled + tied)[:unit]
        with_signal = min(len(kept), len(signalled))
        merged = PromptBatch(input_ids=[p.input_ids[k] for p, k, _, _ in kept], index=[p.index[k] for p, k, _, _ in kept],
                             ground_truth=[p.ground_truth[k] for p, k, _, _ in kept],
                             raw_prompt=[p.raw_prompt[k] for p, k, _, _ in kept])
        samples = [dataclasses.replace(s, prompt_index=i) for i, (_, _, group, _) in enumerate(kept) for s in group]
        merged_out = RolloutOutput(samples, n, RolloutStats(prompt_tokens=prompt_tokens, generated_tokens=new_tokens,
                                                            seconds=seconds))  # every round's
        scores = torch.cat([g for _, _, _, g in kept])
        metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/groups_generated": generated,
                   "dynamic_sampling/groups_with_signal": signal, "dynamic_sampling/groups_kept": with_signal,
                   "dynamic_sampling/groups_tied_kept": len(kept) - with_signal,
                   "dynamic_sampling/groups_short": want - with_signal}
        if self.rank == 0 and with_signal < want:
            log.info("dynamic sampling: %d of %d groups with signal after %d rounds "
                        "(algorithm.dynamic_sampling.max_extra_rounds=%d); step %d trains on %d of them%s",
                        signal, want, rounds, cfg.algorithm.dynamic_sampling.max_extra_rounds, self.step_idx + 1,
                        with_signal, f" and {len(kept) - with_signal} tied groups" if len(kept) > with_signal else "")
        return merged, merged_out, scores, metrics

    def _group_unit(self) -> int:
        """The fewest groups that make whole mini-batches of every trained role, divisible by every Megatron
        role's DP (the batch sizes :func:`~megarl.parallel.placement.validate_for_world` checks for a full step)."""
        sizes = [self.cfg.actor.ppo_mini_batch_size] + [lay.dp for role, lay in self.layouts.items()
                                                        if role in MEGATRON_ROLES]
        if "critic" in self.pools:
            sizes.append(self.cfg.critic.ppo_mini_batch_size)
        rows = math.lcm(self.cfg.rollout.n, *sizes)
        return rows // self.cfg.rollout.n

    def _shape_rewards(self, batch: RolloutBatch) -> None:
        """``batch["overlong_penalty"]`` ``[B]``: DAPO's overlong penalty (``algorithm.overlong``,
        :func:`~megarl.algos.shaping.overlong_penalty`), added to the scores by :meth:`_advantages`."""
        ov = self.cfg.algorithm.overlong
        if ov.buffer_tokens:
            batch["overlong_penalty"] = overlong_penalty(batch["response_lens"], max_length=self.cfg.rollout.max_new_tokens,
                                                         cache_length=ov.buffer_tokens, factor=ov.penalty_factor)

    def _loss_mask(self, batch: RolloutBatch) -> dict[str, float]:
        """``batch["loss_mask"]`` (the tokens in the actor's loss): the response mask without the responses cut
        at the limit (``algorithm.overlong.filter``) and without what the rollout correction masks; and
        ``batch["rollout_weights"]`` when it truncates. Returns the ``rollout_corr/...`` metrics (also with the
        correction off: the token ratios' statistics) and ``response/overlong_filtered``."""
        alg = self.cfg.algorithm
        mask = batch["response_mask"].bool()
        metrics = {}
        if alg.overlong.filter:
            cut = torch.tensor([r == "length" for r in batch.meta["finish_reason"]], dtype=torch.bool)
            mask = mask & ~cut[:, None]
            metrics["response/overlong_filtered"] = float(cut.float().mean()) if len(cut) else 0.0
        rc = alg.rollout_correction
        level, mode, cap, lower = rc.settings() if rc.enabled else ("token", "truncate", math.inf, 0.0)
        weights, keep, stats = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"], mask,
                                                  level=level, mode=mode, cap=cap, lower=lower)
        metrics.update({f"rollout_corr/{k}": v.item() for k, v in stats.items()})
        if rc.enabled:
            mask = keep
            if mode == "truncate":
                batch["rollout_weights"] = weights
        batch["loss_mask"] = mask.float()
        return metrics

    def _log_samples(self, prompts, batch: RolloutBatch) -> None:
        """Append the step's first ``trainer.log_samples`` responses to ``samples.jsonl`` (rank 0): prompt, response,
        score, ground truth, ``length`` (response tokens), ``prompt_tokens``, policy version, finish reason."""
        k = min(self.cfg.trainer.log_samples, len(batch))
        if self.rank != 0 or k == 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for i in range(k):
                g = int(batch["group"][i])
                f.write(json.dumps({"step": self.step_idx + 1, "prompt": prompts.raw_prompt[g],
                                    "response": batch.meta["response"][i], "score": float(batch["scores"][i]),
                                    "ground_truth": prompts.ground_truth[g],
                                    "length": int(batch["response_lens"][i]),
                                    "prompt_tokens": int(batch["prompt_lens"][i]),
                                    "policy_version": batch.meta["policy_version"][i],
                                    "finish_reason": batch.meta["finish_reason"][i]}) + "\n")

    def _advantages(self, batch: RolloutBatch) -> dict[str, float]:
        """Token rewards (with the KL penalty when it is in the reward), advantages and returns."""
        alg = self.cfg.algorithm
        mask = batch["response_mask"]
        metrics = {}
        rewards = batch["scores"] + batch["overlong_penalty"] if "overlong_penalty" in batch else batch["scores"]
        if "overlong_penalty" in batch:
            metrics["reward/overlong_penalty_mean"] = batch["overlong_penalty"].mean().item()
        if "ref_logprobs" in batch:
            kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], alg.kl.estimator)
            metrics["actor/kl"] = masked_mean(kl, mask.bool()).item()
            if not alg.kl.in_loss:
                rewards, mean_kl = apply_kl_penalty(rewards, batch["old_logprobs"], batch["ref_logprobs"], mask,
                                                    coef=self.kl_ctl.value, kind=alg.kl.estimator)
                self.kl_ctl.update(float(mean_kl), len(batch))
            metrics["actor/kl_coef"] = self.kl_ctl.value
        estimator = ADVANTAGES.bind(alg.name, alg)  # with its parameters from the config
        adv, ret = estimator(rewards, mask, values=batch.tensors.get("values"), group_index=batch["group"])
        batch["advantages"], batch["returns"] = adv, ret
        metrics["advantages/mean"] = masked_mean(adv, mask.bool()).item()
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _state(self, is_loading: bool, optimizer_format: str = OPTIMIZER_FORMAT) -> dict[str, Any]:
        """The sharded state of the trained roles held on this rank (none on a pool of other roles)."""
        state = ({"actor": self.actor.sharded_state_dict(is_loading, optimizer_format)}
                 if self.actor is not None else {})
        if self.critic is not None:
            state["critic"] = self.critic.sharded_state_dict(is_loading, optimizer_format)
        return state

    def save(self) -> Path:
        """Checkpoint actor (+ optimizer), critic, LR schedules, KL controller, data position and RNG states."""
        path = self.run_dir / "checkpoints" / f"{ck.CHECKPOINT_PREFIX}{self.step_idx:06d}"
        meta = ck.model_meta(self.spec, ck.DTYPES[self.cfg.model.dtype], self.tokenizer_source,
                             use_te=self.cfg.actor.kernels.transformer_engine,
                             step=self.step_idx, loader=self.loader.state_dict(), kl_ctl=self.kl_ctl.state_dict(),
                             actor_scheduler=share_object(self.actor and self.actor.scheduler.state_dict(),
                                                          self.pools["actor"].ranks),
                             critic_scheduler=share_object(self.critic and self.critic.scheduler.state_dict(),
                                                           self.pools["critic"].ranks) if "critic" in self.pools
                             else None,
                             policy_version=self.step_idx,
                             config=to_dict(self.cfg), world_size=self.world, optimizer_format=OPTIMIZER_FORMAT,
                             source_config=self.source_config,
                             generation_config=self.generation_config)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        self._reload()  # an offloaded optimizer state is saved from the device, then goes back to the host
        with phase("checkpoint"):
            ck.save_checkpoint(path, self._state(is_loading=False), meta, per_rank={"rng": rng})
        self._offload(("grads", "optimizer"))
        self.last_checkpoint = path
        self.saved_at = time.monotonic()
        if self.rank == 0:
            for p in ck.run_checkpoints(self.run_dir)[:-self.cfg.trainer.keep_checkpoints]:
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
        return path

    def _resume(self) -> None:
        """Load the run folder's newest checkpoint (:func:`check_run_folder` found one this run can load), at
        this run's layout: weights, optimizer state, data position, KL controller and RNG states. The LR
        schedule follows the current config from the checkpoint's update count on; what the config changed
        since the checkpoint is logged and kept for the summary (``self.resumed``)."""
        path = ck.latest_checkpoint(self.run_dir)
        meta = ck.read_meta(path)
        self._reload()
        with phase("resume"):
            loaded = ck.load_checkpoint(path, self._state(is_loading=True, optimizer_format=meta.get(
                "optimizer_format", LEGACY_OPTIMIZER_FORMAT)))
        if self.actor is not None:
            self.actor.load_sharded_state(loaded["actor"])
            self.actor.resume_schedule(meta["actor_scheduler"]["num_steps"])
        if self.critic is not None:
            self.critic.load_sharded_state(loaded["critic"])
            self.critic.resume_schedule(meta["critic_scheduler"]["num_steps"])
        self.loader.load_state_dict(meta["loader"])
        self.kl_ctl.load_state_dict(meta["kl_ctl"])
        # each rank's RNG states; a rank the checkpoint's world did not have takes rank 0's
        rng = ck.load_per_rank(path, "rng", self.rank) or ck.load_per_rank(path, "rng", 0)
        if rng is not None:
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
        self.step_idx = int(meta["step"])
        self.policy_version = int(meta.get("policy_version", self.step_idx))  # the weights loaded
        if self.engine is not None:
            self.engine.calls = self.step_idx  # one generate call per step: the sampling seeds continue
        self._offload(("grads", "optimizer"))
        self.last_checkpoint = path
        changed = config_changes(meta.get("config") or {}, json.loads(json.dumps(to_dict(self.cfg), default=str)))
        self.resumed = {"checkpoint": str(path), "step": self.step_idx, "changed": changed}
        log.info("resumed from %s at step %d%s", path, self.step_idx,
                 "; changed since: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
                 if changed else "")

    # ------------------------------------------------------------------ the loop
    def _save_due(self, step: int) -> bool:
        """Whether ``trainer.save_every`` or the last step calls for a checkpoint after ``step``."""
        every = self.cfg.trainer.save_every
        return bool(every and step % every == 0) or step == self.cfg.trainer.steps

    def fit_split(self, batches, steps: int | None = None):
        """The steps with the rollout on a pool of its own, up to ``steps`` (default ``trainer.steps``): both
        groups of ranks walk one :func:`~megarl.trainer.pipeline.schedule` (``trainer.mode``: sync is k = 0,
        async k = ``trainer.max_staleness``), each doing its part of every event, and checkpoint where it says
        (``trainer.save_every``, the last step) or where :meth:`_checkpoint_due` finds it due after a step (every
        rank asks, both pools: ``trainer.save_every_min``, SIGUSR1). After a save on SIGUSR1 the run ends with
        :class:`~megarl.parallel.restart.RequeueRequested`; the batches generated ahead (async) are lost with it
        and generated again on resume, as after a crash.

        Args:
            batches: the prompt loader's iterator; the rollout ranks draw a batch when they generate it, the
                training ranks when they train on it (so the data position saved is the steps trained).

        Yields:
            ``(step, metrics)`` after each step's events (the metrics on the training ranks; ``{}`` on the
            rollout ranks), with ``step_idx`` advanced.

        Raises:
            RequeueRequested: after the checkpoint of a step during which a rank got SIGUSR1.
        """
        cfg, t = self.cfg, self.timer
        k = cfg.trainer.max_staleness if cfg.trainer.mode == "async" else 0
        generating = self.engine is not None
        ready: dict[int, tuple[Any, int]] = {}  # step -> (its samples, the version that generated them)
        end = cfg.trainer.steps if steps is None else steps
        for step, events in schedule(self.step_idx, end, k, lambda s: steps is None and self._save_due(s)):
            step_start = time.perf_counter()
            busy, stats, metrics, trained = {"train": 0.0, "rollout": 0.0}, None, {}, None
            save = False
            for e in events:
                if e.kind == "reshard":
                    with t("reshard"):
                        stats = self._reshard_actor_to_engine()
                    self.policy_version = e.step
                elif e.kind == "generate" and generating:
                    ready[e.step] = (self._generate(next(batches), 0, e.step), self.policy_version)
                elif e.kind == "batch":  # the rollout pool's first rank hands the samples to every rank
                    with t("wait_rollout"):
                        got = share_object(ready.pop(e.step, None), self.rollout_ranks[:1])
                    busy["rollout"] += got[0].stats.seconds
                    if not generating:
                        ready[e.step] = got
                elif e.kind == "train":
                    if not generating:
                        out, version = ready.pop(e.step)
                        start = time.perf_counter()
                        metrics, batch = self._train_on(next(batches), out, version)
                        busy["train"] = time.perf_counter() - start
                        trained = (batch, out)
                    self.step_idx = e.step
                elif e.kind == "save":  # the step's last event
                    save = True
            requeue = False
            if steps is None:  # a world-wide meeting after every step: a save by time or on SIGUSR1
                requeue, due = self._checkpoint_due()
                save = save or due
            if save:  # after the step's timings (a colocated step's exclude it too)
                metrics = self._split_step_metrics(metrics, trained, stats, busy, step_start)
                self.save()
            yield step, self._split_step_metrics(metrics, trained, stats, busy, step_start)
            if requeue and self.step_idx < end:
                raise self._requeue_error()

    def _split_step_metrics(self, metrics: dict[str, Any], trained, stats, busy: dict[str, float],
                            step_start: float) -> dict[str, Any]:
        """:meth:`fit_split`'s metrics of a step with its timings (once; the training ranks only)."""
        if "time/step" in metrics:
            return metrics
        if trained is None:  # a rollout rank: nothing to report, its phase timers start again
            self.timer.reset(), self.timer.reset_peaks()
            return metrics
        return {**metrics, **self._timing_metrics(*trained, stats, busy, time.perf_counter() - step_start)}

    def _checkpoint_due(self) -> tuple[bool, bool]:
        """``(requeue, save)`` after a step, the same on every rank: whether any rank got SIGUSR1 (save, then
        end for a requeued job: :mod:`megarl.parallel.restart`), and whether to checkpoint now (every
        ``trainer.save_every`` steps, ``trainer.save_every_min`` minutes after the last save, at the last step,
        or on SIGUSR1). One small all-reduce: the ranks' clocks and signals may differ."""
        tc = self.cfg.trainer
        by_time = bool(tc.save_every_min) and time.monotonic() - self.saved_at >= 60 * tc.save_every_min
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        flags = torch.tensor([float(requeue_requested()), float(by_time)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        requeue, by_time = bool(flags[0]), bool(flags[1])
        return requeue, self._save_due(self.step_idx) or by_time or requeue

    def _requeue_error(self) -> RequeueRequested:
        return RequeueRequested(f"saved {self.last_checkpoint} on SIGUSR1 (the job's time limit is near); a "
                                "requeued job continues the run from it")

    def _validation_due(self) -> bool:
        return self.validation is not None and self.validation.due(self.step_idx, self.cfg.trainer.steps)

    def fit(self) -> dict[str, Any]:
        """Run until ``trainer.steps``; returns the summary (also printed and written to summary.json)."""
        cfg = self.cfg
        start = time.perf_counter()
        logger = MetricsLogger(self.run_dir / "metrics.jsonl", cfg.trainer.steps, self.step_idx,
                               enabled=self.rank == 0, progress=cfg.trainer.progress, loggers=cfg.trainer.loggers,
                               config=to_dict(cfg))
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.step_idx == 0:
                (self.run_dir / "samples.jsonl").unlink(missing_ok=True)
                (self.run_dir / "val_samples.jsonl").unlink(missing_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
        batches = iter(self.loader)
        more_prompts = functools.partial(next, batches)
        first_step = self.step_idx
        self.saved_at = time.monotonic()
        save_s = None  # the last checkpoint's seconds, reported with the next step
        try:
            if self.split_rollout:  # validation is refused there (check_rollout_pool)
                for step, metrics in self.fit_split(batches):
                    logger.log(step, metrics)
            else:
                with progress_watched(cfg.trainer.timeout_s):  # a rank stalled outside a collective ends the run
                    if self.step_idx == 0 and self._validation_due():
                        logger.log(0, self.validate())
                    while self.step_idx < cfg.trainer.steps:
                        metrics = self.step(next(batches), more_prompts)
                        self.step_idx += 1
                        if self._validation_due():
                            metrics.update(self.validate())
                        requeue, save = self._checkpoint_due()
                        if save_s is not None:  # the last checkpoint's seconds, saved after the step before
                            metrics["time/checkpoint_save"], save_s = save_s, None
                        logger.log(self.step_idx, metrics)  # first: a crash in the save loses no step's metrics
                        if save:
                            start_save = time.perf_counter()
                            self.save()
                            save_s = time.perf_counter() - start_save
                        if requeue and self.step_idx < cfg.trainer.steps:
                            raise self._requeue_error()
        finally:
            logger.close()
        hf_path = None
        if cfg.trainer.export_hf and self.last_checkpoint is not None:
            dist.barrier()
            if self.rank == 0:
                from megarl.models.convert import export_rank
                from megarl.parallel.launch import run_world

                hf_path = Path(run_world(export_rank, 1, str(self.last_checkpoint), str(self.run_dir / "hf"))[0])
        history = read_metrics(self.run_dir / "metrics.jsonl") if self.rank == 0 else []
        text = summary_text(history, run_dir=self.run_dir, checkpoint=self.last_checkpoint, hf_export=hf_path,
                            wall_s=time.perf_counter() - start, steps_this_session=self.step_idx - first_step,
                            validation=self.validation.describe() if self.validation else None,
                            notes=self._resume_notes())
        summary = {"run_dir": str(self.run_dir), "checkpoint": str(self.last_checkpoint), "steps": self.step_idx,
                   "hf_export": str(hf_path) if hf_path else None, "last": history[-1] if history else None,
                   "resumed": self.resumed, "restarts": read_restarts(self.run_dir)}
        if self.rank == 0:
            print(text, flush=True)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if cfg.trainer.report:
                self._write_report()
        return summary

    def _resume_notes(self) -> list[str]:
        """Summary lines: the restarts of the run (``restarts.jsonl``) and what this session's resume changed."""
        notes = [f"{'restart ' + str(r.get('restart')):<19}{r.get('time')}: {r.get('reason')} (from "
                 f"{Path(r['checkpoint']).name if r.get('checkpoint') else 'step 0'})"
                 for r in read_restarts(self.run_dir)]
        if self.resumed:
            changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.resumed["changed"].items()) or "nothing"
            notes.append(f"{'resumed':<19}at step {self.resumed['step']}; config changed: {changed}")
        return notes

    def _write_report(self) -> None:
        """``report.md`` and its plots in the run folder (:mod:`.report`; skipped without matplotlib)."""
        try:
            from megarl.trainer.report import write_report
        except ImportError as e:
            log.warning("no report written (%s): pip install 'megarl[report]' for matplotlib", e)
            return
        print(f"report: {write_report(self.run_dir)}", flush=True)


def _device_bytes_in_use() -> int:
    """Bytes of this rank's GPU in use by every process and allocator (0 without a GPU)."""
    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def _mean_over_updates(prefix: str, history: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the step's optimizer updates, keyed ``prefix/name``."""
    keys = history[0].keys() if history else []
    return {f"{prefix}/{k}": float(np.mean([h[k] for h in history])) for k in keys}


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs alike on every rank (CPU-initialised random weights
    and the data order read them), before the :class:`Trainer` is built."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def train(cfg: Config) -> dict[str, Any]:
    """Run RL training on this rank (call on every rank of the job).

    Rank 0 holds the run folder's lock (:mod:`megarl.trainer.run_lock`) for the whole run, taken before the
    process group is set up (the other ranks wait for rank 0 there), so no rank writes into a folder that
    another run owns.

    Raises:
        ConfigError: the run folder's checkpoints do not fit this run (:func:`check_run_folder`).
        RunLockedError: another run owns the run folder (rank 0).
        PeerLostError: a collective failed because a peer died or stalled past ``trainer.timeout_s``.
    """
    seed_all(cfg.run.seed)
    check_run_folder(cfg, launch_info().world_size)
    lock = RunLock(cfg.run.run_dir).acquire() if launch_info().rank == 0 else None
    try:
        os.makedirs(cfg.run.run_dir, exist_ok=True)
        with peer_failures_named(cfg.trainer.timeout_s):
            return Trainer(cfg).fit()
    finally:
        if lock is not None:
            lock.release()
