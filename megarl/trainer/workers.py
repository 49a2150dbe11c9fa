"""The role workers of the RL step: actor (policy), reference policy and critic, each a Megatron model on the
job's TP x PP x DP mesh.

Every rank holds the whole step's :class:`~megarl.trainer.batch.RolloutBatch`; a worker computes on its
data-parallel share (micro-batched through megatron's ``forward_backward_func``), then all-gathers the result
over DP and broadcasts it from the last pipeline stage, so every rank again holds the whole batch. Updates split
each global mini-batch over DP ranks and micro-batches; the loss is normalised by the mini-batch's global
token (or sequence) count and scaled by ``num_microbatches * dp`` to undo megatron's averaging over
micro-batches and DP ranks, so the gradient equals that of the whole mini-batch whatever the layout.

With context parallelism (CP > 1) the model runs on this CP rank's share of each sequence; its per-token
outputs (log-probs, entropy, values) are gathered over the CP group into whole sequences
(:func:`kernels.context_parallel.gather_from_cp_ranks`, whose backward keeps this rank's slice of the gradient),
so every CP rank computes the same loss with the same normalisers and back-propagates through its own tokens.
megatron multiplies the loss by CP and DDP averages the gradients over DP x CP: their sum over the CP ranks is
the whole sequences' gradient, and ``num_microbatches * dp`` still undoes the rest.
"""

from __future__ import annotations

import copy
import contextlib
import functools
import logging
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from kernels.chunked_logprobs import LogprobOutput
from kernels.context_parallel import gather_from_cp_ranks, next_tokens, split_for_cp_rank
from megarl.algos.aggregation import agg_loss
from megarl.algos.losses import actor_loss, value_loss
from megarl.algos.nonfinite import NonFiniteError
from megarl.algos.registry import POLICY_LOSSES
from megarl.config import ActorConfig, AlgorithmConfig, OptimConfig
from megarl.models.checkpoint import (adapters_only, as_chunks, chunk_parameters, chunks_sharded_state_dict,
                                      init_adapters, is_lora_checkpoint, load_chunks_state_dict,
                                      load_weights)
from megarl.models.logprobs import vocab_parallel_logprobs
from megarl.models.lora import LoRASpec, adapters_disabled, finalize_with_partial_grads
from megarl.models.megatron import build_model_chunks
from megarl.models.moe_router import (
    PassRouting,
    count_routing,
    global_batch_loss,
    needs_batch_stats,
    routers,
    routing_metrics,
)
from megarl.models.pipeline import broadcast_from_last_stage, run_microbatches
from megarl.models.router_replay import ROUTES, RouteReplay
from megarl.models.spec import ModelSpec
from megarl.parallel.mesh import ParallelLayout
from megarl.parallel.placement import PoolGroups
from megarl.trainer.batch import RolloutBatch, response_positions, to_response_frame
from megarl.trainer.packing import pack_rows, pack_shares, trim_to_longest

log = logging.getLogger(__name__)

MODEL_INPUTS = ("input_ids", "prompt_lens", "response_mask")
# How the DistributedOptimizer's state is checkpointed (megatron-core 0.19). "fully_reshardable" stores each
# parameter's main weight and Adam moments in the model's own (layout-free) tensor space, so a checkpoint resumes
# at any TP x PP x DP; torch Adam's per-parameter "step" (without TE/apex) travels in the param groups and is
# put back by :meth:`MegatronWorker.load_sharded_state`. Checkpoints written before it used "dp_reshardable"
# (same TP x PP only); megarl.json records the format, and such a checkpoint still loads at its own layout.
# (The default, "fully_sharded_model_space", builds flattened ShardedTensors that its torch_dist saver refuses.)
OPTIMIZER_FORMAT = "fully_reshardable"
LEGACY_OPTIMIZER_FORMAT = "dp_reshardable"
# An MoE model's experts get an optimizer of their own (megatron's ChainedOptimizer of the dense and the expert
# one) where EP > 1 or TP > 1 (expert TP = 1), a single optimizer otherwise. Its state is keyed by parameter name
# alone (megatron's "chained_optim_avoid_prefix"), not under "chained_<k>.", so a checkpoint resumes when the chain
# changes (EP 1 <-> 2, an MoE model's TP 1 <-> 2); megarl.json's "optimizer_chain_prefix" says so, and a checkpoint
# written before it (the prefixed keys) resumes only where its chain is the same.
OPTIMIZER_CHAIN_PREFIX = False
FP16_INITIAL_LOSS_SCALE = 2.0 ** 16  # model.dtype float16: the dynamic loss scale's start (torch.amp.GradScaler's)


def dp_share(batch: RolloutBatch, dp_rank: int, dp_size: int) -> RolloutBatch:
    """Rows ``[dp_rank * B/dp, (dp_rank + 1) * B/dp)`` of the batch."""
    per = len(batch) // dp_size
    return batch.select(slice(dp_rank * per, (dp_rank + 1) * per))


def reduce_to_all(values: dict[str, float] | None, keys: list[str], *, average_over: float = 1,
                  group=None, op=dist.ReduceOp.SUM) -> dict[str, float]:
    """Metrics computed on the last pipeline stage, summed over DP (divided by ``average_over``), on every rank
    of ``group`` (the role's pool; None = the world); ``op=MAX`` takes the largest instead (of values >= 0).

    ``values`` is read on ranks that are on the last stage with TP rank 0 and CP rank 0 (one per DP replica) and
    ignored elsewhere; missing keys count as 0.
    """
    from megatron.core import parallel_state as ps

    contributes = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                   and ps.get_context_parallel_rank() == 0)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    vec = torch.tensor([float((values or {}).get(k, 0.0)) if contributes else 0.0 for k in keys],
                       dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(vec, op=op, group=group)
    return {k: v / average_over for k, v in zip(keys, vec.tolist())}


class MegatronWorker:
    """One role's Megatron model on this rank (and, when trainable, its DDP wrapper, optimizer and LR schedule).

    With VPP (``mesh.vpp > 1``) the rank holds ``vpp`` model chunks (:func:`~megarl.models.megatron.
    build_model_chunks`), each with its own DDP wrapper and one optimizer over all of them; megatron's
    interleaved schedule runs them. :attr:`chunks` is always the list (one chunk without VPP), :attr:`model`
    the rank's model in the form megatron's and megarl's helpers take: the chunk itself, or with VPP the list.

    Args:
        spec / mesh: the model and its layout (``parallel_state`` already set to ``mesh``, or to a layout with
            the same TP and PP groups when ``pool`` is given).
        role: "actor" (actor and reference) or "critic".
        source: weights to load (megarl checkpoint, HF directory, GGUF file, None = the default model, or
            ``preset:NAME`` = random weights from ``seed``, the same at every layout), or another worker of the same role and mesh to copy them from (the
            reference policy starts as a copy of the actor).
        dtype: parameter dtype.
        rc: the role's config (micro-batch sizes, optimizer).
        trainable: build DDP, optimizer and LR schedule; else a frozen model in eval mode (reference).
        total_updates: optimizer steps over the whole run (for the LR decay).
        pool: the process groups of the role's pool (:mod:`megarl.parallel.placement`); None = the world, in
            megatron's layout.
        seed: the run's seed (``run.seed``): seeds a ``preset:NAME`` model's weights (:func:`~megarl.models.
            checkpoint.load_preset_weights`; every role of a run must get the same) and the LoRA adapters' start
            values (``rc.lora``, the actor; :func:`~megarl.models.checkpoint.init_adapters`) where the source does
            not hold them.

    With ``rc.lora`` (the actor) only the adapters train: the base weights are frozen before megatron's DDP wraps
    the model (no gradient buffer, no optimizer state, no fp32 copy), the optimizer covers the adapters, and the
    checkpointed state is the adapters' (:meth:`sharded_state_dict`); :attr:`lora` is its spec (else None).
    """

    def __init__(self, spec: ModelSpec, mesh: ParallelLayout, role: str, source, dtype: torch.dtype,
                 rc: ActorConfig, *, trainable: bool, total_updates: int = 1, pool: PoolGroups | None = None,
                 seed: int = 0):
        from megatron.core import parallel_state as ps

        self.spec, self.mesh, self.role, self.rc = spec, mesh, role, rc
        self.pool_group = pool.group if pool is not None else None
        self.dp_group = pool.dp if pool is not None and pool.dp is not None else ps.get_data_parallel_group()
        self.pg_collection = pool.collection() if pool is not None else None
        self.dp_rank = dist.get_rank(self.dp_group)
        self.dp_size = dist.get_world_size(self.dp_group)
        self.cp_group = ps.get_context_parallel_group() if mesh.cp > 1 else None
        self.lora = LoRASpec.from_config(rc.lora) if role == "actor" else None
        chunks = build_model_chunks(spec, mesh, role, params_dtype=dtype, init_weights=False,
                                    sequence_parallel=rc.parallel.sequence_parallel, recompute=rc.recompute,
                                    attention=rc.kernels.attention, use_te=rc.kernels.transformer_engine,
                                    lora=self.lora, moe_experts=rc.kernels.moe_experts,
                                    moe_dispatcher=rc.moe.token_dispatcher)
        if torch.cuda.is_available():
            chunks = [c.cuda() for c in chunks]
        if isinstance(source, MegatronWorker):
            for chunk, src in zip(chunks, as_chunks(source.model)):
                chunk.load_state_dict(src.state_dict(), strict=False)
        else:
            load_weights(chunks, source, seed=seed)
            if self.lora is not None and not is_lora_checkpoint(source):
                init_adapters(chunks, seed)
        self.optimizer = self.scheduler = None
        self.pass_routing: PassRouting | None = None  # the last old-log-prob pass's MoE routing statistics
        if not trainable:
            for chunk in chunks:
                chunk.requires_grad_(False)
                chunk.eval()
        else:
            chunks, self.optimizer, self.scheduler = self._make_trainable(chunks, rc.optim, total_updates)
        self.chunks = chunks
        self.model = chunks if mesh.vpp > 1 else chunks[0]
        self.device = next(chunks[0].parameters()).device

    @property
    def bare(self) -> torch.nn.Module | list[torch.nn.Module]:
        """This rank's model without the DDP wrappers: its stage's ``GPTModel``, or with VPP the list of its
        chunks' (the form of :attr:`model`)."""
        bare = as_chunks(self.model)
        return bare if isinstance(self.model, list) else bare[0]

    def source_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by Megatron name (with VPP prefixed by the chunk,
        :func:`~megarl.models.checkpoint.chunk_parameters`): the reshard engine's source tensors."""
        return {n: p.detach() for n, p in chunk_parameters(self.model).items()}

    def _make_trainable(self, chunks: list[torch.nn.Module], oc: OptimConfig, total_updates: int):
        """One megatron DDP per model chunk (bucketing on the first only), the gradient hooks on the first
        chunk's config (what the pipeline schedule reads: ``no_sync_func`` a list per chunk with VPP), one
        optimizer over every chunk and its LR schedule, as Megatron-LM's ``setup_model_and_optimizer`` builds
        them for a list of chunks."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=oc.distributed)
        ddps = [DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=c > 0,
                                        pg_collection=self.pg_collection) for c, chunk in enumerate(chunks)]
        config = ddps[0].config
        config.finalize_model_grads_func = functools.partial(finalize_model_grads, pg_collection=self.pg_collection)
        if self.lora is not None:  # the adapters' TP-partial gradients summed first (megarl.models.lora)
            from megatron.core import parallel_state as ps

            pg = self.pg_collection
            config.finalize_model_grads_func = finalize_with_partial_grads(
                config.finalize_model_grads_func, lambda: pg.tp if pg is not None else ps.get_tensor_model_parallel_group())
        config.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
        opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay, adam_beta1=oc.betas[0],
            adam_beta2=oc.betas[1], adam_eps=oc.eps, clip_grad=oc.clip_grad, bf16=config.bf16, fp16=config.fp16,
            params_dtype=config.params_dtype, use_distributed_optimizer=oc.distributed,
            # megatron's HybridDeviceOptimizer as Megatron-LM's arguments require it (precision-aware: it keeps
            # its own fp32 main copy), the host step overlapped with the copies
            optimizer_cpu_offload=oc.cpu_offload > 0, optimizer_offload_fraction=oc.cpu_offload,
            use_precision_aware_optimizer=oc.cpu_offload > 0, overlap_cpu_optimizer_d2h_h2d=oc.cpu_offload > 0,
            # fp16's dynamic loss scale starts at torch.amp.GradScaler's 2**16: megatron's 2**32 overflowed the
            # first updates (each then skipped) until halved 16 times; hysteresis and window stay megatron's
            initial_loss_scale=FP16_INITIAL_LOSS_SCALE), ddps,
            pg_collection=self.pg_collection, use_gloo_process_groups=self.pg_collection is None)
        use_fused_adam(opt)
        init_adam_state(opt)
        # The schedule multiplies the last stage's loss by the optimizer's loss scale before the backward (1.0
        # for bf16/fp32; fp16's dynamic scale, which the optimizer divides out of the gradients), as Megatron-LM's
        # setup_model_and_optimizer sets it; without it fp16 gradients were 2**-32 of their size.
        for chunk_config in {id(d.config): d.config for d in ddps}.values():
            chunk_config.grad_scale_func = opt.scale_loss
        self.fp16 = bool(config.fp16)
        # The scheduler is stepped after each update, so update k runs at its step k - 1. Megatron's warm-up
        # goes linearly from init_lr at step 0 to lr at step lr_warmup_steps: starting at lr / W and reaching
        # lr at step W - 1 makes update k (1-based) of the warm-up run at lr * k / W, none at 0.
        warm = max(oc.warmup_steps - 1, 0)
        sched = OptimizerParamScheduler(
            opt, init_lr=oc.lr / max(oc.warmup_steps, 1), max_lr=oc.lr, min_lr=oc.min_lr,
            lr_warmup_steps=warm, lr_decay_steps=max(total_updates, warm + 1),
            lr_decay_style=oc.decay, start_wd=oc.weight_decay, end_wd=oc.weight_decay, wd_incr_steps=1,
            wd_incr_style="constant")
        return ddps, opt, sched

    # ------------------------------------------------------------------ forward-only
    def forward_response_frame(self, batch: RolloutBatch, fn: Callable, names: tuple[str, ...],
                               model_kwargs: dict[str, Any] | None = None, *,
                               count_routes: bool = False) -> dict[str, torch.Tensor]:
        """Run ``fn(micro_batch, output) -> {name: [b, R] tensor}`` over this rank's DP share (``model_kwargs``:
        extra model arguments); return the whole batch's ``{name: [B, R] float32}`` on every rank.

        ``count_routes`` (a trainable MoE actor's old-log-prob pass): the routers also count the batch's routing
        statistics (:func:`~megarl.models.moe_router.count_routing`), which the update of this batch then uses
        instead of a pass of its own where the weights are still these (:attr:`pass_routing`)."""
        size = self.forward_micro_batch_size(len(batch) // self.dp_size)
        found = routers(self.model) if count_routes else []
        moe_names = ("response_lens",) if needs_batch_stats(found) else ()
        micro, rows = self._micro_batches(batch, MODEL_INPUTS + moe_names, size)
        for chunk in self.chunks:
            chunk.eval()
        forward = functools.partial(run_microbatches, self.model, micro,
                                    lambda mb, out: (torch.zeros((), device=self.device), fn(mb, out)),
                                    forward_only=True, model_kwargs=model_kwargs)
        with torch.no_grad():
            if moe_names:
                stats, res = count_routing(found, forward, self.dp_group)
                self.pass_routing = PassRouting.of(batch, stats)
            else:
                res = forward()
        return self._whole_frames(batch, res, names, rows)

    def _whole_frames(self, batch: RolloutBatch, res: list[dict[str, Any]], names: tuple[str, ...],
                      rows: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The per-token outputs ``names`` (``[b, R]`` tensors) of this rank's micro-batches of ``batch``
        (``res``: their outputs in order on the last pipeline stage, ``[]`` elsewhere; ``rows``: their batch rows,
        :meth:`_micro_batches`) as the whole batch's ``{name: [B, R] float32}`` on the CPU of every rank:
        broadcast from the last stage, gathered over DP, rows in batch order."""
        width, share = batch["response_mask"].shape[1], len(batch) // self.dp_size
        local = {n: torch.cat([r[n] for r in res]).float() for n in names} if res else None
        shapes = {n: (share, width) for n in names}
        local = broadcast_from_last_stage(local, shapes, device=self.device)
        gathered = {n: self._all_gather_dp(t).cpu() for n, t in local.items()}
        return gathered if rows is None else {n: _unpermute(t, torch.cat(rows)) for n, t in gathered.items()}

    def forward_micro_batch_size(self, share: int) -> int:
        """The largest divisor of ``share`` not above the configured forward micro-batch size (every
        micro-batch must have the same shape for the pipeline schedule) that, with VPP, cuts ``share`` into a
        multiple of ``pp`` micro-batches (megatron's interleaved schedule;
        :func:`~megarl.parallel.placement.validate_for_world` checks that ``share`` is a multiple of ``pp``)."""
        want = self.rc.logprob_micro_batch_size or self.rc.micro_batch_size
        return max(d for d in range(1, min(want, share) + 1)
                   if share % d == 0 and (share // d) % self.mesh.microbatch_multiple == 0)

    def _micro_batches(self, batch: RolloutBatch, names: tuple[str, ...], size: int
                       ) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor] | None]:
        """This rank's DP share of ``batch`` cut into micro-batches of tensors ``names``, on the device.

        ``rc.max_tokens_per_micro_batch == 0``: rows ``[r * B/dp, (r + 1) * B/dp)`` in consecutive micro-batches
        of ``size`` rows, each as wide as the batch; the rows are None. Otherwise rows dealt to the DP ranks
        balanced by tokens and packed into micro-batches by token count (:func:`~megarl.trainer.packing.
        pack_shares`), as many on every DP rank (with VPP a multiple of ``pp``, for megatron's interleaved
        schedule: micro-batches are split until it is); the rows are, per DP rank, the batch rows of its micro-batches
        in order (the same on every rank). Each micro-batch is cut to its longest row, or with
        ``rc.sequence_packing`` is one packed (THD) row (:func:`~megarl.trainer.packing.pack_rows`) of its
        rows' tokens, padded at the tail to a multiple of TP under sequence parallelism and, with PP > 1, to
        the longest micro-batch of the batch (the pipeline schedule sends one shape).
        """
        budget = self.rc.max_tokens_per_micro_batch
        if not budget:
            share = dp_share(batch, self.dp_rank, self.dp_size)
            return [self._with_logit_positions(self._to_device(m)) for m in share.micro_batches(size, names)], None
        lengths = batch["prompt_lens"] + batch["response_lens"]
        count_multiple = self.mesh.microbatch_multiple
        if self.rc.sequence_packing:
            packed = pack_shares(lengths, self.dp_size, budget, packed=True, count_multiple=count_multiple)
            multiple = self.mesh.tp if self.rc.parallel.sequence_parallel else 1
            widths = [[_round_up(int(lengths[idx].sum()), multiple) for idx in share] for share in packed]
            if self.mesh.pp > 1:
                widths = [[max(max(w) for w in widths)] * len(w) for w in widths]
            micro = [self._to_device(pack_rows({k: batch[k][idx] for k in names}, lengths[idx], width))
                     for idx, width in zip(packed[self.dp_rank], widths[self.dp_rank])]
        else:
            multiple = 8 * self.mesh.tp  # the trainer's sequence padding (build_batch's seq_multiple)
            packed = pack_shares(lengths, self.dp_size, budget, multiple=multiple, count_multiple=count_multiple)
            micro = [self._with_logit_positions(self._to_device(trim_to_longest(
                {k: batch[k][idx] for k in names}, lengths[idx], multiple))) for idx in packed[self.dp_rank]]
        return micro, [torch.cat(p) for p in packed]

    def _with_logit_positions(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``mb`` with ``logit_positions`` ``[b, s]`` bool, the response tokens' labels
        (:func:`~megarl.trainer.batch.response_positions`): the chunked log-prob output
        (:class:`kernels.chunked_logprobs.LogprobOutput`) runs the output layer on those tokens only, not on the
        prompt's. Not under CP (the model sees a share of each sequence) and not for packed rows."""
        if self.cp_group is None and "prompt_lens" in mb and "response_mask" in mb:
            mb["logit_positions"] = response_positions(mb["prompt_lens"], mb["response_mask"].shape[1],
                                                       mb["input_ids"].shape[1])
        return mb

    def _cp_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Per-token outputs ``[b, s / cp, ...]`` of this CP rank's tokens -> ``[b, s, ...]`` of the whole
        sequences (as is without CP); the backward keeps this rank's slice of the gradient (every CP rank
        computes the same loss from the gathered tensor)."""
        return t if self.cp_group is None else gather_from_cp_ranks(t, 1, self.cp_group, reduce_grad=False)

    def _to_device(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}

    def _all_gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.dp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.dp_group)
        return torch.cat(parts)

    # ------------------------------------------------------------------ training
    def train_minibatches(self, batch: RolloutBatch, names: tuple[str, ...], loss_fn: Callable, *,
                          epochs: int, seed: int, mean_keys: list[str], sum_keys: list[str],
                          max_keys: tuple[str, ...] = (), mask_name: str = "response_mask",
                          model_kwargs: dict[str, Any] | None = None, step: int | None = None,
                          outputs: tuple[str, ...] = ()) -> list[dict[str, float]]:
        """PPO-style updates: ``epochs`` passes over ``batch`` in shuffled global mini-batches, one optimizer
        step each. With one mini-batch per epoch its rows keep the batch's order, so the first update's
        micro-batches are those of the log-prob pass (first-step exactness: the update's log-probs are the old
        ones bit for bit). An update whose loss or gradient is not finite does not step
        (:meth:`_check_finite`). An MoE model with a load-balancing loss or z-loss first runs a forward pass
        without gradients over each mini-batch, whose routing statistics make those losses the whole
        mini-batch's (:mod:`megarl.models.moe_router`); their values join the step's metrics
        (:func:`~megarl.models.moe_router.routing_metrics`). The first epoch of one mini-batch of the whole batch
        takes them from the old-log-prob pass over the same tokens and weights where one ran
        (:attr:`pass_routing`): on the GPU that pass cost 15% of the update.

        Args:
            loss_fn: ``(micro_batch, output, normalisers) -> (loss, metrics)``; ``normalisers`` holds the
                mini-batch's ``global_tokens`` and ``global_seqs`` (of ``mask_name``, in ``names``).
            seed: seeds the mini-batch shuffle (identical on every rank).
            mean_keys: metrics that are means over a micro-batch's valid tokens (of ``mask_name``): averaged
                over the mini-batch weighted by each micro-batch's valid tokens, as the loss is, so they do not
                depend on the micro-batch or DP layout.
            sum_keys / max_keys: metrics summed (loss shares) / maximised over micro-batches and DP.
            mask_name: the batch's ``[B, R]`` mask of the tokens in the loss.
            model_kwargs: extra model arguments (an ``output_processor``).
            step: the RL step (1-based), named in errors.
            outputs: metrics of ``loss_fn`` that are per-token ``[b, R]`` tensors (detached), put into
                ``batch[name]`` as the whole batch's ``[B, R]`` float32 on every rank of the role's pool; only
                for one epoch of one mini-batch of the whole batch (every row's forward runs once).

        Returns:
            One metrics dict per optimizer step (with ``grad_norm`` and ``lr``, the learning rate the step
            used), identical on every rank.

        Raises:
            NonFiniteError: on every rank of the role's pool, when a micro-batch's loss or the gradient of a
                mini-batch is not finite; the optimizer has not stepped on it.
            ValueError: ``outputs`` with more than one epoch or mini-batch.
        """
        from megatron.core import parallel_state as ps

        rc = self.rc
        n_mini = len(batch) // rc.ppo_mini_batch_size
        if outputs and (epochs, rc.ppo_mini_batch_size) != (1, len(batch)):
            raise ValueError(f"the {self.role} update gives {outputs} only from one epoch of one mini-batch of the "
                             f"whole batch, got {epochs} epochs of mini-batches of {rc.ppo_mini_batch_size} of "
                             f"{len(batch)} rows; compute them before the update")
        found = routers(self.model)
        moe_names = ("response_lens",) if needs_batch_stats(found) else ()
        pass_routing, self.pass_routing = self.pass_routing, None  # valid until this update's first step
        gen = torch.Generator().manual_seed(seed)
        history = []
        for chunk in self.chunks:
            chunk.train()
        for epoch in range(epochs):
            order = torch.randperm(len(batch), generator=gen) if n_mini > 1 else torch.arange(len(batch))
            for k in range(n_mini):
                mini = batch.select(order[k * rc.ppo_mini_batch_size:(k + 1) * rc.ppo_mini_batch_size])
                mask = mini[mask_name]
                norms = {"global_tokens": float(mask.sum()), "global_seqs": float((mask.sum(-1) > 0).sum())}
                micro, rows = self._micro_batches(mini, names + moe_names, rc.update_micro_batch_size(self.dp_size))
                scale = len(micro) * self.dp_size  # the same number of micro-batches on every DP rank
                moe_loss, moe_metrics = contextlib.nullcontext(), {}
                if moe_names:  # the MoE aux loss and z-loss of the whole mini-batch (megarl.models.moe_router)
                    if epoch == 0 and n_mini == 1 and pass_routing is not None and pass_routing.holds(mini):
                        stats = pass_routing.stats  # the old-log-prob pass's: these weights, these tokens
                    else:
                        stats, _ = count_routing(found, functools.partial(
                            run_microbatches, self.model, micro,
                            lambda mb, out: (torch.zeros((), device=self.device), {}),
                            forward_only=True, model_kwargs=model_kwargs), self.dp_group)
                    moe_loss = global_batch_loss(found, stats, scale)
                    moe_metrics = routing_metrics(found, stats, ps.get_pipeline_model_parallel_group())

                def output_fn(mb, out):
                    loss, metrics = loss_fn(mb, out, norms)
                    values = {k: v if k in outputs else float(v) for k, v in metrics.items()}
                    values["tokens"] = float(mb[mask_name].sum())
                    values["loss"] = float(loss.detach())
                    return loss * scale, values

                for chunk in self.chunks:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                with moe_loss:
                    res = run_microbatches(self.model, micro, output_fn, forward_only=False,
                                           model_kwargs=model_kwargs)
                self._check_finite(res, len(micro), ("" if step is None else f"step {step}: ") + f"the {self.role}"
                                   f" update of mini-batch {k + 1}/{n_mini} (epoch {epoch + 1}/{epochs})")
                lr = self.optimizer.param_groups[0]["lr"]  # what this update uses
                stepped, grad_norm, _ = self.optimizer.step()
                if stepped:  # fp16: an overflow of the scaled gradients skips the step (the scale halves)
                    self.scheduler.step(increment=1)
                else:
                    self._check_loss_scale(step)
                if outputs:
                    for name, frame in self._whole_frames(batch, res, outputs, rows).items():
                        batch[name] = frame
                local = None
                if res:
                    local = {k: sum(r.get(k, 0.0) for r in res) for k in sum_keys}
                    local.update({k: sum(r.get(k, 0.0) * r["tokens"] for r in res) for k in mean_keys})
                    local.update({k: max(r.get(k, 0.0) for r in res) for k in max_keys})
                m = reduce_to_all(local, sum_keys, group=self.pool_group)
                m.update(reduce_to_all(local, mean_keys, average_over=max(norms["global_tokens"], 1.0),
                                       group=self.pool_group))
                m.update(reduce_to_all(local, list(max_keys), op=dist.ReduceOp.MAX, group=self.pool_group))
                m.update(moe_metrics)
                m["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
                m["lr"] = lr
                if self.fp16:
                    m["loss_scale"] = float(self.optimizer.get_loss_scale())
                    m["skipped_steps"] = 0.0 if stepped else 1.0
                history.append(m)
        return history

    def _check_finite(self, res: list[dict[str, float]], n_micro: int, update: str) -> None:
        """Stop the update ``update`` (its name in the error) before ``optimizer.step()`` when the loss of one
        of its ``n_micro`` micro-batches per DP rank (``res``: their metrics on the last pipeline stage, ``[]``
        elsewhere) or its gradient is not finite on any rank of the role's pool (:mod:`megarl.algos.nonfinite`,
        rule 4).

        One all-reduce (MAX) over the pool decides, so every rank of every DP, TP and PP group raises or none
        does: no rank steps alone. The gradient is this rank's DDP gradient buffers after the backward
        (reduced over DP, or on the distributed optimizer this rank's reduce-scattered shard and its own
        contributions to the others), tested through their sums: any NaN or infinity makes a sum non-finite.
        (megatron-core's ``DistributedDataParallelConfig.check_for_nan_in_grad`` tests the same buffers, but on
        each rank alone: the rank that finds one raises before the gradients' collective and leaves its peers
        waiting in it; its mixed-precision optimizer's ``found_inf`` skips a step silently, and only with a
        loss scale.)

        Raises:
            NonFiniteError: naming the update, the first micro-batch with a non-finite loss (its DP rank and
                place) and its value, or, with every loss finite, the first rank whose gradient is not finite.
        """
        n = max(n_micro, 1)
        bad = next(((i, r["loss"]) for i, r in enumerate(res) if not math.isfinite(r["loss"])), None)
        # fp16 gradients are scaled by the dynamic loss scale, so an overflow there is the scaler's to handle
        # (the step skipped, the scale halved: _check_loss_scale); its losses are tested as any others
        sums = [] if self.fp16 else [buf.grad_data.sum() for chunk in self.chunks
                                     for buf in (*chunk.buffers, *chunk.expert_parallel_buffers)]
        grad_ok = not sums or bool(torch.isfinite(torch.stack(sums).sum()))
        # MAX over the pool of big - position finds the first: the micro-batch (4 codes a place: + 1 NaN, + 2
        # inf, + 3 -inf, so that every rank can name the value) and the global rank; exact in float64
        big = float(2 ** 50)
        kind = 0 if bad is None else 1 if math.isnan(bad[1]) else 2 if bad[1] > 0 else 3
        flags = torch.tensor([0.0 if bad is None else big - 4 * (self.dp_rank * n + bad[0]) + kind,
                              0.0 if grad_ok else big - dist.get_rank()], dtype=torch.float64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pool_group)
        loss_code, grad_code = flags.tolist()
        if not (loss_code or grad_code):
            return
        if loss_code:
            place = (int(big - loss_code) + 3) // 4
            dp_rank, micro = divmod(place, n)
            value = {1: "nan", 2: "inf", 3: "-inf"}[int(loss_code - (big - 4 * place))]
            what = f"the loss of micro-batch {micro + 1} on DP rank {dp_rank} is {value}"
        else:
            what = (f"the gradient is not finite (a NaN or infinity in the gradient buffers of global rank "
                    f"{int(big - grad_code)}) although every micro-batch's loss is finite")
        raise NonFiniteError(f"{update}: {what}; the optimizer did not step (the weights and optimizer state are "
                             "those of the update before). Non-finite rollout log-probs and scores never reach "
                             "the loss (megarl.algos.nonfinite): look at the learning rate, the advantages and "
                             "the model's numerics (model.dtype)")

    def _check_loss_scale(self, step: int | None) -> None:
        """After an fp16 step that the optimizer skipped (its scaled gradients overflowed): nothing while the
        dynamic loss scale can still be halved; at megatron's ``min_loss_scale`` (1.0) the gradient itself is not
        finite, so the run stops as for bf16 and fp32 (:meth:`_check_finite`).

        Raises:
            NonFiniteError: the step was skipped at the smallest loss scale (the same on every rank: megatron's
                optimizer all-reduces its overflow flag).
        """
        scale = float(self.optimizer.get_loss_scale())
        if scale > 1.0:
            return
        raise NonFiniteError(f"{'' if step is None else f'step {step}: '}the {self.role} update: the fp16 gradient "
                             f"is not finite at the smallest loss scale ({scale:g}); the optimizer did not step. "
                             "Look at the learning rate, the advantages and the model's numerics (model.dtype: "
                             "bfloat16 has fp32's range)")

    # ------------------------------------------------------------------ checkpoint state
    def sharded_state_dict(self, is_loading: bool = False, optimizer_format: str = OPTIMIZER_FORMAT,
                           chain_prefix: bool = OPTIMIZER_CHAIN_PREFIX) -> dict[str, Any]:
        """Model (and optimizer) state for megatron's dist checkpointing. The critic's checkpoint keys carry
        the prefix ``critic.`` so that both models fit one checkpoint; the actor's have none, so converted
        model checkpoints and trainer checkpoints load alike. ``optimizer_format``: the DistributedOptimizer's
        sharding type (:data:`OPTIMIZER_FORMAT`; a checkpoint's own when loading one written before it);
        ``chain_prefix``: the chained optimizers' state under ``chained_<k>.`` (:data:`OPTIMIZER_CHAIN_PREFIX`;
        True for a checkpoint written before it). A LoRA actor's model state is its adapters alone (the frozen
        base is the run's ``model.path``)."""
        from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

        model_sd = chunks_sharded_state_dict(self.model)
        if self.lora is not None:
            model_sd = adapters_only(model_sd)
        out = {"model": model_sd}
        if self.optimizer is not None:
            if is_loading:
                self._materialize_optimizer_state()
            out["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                 metadata={"distrib_optim_sharding_type":
                                                                           optimizer_format,
                                                                           "chained_optim_avoid_prefix":
                                                                           not chain_prefix})
        if self.role == "critic":
            add_prefix_for_sharding(out, "critic.")
        return out

    def _materialize_optimizer_state(self) -> None:
        """An optimizer whose state is created at its first step (TE's or apex's fused Adam; torch's has its
        state from the build on: :func:`init_adam_state`) cannot describe an empty state for loading. Create it
        the way megatron does for its FSDP checkpoints: one step on zero gradients (the parameters are loaded
        from the checkpoint right after)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()

    def _restore_adam_steps(self) -> None:
        """megatron-core 0.19's DistributedOptimizer, with torch's Adam (no TE/apex), restores the step count
        into each param group's "step" but leaves the per-parameter "step" of torch's Adam state at its
        pre-load value, which Adam's bias correction reads. Copy the group's step into every parameter's."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = opt.optimizer
            for group in inner.param_groups:
                if group.get("step") is None:
                    continue
                for p in group["params"]:
                    if p in inner.state and "step" in inner.state[p]:
                        inner.state[p]["step"] = torch.tensor(float(group["step"]))

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's model and optimizer state (:func:`megarl.models.checkpoint.load_checkpoint` of
        :meth:`sharded_state_dict`). The optimizer's hyper-parameters (LR, weight decay, betas, eps, their
        schedule's bounds) are the current config's, not the checkpoint's: its param groups are replaced by this
        optimizer's own, keeping only the update count (megatron would otherwise fail to pair groups whose
        ``max_lr``/``min_lr`` changed, or restore the old weight decay); :meth:`resume_schedule` then sets the LR
        and weight decay of the resumed update."""
        load_chunks_state_dict(self.model, state["model"])
        if self.optimizer is not None and "optimizer" in state:
            state["optimizer"] = self._in_current_chain(state["optimizer"])
            self._use_current_param_groups(state["optimizer"])
            with torch.no_grad(), self._adam_steps_left_alone():  # megatron copies into the main params in place
                self.optimizer.load_state_dict(state["optimizer"])
            self._restore_adam_steps()

    @contextlib.contextmanager
    def _adam_steps_left_alone(self):
        """megatron-core 0.19's ``fully_reshardable`` loader, with torch's Adam (no TE/apex), copies every
        tensor of a parameter's optimizer state from the checkpoint, torch Adam's per-parameter ``step``
        included, which the checkpoint keeps in the param groups instead (a ``KeyError: 'step'``). Inside the
        block, each parameter's own step stands in for the missing one (the copy changes nothing);
        :meth:`_restore_adam_steps` then sets it from the checkpoint's count."""
        opts = [o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                if hasattr(o, "_set_main_param_and_optimizer_states")]

        def keep_step(opt, original):
            def set_states(model_param, tensors):
                group, order = opt.model_param_group_index_map[model_param]
                step = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]].get("step")
                original(model_param, {"step": step, **tensors} if step is not None else tensors)
            return set_states

        for opt in opts:
            opt._set_main_param_and_optimizer_states = keep_step(opt, opt._set_main_param_and_optimizer_states)
        try:
            yield
        finally:
            for opt in opts:
                del opt._set_main_param_and_optimizer_states  # the class's method again

    def _in_current_chain(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """A loaded optimizer state in this optimizer's form where the checkpoint's chain differs (its experts'
        optimizer of their own or not: :data:`OPTIMIZER_CHAIN_PREFIX`). megatron's loader places the tensors as
        this optimizer's state dict has them (one per chained optimizer under ``0``, ``1``..., or a single
        optimizer's at the top) and the rest (param groups, step, grad scaler) as the checkpoint had it; the
        checkpoint's first optimizer's rest goes with every optimizer's tensors, where they have no entry of that
        name (megatron keeps one step count for the chain; the param groups are replaced by
        :meth:`_use_current_param_groups`)."""
        def fill(into: dict, rest: dict) -> dict:
            for k, v in rest.items():
                if k not in into:
                    into[k] = copy.deepcopy(v)
                elif isinstance(into[k], dict) and isinstance(v, dict):
                    fill(into[k], v)
            return into

        chained = {k: v for k, v in loaded.items() if isinstance(k, int)}
        single = {k: v for k, v in loaded.items() if not isinstance(k, int)}
        if not chained or not single:
            return loaded  # the checkpoint's chain is this optimizer's
        if len(getattr(self.optimizer, "chained_optimizers", [self.optimizer])) > 1:
            return {k: fill(v, single) for k, v in chained.items()}
        return fill(single, chained[min(chained)])

    def _use_current_param_groups(self, loaded: dict[str, Any]) -> None:
        """Replace the param groups of a loaded optimizer state (one per chained optimizer, or the single
        one's) by this optimizer's, with the checkpoint's ``step`` (torch Adam's update count, without
        TE/apex). megatron's optimizer state dicts hold them under ``["optimizer"]["param_groups"]`` (the
        distributed and the mixed-precision optimizer) or ``["param_groups"]`` (the fp32 one)."""
        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        parts = [loaded] if len(opts) == 1 else [loaded[k] for k in sorted(loaded)]
        for opt, part in zip(opts, parts):
            holder = part.get("optimizer", part)
            steps = {g["step"] for g in holder["param_groups"] if g.get("step") is not None}
            current = opt.state_dict()
            kept = {"step": steps.pop()} if len(steps) == 1 else {}  # megatron keeps one count for all groups
            holder["param_groups"] = [{**g, **kept} for g in current.get("optimizer", current)["param_groups"]]

    def resume_schedule(self, updates_done: int) -> None:
        """Continue the LR and weight-decay schedule of the current config (``optim``, and the decay horizon of
        the current ``trainer.steps``) after ``updates_done`` optimizer updates: the count carries over, the
        schedule does not (an extended run does not train its new steps at ``min_lr``)."""
        self.scheduler.num_steps = 0
        self.scheduler.step(increment=updates_done)


def use_fused_adam(optimizer) -> None:
    """Step the torch Adam/AdamW inside a megatron optimizer (plain or chained) with torch's fused kernel (one pass
    over each tensor for the whole update), on CPU and CUDA parameters alike. Megatron builds torch's AdamW where
    neither Transformer Engine's nor apex's fused Adam exists, and torch then runs, on the CPU, its per-tensor loop
    of ~10 operations (0.73 s against 0.13 s a step for SmolLM2-135M's 148M fp32 parameters on 2 cores) and, on a
    GPU, its ``foreach`` kernels, whose temporaries (``sqrt(exp_avg_sq)`` and the step, each as large as the
    fp32 main parameters: 2 x 22 GiB for the 5.6B parameters of the 8-layer Qwen3-30B-A3B) set the update's
    peak memory. The same update within float rounding (tests/test_workers_adam.py)."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            if group["params"] and all(p.device.type in ("cpu", "cuda") for p in group["params"]):
                group["foreach"], group["fused"] = False, True


def init_adam_state(optimizer) -> None:
    """Give the torch Adam/AdamW inside a megatron optimizer (plain, chained, or the sub-optimizers of the
    HybridDeviceOptimizer of ``optim.cpu_offload``) the state that torch creates lazily at its first step
    (``torch.optim.Adam._init_group``): for every parameter a step count of 0 (float32; on the parameter's device
    for the fused kernel) and zero moments of its shape and dtype, so the first update is the same. A
    never-stepped optimizer (the actor during the critic's warm-up) is then checkpointed and resumed as any
    other: megatron-core's DistributedOptimizer reads its one step count from the state to save it (an empty
    state failed its ``assert len(steps) == 1``), and a run resumed from it makes the uninterrupted run's first
    update. The moments take the memory that the first update would take (2 x the fp32 main
    parameters of this rank's shard), from the build on."""
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        hybrid = getattr(inner, "sub_optimizers", None)  # optim.cpu_offload: megatron's HybridDeviceOptimizer
        for adam in hybrid if hybrid is not None else [inner]:
            if type(adam) not in (torch.optim.Adam, torch.optim.AdamW):
                continue
            for group in adam.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    if adam.state[p]:
                        continue
                    state = adam.state[p]
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if hybrid is not None:
            inner._sync_sub_optimizers_state_to_hdo()  # what its step does after the sub-optimizers' steps


def _round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def _unpermute(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` back in share order: row ``k`` of ``x`` belongs to share row ``order[k]`` (None: as is)."""
    if order is None:
        return x
    out = torch.empty_like(x)
    out[order.to(x.device)] = x
    return out


class PolicyWorker(MegatronWorker):
    """The actor (trainable) or the reference policy (frozen): per-token log-probs and the PPO update.

    An MoE actor's passes read the batch's engine routes (``routed_experts``): :attr:`routes` replays them
    (``rc.moe.router_replay``) and measures the routing agreement of the old-log-prob pass
    (:meth:`routing_agreement`); None for a dense model and the reference policy.
    """

    def __init__(self, *args, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.temperature = temperature
        self.routes = (RouteReplay(self.chunks, replay=self.rc.moe.router_replay)
                       if self.spec.is_moe and self.optimizer is not None else None)

    def _micro_batches(self, batch: RolloutBatch, names: tuple[str, ...], size: int):
        """:meth:`MegatronWorker._micro_batches`, with the batch's routes in each micro-batch, handed to
        :attr:`routes` (which finds each micro-batch of the passes that follow by its ``input_ids``)."""
        if self.routes is None:
            return super()._micro_batches(batch, names, size)
        micro, rows = super()._micro_batches(batch, names + ((ROUTES,) if ROUTES in batch else ()), size)
        self.routes.queue(micro)
        return micro, rows

    def routing_agreement(self) -> dict[str, float]:
        """The routing agreement between the engine and the old-log-prob passes since the last call
        (:meth:`~megarl.models.router_replay.RouteReplay.agreement`, over the role's pool: every rank of it
        calls); ``{}`` without routes."""
        return self.routes.agreement(self.pool_group) if self.routes is not None else {}

    def _model_kwargs(self, with_entropy: bool) -> dict[str, Any] | None:
        """With ``kernels.chunked_logprob`` the model itself returns ``(logprobs, entropy)``, computed in chunks
        of tokens from its last hidden states (:class:`kernels.chunked_logprobs.LogprobOutput`)."""
        k = self.rc.kernels
        if not k.chunked_logprob:
            return None
        return {"output_processor": LogprobOutput(vocab_size=self.spec.vocab_size, temperature=self.temperature,
                                                  with_entropy=with_entropy, chunk_tokens=k.logprob_chunk_tokens)}

    def _logprobs(self, mb, out, with_entropy: bool):
        """Response-frame ``[b, R]`` log-probs (and entropy) from the model output: vocab-parallel logits, or
        the ``(logprobs, entropy)`` of :meth:`_model_kwargs`' output processor."""
        if isinstance(out, tuple):
            logp, ent = out
        else:
            labels = next_tokens(mb["input_ids"])
            if self.cp_group is not None:
                labels = split_for_cp_rank(labels, 1, self.cp_group)
            logp, ent = vocab_parallel_logprobs(out, labels, vocab_size=self.spec.vocab_size,
                                                temperature=self.temperature, with_entropy=with_entropy)
        logp = self._cp_gather(logp)
        ent = self._cp_gather(ent) if with_entropy else None
        frame = functools.partial(to_response_frame, prompt_lens=mb["prompt_lens"],
                                  response_width=mb["response_mask"].shape[1], seq_offsets=mb.get("seq_offsets"))
        return frame(logp), (frame(ent) if with_entropy else None)

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False, *,
                         adapters: bool = True) -> dict[str, torch.Tensor]:
        """``{"logprobs": [B, R]}`` (and ``"entropy"``) of the batch's responses under this policy, fp32;
        ``adapters=False``: under a LoRA actor's base (its adapters off, :func:`~megarl.models.lora.
        adapters_disabled`)."""
        names = ("logprobs", "entropy") if with_entropy else ("logprobs",)

        def fn(mb, logits):
            logp, ent = self._logprobs(mb, logits, with_entropy)
            return {"logprobs": logp, "entropy": ent} if with_entropy else {"logprobs": logp}

        measure = self.routes.measuring() if self.routes is not None and adapters else contextlib.nullcontext()
        with contextlib.nullcontext() if adapters else adapters_disabled(self.chunks), measure:
            return self.forward_response_frame(batch, fn, names, self._model_kwargs(with_entropy),
                                               count_routes=adapters and self.optimizer is not None)

    def update(self, batch: RolloutBatch, alg: AlgorithmConfig, *, seed: int,
               norm_tokens: float | None = None, step: int | None = None) -> list[dict[str, float]]:
        """Policy-loss updates of the actor on ``batch`` (needs old_logprobs, advantages, loss_mask (the tokens
        in the loss: the response mask minus what overlong filtering, rollout correction and the non-finite
        rule leave out; without it, the response mask),
        rollout_weights when the rollout correction weighs tokens, and ref_logprobs when the KL is in the
        loss); ``norm_tokens``: the constant of ``loss_agg_mode=seq-mean-token-sum-norm``; ``step``: the RL
        step, for errors. Returns per-optimizer-step metrics: pg_loss, entropy, kl_loss, clipfrac,
        clipfrac_lower, ppo_kl, approx_kl (token means over the mini-batch), log_ratio_absmax (largest |log-prob
        - old log-prob|), grad_norm, lr.

        Without ``batch["old_logprobs"]`` (one epoch of one mini-batch: :mod:`megarl.trainer.old_logprobs`) the
        update's own detached log-probs are the old ones (the ratio exactly 1, with its gradient), and they are
        added to the batch as ``old_logprobs`` ``[B, R]`` float32 on every rank of the actor's pool.

        Raises:
            NonFiniteError: a loss or gradient that is not finite (:meth:`train_minibatches`).
            ValueError: no old log-probs with more than one epoch or mini-batch.
        """
        kl_in_loss = alg.kl.in_loss and alg.kl.coef > 0
        mask_name = "loss_mask" if "loss_mask" in batch else "response_mask"
        on_policy = "old_logprobs" not in batch
        names = (MODEL_INPUTS + (() if on_policy else ("old_logprobs",)) + ("advantages",)
                 + (("loss_mask",) if mask_name == "loss_mask" else ())
                 + (("ref_logprobs",) if kl_in_loss else ())
                 + (("rollout_weights",) if "rollout_weights" in batch else ()))
        params = POLICY_LOSSES.entry(alg.policy_loss).config_params(alg)

        def loss_fn(mb, logits, norms):
            logp, ent = self._logprobs(mb, logits, with_entropy=True)
            old = logp.detach() if on_policy else mb["old_logprobs"]
            loss, metrics = actor_loss(
                logp, old, mb["advantages"], mb[mask_name], policy_loss=alg.policy_loss,
                policy_loss_params=params, agg_mode=alg.loss_agg_mode, entropy=ent,
                entropy_coeff=alg.entropy_coef, ref_logprob=mb.get("ref_logprobs"),
                kl_coef=alg.kl.coef if kl_in_loss else 0.0, kl_kind=alg.kl.estimator,
                rollout_weights=mb.get("rollout_weights"), norm_tokens=norm_tokens, **norms)
            metrics["entropy"] = agg_loss(ent.detach(), mb[mask_name], "token-mean",
                                          global_tokens=norms["global_tokens"])
            if on_policy:
                metrics["old_logprobs"] = old
            return loss, metrics

        return self.train_minibatches(batch, names, loss_fn, epochs=self.rc.ppo_epochs, seed=seed,
                                      sum_keys=["pg_loss", "kl_loss", "entropy"],
                                      mean_keys=["clipfrac", "clipfrac_lower", "ppo_kl", "approx_kl"],
                                      max_keys=("log_ratio_absmax",), mask_name=mask_name,
                                      model_kwargs=self._model_kwargs(with_entropy=True), step=step,
                                      outputs=("old_logprobs",) if on_policy else ())


class BasePolicy:
    """The reference policy of a LoRA actor: the actor itself with its adapters off, so no second copy of the
    weights exists (the frozen base is the reference's weights, bit for bit).

    Args:
        actor: the LoRA actor's :class:`PolicyWorker`.
    """

    def __init__(self, actor: PolicyWorker):
        self.actor = actor

    def compute_logprobs(self, batch: RolloutBatch, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`PolicyWorker.compute_logprobs` under the base."""
        return self.actor.compute_logprobs(batch, with_entropy, adapters=False)


class CriticWorker(MegatronWorker):
    """The value model: per-token values ``V(s_t)`` (the state before each response token) and its update."""

    def _values(self, mb, out):
        return to_response_frame(self._cp_gather(out.float()), mb["prompt_lens"], mb["response_mask"].shape[1],
                                 mb.get("seq_offsets"))

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """``[B, R]`` float32 values of the batch's response positions."""
        return self.forward_response_frame(batch, lambda mb, out: {"values": self._values(mb, out)},
                                           ("values",))["values"]

    def update(self, batch: RolloutBatch, alg: AlgorithmConfig, *, seed: int,
               norm_tokens: float | None = None, step: int | None = None) -> list[dict[str, float]]:
        """Clipped value-loss updates on ``batch`` (needs values (old), returns, and value_mask where samples
        leave the value loss (the response mask without the samples the non-finite rule drops; without it, the
        response mask)); ``norm_tokens`` and ``step`` as the actor's. Returns per-step metrics: vf_loss,
        vf_clipfrac, vpred_mean, grad_norm, lr.

        Raises:
            NonFiniteError: a loss or gradient that is not finite (:meth:`train_minibatches`).
        """
        mask_name = "value_mask" if "value_mask" in batch else "response_mask"
        names = MODEL_INPUTS + ("values", "returns") + (("value_mask",) if mask_name == "value_mask" else ())

        def loss_fn(mb, out, norms):
            loss, metrics = value_loss(self._values(mb, out), mb["values"], mb["returns"], mb[mask_name],
                                       cliprange_value=alg.value_clip, agg_mode=alg.loss_agg_mode,
                                       norm_tokens=norm_tokens, **norms)
            return loss * alg.vf_coef, metrics

        return self.train_minibatches(batch, names, loss_fn, epochs=self.rc.ppo_epochs, seed=seed,
                                      sum_keys=["vf_loss"], mean_keys=["vf_clipfrac", "vpred_mean"],
                                      mask_name=mask_name, step=step)
