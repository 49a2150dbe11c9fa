"""The Megatron roles' sections: the model (and the one dtype table), each role's mesh, optimizer, fast paths, LoRA
and mixture-of-experts settings (``actor``, ``critic``), and which ranks hold which role (``placement``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from megarl.config.errors import _require_in_section, require


class Dtype(NamedTuple):
    """A parameter dtype megarl trains in, by its torch name (``torch.<name>``)."""

    short: str  # the short name (``megarl bench reshard --dtype``)
    itemsize: int  # bytes per element
    safetensors: str  # the dtype code of a safetensors file's header


# The one dtype table (model.dtype, ``megarl convert --dtype``): torch's dtypes (megarl.models.checkpoint.DTYPES), the
# memory estimate's bytes (megarl.launch.memory), the reshard bench's short names (megarl.bench.reshard) and the
# safetensors codes (megarl.models.hf_io) read it.
DTYPE_TABLE = {"float32": Dtype("fp32", 4, "F32"), "bfloat16": Dtype("bf16", 2, "BF16"),
               "float16": Dtype("fp16", 2, "F16")}
DTYPES = tuple(DTYPE_TABLE)
OLD_LOGPROB_PASSES = ("auto", "always")  # actor.old_logprob_pass


@dataclass
class ModelConfig:
    """The model to train.

    Attributes:
        path: a Hugging Face directory, a ``.gguf`` file, a megarl checkpoint, or ``default`` (the
            SmolLM2-135M-Instruct GGUF installed by build.sh).
        tokenizer: tokenizer location; ``null`` = the model path.
        dtype: parameter dtype of actor, critic and reference (float32 on CPU, bfloat16 on GPU).
    """

    path: str = "default"
    tokenizer: Optional[str] = None
    dtype: str = "float32"

    def __post_init__(self):
        require(self.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")


@dataclass
class ParallelConfig:
    """A Megatron mesh; ``dp`` is derived as world_size / (tp * cp * pp) when 0.

    Attributes:
        tp: tensor-parallel size. pp: pipeline-parallel size. dp: data-parallel size (0 = derive).
        sequence_parallel: shard norm/dropout activations over TP (tp > 1); a mixture-of-experts model trained
            with tp > 1 needs it (megatron-core's MoE layer refuses to train without).
        ep: expert-parallel size of a mixture-of-experts model (its experts split over ``ep`` ranks of each
            pipeline stage, expert TP = 1; must divide the experts and ``tp * dp``); 1 for dense models. The
            actor's ``ep`` applies to every Megatron role, which all run on the whole world.
        cp: context-parallel size: each sequence split over ``cp`` ranks of one DP replica (load-balanced
            causal split into ``2 * cp`` chunks, :mod:`megarl.kernels.context_parallel`); 1 = off. The critic's and
            the reference's must equal the actor's.
        vpp: virtual pipeline stages per pipeline rank (megatron's interleaved 1F1B schedule; needs pp > 1 and
            pp * vpp dividing the layers, and each DP rank's micro-batch count a multiple of pp); 1 = no
            interleaving. The critic's and the reference's must equal the actor's.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 0
    sequence_parallel: bool = False
    ep: int = 1
    cp: int = 1
    vpp: int = 1

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica: ``tp * cp * pp`` (the world is this times ``dp``)."""
        return self.tp * self.cp * self.pp

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "cp", "vpp"):
            _require_in_section(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require_in_section(self.dp >= 0, "dp", f"must be >= 0 (0 derives it), got {self.dp}")
        _require_in_section(self.vpp == 1 or self.pp > 1, "vpp", f"{self.vpp} interleaves pipeline stages and "
                            f"needs pp > 1 (pp={self.pp}); set vpp=1 or pp >= 2")


@dataclass
class OptimConfig:
    """megatron-core optimizer (Adam) and LR schedule.

    Attributes:
        lr: peak learning rate. min_lr: floor of the decay.
        warmup_steps: linear warm-up W, in optimizer updates: update k = 1..W runs at lr * k / W (the first
            already learns; megatron's and HF's schedules run the first at 0), update W at lr.
        decay: "constant", "linear" or "cosine" after warm-up (over ``trainer.steps`` RL steps' updates).
        weight_decay, betas, eps: AdamW.
        clip_grad: global gradient-norm clip (0 = off).
        distributed: megatron's DistributedOptimizer (optimizer state sharded over DP).
        cpu_offload: fraction of this rank's optimizer shard whose Adam step runs on the host (megatron-core's
            ``HybridDeviceOptimizer``: Megatron-LM's ``--optimizer-cpu-offload --optimizer-offload-fraction F
            --use-precision-aware-optimizer --overlap-cpu-optimizer-d2h-h2d``), in [0, 1]; 0 = off. The fp32
            main parameters and Adam moments of that fraction live in host memory, with a pinned fp32 copy of
            their gradients; each update copies those gradients to the host, steps there, and copies the
            parameters back. Needs ``distributed`` and ``model.dtype=bfloat16``; a checkpoint resumes with
            another value (on or off).
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay: str = "constant"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = True
    cpu_offload: float = 0.0

    def __post_init__(self):
        _require_in_section(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _require_in_section(0.0 <= self.cpu_offload <= 1.0, "cpu_offload",
                            f"must be in [0, 1] (the fraction of the optimizer state on the host), got {self.cpu_offload}")
        _require_in_section(not self.cpu_offload or self.distributed, "cpu_offload",
                            "needs distributed=true (megatron's CPU offload runs inside the DistributedOptimizer); "
                            "set distributed=true or cpu_offload=0")
        _require_in_section(self.decay in ("constant", "linear", "cosine"), "decay",
                            f"must be constant, linear or cosine, got {self.decay!r}")
        _require_in_section(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _require_in_section(self.clip_grad >= 0, "clip_grad", "must be >= 0 (0 disables clipping)")


ATTENTION_KERNELS = ("sdpa", "local")
MOE_EXPERTS = ("grouped", "sequential")  # the local spec's routed experts (megarl.models.megatron builds them)
MOE_DISPATCHERS = ("auto", "allgather", "alltoall")  # megatron-core's MoE token dispatchers (megarl.models.megatron)


@dataclass
class KernelsConfig:
    """Fast paths of the training phase (:mod:`megarl.kernels`, the ``kernels/`` folder); each equals the plain
    path within floating-point rounding (tests/test_kernels_*.py).

    Attributes:
        chunked_logprob: the output layer, log-probs and entropy computed ``logprob_chunk_tokens`` tokens at a
            time (``megarl.kernels.chunked_logprobs``; Triton on the GPU), so the batch's ``[b, s, vocab/tp]`` logits
            are never held; false = the model's full logits, then ``vocab_parallel_logprobs``.
        logprob_chunk_tokens: tokens per chunk (memory: about this many rows of vocab/tp logits at once).
        attention: core attention of the local layer spec: "sdpa" (torch's ``scaled_dot_product_attention``:
            flash/cuDNN on the GPU, no ``[b, heads, s, s]`` scores) or "local" (megatron's
            ``DotProductAttention``).
        transformer_engine: Transformer Engine's layer spec instead of the local one (GPU with TE installed:
            ``perf/gpu_te.sh`` builds it): fused LayerNorm + GEMM, TE's attention (``attention`` is then unused),
            an MoE model's experts as grouped GEMMs. Checkpoints record it; a dense model's load under either.
        moe_experts: an MoE model's routed experts on the local layer spec: "grouped" (two grouped GEMMs for all
            of a rank's experts, ``megarl.kernels.grouped_experts``) or "sequential" (megatron-core's ``SequentialMLP``,
            one GEMM per expert; the one LoRA adapts, ``lora.experts``). Their checkpoints load across the two.
            The Transformer Engine spec groups its own.
    """

    chunked_logprob: bool = True
    logprob_chunk_tokens: int = 4096
    attention: str = "sdpa"
    transformer_engine: bool = False
    moe_experts: str = "grouped"

    def __post_init__(self):
        _require_in_section(self.logprob_chunk_tokens >= 1, "logprob_chunk_tokens",
                            f"must be >= 1, got {self.logprob_chunk_tokens}")
        _require_in_section(self.attention in ATTENTION_KERNELS, "attention",
                            f"must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        _require_in_section(self.moe_experts in MOE_EXPERTS, "moe_experts",
                            f"must be one of {MOE_EXPERTS}, got {self.moe_experts!r}")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # the layers megarl.models.lora adapts
LORA_SYNC = ("merged", "adapter")


@dataclass
class LoRAConfig:
    """LoRA adapters on the actor (Hu et al. 2021): only they train; the base weights stay frozen in the model's
    dtype (no gradient, no optimizer state), and the reference policy is the actor with its adapters off.

    Attributes:
        rank: the adapters' rank ``r``; 0 = no LoRA (every weight trains).
        alpha: the adapter's output is scaled by ``alpha / rank``.
        dropout: dropout on the adapters' input while training, in [0, 1) (0 keeps the update's first log-probs
            equal to the old ones).
        target_modules: megatron layers that get adapters: ``linear_qkv`` (q, k, v), ``linear_proj`` (attention
            output), ``linear_fc1`` (gate and up), ``linear_fc2`` (down).
        experts: also a mixture-of-experts model's routed experts (their ``linear_fc1`` / ``linear_fc2`` among
            ``target_modules``; local layer spec).
        sync: how the weights reach the rollout engine each step: ``merged`` (the reshard writes ``W + (alpha / r)
            B A`` into the engine's own weights, shard by shard: the engine runs the plain model) or ``adapter``
            (vLLM with LoRA enabled gets the adapters alone, in memory; its base weights are written once).
    """

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    experts: bool = False
    sync: str = "merged"

    def __post_init__(self):
        _require_in_section(self.rank >= 0, "rank", f"must be >= 0 (0 = no LoRA), got {self.rank}")
        _require_in_section(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        _require_in_section(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        _require_in_section(bool(self.target_modules) and not unknown, "target_modules",
                            f"{list(self.target_modules)}: choose one or more of {list(LORA_TARGETS)}")
        _require_in_section(self.sync in LORA_SYNC, "sync", f"must be one of {LORA_SYNC}, got {self.sync!r}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class MoEConfig:
    """Mixture-of-experts training (README "Mixture-of-experts models").

    Attributes:
        router_replay: router replay (R3): the trainer's old-log-prob and update passes route every token to
            the experts the rollout engine routed it to (recorded by the transformers engine, or by vLLM's
            ``enable_return_routed_experts``; :mod:`megarl.models.router_replay`). Off: the trainer's routers
            choose for themselves. The routing agreement per layer is in the metrics (``moe/routing_agreement``)
            either way with the transformers engine, with replay on with vLLM (which records routes only then).
        token_dispatcher: how megatron-core's MoE layer sends tokens to the expert-parallel ranks holding their
            experts and back: "alltoall" (each token only to the ranks of its top-k experts), "allgather"
            (every rank gathers all the EP group's tokens and keeps those of its own experts: more traffic, the
            more so at larger ``ep``), or "auto": "alltoall" at ``parallel.ep > 1``, "allgather" at ``ep = 1``
            (nothing to send either way). Both give the same outputs and gradients (tests/test_models_moe.py);
            the routing statistics and router replay act on the router, before either
            (``megarl.models.megatron.moe_config_kwargs``).
    """

    router_replay: bool = False
    token_dispatcher: str = "auto"

    def __post_init__(self):
        _require_in_section(self.token_dispatcher in MOE_DISPATCHERS, "token_dispatcher",
                            f"must be one of {MOE_DISPATCHERS}, got {self.token_dispatcher!r}")


@dataclass
class ActorConfig:
    """The policy being trained (and the critic, which has the same fields).

    Attributes:
        parallel: its Megatron mesh.
        optim: optimizer and LR schedule.
        micro_batch_size: sequences per forward/backward micro-batch, per DP rank; a DP rank's share of a
            mini-batch smaller than this is one micro-batch (:meth:`update_micro_batch_size`). The default, 16,
            runs the CPU default's mini-batches of 16 in one forward/backward each.
        ppo_mini_batch_size: sequences per optimizer step, global (over all DP ranks).
        ppo_epochs: passes over the step's rollout batch.
        recompute: full activation recomputation.
        logprob_micro_batch_size: sequences per micro-batch for forward-only passes (0 = micro_batch_size).
        max_tokens_per_micro_batch: micro-batches by token count (dynamic batch size) for the log-prob,
            value and update passes: rows of similar length packed up to this many padded tokens (rows x
            longest row) per micro-batch, each cut to its longest row (:mod:`megarl.workers.packing`); 0 = off
            (``micro_batch_size`` / ``logprob_micro_batch_size`` rows as wide as the batch). Needs pp = 1
            unless ``sequence_packing``.
        sequence_packing: with ``max_tokens_per_micro_batch``, each micro-batch is one packed row of up
            to that many real tokens, sequences back to back with no padding between them, attention within
            each sequence (megatron's ``PackedSeqParams``; :mod:`megarl.workers.packing`); works at any pp (at
            pp > 1 every micro-batch is padded at its tail to the longest one's length). Needs
            ``kernels.attention="sdpa"`` on the local spec (not Transformer Engine's, not wired for packing yet).
            The reference policy packs as the actor does.
        offload: keep the gradients and optimizer state in pinned host memory from the end of each update to
            the next step's log-probs, and the parameters too while the rollout engine generates
            (:mod:`megarl.workers.offload`), so that a model that fits only one phase at a time still runs.
        kernels: fast paths (chunked log-probs, SDPA attention).
        lora: LoRA adapters instead of training every weight (the actor only).
        moe: mixture-of-experts settings (router replay: the actor only; the token dispatcher).
        old_logprob_pass: "auto" (default): the step's old-log-prob pass is skipped where the actor update's
            first forward gives the same numbers (one epoch of one mini-batch, nothing reading them before the
            update: :func:`megarl.trainer.old_logprobs.old_logprob_pass`); "always": it always runs (the
            actor only).
    """

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5))
    micro_batch_size: int = 16
    ppo_mini_batch_size: int = 16
    ppo_epochs: int = 1
    recompute: bool = False
    logprob_micro_batch_size: int = 0
    max_tokens_per_micro_batch: int = 0
    sequence_packing: bool = False
    offload: bool = False
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    old_logprob_pass: str = "auto"

    def update_micro_batch_size(self, dp: int) -> int:
        """Rows of the update's micro-batches with fixed-size micro-batches at data-parallel size ``dp``:
        ``micro_batch_size``, or a DP rank's share of a mini-batch (``ppo_mini_batch_size // dp``) where that
        is smaller. The gradient does not depend on it (the loss is normalised over the mini-batch); the
        activation memory does."""
        return min(self.micro_batch_size, max(1, self.ppo_mini_batch_size // dp))

    def __post_init__(self):
        _require_in_section(not (self.moe.router_replay and self.recompute and self.parallel.pp > 1),
                            "moe.router_replay", "with recompute and parallel.pp > 1 the recomputed routers would "
                            "not see their own micro-batch's routes; set recompute=false or parallel.pp=1")
        _require_in_section(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        _require_in_section(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch",
                            f"must be >= 0 (0 = fixed-size micro-batches), got {self.max_tokens_per_micro_batch}")
        _require_in_section(not self.sequence_packing or self.max_tokens_per_micro_batch > 0, "sequence_packing",
                            "needs max_tokens_per_micro_batch > 0 (the tokens of one packed micro-batch); set "
                            "max_tokens_per_micro_batch or sequence_packing=false")
        _require_in_section(not self.sequence_packing or self.kernels.attention == "sdpa", "sequence_packing",
                            f"needs kernels.attention='sdpa' (packed attention), got {self.kernels.attention!r}")
        _require_in_section(not (self.sequence_packing and self.kernels.transformer_engine), "sequence_packing",
                            "is not wired for Transformer Engine's layer spec yet; set "
                            "kernels.transformer_engine=false or sequence_packing=false")
        _require_in_section(self.ppo_mini_batch_size >= 1, "ppo_mini_batch_size", "must be >= 1")
        _require_in_section(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        _require_in_section(self.old_logprob_pass in OLD_LOGPROB_PASSES, "old_logprob_pass",
                            f"must be one of {OLD_LOGPROB_PASSES}, got {self.old_logprob_pass!r}")


@dataclass
class CriticConfig(ActorConfig):
    """The value model (PPO with GAE): the actor's trunk with a scalar head, its own optimizer.

    Attributes:
        warmup_steps: RL steps during which only the critic is updated (the actor is frozen).
    """

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    warmup_steps: int = 0

    def __post_init__(self):
        super().__post_init__()
        _require_in_section(not self.lora.enabled, "lora.rank", f"{self.lora.rank}: LoRA trains the actor only "
                            "(the critic trains every weight); set critic.lora.rank=0")


ROLES = ("actor", "critic", "reference", "reward", "rollout")
MEGATRON_ROLES = ("actor", "critic", "reference")


@dataclass
class PlacementConfig:
    """Which global ranks hold which role (:mod:`megarl.parallel.placement` builds their process groups).

    Roles on one pool take turns (the rollout engine sleeps while the Megatron roles compute); roles on
    disjoint pools work at the same time where the data flow allows (the reference scores a batch while the
    actor pool computes its old log-probs). The default puts every role on every rank.

    Attributes:
        pools: named sets of global ranks, each a list of ranks or ``all`` (the whole world); the pool
            ``all`` always exists.
        actor / critic / reference / reward / rollout: the pool of each role (``reward``: the reward function,
            e.g. an in-process reward model, scores on its pool's ranks).
        reference_parallel: the reference policy's Megatron layout on its pool; null = the actor's tp and pp,
            dp derived from the pool. The other roles' layouts: ``actor.parallel``, ``critic.parallel``,
            ``rollout.tp``.
    """

    pools: dict[str, Any] = field(default_factory=lambda: {"all": "all"})
    actor: str = "all"
    critic: str = "all"
    reference: str = "all"
    reward: str = "all"
    rollout: str = "all"
    reference_parallel: Optional[ParallelConfig] = None

    def __post_init__(self):
        require(self.pools.get("all", "all") == "all", "placement.pools.all",
                 f"is the whole world, got {self.pools.get('all')!r}; give your pool another name")
        self.pools.setdefault("all", "all")
        for name, ranks in self.pools.items():
            ok = ranks == "all" or (isinstance(ranks, (list, tuple)) and len(ranks) > 0
                                    and all(isinstance(r, int) and r >= 0 for r in ranks))
            require(ok, f"placement.pools.{name}", f"must be 'all' or a non-empty list of global ranks >= 0, "
                     f"got {ranks!r}")
            require(ranks == "all" or len(set(ranks)) == len(ranks), f"placement.pools.{name}",
                     f"lists a rank twice: {list(ranks)}")
        for role in ROLES:
            require(getattr(self, role) in self.pools, f"placement.{role}",
                     f"unknown pool {getattr(self, role)!r}; placement.pools defines {sorted(self.pools)}")

    def ranks(self, pool: str, world_size: int) -> list[int]:
        """Global ranks of ``pool`` in a world of ``world_size`` ranks (``all``: every rank)."""
        ranks = self.pools[pool]
        return list(range(world_size)) if ranks == "all" else sorted(ranks)

    def explicit_world(self) -> int:
        """The fewest ranks that hold every listed pool (0 when every pool is ``all``)."""
        return max((max(r) + 1 for r in self.pools.values() if r != "all"), default=0)
