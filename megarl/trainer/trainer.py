"""The RL trainer: ``megarl train`` runs :func:`train` on every rank (SPMD, launched by torchrun or SLURM).

One step (:meth:`Trainer.step`) reads top to bottom:

    reshard actor -> rollout engine | generate (| dynamic sampling) | score | old, reference log-probs (values)
    | advantages and loss mask | critic update | actor update | metrics

(the old log-probs from the actor update's first forward instead where that is exact: :mod:`.old_logprobs`),
and :func:`~megarl.trainer.loop.fit` runs the steps with validation, metrics and checkpoints between them.
What the trainer is built from is in :mod:`.builders`, its checkpoints in :mod:`.checkpointing` (of the run's
progress, :mod:`.run_state`), the step's algorithm glue in :mod:`.advantages` and :mod:`.dynamic_sampling`, its
metrics in :mod:`.metrics`; the Megatron roles are :mod:`megarl.workers`.

Every rank holds the whole step's batch (prompts and responses are small next to the models); each Megatron
role runs on its pool behind one handle (:class:`~megarl.workers.role.Role`), its workers compute on their
data-parallel shares and gather the results, and the handle shares them with every training rank, so the
advantage estimators see every sample of a group and every rank agrees on them.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from typing import Any, Callable

import torch

from megarl.algos.kl import AdaptiveKLController, FixedKLController
from megarl.config import Config, absolute_paths
from megarl.data.batch import RolloutBatch, build_batch
from megarl.data.loader import PromptBatch, PromptLoader
from megarl.kernels.batch_invariant import enable_batch_invariant_mode
from megarl.measure.flops import peak_bf16_flops
from megarl.measure.monitor import device_bytes_in_use
from megarl.measure.throughput import step_perf_metrics
from megarl.measure.timers import PhaseTimer
from megarl.models import checkpoint as ck
from megarl.models.hf_io import load_tokenizer
from megarl.models.layout_lora import adapter_layout, with_lora_merge
from megarl.models.layout_megatron import megatron_layout
from megarl.models.lora import LoRASpec
from megarl.parallel.lifecycle import peer_failures_named, record_peers
from megarl.parallel.mesh import init_distributed, initialize_model_parallel, launch_info, ranks_per_node
from megarl.parallel.placement import (build_pool_groups, global_layout, join_optimizer_setup, placement_summary,
                                      role_layouts, rollout_split, share_object, training_group,
                                      validate_for_world)
from megarl.reshard.executor import execute_plan
from megarl.reshard.planner import plan_reshard
from megarl.rewards.mix import StepReward, merge_reward_metrics
from megarl.rewards.registry import task_metrics
from megarl.rollout.base import RolloutOutput, SamplingConfig
from megarl.rollout.data_parallel import (gather_shares, generate_data_parallel, map_data_parallel, map_share,
                                          rollout_dp_group)
from megarl.rollout.overlap import OverlapScoring
from megarl.trainer.advantages import compute_advantages, drop_nonfinite, set_loss_mask, shape_rewards
from megarl.trainer.checkpointing import Checkpointer, check_run_folder
from megarl.trainer.builders import (load_prompts, load_validation, make_engine, model_meta, resolve_eos,
                                     rollout_layout, seed_all)
from megarl.trainer.dynamic_sampling import dynamic_sampling, group_unit
from megarl.trainer.episodes import (build_agent, episode_batch, episode_metrics, episode_scores, evaluate_episodes,
                                     fill_scores, generate_episodes, row_multiple, to_score)
from megarl.trainer.loop import fit
from megarl.trainer.metrics import batch_metrics, timing_metrics, update_metrics
from megarl.trainer.old_logprobs import old_logprob_metrics, old_logprob_pass
from megarl.trainer.preflight import tokenizer_source, validate_for_model
from megarl.parallel.run_lock import RunLock
from megarl.trainer.run_state import RunState
from megarl.data.staleness import bound_token_staleness, oldest_versions, stamp_token_versions, trained_versions
from megarl.workers.teacher import build_teacher, check_teacher
from megarl.trainer.validation import append_samples
from megarl.workers.actor import BasePolicy, PolicyWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.offload import RoleOffloads
from megarl.workers.role import Role

log = logging.getLogger(__name__)


class Trainer:
    """One RL run on this rank: workers, rollout engine, reshard engine, data, and the run's progress
    (:attr:`state`, a :class:`~megarl.trainer.run_state.RunState`, which :attr:`checkpointer` saves and resumes).

    Raises:
        ConfigError: from :func:`~megarl.parallel.placement.validate_for_world` and data loading, before any model is
            built.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg = absolute_paths(cfg)  # what the run records resolves the same from any folder
        # before the rendezvous: a wrong world stops here (its warnings were the pre-run checks')
        validate_for_world(cfg, launch_info().world_size, warn=False)
        info = init_distributed(timeout_s=cfg.trainer.timeout_s)
        record_peers()
        self.rank, self.world = info.rank, info.world_size
        self.layouts = role_layouts(cfg, self.world)
        if self.rank == 0:
            log.info("%s", placement_summary(self.layouts))
        self.run_dir = cfg.run.run_dir
        self._build_data()  # bad data fails before any model is built
        self._build_roles()
        self._build_rollout()
        # each role behind one handle: its worker on its pool, its results shared with every training rank
        self.roles = {name: Role(worker, self.pools[name].ranks, self.train_group)
                      for name, worker in (("actor", self.actor), ("reference", self.ref), ("critic", self.critic))
                      if name in self.pools}
        self.overlap = (OverlapScoring(self.roles, self.pools, self._rewards, self.tokenizer, pad_id=self.pad_id,
                                       old_pass=functools.partial(old_logprob_pass, cfg, moe=False),
                                       exact=cfg.rollout.exact) if cfg.rollout.overlap_scoring else None)
        self.timer = PhaseTimer()
        self.peak_flops = peak_bf16_flops()  # MFU's denominator per GPU; None on the CPU
        if cfg.trainer.mode == "async" and not cfg.algorithm.rollout_correction.enabled and self.rank == 0:
            log.warning("trainer.mode=async trains on samples of older weights without correcting for them: set "
                        "algorithm.rollout_correction (e.g. preset=token_tis, README 'Asynchronous RL')")
        self.old_logprob_source: str | None = None  # where the last step's old log-probs came from (train_on)
        kl = cfg.algorithm.kl
        self.state = RunState(self.loader, AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.target
                              else FixedKLController(kl.coef))
        self.checkpointer = Checkpointer(cfg, actor=self.actor, critic=self.critic, pools=self.pools,
                                         rollout_ranks=self.rollout_ranks, offloads=self.offloads,
                                         model_meta=model_meta(cfg, self.spec, self.tokenizer_source,
                                                               self.source_config, self.generation_config))
        if cfg.trainer.resume:
            self.checkpointer.resume(self.state)
            if self.engine is not None:  # what it is between steps (generate sets it per step)
                self.engine.calls = self.state.step

    def _build_data(self) -> None:
        """The model's spec and tokenizer, the training prompts and their loader, the reward function (on the
        reward pool) and the validation."""
        cfg = self.cfg
        self.spec, _, tok_source = ck.source_spec(None if cfg.model.path == "default" else cfg.model.path)
        validate_for_model(cfg, self.spec)
        self.source_config = ck.source_config(None if cfg.model.path == "default" else cfg.model.path)
        self.generation_config = ck.source_generation_config(None if cfg.model.path == "default" else cfg.model.path)
        self.tokenizer_source = tokenizer_source(cfg, tok_source)
        self.tokenizer = load_tokenizer(self.tokenizer_source)
        self.spec = resolve_eos(self.spec, self.tokenizer, cfg.model.path, self.generation_config)
        self.teacher_spec = check_teacher(cfg, self.tokenizer)  # on-policy distillation's, or None
        self.prompts = load_prompts(cfg, self.tokenizer)
        self.reward_ranks = self.layouts["reward"].ranks  # a reward model is loaded on its pool only
        self.reward_fn = StepReward(cfg.reward) if self.rank in self.reward_ranks else None
        self.agent = build_agent(cfg, self.tokenizer) if cfg.rollout.multi_turn.enabled else None  # episodes
        self.validation = None
        if cfg.validation.enabled:
            self.validation = load_validation(cfg, self.tokenizer, self._rewards, self.spec)
            self.validation.hold_out(self.prompts)
        ds = cfg.algorithm.dynamic_sampling
        rounds = 1 + (ds.max_extra_rounds if ds.enabled else 0)  # prompt batches a step may draw
        epochs = PromptLoader.epochs_for(len(self.prompts), cfg.data.prompts_per_step, cfg.trainer.steps * rounds)
        self.loader = PromptLoader(self.prompts, cfg.data.prompts_per_step, shuffle=cfg.data.shuffle,
                                   seed=cfg.run.seed, epochs=epochs)
        pad = self.spec.pad_token_id
        self.pad_id = pad if pad is not None else self.spec.eos_token_ids[0]

    def _build_roles(self) -> None:
        """The Megatron roles on their pools (:mod:`megarl.parallel.placement`; the critic on the actor's): a
        role is built on the ranks of its pool only, None elsewhere; the host offload of the
        trained roles that ask for it (the engine starts with their idle state away)."""
        cfg = self.cfg
        self.mesh = global_layout(self.layouts, self.world, cfg.actor.parallel.ep)
        initialize_model_parallel(self.mesh, seed=cfg.run.seed, timeout_s=cfg.trainer.timeout_s)
        self.pools = build_pool_groups(self.layouts, self.world, self.mesh.ep)
        dtype = ck.DTYPES[cfg.model.dtype]
        if cfg.rollout.exact and cfg.rollout.engine == "vllm":  # before the first matmul (cuBLAS's workspace)
            enable_batch_invariant_mode()
        source = None if cfg.model.path == "default" else cfg.model.path
        updates = cfg.trainer.steps * cfg.actor.ppo_epochs * (cfg.rollout_batch_size // cfg.actor.ppo_mini_batch_size)
        self.actor = self.ref = self.critic = None
        pools = self.pools
        self.actor_lora = LoRASpec.from_config(cfg.actor.lora)
        if pools["actor"].holds_here:
            self.actor = PolicyWorker(self.spec, pools["actor"].mesh, "actor", source, dtype, cfg.actor,
                                      trainable=True, total_updates=updates, temperature=cfg.rollout.temperature,
                                      pool=pools["actor"], seed=cfg.run.seed)
        else:
            join_optimizer_setup()
        if "reference" in pools and self.teacher_spec is not None:  # distillation: the teacher in the slot
            self.ref = (build_teacher(cfg, self.teacher_spec, pools["reference"], dtype)
                        if pools["reference"].holds_here else None)
        elif "reference" in pools and self.actor_lora and self.actor:  # the actor's base: its adapters off
            self.ref = BasePolicy(self.actor)
        elif "reference" in pools and pools["reference"].holds_here:  # a copy of the actor where it is here
            self.ref = PolicyWorker(self.spec, pools["reference"].mesh, "actor", self.actor or source, dtype,
                                    cfg.actor, trainable=False, temperature=cfg.rollout.temperature,
                                    pool=pools["reference"], seed=cfg.run.seed)
        if "critic" in pools and pools["critic"].holds_here:
            self.critic = CriticWorker(self.spec, pools["critic"].mesh, "critic", source, dtype, cfg.critic,
                                       trainable=True, total_updates=cfg.trainer.steps * cfg.critic.ppo_epochs
                                       * (cfg.rollout_batch_size // cfg.critic.ppo_mini_batch_size),
                                       pool=pools["critic"], seed=cfg.run.seed)
        elif "critic" in pools:
            join_optimizer_setup()
        self.offloads = RoleOffloads([w for w in (self.actor, self.critic) if w is not None])
        self.offloads.to_host(("grads", "optimizer"))

    def _build_rollout(self) -> None:
        """The rollout engine on its pool (the whole world, or ranks of its own: :mod:`megarl.trainer.pipeline`),
        fed by the reshard plan from the actor's layout to the engines'; the training ranks share results over
        their own group, without the rollout ranks."""
        cfg, pools = self.cfg, self.pools
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
        lora = self.actor_lora
        src_layout = megatron_layout(self.spec, pools["actor"].mesh, ranks=actor_ranks, role="actor",
                                     use_te=cfg.actor.kernels.transformer_engine, lora=lora,
                                     moe_experts=cfg.actor.kernels.moe_experts,
                                     padded_vocab=share_object(
                                         self.actor and ck.as_chunks(self.actor.model)[0].vocab_size, actor_ranks))
        dst_layout = rollout_layout(cfg, self.spec, self.rollout_ranks)
        # LoRA: merged weights shard by shard, or (adapter sync) the base once and then the adapters, whole
        self.adapter_sync = lora is not None and cfg.actor.lora.sync == "adapter"
        if lora is not None and not self.adapter_sync:
            dst_layout = with_lora_merge(dst_layout, lora)
        self.reshard_plan = plan_reshard(src_layout, dst_layout, ranks_per_node(self.world))
        self.adapter_plan = (plan_reshard(src_layout, adapter_layout(self.spec, lora, self.rollout_ranks),
                                          ranks_per_node(self.world)) if self.adapter_sync else None)
        self.sampling = dict(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                             top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                             stop_token_ids=tuple(self.spec.eos_token_ids))

    # ------------------------------------------------------------------ one RL step
    def step(self, prompts, more_prompts=None) -> dict[str, Any]:
        """One RL step on a batch of prompts with the rollout engine on every rank (colocated, synchronous);
        returns its metrics (identical on every rank). ``more_prompts()``: the next batch of prompts, for
        dynamic sampling's extra rounds. A rollout pool of its own runs :func:`~megarl.trainer.loop.fit_split`."""
        cfg, alg, t = self.cfg, self.cfg.algorithm, self.timer
        step_start = time.perf_counter()

        with t("wake_up"):  # the engine's memory back: vLLM maps its weights and KV cache again (sleep level 2)
            self.engine.wake_up()
        with t("reshard"):  # the weights alone
            stats = self.reshard_actor_to_engine()
        self.state.policy_version = self.state.step
        self.offloads.to_host(("params",))  # read by the reshard: the engine generates alone
        offloaded_bytes = self.offloads.bytes_on_host
        sampling_metrics, known_scores = {}, None
        with t("generate"):
            out = self.generate(prompts, 0)
            if alg.dynamic_sampling.enabled:
                prompts, out, known_scores, sampling_metrics = dynamic_sampling(
                    prompts, out, generate=self.generate, score=self._score_round, more_prompts=more_prompts,
                    want=cfg.data.prompts_per_step, unit=group_unit(cfg, self.layouts, "critic" in self.pools),
                    max_extra_rounds=alg.dynamic_sampling.max_extra_rounds, step=self.state.step + 1,
                    verbose=self.rank == 0)
            in_use = device_bytes_in_use()  # the engine's weights and cache, and what training left resident
            self.engine.sleep(level=self.sleep_level)
        self.offloads.to_device()
        train_start = time.perf_counter()
        if self.overlap is not None:  # the finished groups' scores, computed while the others generated
            known_scores, sampling_metrics = self.overlap.frames("scores", [len(out.samples)]), self.overlap.metrics
        metrics, batch = self.train_on(prompts, out, self.state.policy_version, known_scores)
        metrics.update(sampling_metrics)
        busy = {"train": time.perf_counter() - train_start, "rollout": out.stats.seconds}
        metrics.update({"offload/host_bytes": offloaded_bytes, "offload/device_used_bytes": in_use})
        metrics.update(self.timing_metrics(batch, out, stats, busy, time.perf_counter() - step_start))
        return metrics

    def train_on(self, prompts, out, version: int, known_scores: torch.Tensor | None = None
                 ) -> tuple[dict[str, Any], RolloutBatch]:
        """Everything of one step after generation, on the training ranks (every rank when colocated), as the
        data flows: score -> old and reference log-probs (values) -> advantages and loss masks -> critic and
        actor updates -> metrics. Each role runs on its pool behind its handle (:attr:`roles`, at the same time
        where the pools are disjoint) and shares its results with every training rank. ``version``: the policy
        version (step) whose weights started generating ``out`` (each token's own is stamped on it: the batch's
        ``token_version``, :mod:`megarl.data.staleness`); ``known_scores``: its
        ``[B]`` scores where dynamic sampling already computed them.

        Returns:
            The step's metrics without its timings (:meth:`timing_metrics`), and the batch.
        """
        with self.timer("reward"):
            batch, scores = self._score(prompts, out, known_scores)
        if self.agent is None:  # an episode's rows carry their tokens' stamps (episode_batch)
            stamp_token_versions(batch, [s.policy_version for s in out.samples], default=version)
        else:
            stamp_token_versions(batch, batch.meta.pop("token_versions"), default=version)
        batch.meta["policy_version"] = oldest_versions(batch, default=version)
        if self.actor_lora:
            batch.meta["adapter_version"] = ([s.adapter_version for s in out.samples] if self.agent is None
                                             else [out.adapter_version] * len(batch))
        passes = self._forward_passes(batch)
        prepared = self._prepare_loss_inputs(batch, scores, known_scores, passes)
        self._log_samples(prompts, batch)
        updates = self._updates(batch, old_logprobs_from_update="old_logprobs" not in passes)
        metrics = {**prepared, **updates, **batch_metrics(batch, version=version, step=self.state.step + 1,
                                                          epoch=self.state.loader.epoch),
                   **old_logprob_metrics(batch, self.cfg.algorithm, exact=self.cfg.rollout.exact)}
        task = dict(zip(prompts.index, (row.get("task") for row in prompts.rows or ())))  # per-task figures
        metrics.update(task_metrics([task.get(i) for i in batch.meta["index"]], batch["scores"],
                                    batch.meta["correct"], ~batch["dropped"]))
        if self.agent is not None:  # turns, tools, tokens by role; the reward figures per episode
            metrics.update(episode_metrics(batch, out))
        return metrics, batch

    def _forward_passes(self, batch: RolloutBatch) -> dict[str, Any]:
        """The forward passes before the updates, each role on its pool (no collective between the pools):
        the actor's old log-probs where they need a pass of their own (:func:`~megarl.trainer.old_logprobs.
        old_logprob_pass`; else the actor update's first forward gives them) with its routing agreement, the
        reference's log-probs, the critic's values. Returns ``{batch key: [B, R] float32}`` (None off the role's
        pool) and ``"routing"`` (the actor's routing metrics; None off its pool)."""
        t, roles = self.timer, self.roles
        reason = old_logprob_pass(self.cfg, rows=len(batch), step=self.state.step, moe=self.spec.is_moe)
        source = (f"a pass of their own: {reason}" if reason else
                  "the actor update's first forward (actor.old_logprob_pass=always runs a pass of their own)")
        if source != self.old_logprob_source and self.rank == 0:  # said once, and again where it changes
            log.info("step %d: old log-probs from %s", self.state.step + 1, source)
        self.old_logprob_source = source
        passes: dict[str, Any] = {"routing": roles["actor"].run(lambda actor: {})}
        overlap, shape = self.overlap, batch["response_mask"].shape  # its passes ran on units of finished groups
        if reason:
            with t("old_logprobs" if overlap is None else "overlap_frames"):
                passes["old_logprobs"] = overlap.frames("old_logprobs", shape) if overlap else roles["actor"].run(
                    lambda actor: actor.compute_logprobs(batch, exact=self.cfg.rollout.exact)["logprobs"])
                passes["routing"] = roles["actor"].run(lambda actor: actor.routing_agreement())
        if "reference" in roles:
            with t("reference" if overlap is None else "overlap_frames"):
                passes["ref_logprobs"] = overlap.frames("ref_logprobs", shape) if overlap else roles["reference"].run(
                    lambda ref: ref.compute_logprobs(batch)["logprobs"])
        if "critic" in roles:
            with t("values"):
                passes["values"] = roles["critic"].run(lambda critic: critic.compute_values(batch))
        return passes

    def _prepare_loss_inputs(self, batch: RolloutBatch, scores: Any, known_scores: torch.Tensor | None,
                             passes: dict[str, Any]) -> dict[str, Any]:
        """Every input of the losses, in the batch on every training rank: the reward ranks' scores
        (:meth:`_gather_scores`), the non-finite rule's drops and the shaped rewards (every rank takes the same
        decisions), the forward passes' outputs (:meth:`_forward_passes`) shared from their pools, then the
        advantages and returns and the loss masks (:mod:`megarl.trainer.advantages`). Returns their metrics:
        the actor's routing agreement, KL, loss mask and non-finite figures."""
        alg, t = self.cfg.algorithm, self.timer
        with t("share"):
            self._gather_scores(batch, scores, known_scores)
            judge_metrics = merge_reward_metrics(gather_shares(
                self.reward_fn and self.reward_fn.take_metrics(), self.reward_ranks, group=self.train_group)
            ) if self.cfg.reward.judge.enabled else {}
            nonfinite_metrics = drop_nonfinite(batch, alg, self.state.step + 1)  # every rank: the same decision
            shape_rewards(batch, alg, self.cfg.rollout.max_new_tokens)
            # the reference's slot holds the KL's reference, or on-policy distillation's teacher
            ref_key = "ref_logprobs" if self.teacher_spec is None else "teacher_logprobs"
            for key, role, batch_key in (("old_logprobs", "actor", "old_logprobs"),
                                         ("ref_logprobs", "reference", ref_key), ("values", "critic", "values")):
                if key in passes:
                    batch[batch_key] = self.roles[role].share(passes[key], batch["response_mask"].shape)
        with t("advantages"):
            kl_metrics = compute_advantages(batch, alg, self.state.kl_ctl)
            loss_metrics = set_loss_mask(batch, alg)
            tc = self.cfg.trainer  # no token older than the bound trains (megarl.data.staleness)
            loss_metrics.update(bound_token_staleness(batch, self.state.step + 1,
                                                      tc.max_staleness if tc.mode == "async" else 0))
        routing = self.roles["actor"].share(passes["routing"])
        return {**routing, **kl_metrics, **loss_metrics, **nonfinite_metrics, **judge_metrics}

    def _updates(self, batch: RolloutBatch, *, old_logprobs_from_update: bool) -> dict[str, float]:
        """The critic's update, then the actor's (once the critic's warm-up, ``critic.warmup_steps``, is over),
        each on its pool, their metrics shared (:func:`~megarl.trainer.metrics.update_metrics`); then the
        offloaded roles' gradients and optimizer state go to the host until the next step's updates, and with
        ``old_logprobs_from_update`` the old log-probs the actor update's first forward gave are shared."""
        cfg, alg, t, roles = self.cfg, self.cfg.algorithm, self.timer, self.roles
        kwargs = dict(seed=cfg.run.seed * 7919 + self.state.step, norm_tokens=cfg.loss_norm_tokens,
                      step=self.state.step + 1)
        metrics: dict[str, float] = {}
        if "critic" in roles:
            with t("critic_update"):
                metrics.update(update_metrics("critic", roles["critic"].run_shared(
                    lambda critic: critic.update(batch, alg, **kwargs))))
        if "critic" not in roles or self.state.step >= cfg.critic.warmup_steps:
            with t("actor_update"):
                metrics.update(update_metrics("actor", roles["actor"].run_shared(
                    lambda actor: actor.update(batch, alg, **kwargs))))
        self.offloads.to_host(("grads", "optimizer"))  # idle until the next step's updates
        if old_logprobs_from_update:  # the update's, on the actor's pool
            batch["old_logprobs"] = roles["actor"].run_shared(lambda actor: batch["old_logprobs"],
                                                              batch["response_mask"].shape)
        return metrics

    def timing_metrics(self, batch: RolloutBatch, out, stats, busy: dict[str, float], step_s: float
                       ) -> dict[str, Any]:
        """The step's seconds per phase, throughput, reshard and offload figures, and each pool's busy and
        idle seconds (:func:`~megarl.trainer.metrics.timing_metrics`): ``busy["train"]`` (score, log-probs,
        advantages, updates) and ``busy["rollout"]`` (generation); with the step's tokens/s/GPU, MFU and peak
        memory (:meth:`_perf_metrics`)."""
        phases = self.timer.reset()
        phases.setdefault("generate", out.stats.seconds)  # on a pool of its own: the rollout ranks' seconds
        return {**timing_metrics(phases, self.offloads.take_seconds(), stats, busy, step_s,
                                 out.stats.generated_tokens),
                **self._perf_metrics(batch, phases, step_s)}

    def _perf_metrics(self, batch: RolloutBatch, phases: dict[str, float], step_s: float) -> dict[str, float]:
        """Tokens/s/GPU, MFU and peak memory of the step and of each phase (:mod:`megarl.measure.throughput`)."""
        return step_perf_metrics(self.spec, batch["prompt_lens"], batch["response_lens"], seconds=phases,
                                 peak_bytes=self.timer.reset_peaks(), step_s=step_s, world=self.world,
                                 epochs={"actor_update": self.cfg.actor.ppo_epochs,
                                         "critic_update": self.cfg.critic.ppo_epochs},
                                 peak_flops=self.peak_flops)

    @property
    def sleep_level(self) -> int:
        """How deep the engine sleeps after generating: 2 (weights dropped) where the next reshard rewrites every
        weight; 1 (weights kept on the host) with LoRA adapter sync, whose base is written once."""
        return 1 if self.adapter_sync else 2

    def reshard_actor_to_engine(self, version: int | None = None):
        """Wake the rollout engine and write the actor's current weights into it (every rank: a rank without
        an engine sends its shards or just takes part); returns this rank's reshard stats. A LoRA actor sends
        merged weights, or with adapter sync its base once and then its adapters alone (:meth:`_sync_adapters`);
        the engine records the version its samples come from: ``version``, default ``state.step`` (a rollout
        rank taking weights in flight is still at the step before, :mod:`megarl.parallel.in_flight`)."""
        rc = self.cfg.reshard
        version = self.state.step if version is None else version

        def run(plan, dst: dict[str, torch.Tensor]):
            return execute_plan(plan, self.actor.source_tensors() if self.actor else {}, dst,
                                bucket_bytes=int(rc.bucket_mb * 2**20),
                                direct_min_bytes=None if rc.direct_min_kb is None else
                                math.ceil(rc.direct_min_kb * 2**10))

        if self.adapter_sync:
            return self._sync_adapters(run, version)
        if self.engine is None:
            return run(self.reshard_plan, {})
        self.engine.wake_up()
        stats = self.engine.update_weights(lambda dst: run(self.reshard_plan, dst))
        self.engine.adapter_version = version if self.actor_lora else None
        self.engine.policy_version = version
        return stats

    def _sync_adapters(self, run, version: int):
        """LoRA adapter sync: the base weights into the engine where it has none (the first step; its sleep keeps
        them: :attr:`sleep_level`), then the adapters, whole on every engine rank (vLLM's LoRA layers cut their
        own TP shards), handed to the engine in memory as ``version``."""
        engine = self.engine
        has_base = share_object(engine is not None and engine.has_weights, self.rollout_ranks[:1])
        if not has_base:
            if engine is None:
                run(self.reshard_plan, {})
            else:
                engine.wake_up()
                engine.update_weights(lambda dst: run(self.reshard_plan, dst))
        if engine is None:
            return run(self.adapter_plan, {})
        engine.wake_up()
        layout = self.adapter_plan.dst.tensors(self.rank)
        tensors = {n: torch.empty(lt.shape, dtype=engine.dtype, device=engine.device) for n, lt in layout.items()}
        stats = run(self.adapter_plan, tensors)
        engine.update_adapters(tensors, self.actor_lora, version=version)
        engine.policy_version = version
        return stats

    def validate(self) -> dict[str, Any]:
        """Validation metrics (``val/...``) of the current actor; its responses go to ``val_samples.jsonl``.

        The engine's call counter (part of every training sample's seed) is restored afterwards, so training
        samples do not depend on when, or whether, the run validates.
        """
        calls = self.engine.calls
        if self.rank == 0:  # minutes on a CPU: say what runs (the step bar waits meanwhile)
            log.info("validating at step %d: %s", self.state.step, self.validation.describe())
        start = time.perf_counter()
        self.reshard_actor_to_engine()
        metrics, records = self.validation.run(self.engine, group=self.rollout_group, evaluate_fn=self.agent and
                                               functools.partial(evaluate_episodes, self.agent))
        if self.rank == 0:
            log.info("validation at step %d: accuracy %.3f, mean reward %.3f (%.0f s)", self.state.step,
                     metrics.get("val/accuracy", float("nan")), metrics.get("val/reward_mean", float("nan")),
                     time.perf_counter() - start)
        self.engine.sleep(level=self.sleep_level)
        self.engine.calls = calls
        if self.reward_fn is not None:  # the judge's figures are the training steps' alone
            self.reward_fn.take_metrics()
        if self.rank == 0:
            append_samples(self.run_dir / "val_samples.jsonl", records, step=self.state.step)
        return metrics

    def _rewards(self, prompts: list[str], responses: list[str], truths: list[str | None]) -> torch.Tensor:
        """``[B]`` float32 scores of ``B`` responses on every rank: the reward pool scores, each rank a share."""
        return torch.cat(map_data_parallel(self.reward_fn, prompts, responses, truths, ranks=self.reward_ranks))

    def _score_round(self, prompts: PromptBatch, out: RolloutOutput) -> torch.Tensor:
        """``[B]`` float32 scores of a round's responses (episodes: one each, the environment's reward or
        ``reward.fn`` on its last assistant message) on every rank (dynamic sampling's rounds)."""
        if self.agent is not None:
            return episode_scores(prompts, out, self._rewards)
        return self._rewards(*prompts.reward_inputs(out.samples, self.tokenizer))

    def _score(self, prompts, out, known: torch.Tensor | None = None) -> tuple[RolloutBatch, Any]:
        """Decode and pack the rollout into a batch, and score this rank's share of it (the reward pool's ranks
        a share each, None elsewhere; no collective, so the other pools go on meanwhile);
        :meth:`_gather_scores` puts every score into the batch. With ``known`` (the ``[B]`` scores, already
        computed on every rank: dynamic sampling; with episodes one per episode) nothing is scored."""
        if self.agent is not None:  # one row per trained sample of an episode; reward.fn where the env gave none
            batch = episode_batch(prompts, out, self.tokenizer, pad_token_id=self.pad_id,
                                  seq_multiple=8 * self.mesh.tp * self.mesh.cp,
                                  multiple=row_multiple(self.cfg, "critic" in self.pools))
            if known is not None:
                return batch, None
            return batch, map_share(self.reward_fn, *to_score(batch, prompts, out), ranks=self.reward_ranks)
        n = out.n
        samples = out.samples
        raw, texts, truths = prompts.reward_inputs(samples, self.tokenizer)
        local = None if known is not None else map_share(self.reward_fn, raw, texts, truths,
                                                          ranks=self.reward_ranks)
        batch = build_batch([prompts.input_ids[s.prompt_index] for s in samples], [s.token_ids for s in samples],
                            [s.logprobs for s in samples], [s.prompt_index for s in samples],
                            pad_token_id=self.pad_id, seq_multiple=8 * self.mesh.tp * self.mesh.cp,
                            routed_experts=[s.routed_experts for s in samples],
                            meta={"response": texts, "finish_reason": [s.finish_reason for s in samples],
                                  "index": [prompts.index[s.prompt_index] for s in samples]})
        assert len(batch) == len(prompts.input_ids) * n
        return batch, local

    def _gather_scores(self, batch: RolloutBatch, local: Any, known: torch.Tensor | None = None) -> None:
        """Every reward rank's share of the scores (:meth:`_score`) as ``batch["scores"]`` ``[B]`` float32 and
        ``batch.meta["correct"]`` (score >= 1), on every rank (``known``: all of them, already on every rank)."""
        if self.agent is not None and known is not None:  # an episode's score on each of its rows (padding: 0)
            scores = torch.tensor([float(known[e]) if e >= 0 else 0.0 for e in batch.meta["episode"]])
        elif known is not None:
            scores = known
        else:
            scores = torch.cat(gather_shares(local, self.reward_ranks, group=self.train_group))
            if self.agent is not None:
                scores = fill_scores(batch, scores)
        batch["scores"] = scores
        batch.meta["correct"] = (scores >= 1.0).tolist()

    def generate(self, prompts: PromptBatch, round_idx: int, step: int | None = None, pause=None,
                 gather: bool = True) -> RolloutOutput:
        """Generate ``rollout.n`` responses to each prompt, over the rollout data-parallel group.

        Every sample's seed is a function of ``(run.seed, step, round, prompt, sample)`` alone, never of what
        ran before: round ``round_idx`` of a step (dynamic sampling's extra rounds) has its own sampling seed,
        and the engine's call counter (the other part of the seed) is set to the step's index before the
        call and to the next step's after it, whatever the rounds, validations or generations ahead before
        it. So the checkpoint's step is all a resumed run needs to sample as the uninterrupted one
        (:class:`Trainer` sets the counter from it on resume).
        ``step``: the (1-based) step whose batch this is, when not the one after ``state.step`` (a rollout pool
        of its own generates ahead). Episodes only: ``pause``, new weights taken between turns, and
        ``gather=False``, this rank's episodes alone (:mod:`megarl.parallel.in_flight`)."""
        index = self.state.step if step is None else step - 1
        sampling = SamplingConfig(seed=self.cfg.run.seed * 1_000_003 + index + round_idx * 7_919_993, **self.sampling)
        self.engine.calls = index
        if self.agent is not None:
            adapters = self.engine.adapter_version  # at the start: the oldest, where weights change in flight
            out = generate_episodes(self.agent, self.engine, prompts, sampling, group=self.rollout_group,
                                    pause=pause, gather=gather)
            out.adapter_version = adapters
        elif self.overlap is not None:  # rollout.overlap_scoring: the finished groups scored meanwhile
            out = self.overlap.generate(self.engine, prompts, sampling, group=self.rollout_group, step=index)
        else:
            out = generate_data_parallel(self.engine, prompts.input_ids, sampling, group=self.rollout_group)
        self.engine.calls = index + 1
        return out

    def _log_samples(self, prompts, batch: RolloutBatch) -> None:
        """Append the step's first ``trainer.log_samples`` responses to ``samples.jsonl`` (rank 0): ``row`` (in the
        step's batch), prompt, response, score, ground truth, ``length`` (response tokens), ``prompt_tokens``,
        policy version (the row's oldest token's), ``token_versions`` (``{version: tokens}`` of the row's tokens in
        the actor's loss), finish reason."""
        k = min(self.cfg.trainer.log_samples, len(batch))
        if self.rank != 0 or k == 0:
            return
        adapters = "adapter_version" in batch.meta
        append_samples(self.run_dir / "samples.jsonl", [
            {"row": i, "prompt": prompts.raw_prompt[g], "response": batch.meta["response"][i],
             "score": None if batch["dropped"][i] else float(batch["scores"][i]),
             "ground_truth": prompts.ground_truth[g], "length": int(batch["response_lens"][i]),
             "prompt_tokens": int(batch["prompt_lens"][i]), "policy_version": batch.meta["policy_version"][i],
             "token_versions": trained_versions(batch, i),
             **({"adapter_version": batch.meta["adapter_version"][i]} if adapters else {}),
             "finish_reason": batch.meta["finish_reason"][i]}
            for i, g in ((i, int(batch["group"][i])) for i in range(k))], step=self.state.step + 1)


def train(cfg: Config) -> dict[str, Any]:
    """Run RL training on this rank (call on every rank of the job).

    Rank 0 holds the run folder's lock (:mod:`megarl.parallel.run_lock`) for the whole run, taken before the
    process group is set up (the other ranks wait for rank 0 there), so no rank writes into a folder that
    another run owns.

    Raises:
        ConfigError: the run folder's checkpoints do not fit this run
            (:func:`~megarl.trainer.checkpointing.check_run_folder`).
        RunLockedError: another run owns the run folder (rank 0).
        PeerLostError: a collective failed because a peer died or stalled past ``trainer.timeout_s``.
    """
    seed_all(cfg.run.seed)
    return fit_in_run_folder(cfg, lambda: Trainer(cfg))


def fit_in_run_folder(cfg: Config, build: Callable[[], Any]) -> dict[str, Any]:
    """Check that the run folder's checkpoints fit ``cfg``'s run, hold the folder's lock on rank 0, build the
    trainer (``build()``: :class:`Trainer`, or an offline trainer of :mod:`megarl.offline`) and run its loop
    (:func:`~megarl.trainer.loop.fit`) with lost peers named; returns the summary. Raises as :func:`train`."""
    check_run_folder(cfg, launch_info().world_size)
    lock = RunLock(cfg.run.run_dir).acquire() if launch_info().rank == 0 else None
    try:
        os.makedirs(cfg.run.run_dir, exist_ok=True)
        with peer_failures_named(cfg.trainer.timeout_s):
            return fit(build())
    finally:
        if lock is not None:
            lock.release()
