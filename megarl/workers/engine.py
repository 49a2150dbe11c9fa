"""The engine of one Megatron role on this rank (:class:`MegatronWorker`): its model chunks on the role's
TP x PP x DP (x CP, EP, VPP) mesh and, when trained, their DDP wrappers, optimizer and LR schedule; forward
passes that give per-token outputs of the whole batch, PPO-style updates over mini-batches, and the checkpoint
state. The roles build on it: the actor and reference policy (:mod:`megarl.workers.actor`) and the critic
(:mod:`megarl.workers.critic`).

Every rank holds the whole step's :class:`~megarl.data.batch.RolloutBatch`; a worker computes on its
data-parallel share (micro-batched through megatron's ``forward_backward_func``), then all-gathers the result
over DP and broadcasts it from the last pipeline stage, so every rank again holds the whole batch. Updates split
each global mini-batch over DP ranks and micro-batches; the loss is normalised by the mini-batch's global
token (or sequence) count and scaled by ``num_microbatches * dp`` to undo megatron's averaging over
micro-batches and DP ranks, so the gradient equals that of the whole mini-batch whatever the layout.

With context parallelism (CP > 1) the model runs on this CP rank's share of each sequence; its per-token
outputs (log-probs, entropy, values) are gathered over the CP group into whole sequences
(:func:`megarl.kernels.context_parallel.gather_from_cp_ranks`, whose backward keeps this rank's slice of the gradient),
so every CP rank computes the same loss with the same normalisers and back-propagates through its own tokens.
megatron multiplies the loss by CP and DDP averages the gradients over DP x CP: their sum over the CP ranks is
the whole sequences' gradient, and ``num_microbatches * dp`` still undoes the rest.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from megarl.kernels.batch_invariant import EXACT_LOGIT_BYTES, batch_invariant_mode, vllm_kernels
from megarl.kernels.context_parallel import gather_from_cp_ranks
from megarl.algos.nonfinite import NonFiniteError
from megarl.config import ActorConfig, OptimConfig
from megarl.data.batch import RolloutBatch, response_positions
from megarl.models.checkpoint import (adapters_only, as_chunks, chunk_parameters, chunks_sharded_state_dict,
                                      init_adapters, is_lora_checkpoint, load_chunks_state_dict,
                                      load_weights)
from megarl.models.lora import LoRASpec, finalize_with_partial_grads
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
from megarl.models.spec import ModelSpec
from megarl.parallel.mesh import ParallelLayout
from megarl.parallel.placement import PoolGroups
from megarl.workers.optimizer import (OPTIMIZER_CHAIN_PREFIX, OPTIMIZER_FORMAT, load_optimizer_state,
                                      init_adam_state, sharded_optimizer_state, use_fused_adam)
from megarl.workers.packing import pack_rows, pack_shares, trim_to_longest

MODEL_INPUTS = ("input_ids", "prompt_lens", "response_mask")
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
                               count_routes: bool = False, exact: bool = False) -> dict[str, torch.Tensor]:
        """Run ``fn(micro_batch, output) -> {name: [b, R] tensor}`` over this rank's DP share (``model_kwargs``:
        extra model arguments); return the whole batch's ``{name: [B, R] float32}`` on every rank.

        ``count_routes`` (a trainable MoE actor's old-log-prob pass): the routers also count the batch's routing
        statistics (:func:`~megarl.models.moe_router.count_routing`), which the update of this batch then uses
        instead of a pass of its own where the weights are still these (:attr:`pass_routing`).

        ``exact`` (``rollout.exact``'s old-log-prob pass): batch-invariant, a sample's outputs do not depend on the
        other samples of the batch, their number or its padding (:meth:`_exact_micro_batches`): in vLLM's
        batch-invariant mode (a GPU run with vLLM) the linear layers, norms and attention run vLLM's kernels
        (:func:`megarl.kernels.batch_invariant.vllm_kernels`), elsewhere every sample is a micro-batch of its own."""
        found = routers(self.model) if count_routes else []
        moe_names = ("response_lens",) if needs_batch_stats(found) else ()
        if exact:
            micro, rows = self._exact_micro_batches(batch, MODEL_INPUTS + moe_names)
        else:
            micro, rows = self._micro_batches(batch, MODEL_INPUTS + moe_names,
                                              self.forward_micro_batch_size(len(batch) // self.dp_size))
        for chunk in self.chunks:
            chunk.eval()
        forward = functools.partial(run_microbatches, self.model, micro,
                                    lambda mb, out: (torch.zeros((), device=self.device), fn(mb, out)),
                                    forward_only=True, model_kwargs=model_kwargs)
        kernels = vllm_kernels(self.chunks) if exact and batch_invariant_mode() else contextlib.nullcontext()
        with torch.no_grad(), kernels:
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

    def _micro_batches(self, batch: RolloutBatch, names: tuple[str, ...], size: int, budget: int | None = None
                       ) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor] | None]:
        """This rank's DP share of ``batch`` cut into micro-batches of tensors ``names``, on the device.

        ``budget``: padded tokens per micro-batch; None: ``rc.max_tokens_per_micro_batch``. A budget of 0: rows
        ``[r * B/dp, (r + 1) * B/dp)`` in consecutive micro-batches of ``size`` rows, each as wide as the batch; the
        rows are None. Otherwise rows dealt to the DP ranks
        balanced by tokens and packed into micro-batches by token count (:func:`~megarl.workers.packing.
        pack_shares`), as many on every DP rank (with VPP a multiple of ``pp``, for megatron's interleaved
        schedule: micro-batches are split until it is); the rows are, per DP rank, the batch rows of its micro-batches
        in order (the same on every rank). Each micro-batch is cut to its longest row, or with
        ``rc.sequence_packing`` is one packed (THD) row (:func:`~megarl.workers.packing.pack_rows`) of its
        rows' tokens, padded at the tail to a multiple of TP under sequence parallelism and, with PP > 1, to
        the longest micro-batch of the batch (the pipeline schedule sends one shape).
        """
        budget = self.rc.max_tokens_per_micro_batch if budget is None else budget
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

    def _exact_micro_batches(self, batch: RolloutBatch, names: tuple[str, ...]
                             ) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor] | None]:
        """This rank's DP share of ``batch`` in micro-batches whose outputs do not depend on which samples share
        them (:meth:`_micro_batches`' return).

        In vLLM's batch-invariant mode (:func:`~megarl.kernels.batch_invariant.batch_invariant_mode`) every kernel
        of the pass computes a token's row alone and attention a sequence alone, whatever the batch: rows of
        similar length share micro-batches (:func:`~megarl.workers.packing.pack_shares`, each cut to its longest
        row) of at most :data:`EXACT_LOGIT_BYTES` of float32 logits, since the pass keeps the model's whole logits
        (:func:`~megarl.kernels.batch_invariant.vllm_logprobs`). Elsewhere (the CPU, whose matmuls are not
        batch-invariant) every sample is a micro-batch of its own, cut to its own length (padded to a multiple of
        ``8 * tp``, as the batch is), in order (the rows are None), so that the positions whose logits the
        chunked output layer computes are its response's, not the batch's response width (``logit_positions``,
        :meth:`_with_logit_positions`), which its chunks of tokens cut."""
        if batch_invariant_mode():  # (exact refuses sequence packing: padded rows, each micro-batch its longest)
            return self._micro_batches(batch, names, 1, budget=max(1, EXACT_LOGIT_BYTES // (4 * self.spec.vocab_size)))
        share = dp_share(batch, self.dp_rank, self.dp_size)
        lengths = share["prompt_lens"] + share["response_lens"]
        micro = []
        for i, mb in enumerate(share.micro_batches(1, names)):
            mb = self._to_device(trim_to_longest(mb, lengths[i:i + 1], 8 * self.mesh.tp))
            mb["logit_positions"] = response_positions(mb["prompt_lens"], int(share["response_lens"][i]),
                                                       mb["input_ids"].shape[1])
            micro.append(mb)
        return micro, None

    def _with_logit_positions(self, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``mb`` with ``logit_positions`` ``[b, s]`` bool, the response tokens' labels
        (:func:`~megarl.data.batch.response_positions`): the chunked log-prob output
        (:class:`megarl.kernels.chunked_logprobs.LogprobOutput`) runs the output layer on those tokens only, not on the
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
        model checkpoints and trainer checkpoints load alike. ``optimizer_format`` and ``chain_prefix``: the
        optimizer state's form (:func:`~megarl.workers.optimizer.sharded_optimizer_state`; a checkpoint's own
        when loading one written before the current form). A LoRA actor's model state is its adapters alone (the
        frozen base is the run's ``model.path``)."""
        from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding

        model_sd = chunks_sharded_state_dict(self.model)
        if self.lora is not None:
            model_sd = adapters_only(model_sd)
        out = {"model": model_sd}
        if self.optimizer is not None:
            out["optimizer"] = sharded_optimizer_state(self.optimizer, model_sd, is_loading=is_loading,
                                                       optimizer_format=optimizer_format, chain_prefix=chain_prefix)
        if self.role == "critic":
            add_prefix_for_sharding(out, "critic.")
        return out

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's model and optimizer state (:func:`megarl.models.checkpoint.load_checkpoint` of
        :meth:`sharded_state_dict`); the optimizer keeps the current config's hyper-parameters
        (:func:`~megarl.workers.optimizer.load_optimizer_state`), and :meth:`resume_schedule` then sets the LR
        and weight decay of the resumed update."""
        load_chunks_state_dict(self.model, state["model"])
        if self.optimizer is not None and "optimizer" in state:
            load_optimizer_state(self.optimizer, state["optimizer"])

    def resume_schedule(self, updates_done: int) -> None:
        """Continue the LR and weight-decay schedule of the current config (``optim``, and the decay horizon of
        the current ``trainer.steps``) after ``updates_done`` optimizer updates: the count carries over, the
        schedule does not (an extended run does not train its new steps at ``min_lr``)."""
        self.scheduler.num_steps = 0
        self.scheduler.step(increment=updates_done)


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
