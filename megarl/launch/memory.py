"""Per-rank memory estimate of an RL run, from the model shape and the layout (``megarl sweep`` drops the
points whose estimate exceeds the device's memory before anything starts).

For the busiest rank (the pipeline stage holding the most parameters), in bytes:

- **params**: the actor's share: ``layers/pp`` decoder layers with attention and FFN split over TP (an MoE
  layer: the router whole, ``num_experts/ep`` experts whole (expert TP = 1), the shared expert over TP; a
  DeepSeek-V3 model's first ``first_k_dense`` layers are dense, so its first stage is the lighter), the
  embedding (vocab padded to ``lcm(128, tp)``, split over TP) on the first stage, the output layer (or the tied
  embedding's copy) on the last stage; norms replicated. Element size of ``model.dtype``.
- **grads**: megatron-core's DDP keeps one fp32 gradient buffer of the rank's parameters
  (``grad_reduce_in_fp32``): 4 bytes per parameter.
- **optimizer**: Adam's two fp32 moments, plus fp32 master weights for bf16/fp16 parameters: 8 or 12 bytes per
  parameter, divided by DP x CP under ``actor.optim.distributed`` (megatron's DistributedOptimizer shards over
  the DP x CP ranks, which hold the same weights).
- **host** (``actor.optim.cpu_offload`` / ``critic.optim.cpu_offload`` = f > 0, megatron's
  ``HybridDeviceOptimizer``, bf16 weights): the fraction f of the rank's optimizer shard (by elements) leaves the
  device's figure (its fp32 master weights and Adam moments, 12 bytes per parameter) and is held in host memory
  with a pinned fp32 copy of its gradients: 16 bytes per offloaded parameter. The device keeps the rest of the
  shard's state, the weights and the fp32 gradient buffer. On a CPU rank the host is the device: both count there.
- **save_host** (GPU ranks, ``optim.distributed``): host memory a checkpoint save adds on each rank. The
  DistributedOptimizer's ``fully_reshardable`` format (megarl's, for resume at any layout) gathers the whole
  model-parallel shard's fp32 main weights and both Adam moments into host buffers on every rank of the DP
  group while it saves (megatron-core 0.19 ``DistributedOptimizer.get_parameter_state_dp_zero``): 12 bytes per
  trained parameter of the stage, whatever the DP size (85 GiB for a 7.6B model at TP = PP = 1). Measured on an
  H200 (perf/RESULTS.md, issue 30): a full 7B run with ``cpu_offload=0.8`` trained and was killed by the host's
  OOM killer in its first save. Not part of ``total`` (a device figure).
- **reference** (``algorithm.kl.coef > 0``): a frozen copy of the actor's parameters (none with ``actor.lora``: the
  reference is the actor's base); with ``algorithm.distill.teacher``, the teacher's stage in the actor's layout.
- **LoRA** (``actor.lora.rank > 0``): the base is frozen in the model dtype (no gradient buffer, no optimizer
  state); the stage's adapters (:func:`stage_adapter_params`: ``r x in`` and ``out x r`` per adapted layer, split
  over TP like their weights) are added to the parameters and take the gradients and optimizer state alone.
  **critic** (PPO): parameters, gradients and optimizer like the actor's (its output layer is one column).
- **activations**: one micro-batch of ``data.max_prompt_length + rollout.max_new_tokens`` tokens through the
  stage's layers, times the micro-batches in flight on the first stage of a 1F1B pipeline (``min(pp, micro-
  batches per mini-batch)``). Per token and layer, elements kept for the backward (SwiGLU, GQA, unfused
  softmax; after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Sec. 4, adapted to SwiGLU/GQA): ``2h`` replicated (norm inputs; split over TP with sequence parallelism) +
  ``(4h + 4*kv_size + 3*ffn + 2*heads*s) / tp`` (the ``s`` term only with ``actor.kernels.attention=local``;
  an MoE layer's ``3*ffn`` is ``top_k`` experts' ``3*moe_ffn`` plus the shared expert's ``3*shared_ffn``, and it
  adds ``top_k * (h + moe_ffn)`` (the dispatched copies of each token and the second GEMM's scaled inputs) and
  the router's fp32 logits and probabilities over the experts, for ``actor.kernels.moe_experts`` grouped or
  sequential alike: the grouped GEMMs keep for their backward the same inputs as the loop of one GEMM per
  expert, and the stacked weights are the same elements);
  with ``actor.recompute`` only each layer's input ``h`` is kept (plus one layer's full set while it is
  recomputed). The last stage adds fp32 logits, three copies (logits, log-softmax, its gradient) of
  ``vocab/tp`` per token, of the micro-batch, or of one chunk with ``actor.kernels.chunked_logprob``.
  ``actor.max_tokens_per_micro_batch`` caps the micro-batch's tokens. Context parallelism
  (``actor.parallel.cp``) divides the tokens of a rank by CP and adds, per layer, the keys and values of the
  whole sequence that CP attention all-gathers (``2 * kv_size / tp`` per token of the sequence). Megatron's
  interleaved schedule (``actor.parallel.vpp > 1``) keeps more in flight on the first stage: the 1F1B figure
  times ``1 + (pp - 1) / (pp * vpp)`` (Korthikanti et al. 2022, Sec. 4.2.3; Megatron-LM's
  ``interleaved_schedule_memory_penalty`` in ``theoretical_memory_usage.py``).
- **rollout**: vLLM reserves ``rollout.gpu_memory_utilization`` of the whole GPU (over ``rollout.engines_per_gpu``
  engines, plus one copy of the weights they are staged in when there are several); the transformers engine
  (CPU) holds a full fp32 copy of the model plus the KV cache and last logits of the sequences it decodes at
  once (this rank's share of the step, at most ``rollout.max_batch_size``), and frees its weights while the
  actor trains, so the peak is ``static + max(training,
  rollout)``. With ``placement.rollout`` on a pool of its own (:mod:`megarl.trainer.pipeline`) the two groups
  of ranks hold different things: the training ranks everything but the rollout, the rollout ranks the
  rollout alone (its share of the step over the pool's ranks); the estimate is the busier of the two
  (:attr:`MemoryEstimate.pools` gives both).
- **runtime**: what the process holds besides tensors: the CUDA context and NCCL buffers on a GPU, the
  Python interpreter with torch/megatron/transformers loaded on the CPU (:data:`RUNTIME_BYTES`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass

from megarl.config import DTYPE_TABLE, Config

log = logging.getLogger(__name__)

GIB = 2**30
# measured: RSS of one CPU rank after imports and process-group start, before any model (perf/RESULTS.md);
# on a GPU, the CUDA context plus NCCL's buffers beyond torch's allocator
RUNTIME_BYTES = {"cpu": int(0.9 * GIB), "gpu": int(1.5 * GIB)}


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes of the busiest rank, by part (see the module docstring)."""

    params: int
    grads: int
    optimizer: int
    reference: int
    critic: int
    activations: int
    rollout: int
    runtime: int
    colocated_rollout: bool  # True: vLLM reserves its share for the whole run (added, not overlapped)
    rollout_pool: bool = False  # True: the rollout on ranks of its own (placement.rollout), nothing else there
    host: int = 0  # the offloaded optimizer state in host memory (optim.cpu_offload), outside every device figure
    save_host: int = 0  # host memory a checkpoint save adds (the distributed optimizer's gather), GPU ranks

    @property
    def pools(self) -> dict[str, int]:
        """Peak bytes of a training rank and of a rollout rank (one figure each; the same ranks unless the
        rollout has a pool of its own)."""
        static = self.params + self.grads + self.optimizer + self.reference + self.critic + self.runtime
        if self.rollout_pool:
            return {"train": static + self.activations, "rollout": self.runtime + self.rollout}
        both = static + self.activations + self.rollout if self.colocated_rollout else \
            static + max(self.activations, self.rollout)
        return {"train": both, "rollout": both}

    @property
    def total(self) -> int:
        """The busiest rank's peak bytes."""
        return max(self.pools.values())

    @property
    def tensors(self) -> int:
        """The part in torch's allocator on a GPU (``torch.cuda.max_memory_allocated``): the total without the
        runtime and without vLLM's reservation (its own memory pool)."""
        if self.rollout_pool:
            return self.pools["train"] - self.runtime
        return self.total - self.runtime - (self.rollout if self.colocated_rollout else 0)

    def as_dict(self) -> dict[str, int]:
        out = {**{k: v for k, v in asdict(self).items() if k not in ("colocated_rollout", "rollout_pool")},
               "total": self.total, "tensors": self.tensors}
        if self.rollout_pool:
            out.update({f"{k}_ranks": v for k, v in self.pools.items()})
        return out

    def describe(self) -> str:
        parts = [f"{k} {v / GIB:.2f}" for k, v in self.as_dict().items()
                 if v and k not in ("total", "tensors", "train_ranks", "rollout_ranks", "host", "save_host")]
        per_pool = (f"; training ranks {self.pools['train'] / GIB:.2f}, rollout ranks "
                    f"{self.pools['rollout'] / GIB:.2f}") if self.rollout_pool else ""
        host = f"; host memory {self.host / GIB:.2f} GiB (offloaded optimizer)" if self.host else ""
        return f"{self.total / GIB:.2f} GiB ({', '.join(parts)}{per_pool}){host}"


def _ffn_width(spec) -> int:
    """Per token, the FFN width a layer's SwiGLU activations have: ``ffn``, or for an MoE layer its ``top_k``
    experts' and the shared expert's."""
    if not spec.is_moe:
        return spec.ffn_hidden_size
    return spec.moe_top_k * spec.moe_ffn_hidden_size + spec.shared_expert_ffn_hidden_size


def _moe_routed_width(spec, e: int) -> float:
    """Per token, what an MoE layer keeps for the backward beyond its experts' SwiGLU activations (in elements of
    ``e`` bytes): the ``top_k`` dispatched copies of the token's hidden state (the first grouped GEMM's input),
    its ``top_k`` probability-scaled SwiGLU outputs (the second's input), and the router's fp32 logits and
    probabilities over the experts. 0 for a dense model."""
    if not spec.is_moe:
        return 0.0
    k = spec.moe_top_k
    return k * spec.hidden_size + k * spec.moe_ffn_hidden_size + 2 * spec.num_experts * 4 / e


def layer_params(spec, layer: int, tp: int, ep: int = 1) -> tuple[int, int]:
    """Parameters of decoder layer ``layer`` on one rank of a TP x EP actor, and how many of them are routed
    experts' (sharded for the optimizer over their own DP group): attention and a dense MLP split over TP; an MoE
    layer's router whole, ``num_experts / ep`` experts whole (expert TP = 1), the shared expert over TP; a
    DeepSeek-V3 or GLM-4.5 model's first ``first_k_dense`` layers have a dense MLP of width ``ffn_hidden_size``; a
    Qwen3.5 layer's mixer is its own (gated DeltaNet or gated attention)."""
    from megarl.models.deepseek_moe import is_moe_layer
    from megarl.models.mixer import attention_shapes
    from megarl.models.spec import FAMILIES

    h, kv, fam = spec.hidden_size, spec.kv_size, FAMILIES[spec.family]
    experts = 0
    if is_moe_layer(spec, layer):  # router and local experts whole, the shared expert and its gate like a dense MLP
        m, shared = spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size
        gate = h if shared and spec.deepseek_moe is None else 0  # Qwen2-MoE's, Qwen3-Next's shared-expert gate
        experts = spec.num_experts // ep * (3 * h * m + (2 * m + h) * fam.gpt_oss)  # gpt-oss: the experts' biases
        ffn = spec.num_experts * h + experts + 3 * h * shared // tp + gate
        ffn += spec.num_experts if fam.gpt_oss or fam.deepseek_moe else 0  # the router's bias (DeepSeek's: frozen)
    else:
        ffn = 3 * h * spec.ffn_hidden_size // tp
    # q/k/v/o; DeepSeek-V3's MLA (its a-norms too, a few kB), Qwen3.5's mixer: all split over TP (megatron's local spec)
    attention = sum(math.prod(s) for s in attention_shapes(spec, layer).values()) // tp
    n = attention + ffn + 2 * h
    n += 2 * spec.head_dim if spec.qk_norm and spec.gdn is None else 0  # (Qwen3.5's: in its mixer's shapes)
    n += 2 * h if fam.gemma else 0  # Gemma 3's post-attention and post-MLP norms
    n += (spec.q_size + 2 * kv) // tp if spec.qkv_bias else 0
    n += h + spec.num_attention_heads // tp if fam.gpt_oss else 0  # o_proj's bias, the sinks
    return n, experts


def stage_split(spec, tp: int, pp: int, *, value_head: bool = False, ep: int = 1) -> tuple[int, int]:
    """The busiest pipeline stage of a TP x PP (x EP) actor: its parameters on one rank and how many of them are
    routed experts' (:func:`layer_params`). Stage ``i`` holds layers ``[i * L / pp, (i + 1) * L / pp)``, the
    first stage the embedding (vocab padded to ``lcm(128, tp)``, split over TP), the last the final norm and the
    output layer (``value_head``: a critic's, one column; tied embeddings: a copy of the embedding when pp > 1).
    """
    from megarl.models.megatron import padded_vocab_size

    h, per_stage = spec.hidden_size, spec.num_layers // pp
    layers = [layer_params(spec, i, tp, ep) for i in range(spec.num_layers)]
    embed = padded_vocab_size(spec.vocab_size, tp) * h // tp
    output = h if value_head else (0 if pp == 1 and spec.tie_word_embeddings else embed)
    stages = []
    for s in range(pp):
        params = sum(n for n, _ in layers[s * per_stage:(s + 1) * per_stage])
        experts = sum(x for _, x in layers[s * per_stage:(s + 1) * per_stage])
        params += (embed if s == 0 else 0) + (output + h if s == pp - 1 else 0)
        stages.append((params, experts))
    return max(stages)


def stage_params(spec, tp: int, pp: int, *, value_head: bool = False, ep: int = 1) -> int:
    """Parameters held by the busiest pipeline stage of a TP x PP (x EP) actor (``value_head``: a critic, whose
    output layer is one column; :func:`stage_split`).

    Raises:
        megarl.models.spec.SpecError: TP or PP does not fit the model
            (:func:`megarl.models.megatron.check_layout`).
    """
    return stage_split(spec, tp, pp, value_head=value_head, ep=ep)[0]


def stage_adapter_params(spec, lora, tp: int, pp: int, ep: int = 1) -> int:
    """LoRA adapter parameters of one pipeline stage of a TP x PP (x EP) actor: per adapted layer ``A`` ``[r,
    in]`` and ``B`` ``[out, r]``, the column-parallel layers' ``B`` and the row-parallel layers' ``A`` split over TP,
    the routed experts' whole (``lora.experts``; ``num_experts / ep`` of them per rank)."""
    h, r = spec.hidden_size, lora.rank
    qkv_out = spec.q_size + 2 * spec.kv_size
    layer = 0
    want = set(lora.target_modules)
    if "linear_qkv" in want:
        layer += r * h + qkv_out * r // tp
    if "linear_proj" in want:
        layer += r * spec.q_size // tp + h * r
    mlps = []  # (width, split over TP?, count)
    if not spec.is_moe:
        mlps.append((spec.ffn_hidden_size, True, 1))
    else:
        if spec.shared_expert_ffn_hidden_size:
            mlps.append((spec.shared_expert_ffn_hidden_size, True, 1))
        if lora.experts:
            mlps.append((spec.moe_ffn_hidden_size, False, spec.num_experts // ep))
    for f, split, count in mlps:
        t = tp if split else 1
        if "linear_fc1" in want:
            layer += count * (r * h + 2 * f * r // t)
        if "linear_fc2" in want:
            layer += count * (r * f // t + h * r)
    return spec.num_layers // pp * layer


def activation_bytes(cfg: Config, spec, tp: int, pp: int, dp: int) -> int:
    """Activations of the busiest stage during an update (micro-batches in flight x per-micro-batch bytes).

    A micro-batch holds ``actor.micro_batch_size`` sequences (at most a DP rank's share of a mini-batch) of
    ``data.max_prompt_length + rollout.max_new_tokens`` tokens, or at most ``actor.max_tokens_per_micro_batch``
    padded tokens where that is set. ``actor.kernels`` decides two terms: SDPA attention keeps no
    ``[b, heads, s, s]`` scores (local attention keeps two such tensors: the softmax and its dropout mask), and the
    chunked log-prob holds the fp32 logits of ``logprob_chunk_tokens`` tokens at a time instead of the micro-batch's.
    """
    a = cfg.actor
    cp = a.parallel.cp
    s = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    mbs = a.update_micro_batch_size(dp)
    tokens = mbs * s
    if a.max_tokens_per_micro_batch:
        tokens = min(tokens, a.max_tokens_per_micro_batch)
    tokens = math.ceil(tokens / cp)
    e = DTYPE_TABLE[cfg.model.dtype].itemsize
    h = spec.hidden_size
    scores = 2 * spec.num_attention_heads * s if a.kernels.attention == "local" else 0
    gathered_kv = 2 * spec.kv_size * cp if cp > 1 else 0  # per local token: the sequence's K and V
    full = (2 * h / (tp if a.parallel.sequence_parallel else 1) + _moe_routed_width(spec, e)
            + (4 * h + 4 * spec.kv_size + 3 * _ffn_width(spec) + scores + gathered_kv) / tp)
    layers = spec.num_layers // pp
    per_micro = tokens * e * ((h + full / layers) if a.recompute else full) * layers
    in_flight = min(pp, max(1, a.ppo_mini_batch_size // (dp * mbs)))
    if a.parallel.vpp > 1:  # the interleaved schedule's penalty (Korthikanti et al. 2022, Sec. 4.2.3)
        in_flight *= 1 + (pp - 1) / (pp * a.parallel.vpp)
    logit_tokens = min(tokens, a.kernels.logprob_chunk_tokens) if a.kernels.chunked_logprob else tokens
    logits = logit_tokens * 3 * 4 * math.ceil(spec.vocab_size / tp)
    # the first stage holds the micro-batches in flight; the last one micro-batch and its logits (pp=1: both)
    return int(max(per_micro * in_flight, per_micro + logits))


def rollout_bytes(cfg: Config, spec, ranks: int, device_bytes: int, gpu: bool) -> int:
    """The rollout engine's share on one of the rollout pool's ``ranks`` (the transformers engine decodes this
    rank's share of the step's sequences, at most ``rollout.max_batch_size`` at once)."""
    r, k = cfg.rollout, cfg.rollout.engines_per_gpu
    # a pool of k engines (rollout.engines_per_gpu) adds the staging tensors the reshard writes, one more copy
    itemsize = DTYPE_TABLE[cfg.model.dtype].itemsize if r.engine == "vllm" else 4
    staging = 0 if k == 1 else spec.num_params() * itemsize
    if r.engine == "vllm":
        return int(r.gpu_memory_utilization * device_bytes) + staging if gpu else 0
    s = cfg.data.max_prompt_length + r.max_new_tokens
    batch = min(r.max_batch_size, math.ceil(cfg.rollout_batch_size / ranks / k))  # each engine's share
    weights = spec.num_params() * 4
    kv_cache = 2 * spec.num_layers * spec.kv_size * s * batch * 4
    logits = batch * spec.vocab_size * 4 * 2
    return k * (weights + kv_cache + logits) + staging


def check_rollout_weights(cfg: Config, spec, device_bytes: int) -> None:
    """Refuse a vLLM rollout whose weights alone overflow the memory vLLM reserves on a GPU: every rank of an
    engine holds ``1 / rollout.tp`` of every weight (vLLM shards the experts over TP too), in ``model.dtype`` or,
    with ``rollout.quantization=fp8``, one byte per weight of the decoder layers (embedding and output layer kept);
    the reservation (``rollout.gpu_memory_utilization`` of the GPU) must hold them and the KV cache.

    Raises:
        ConfigError: naming ``rollout.tp``, the two sizes and the fixes.
    """
    from megarl.config import ConfigError

    r = cfg.rollout
    if r.engine != "vllm":
        return
    e = DTYPE_TABLE[cfg.model.dtype].itemsize
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    n = spec.num_params()
    weights = (n * e if r.quantization is None else (n - embeddings) + embeddings * e) // r.tp
    reserved = r.gpu_memory_utilization / r.engines_per_gpu * device_bytes  # one engine's share
    if weights >= reserved:
        raise ConfigError(f"rollout.tp: vLLM's weights are {weights / GIB:.1f} GiB per GPU at rollout.tp={r.tp} "
                          f"({n / 1e9:.1f}B parameters{', fp8' if r.quantization else ''}), over the "
                          f"{reserved / GIB:.1f} GiB it reserves (rollout.gpu_memory_utilization="
                          f"{r.gpu_memory_utilization} of {device_bytes / GIB:.1f} GiB"
                          f"{f' over {r.engines_per_gpu} engines' if r.engines_per_gpu > 1 else ''}), which must "
                          f"hold them and the KV cache; raise rollout.tp or rollout.gpu_memory_utilization"
                          f"{', or lower rollout.engines_per_gpu' if r.engines_per_gpu > 1 else ''}"
                          f"{'' if spec.is_moe or r.quantization else ', or set rollout.quantization=fp8'}")


def estimate_memory(cfg: Config, spec, world_size: int, *, gpu: bool, device_bytes: int = 0) -> MemoryEstimate:
    """The per-rank peak memory of ``cfg`` with model ``spec`` on ``world_size`` ranks.

    Args:
        gpu: estimate for a GPU rank (vLLM's reservation, the CUDA runtime) rather than a CPU rank.
        device_bytes: the device's memory (vLLM reserves a fraction of it); unused on the CPU.

    Raises:
        megarl.models.spec.SpecError: TP, PP or PP x VPP does not fit the model.
    """
    from megarl.models.megatron import check_layout
    from megarl.models.spec import SpecError
    from megarl.parallel.mesh import LayoutError, ParallelLayout

    p = cfg.actor.parallel
    pl = cfg.placement
    dp = max(1, len(pl.ranks(pl.actor, world_size)) // p.replica_size)
    rollout_ranks = len(pl.ranks(pl.rollout, world_size))
    try:
        check_layout(spec, ParallelLayout(p.tp, p.pp, dp, ep=p.ep, cp=p.cp, vpp=p.vpp))
    except LayoutError as e:
        raise SpecError(f"actor.parallel.ep: {e}") from None
    # experts' optimizer state is sharded over their own DP group, the tp * dp / ep ranks holding the same experts
    n, experts = stage_split(spec, p.tp, p.pp, ep=p.ep)
    e = DTYPE_TABLE[cfg.model.dtype].itemsize
    opt_per_param = 8 + (4 if e < 4 else 0)

    def optimizer(params: int, distributed: bool) -> int:
        if not distributed:
            return params * opt_per_param
        return (params - experts) * opt_per_param // (dp * p.cp) + experts * opt_per_param * p.ep // (p.tp * dp)

    def split(state: int, fraction: float) -> tuple[int, int]:
        """(device, host) bytes of an optimizer shard of ``state`` bytes with ``fraction`` of it offloaded."""
        host = int(fraction * state / opt_per_param) * 16  # fp32 master, two moments, pinned fp32 gradient copy
        return (state - int(fraction * state), host) if gpu else (state - int(fraction * state) + host, 0)

    lora = cfg.actor.lora
    if lora.enabled:  # the base frozen: adapters alone have gradients and optimizer state; no reference copy
        from megarl.models.lora import LoRASpec

        ad = stage_adapter_params(spec, LoRASpec.from_config(lora), p.tp, p.pp, ep=p.ep)
        trained, reference = ad, 0
        state = ad * opt_per_param // (dp * p.cp) if cfg.actor.optim.distributed else ad * opt_per_param
    else:
        ad, trained, reference = 0, n, n * e if cfg.algorithm.kl.coef > 0 else 0
        state = optimizer(n, cfg.actor.optim.distributed)
    if cfg.algorithm.distill.teacher is not None:  # distillation's teacher in the reference's slot: its own size
        from megarl.models.checkpoint import source_spec

        reference = stage_params(source_spec(cfg.algorithm.distill.teacher)[0], p.tp, p.pp) * e
    actor_optimizer, host = split(state, cfg.actor.optim.cpu_offload)
    critic = 0
    if cfg.algorithm.uses_critic:
        c = stage_params(spec, p.tp, p.pp, value_head=True, ep=p.ep)
        critic_optimizer, critic_host = split(optimizer(c, cfg.critic.optim.distributed), cfg.critic.optim.cpu_offload)
        critic, host = c * (e + 4) + critic_optimizer, host + critic_host
    save_host = 0
    if gpu:  # the fully_reshardable gather of a save: fp32 main weight and two moments per trained parameter
        if cfg.actor.optim.distributed:
            save_host += 12 * trained
        if cfg.algorithm.uses_critic and cfg.critic.optim.distributed:
            save_host += 12 * c
    return MemoryEstimate(
        params=(n + ad) * e, grads=trained * 4, optimizer=actor_optimizer, reference=reference, critic=critic,
        activations=activation_bytes(cfg, spec, p.tp, p.pp, dp),
        rollout=rollout_bytes(cfg, spec, rollout_ranks, device_bytes, gpu),
        runtime=RUNTIME_BYTES["gpu" if gpu else "cpu"],
        colocated_rollout=cfg.rollout.engine == "vllm", rollout_pool=rollout_ranks < world_size, host=host,
        save_host=save_host)


def host_memory_bytes() -> int:
    """This machine's physical memory (the CPU ranks' device)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def warn_host_memory(cfg: Config, spec, world_size: int, *, local_ranks: int | None = None,
                     device_bytes: int = 0, host_bytes: int = 0) -> str | None:
    """Warn (and return the warning) when the GPU ranks this machine starts need more host memory than it has:
    the offloaded optimizer state (``optim.cpu_offload``) plus what a checkpoint save gathers on the host
    (:class:`MemoryEstimate` ``host`` and ``save_host``, per rank). A warning, not a refusal: the steps run, and
    the first save (every ``trainer.save_every`` steps, and at the end) is what the host's OOM killer stops, the
    checkpoint lost. None when it fits, or on a machine without a GPU.

    Args:
        local_ranks: the ranks this machine runs; device_bytes: one GPU's memory; host_bytes: this machine's
            (bytes). Without ``local_ranks``, all three are read from this machine (``megarl train`` before it
            starts its ranks).
    """
    if local_ranks is None:
        import torch

        if not torch.cuda.is_available():
            return None
        local_ranks = min(world_size, torch.cuda.device_count())
        device_bytes = torch.cuda.get_device_properties(0).total_memory
        host_bytes = host_memory_bytes()
    try:
        est = estimate_memory(cfg, spec, world_size, gpu=True, device_bytes=device_bytes)
    except Exception as e:  # noqa: BLE001 - advisory: a config the estimate does not cover never stops a run
        log.debug("host memory not estimated: %r", e)
        return None
    need = (est.host + est.save_host) * local_ranks
    if need <= host_bytes:
        return None
    msg = (f"host memory: this machine's {local_ranks} rank(s) need an estimated {need / GIB:.1f} GiB of host "
           f"memory while a checkpoint saves ({est.host / GIB:.1f} GiB of offloaded optimizer state and "
           f"{est.save_host / GIB:.1f} GiB that the distributed optimizer's save gathers, per rank), over the "
           f"{host_bytes / GIB:.1f} GiB it has: the steps may run, the first checkpoint save will likely be killed "
           f"for memory. Lower actor.optim.cpu_offload, or shard the model further (actor.parallel.tp / pp: the "
           f"save gathers one model-parallel shard per rank, whatever the DP size), or use more machines")
    log.warning(msg)
    return msg
