"""Run configuration: dataclasses with the CPU default embedded, YAML loading and validation.

``megarl train [CONFIG.yaml] [key=value ...]`` merges, in order: the defaults below (the CPU default: GRPO on
the arithmetic task with SmolLM2-135M-Instruct, transformers rollouts), the YAML file, and dotted overrides
(``actor.optim.lr=1e-6``, OmegaConf syntax). Every field is type-checked by OmegaConf and validated by the
dataclasses' ``__post_init__``; :func:`megarl.parallel.placement.validate_for_world` then checks what depends on the job's world size (the
roles' layouts on their pools).
All of this happens before any model is built, and every error names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megarl.algos.registry import (ADVANTAGES, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTION_LEVELS,
                                   ROLLOUT_CORRECTION_MODES, ROLLOUT_CORRECTION_PRESETS)

QUANTIZATIONS = ("fp8",)  # rollout.quantization besides null: the engine weight formats (megarl.models.fp8)
MODEL_RUNNERS = ("v1", "v2")  # rollout.model_runner besides null (megarl.rollout.vllm_engine: VLLM_USE_V2_MODEL_RUNNER)
ROLLOUT_CORRECTION_OFF = "none"  # algorithm.rollout_correction.preset that turns it off, also where it defaults on


class ConfigError(ValueError):
    """A configuration value that cannot run; the message names the field and the fix."""


def require(cond: bool, field_name: str, msg: str) -> None:
    """Raise :class:`ConfigError` ``"FIELD: MSG"`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(f"{field_name}: {msg}")


class _SectionFieldError(ConfigError):
    """A bad field of a section that several places of the config hold (``ParallelConfig`` as
    ``actor.parallel``, ``critic.parallel`` and ``placement.reference_parallel``, ``OptimConfig``, ...), named
    relative to the section; :func:`load_config` names it in full (``critic.optim.lr``)."""

    def __init__(self, field_name: str, msg: str):
        super().__init__(f"{field_name}: {msg}")
        self.field_name, self.msg = field_name, msg


def _require_in_section(cond: bool, field_name: str, msg: str) -> None:
    """:func:`require` for a field of a shared section, ``field_name`` relative to the section."""
    if not cond:
        raise _SectionFieldError(field_name, msg)


DTYPES = ("float32", "bfloat16", "float16")
OLD_LOGPROB_PASSES = ("auto", "always")  # actor.old_logprob_pass
# The smallest reshard bucket, MiB (reshard.bucket_mb, megarl bench reshard --bucket-mb): 64 KiB, a floor that
# catches a size given in the wrong unit; buckets of a few MiB and less already spend most of each round on
# the round's synchronisation, not on moving bytes.
MIN_BUCKET_MB = 1 / 16
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")  # the names of trainer.loggers
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # loggers that need an optional package


@dataclass
class RunConfig:
    """Where the run writes and how it is seeded.

    Attributes:
        name: run name (folder under ``output_dir``).
        output_dir: parent of the run folder (metrics.jsonl, checkpoints, summary.json).
        seed: seeds data order, sampling and initialisation.
    """

    name: str = "smollm2-arithmetic-grpo"
    output_dir: str = "runs"
    seed: int = 1

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


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
            causal split into ``2 * cp`` chunks, :mod:`kernels.context_parallel`); 1 = off. The critic's and
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
MOE_EXPERTS = ("grouped", "sequential")  # megarl.models.megatron.MOE_EXPERTS (tested)
MOE_DISPATCHERS = ("auto", "allgather", "alltoall")  # megarl.models.megatron.MOE_DISPATCHERS (tested)


@dataclass
class KernelsConfig:
    """Fast paths of the training phase (the top-level ``kernels`` package); each equals the plain path within
    floating-point rounding (tests/test_kernels_*.py).

    Attributes:
        chunked_logprob: the output layer, log-probs and entropy computed ``logprob_chunk_tokens`` tokens at a
            time (``kernels.chunked_logprobs``; Triton on the GPU), so the batch's ``[b, s, vocab/tp]`` logits
            are never held; false = the model's full logits, then ``vocab_parallel_logprobs``.
        logprob_chunk_tokens: tokens per chunk (memory: about this many rows of vocab/tp logits at once).
        attention: core attention of the local layer spec: "sdpa" (torch's ``scaled_dot_product_attention``:
            flash/cuDNN on the GPU, no ``[b, heads, s, s]`` scores) or "local" (megatron's
            ``DotProductAttention``).
        transformer_engine: Transformer Engine's layer spec instead of the local one (GPU with TE installed:
            ``perf/gpu_te.sh`` builds it): fused LayerNorm + GEMM, TE's attention (``attention`` is then unused),
            an MoE model's experts as grouped GEMMs. Checkpoints record it; a dense model's load under either.
        moe_experts: an MoE model's routed experts on the local layer spec: "grouped" (two grouped GEMMs for all
            of a rank's experts, ``kernels.grouped_experts``) or "sequential" (megatron-core's ``SequentialMLP``,
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


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megarl.models.lora.TARGET_MODULES (tested)
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
            longest row) per micro-batch, each cut to its longest row (:mod:`megarl.trainer.packing`); 0 = off
            (``micro_batch_size`` / ``logprob_micro_batch_size`` rows as wide as the batch). Needs pp = 1
            unless ``sequence_packing``.
        sequence_packing: with ``max_tokens_per_micro_batch``, each micro-batch is one packed row of up
            to that many real tokens, sequences back to back with no padding between them, attention within
            each sequence (megatron's ``PackedSeqParams``; :mod:`megarl.trainer.packing`); works at any pp (at
            pp > 1 every micro-batch is padded at its tail to the longest one's length). Needs
            ``kernels.attention="sdpa"`` on the local spec (not Transformer Engine's, not wired for packing yet).
            The reference policy packs as the actor does.
        offload: keep the gradients and optimizer state in pinned host memory from the end of each update to
            the next step's log-probs, and the parameters too while the rollout engine generates
            (:mod:`megarl.trainer.offload`), so that a model that fits only one phase at a time still runs.
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


@dataclass
class MultiTurnConfig:
    """Multi-turn episodes with tools and environments (:mod:`megarl.agents`; README "Agentic RL").

    Attributes:
        enabled: generate episodes instead of one response per sample (``rollout.n`` episodes per prompt: the
            GRPO/RLOO group).
        env: the environment, a registered name ("tools": tool calls answered, a turn without one ends the
            episode; "guess_number") or a dotted path ("pkg.mod:MyEnv"); built once per episode.
        env_kwargs: keyword arguments of the environment's constructor.
        tools: the tools offered, registered names ("calculator") or dotted paths; rendered by the chat template.
        tool_parser: "auto" (from the chat template), "hermes" (Qwen2.5/Qwen3 ``<tool_call>``), "llama3_json"
            or "plain" (``CALL name(args)`` lines, the tools described in the system message: templates without
            tools, such as SmolLM2's), or a dotted path to a parser class of your own
            (:mod:`megarl.agents.parsers`); checked against the chat template before the run starts.
        max_turns: turns per episode, >= 1.
        max_episode_tokens: sampled plus observation tokens after the first prompt; 0 = up to the context.
            Each turn samples at most rollout.max_new_tokens.
        tool_timeout_s: seconds per tool call (> 0); a call past it is a "timeout" observation.
        env_timeout_s: seconds per environment call, ``reset`` or ``step`` (> 0); past them the episode ends with
            reward 0 (``agent/env_timeouts``), the run goes on.
        max_observation_tokens: observation messages are cut to this many tokens ("truncated"); 0 = no limit.
        max_parallel_episodes: episodes running at once per rank (worker threads; agents: coroutines), >= 1.
        agent: an agent written as ordinary code instead of ``env`` and ``tools``: a registered name or a
            dotted path ("pkg.mod:my_agent") to ``async def my_agent(row, client[, prompt])`` that talks to an
            OpenAI-compatible chat client served from the rollout engine and returns the episode's reward (or
            None: ``reward.fn`` on its last reply; :mod:`megarl.agents.endpoint`). "" = none.
        agent_server: give the agent an ``openai.AsyncOpenAI`` client pointed at a local HTTP endpoint
            (``/v1/chat/completions``; needs the ``openai`` package) instead of the in-process client of the same
            interface.
    """

    enabled: bool = False
    env: str = "tools"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)
    tool_parser: str = "auto"
    max_turns: int = 4
    max_episode_tokens: int = 0
    tool_timeout_s: float = 10.0
    env_timeout_s: float = 60.0
    max_observation_tokens: int = 256
    max_parallel_episodes: int = 256
    agent: str = ""
    agent_server: bool = False

    def __post_init__(self):
        require(self.max_turns >= 1, "rollout.multi_turn.max_turns", f"must be >= 1, got {self.max_turns}")
        require(self.max_episode_tokens >= 0, "rollout.multi_turn.max_episode_tokens",
                f"must be >= 0 (0: up to the context), got {self.max_episode_tokens}")
        require(self.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s",
                f"must be > 0 seconds, got {self.tool_timeout_s}")
        require(self.env_timeout_s > 0, "rollout.multi_turn.env_timeout_s",
                f"must be > 0 seconds, got {self.env_timeout_s}")
        require(self.max_observation_tokens >= 0, "rollout.multi_turn.max_observation_tokens",
                f"must be >= 0 (0: no limit), got {self.max_observation_tokens}")
        require(self.max_parallel_episodes >= 1, "rollout.multi_turn.max_parallel_episodes",
                f"must be >= 1, got {self.max_parallel_episodes}")
        if self.agent:
            require(not self.tools, "rollout.multi_turn.tools",
                    f"must be empty with rollout.multi_turn.agent (the agent sends its tools in each request), "
                    f"got {self.tools}")
            require(self.env == "tools" and not self.env_kwargs, "rollout.multi_turn.env",
                    f"is not used with rollout.multi_turn.agent (the agent is the environment): leave env and "
                    f"env_kwargs unset, got env={self.env!r}, env_kwargs={self.env_kwargs}")
        require(self.agent or not self.agent_server, "rollout.multi_turn.agent_server",
                "serves an agent function: set rollout.multi_turn.agent too, or agent_server=false")


@dataclass
class RolloutConfig:
    """Generation (the rollout engine) and its sampling.

    Attributes:
        engine: "hf" (transformers; CPU and tests) or "vllm" (GPU).
        tp: the engine's tensor parallelism (vLLM): engines of tp consecutive ranks, world / tp of them
            (rollout data parallelism); must divide the world size and fit the model's heads (vLLM's rules).
        n: samples per prompt (the GRPO/RLOO group size).
        temperature, top_p, top_k: sampling. Log-probs are of softmax(logits/temperature) over the whole
            vocab, as the actor's are; truncated sampling (top_p < 1, top_k != -1) is refused: the samples
            would come from the renormalised kept tokens (whose log-probs vLLM reports), not from the policy
            the actor's log-probs describe, and the PPO ratio would be biased (below 1 on fresh data).
        max_new_tokens: response length limit, tokens.
        max_batch_size: sequences decoded at once per rank (hf engine), bounds memory.
        gpu_memory_utilization: fraction of the GPU's total memory that vLLM may use for its weights,
            activations and KV cache, in (0, 1]; that much must be free when the engine starts (after the
            actor, reference and critic are on the GPU).
        enforce_eager: vLLM without CUDA graphs or torch.compile (faster start; false decodes faster).
        max_model_len: vLLM's context (prompt + response), tokens; null = the model's
            max_position_embeddings. vLLM refuses to start when its KV cache cannot hold one sequence of this
            length; data.max_prompt_length + max_new_tokens is enough for RL.
        multi_turn: episodes with tools and environments (:class:`MultiTurnConfig`); max_new_tokens is then
            each turn's limit.
        quantization: the rollout engine's weights: null (bf16) or "fp8": block-FP8 (E4M3, one float32 scale a
            128 x 128 tile, vLLM's ``fp8`` with ``weight_block_size``), quantised by the reshard while it moves
            the actor's bf16 shards (half the bytes; the actor trains in bf16); vllm engine, dense models whose
            TP shards are whole 128-blocks (:func:`megarl.models.layout.check_vllm_fp8`). Its rollout log-probs
            are those of the FP8 model: ``algorithm.rollout_correction`` then defaults to token-level TIS
            (``preset: token_tis``; ``preset: none`` turns it off).
        model_runner: vLLM's model runner: "v1", "v2" or null (vLLM's choice for the architecture: V1 for Qwen2,
            V2 for Llama, Mistral, Qwen3). V2 samples seeded requests in one kernel; V1 draws each seeded
            request's noise in a Python loop (see :mod:`megarl.rollout.vllm_engine`).
        async_scheduling: vLLM's async scheduler (the next step is scheduled while the GPU runs this one); null =
            vLLM's default (on for megarl's engine).
        max_num_seqs: sequences vLLM decodes at once; null = vLLM's default (1024 on an H200, 256 on GPUs under
            70 GiB); a rollout batch above it decodes in waves.
        max_num_batched_tokens: tokens per vLLM step (prefill chunks); null = vLLM's default (16384 on an
            H200, 8192 under 70 GiB); at least max_num_seqs.
        cudagraph_capture_sizes: decode batch sizes vLLM captures as CUDA graphs (enforce_eager=false); null =
            vLLM's (1, 2, 4, multiples of 8 to 248, of 16 up to max_cudagraph_capture_size).
        max_cudagraph_capture_size: the largest captured batch (enforce_eager=false); null = vLLM's
            min(2 * max_num_seqs, 512). A decode step of more sequences runs without graphs.
        request_seeds: seed every sample on its own (its tokens do not depend on how prompts are batched or split
            over engines); false: vLLM's generator seeded by run.seed (reproducible for the same batches only),
            which saves the V1 runner's per-request noise loop.

    The vLLM knobs (quantization to request_seeds) apply to ``engine: vllm``; ``perf/gpu_generation.sh``
    measures them side by side.
    """

    engine: str = "hf"
    tp: int = 1
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    max_batch_size: int = 64
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    max_model_len: Optional[int] = None
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    quantization: Optional[str] = None
    model_runner: Optional[str] = None
    async_scheduling: Optional[bool] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None
    request_seeds: bool = True

    def __post_init__(self):
        require(self.engine in ("hf", "vllm"), "rollout.engine", f"must be 'hf' or 'vllm', got {self.engine!r}")
        self._check_vllm_knobs()
        require(self.n >= 1, "rollout.n", f"must be >= 1, got {self.n}")
        require(self.temperature > 0, "rollout.temperature",
                 "must be > 0 for RL (log-probs of a greedy policy are not defined)")
        require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        truncation = ("the rollout would sample from the distribution renormalised over the kept tokens (and vLLM "
                      "report its log-probs) while the actor's log-probs are over the whole vocab, which biases the "
                      "PPO importance ratio")
        require(self.top_p == 1, "rollout.top_p", f"{self.top_p} < 1: {truncation}; set rollout.top_p=1.0 "
                 "(use rollout.temperature to sharpen sampling)")
        require(self.top_k == -1, "rollout.top_k", f"{self.top_k} truncates sampling: {truncation}; set "
                 "rollout.top_k=-1 (use rollout.temperature to sharpen sampling)")
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1")
        require(self.tp >= 1, "rollout.tp", "must be >= 1")
        require(self.engine == "vllm" or self.tp == 1, "rollout.tp",
                 f"is {self.tp} but the hf engine runs TP=1 on every rank; use rollout.engine=vllm or rollout.tp=1")
        require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
                 f"must be in (0, 1] (a fraction of the GPU's memory), got {self.gpu_memory_utilization}")
        require(self.max_model_len is None or self.max_model_len >= 2, "rollout.max_model_len",
                 f"must be null (the model's context) or >= 2 tokens, got {self.max_model_len}")

    def _check_vllm_knobs(self) -> None:
        require(self.quantization in (None, *QUANTIZATIONS), "rollout.quantization",
                f"must be null (bf16) or one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        require(self.quantization is None or self.engine == "vllm", "rollout.quantization",
                f"{self.quantization} rollouts need rollout.engine=vllm (the hf engine runs the model dtype)")
        require(self.model_runner in (None, *MODEL_RUNNERS), "rollout.model_runner",
                f"must be null (vLLM's choice) or one of {list(MODEL_RUNNERS)}, got {self.model_runner!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_cudagraph_capture_size"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"rollout.{name}", f"must be null (vLLM's default) or >= 1, got {value}")
        require(None in (self.max_num_seqs, self.max_num_batched_tokens)
                or self.max_num_batched_tokens >= self.max_num_seqs, "rollout.max_num_batched_tokens",
                f"{self.max_num_batched_tokens} is below rollout.max_num_seqs={self.max_num_seqs} (vLLM refuses it)")
        sizes = self.cudagraph_capture_sizes
        require(sizes is None or (len(sizes) > 0 and min(sizes) >= 1), "rollout.cudagraph_capture_sizes",
                f"must be null (vLLM's sizes) or a non-empty list of batch sizes >= 1, got {sizes}")
        for name in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
            require(getattr(self, name) is None or not self.enforce_eager, f"rollout.{name}",
                    "CUDA graphs are off with rollout.enforce_eager=true; set rollout.enforce_eager=false or leave it null")
        require(sizes is None or self.max_cudagraph_capture_size is None or max(sizes) == self.max_cudagraph_capture_size,
                "rollout.max_cudagraph_capture_size", f"{self.max_cudagraph_capture_size} differs from the largest of "
                f"rollout.cudagraph_capture_sizes ({max(sizes or [0])}); vLLM refuses both given and unequal, set one")
        vllm_only = {name: getattr(self, name) for name in ("model_runner", "async_scheduling", "max_num_seqs",
                                                            "max_num_batched_tokens", "cudagraph_capture_sizes",
                                                            "max_cudagraph_capture_size")}
        set_fields = [f"rollout.{k}" for k, v in vllm_only.items() if v is not None]
        set_fields += [] if self.request_seeds else ["rollout.request_seeds"]
        require(self.engine == "vllm" or not set_fields, set_fields[0] if set_fields else "rollout",
                f"is a vLLM knob, but rollout.engine={self.engine}; use rollout.engine=vllm or leave its default")


PREPARED = ("arithmetic", "calculator", "gsm8k")  # data.prepare's datasets; each writes its train.parquet and test.parquet


@dataclass
class DataConfig:
    """Prompt dataset.

    Attributes:
        train_files: jsonl or parquet files with one prompt per row.
        prepare: if the train files are missing, prepare them first: "arithmetic" (the CPU default's task,
            :mod:`megarl.data.arithmetic`), "calculator" (its 5-digit version, for the calculator tool), "gsm8k"
            (from ``gsm8k_source``) or null.
        gsm8k_source: a local GSM8K folder ({train,test}.jsonl) or "hub" (openai/gsm8k, online only);
            "auto" tries ../shared/data/gsm8k, then the hub.
        prompt_key / answer_key: row fields holding the prompt and the ground truth.
        system_prompt / instruction: chat-template system message and text appended to each prompt (GSM8K's
            configs: :data:`megarl.rewards.gsm8k.GSM8K_INSTRUCTION`; the arithmetic task's questions say it).
        use_chat_template: render prompts with the tokenizer's chat template (false: plain text, base models).
        max_prompt_length: longer prompts are dropped (and reported), tokens.
        prompts_per_step: prompts per RL step (the rollout batch is prompts_per_step * rollout.n sequences).
        shuffle: reshuffle each epoch (seeded by run.seed).
    """

    train_files: list[str] = field(default_factory=lambda: ["data/arithmetic/train.parquet"])
    prepare: Optional[str] = "arithmetic"
    gsm8k_source: str = "auto"
    prompt_key: str = "question"
    answer_key: str = "ground_truth"
    system_prompt: Optional[str] = None
    instruction: str = ""
    use_chat_template: bool = True
    max_prompt_length: int = 256
    prompts_per_step: int = 4
    shuffle: bool = True

    def __post_init__(self):
        require(len(self.train_files) > 0, "data.train_files", "list at least one jsonl or parquet file")
        require(self.prompts_per_step >= 1, "data.prompts_per_step", "must be >= 1")
        require(self.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1")
        require(self.prepare is None or self.prepare in PREPARED, "data.prepare",
                f"must be null or one of {list(PREPARED)}, got {self.prepare!r}")


@dataclass
class RewardConfig:
    """How responses are scored.

    Attributes:
        fn: a registered reward name ("arithmetic", "gsm8k"; "reward_model" for an HF sequence-classification model in
            this process; "http" for a reward model served over HTTP, e.g. by vLLM) or a dotted path to a user
            function ("pkg.mod:fn").
        kwargs: keyword arguments for the function (gsm8k: correct_score, format_score (default 0.1: a wrong
            answer in the "#### N" format), strict, last_number; reward_model: model (an HF directory), batch_size,
            max_length, device, dtype; http: url, model, api, batch_size, timeout_s, max_retries, backoff_s,
            label_index, template).
    """

    fn: str = "arithmetic"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class KLConfig:
    """KL to the reference policy.

    Attributes:
        coef: weight of the KL term (0 = no reference model is built).
        estimator: a registered KL estimator: k1, k2, k3 (Schulman's) or k3+ (k3's value, k2's gradient).
        in_loss: add the KL to the loss (GRPO style) rather than subtract it from the token rewards (PPO style).
            As a loss only the estimator's gradient counts: k1's estimates no KL gradient and is refused
            (see megarl.algos.kl).
        target: adaptive controller's target KL (null = fixed coefficient); horizon: its horizon, samples.
    """

    coef: float = 0.001
    estimator: str = "k3"
    in_loss: bool = True
    target: Optional[float] = None
    horizon: int = 10000

    def __post_init__(self):
        require(self.coef >= 0, "algorithm.kl.coef", "must be >= 0")
        require(self.estimator in KL_ESTIMATORS, "algorithm.kl.estimator",
                 f"must be one of {KL_ESTIMATORS.names()}, got {self.estimator!r}")
        if self.in_loss and self.coef > 0:
            fit = [n for n in KL_ESTIMATORS.names() if KL_ESTIMATORS.entry(n).loss_gradient]
            require(self.estimator in fit, "algorithm.kl.estimator",
                     f"{self.estimator!r} in the loss (algorithm.kl.in_loss=true): its gradient does not estimate the "
                     "gradient of a KL (k1's is zero in expectation: it does not pull the policy towards the "
                     f"reference; see megarl.algos.kl); use one of {fit} in the loss, or set "
                     f"algorithm.kl.in_loss=false to subtract {self.estimator} from the reward")


@dataclass
class RolloutCorrectionConfig:
    """Importance weights between the actor's old log-probs and the rollout engine's, applied to every policy
    loss (``megarl.algos.rollout_correction``). Off by default (``level: null``), except with FP8 rollouts
    (``rollout.quantization: fp8``: token-level TIS, ``preset: token_tis``, as verl and NVIDIA's FP8 recipes); the
    metrics ``rollout_corr/...`` (k3 KL rollout vs old, ratio mean/min/max, fractions truncated or masked) are
    logged every step whatever the setting.

    Attributes:
        preset: fills the fields left null: "token_tis", "seq_tis" (truncate at 2), "token_mis", "seq_mis"
            (mask outside [0.5, 2]), "icepop" (token mask outside [0.5, 5]); "none": off (also with FP8
            rollouts); null = none, or token_tis with FP8 rollouts.
        level: "token", "sequence", or null (off).
        mode: "truncate" (TIS: weight min(ratio, cap)) or "mask" (MIS: outside [lower, cap] leaves the loss);
            null = "truncate".
        cap: TIS's cap C (> 0) or MIS's upper bound (>= 1); null = 2.0.
        lower: MIS's lower bound, in [0, 1]; null = 0.5.
    """

    preset: Optional[str] = None
    level: Optional[str] = None
    mode: Optional[str] = None
    cap: Optional[float] = None
    lower: Optional[float] = None

    def __post_init__(self):
        require(self.preset in (None, ROLLOUT_CORRECTION_OFF, *ROLLOUT_CORRECTION_PRESETS),
                "algorithm.rollout_correction.preset",
                f"must be one of {[*ROLLOUT_CORRECTION_PRESETS, ROLLOUT_CORRECTION_OFF]} or null, got {self.preset!r}")
        require(self.preset != ROLLOUT_CORRECTION_OFF or self.level is None, "algorithm.rollout_correction.level",
                f"is {self.level!r} but preset=none turns the correction off; leave one of them null")
        level, mode, cap, lower = self.settings() if self.enabled else (None, "truncate", 2.0, 0.5)
        require(self.level is None or self.level in ROLLOUT_CORRECTION_LEVELS, "algorithm.rollout_correction.level",
                 f"must be one of {ROLLOUT_CORRECTION_LEVELS} or null (off), got {self.level!r}")
        require(mode in ROLLOUT_CORRECTION_MODES, "algorithm.rollout_correction.mode",
                 f"must be one of {ROLLOUT_CORRECTION_MODES}, got {mode!r}")
        require(cap > 0, "algorithm.rollout_correction.cap", f"must be > 0, got {cap}")
        require(mode == "truncate" or 0 <= lower <= 1 <= cap, "algorithm.rollout_correction",
                 f"mask needs 0 <= lower <= 1 <= cap (ratio 1 must stay in the loss), got lower={lower}, cap={cap}")

    @property
    def enabled(self) -> bool:
        """A level is set, by the field or by the preset (not "none")."""
        return self.level is not None or self.preset not in (None, ROLLOUT_CORRECTION_OFF)

    def settings(self) -> tuple[str, str, float, float]:
        """``(level, mode, cap, lower)``: the fields, those left null from the preset, then the defaults."""
        preset = ROLLOUT_CORRECTION_PRESETS.get(self.preset, (None, None, None, None))
        given = (self.level, self.mode, self.cap, self.lower)
        return tuple(g if g is not None else p if p is not None else d
                     for g, p, d in zip(given, preset, (None, "truncate", 2.0, 0.5)))


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2): groups whose rewards are all equal
    carry no signal (zero advantage) and are dropped; more prompts are generated until the step has
    ``data.prompts_per_step`` groups with signal, or ``max_extra_rounds`` more rounds of
    ``data.prompts_per_step`` prompts ran (then the step trains on what there is, in whole mini-batches; the
    ``dynamic_sampling/...`` metrics say how many groups).

    Attributes:
        enabled: drop tied groups and refill.
        max_extra_rounds: generation rounds after the first, at most (>= 0).
    """

    enabled: bool = False
    max_extra_rounds: int = 3

    def __post_init__(self):
        require(self.max_extra_rounds >= 0, "algorithm.dynamic_sampling.max_extra_rounds",
                 f"must be >= 0, got {self.max_extra_rounds}")


@dataclass
class OverlongConfig:
    """DAPO's handling of long responses (Yu et al. 2025, arXiv:2503.14476, sec. 3.4).

    Attributes:
        buffer_tokens: L_cache of the soft overlong punishment (eq. 13): a response longer than
            ``rollout.max_new_tokens - buffer_tokens`` loses up to ``penalty_factor`` of reward, linearly, -1 x
            factor at the limit; 0 = no shaping.
        penalty_factor: scale of that penalty (>= 0).
        filter: overlong filtering: responses cut at ``rollout.max_new_tokens`` leave the loss (still counted
            in the reward metrics and in their group's advantages).
    """

    buffer_tokens: int = 0
    penalty_factor: float = 1.0
    filter: bool = False

    def __post_init__(self):
        require(self.buffer_tokens >= 0, "algorithm.overlong.buffer_tokens", f"must be >= 0, got {self.buffer_tokens}")
        require(self.penalty_factor >= 0, "algorithm.overlong.penalty_factor",
                 f"must be >= 0, got {self.penalty_factor}")


@dataclass
class NonFiniteConfig:
    """What a step does with non-finite numbers from the rollout engine and the reward
    (``megarl.algos.nonfinite``): a token whose rollout log-prob is not finite leaves the loss, a sample whose
    score is not finite is dropped from its group (``rollout/nonfinite_logprob_tokens``, ``reward/nonfinite``),
    and past ``max_fraction`` the step fails naming the first such sample.

    Attributes:
        max_fraction: the share of a step's samples that may carry a non-finite rollout log-prob or score, in
            [0, 1]; 0 fails on the first one, 1 never fails.
    """

    max_fraction: float = 0.05

    def __post_init__(self):
        require(0 <= self.max_fraction <= 1, "algorithm.nonfinite.max_fraction",
                f"must be in [0, 1] (a share of the step's samples), got {self.max_fraction}")


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy/value losses, KL.

    Each advantage estimator and policy loss takes its parameters from these fields, as its registry entry
    says (``megarl.algos.registry``).

    Attributes:
        name: the advantage estimator (registry names): "grpo", "ppo" (= "gae": GAE with a critic), "rloo",
            "reinforce_plus_plus", "reinforce_plus_plus_baseline", or one registered by the user.
        policy_loss: the registered policy loss: "ppo" (the clipped surrogate), "gspo" (sequence-level ratio;
            clip ranges ~3e-4/4e-4, loss_agg_mode seq-mean-token-mean), "cispo" (clipped, stop-gradient weight
            times log-prob; clip_ratio_low 1.0 = no lower bound).
        gamma / lam: discount and GAE lambda.
        whiten_advantages: GAE whitens the advantages over the batch.
        norm_adv_by_std: GRPO divides by the group std (Dr. GRPO: false); norm_adv_eps: added to that std.
        clip_ratio_low / clip_ratio_high: PPO clip range [1 - low, 1 + high] (clip-higher when high > low).
        clip_ratio_c: dual-clip bound for negative advantages (null = off; typical 3.0).
        loss_agg_mode: token-mean, seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (Dr.
            GRPO: each response's token sum over the constant loss_norm_tokens).
        loss_norm_tokens: the constant of seq-mean-token-sum-norm, tokens; null = rollout.max_new_tokens.
        rollout_correction / dynamic_sampling / overlong / nonfinite: see their sections.
        entropy_coef: entropy bonus weight.
        value_clip: PPO value clipping range; vf_coef: value-loss weight.
    """

    name: str = "grpo"
    policy_loss: str = "ppo"
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    norm_adv_by_std: bool = True
    norm_adv_eps: float = 1e-6
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    loss_norm_tokens: Optional[int] = None
    entropy_coef: float = 0.0
    value_clip: float = 0.2
    vf_coef: float = 1.0
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)

    def __post_init__(self):
        require(self.name in ADVANTAGES, "algorithm.name", f"unknown algorithm {self.name!r}; choose one of "
                 f"{ADVANTAGES.names()}")
        require(self.policy_loss in POLICY_LOSSES, "algorithm.policy_loss",
                 f"unknown policy loss {self.policy_loss!r}; choose one of {POLICY_LOSSES.names()}")
        require(self.loss_agg_mode in AGG_MODES, "algorithm.loss_agg_mode",
                 f"must be one of {AGG_MODES}, got {self.loss_agg_mode!r}")
        require(self.norm_adv_eps >= 0, "algorithm.norm_adv_eps", f"must be >= 0, got {self.norm_adv_eps}")
        require(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma/lam", "must be in [0, 1]")
        require(self.clip_ratio_low >= 0 and self.clip_ratio_high >= 0, "algorithm.clip_ratio_low/high",
                 "must be >= 0")
        require(self.clip_ratio_c is None or self.clip_ratio_c > 1, "algorithm.clip_ratio_c",
                 "must be > 1 (or null to disable dual-clip)")
        require(self.loss_norm_tokens is None or self.loss_norm_tokens >= 1, "algorithm.loss_norm_tokens",
                 f"must be >= 1 or null (rollout.max_new_tokens), got {self.loss_norm_tokens}")

    @property
    def uses_critic(self) -> bool:
        """The advantage estimator needs a critic's values."""
        return "values" in ADVANTAGES.entry(self.name).needs


@dataclass
class ReshardConfig:
    """The reshard engine (:mod:`megarl.reshard.executor`).

    Attributes:
        bucket_mb: staging bytes (packed for sending + unpacked after receiving) per rank per round, MiB
            (fractions allowed), at least :data:`MIN_BUCKET_MB` (64 KiB); two such buffers per rank (rounds
            overlap).
        direct_min_kb: pieces of at least this many KiB that are one contiguous run of memory at an end are
            sent straight from the actor's tensors or received straight into the rollout engine's (no staging
            copy); null stages every piece through the buckets, a fallback for a transport that cannot address
            the engine's memory (``megarl bench reshard --no-direct`` measures the difference).
    """

    bucket_mb: float = 64.0
    direct_min_kb: Optional[float] = 256.0

    def __post_init__(self):
        require(self.bucket_mb >= MIN_BUCKET_MB, "reshard.bucket_mb",
                 f"must be >= {MIN_BUCKET_MB:g} MiB (64 KiB; the unit is MiB), got {self.bucket_mb:g}")
        require(self.direct_min_kb is None or self.direct_min_kb > 0, "reshard.direct_min_kb",
                 f"must be > 0 KiB, or null to stage every piece; got {self.direct_min_kb}")


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


@dataclass
class TrainerConfig:
    """The RL loop.

    Attributes:
        steps: RL steps (each: reshard, generate, score, log-probs, advantages, updates).
        save_every: checkpoint every N steps (0 = only at the end).
        save_every_min: also checkpoint after a step that ends this many minutes after the last checkpoint
            (0 = off); a save's seconds are the next step's ``time/checkpoint_save`` metric (each step's metrics
            are written before its checkpoint, so a crash during the save loses none).
        keep_checkpoints: newest checkpoints kept on disk.
        resume: continue from the newest checkpoint in the run folder (at any layout; the run's current
            config applies from there on: LR schedule, optimizer settings, ``steps``); refused when the folder
            holds none or the run has done its ``steps``.
        export_hf: also write a Hugging Face copy of the final actor.
        progress: show a progress bar over the steps.
        log_samples: responses per step written to ``samples.jsonl`` (prompt, response, score).
        timeout_s: seconds a collective waits for its peers before the run stops with an error naming the
            rank and phase (a peer that stalled); a peer that died is reported at once.
        loggers: where metrics go (rank 0): "console" (a line per step), "jsonl" (``metrics.jsonl``, which
            the summary and ``megarl report`` read; required), "tensorboard" (event files in
            ``<run>/tensorboard``; extra ``megarl[tensorboard]``), "wandb" (W&B offline run in
            ``<run>/wandb``; extra ``megarl[wandb]``).
        report: write ``report.md`` and its plots into the run folder at the end (``megarl report``).
        mode: "sync": every batch is generated with the weights of the step before it (on-policy); "async":
            with ``placement.rollout`` on a pool of its own, the rollout pool generates the batches of steps
            t+1..t+k with the weights of step t while the training pools compute step t
            (:mod:`megarl.trainer.pipeline`; the loss should correct for it, README "Asynchronous RL").
        max_staleness: k of the async mode, >= 1: a batch trained at step t was generated by the weights of
            step t-1-k or newer (1 = one-step-off).
    """

    steps: int = 15
    save_every: int = 10
    save_every_min: float = 0.0
    keep_checkpoints: int = 1
    resume: bool = False
    export_hf: bool = False
    progress: bool = True
    log_samples: int = 2
    timeout_s: float = 1800.0
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    report: bool = True
    mode: str = "sync"
    max_staleness: int = 1

    def __post_init__(self):
        import importlib.util

        require(self.mode in ("sync", "async"), "trainer.mode", f"must be sync or async, got {self.mode!r}")
        require(self.max_staleness >= 1, "trainer.max_staleness",
                f"{self.max_staleness} must be >= 1 (batches generated ahead of the step that trains them)")

        require(self.steps >= 1, "trainer.steps", "must be >= 1")
        require(self.timeout_s > 0, "trainer.timeout_s", "must be > 0 (seconds)")
        require(self.save_every >= 0, "trainer.save_every", "must be >= 0")
        require(self.save_every_min >= 0, "trainer.save_every_min", "must be >= 0 (minutes; 0 = off)")
        require(self.keep_checkpoints >= 1, "trainer.keep_checkpoints",
                 f"{self.keep_checkpoints} must be >= 1 (how many of the newest checkpoints stay on disk)")
        unknown = [name for name in self.loggers if name not in LOGGERS]
        require(not unknown, "trainer.loggers", f"unknown {unknown}; choose from {list(LOGGERS)}")
        require("jsonl" in self.loggers, "trainer.loggers", "must include jsonl (the summary and `megarl report` "
                 "read metrics.jsonl)")
        for name in self.loggers:
            package = LOGGER_PACKAGES.get(name)
            require(package is None or importlib.util.find_spec(package) is not None, "trainer.loggers",
                     f"{name} needs the {package!r} package: pip install 'megarl[{name}]', or remove {name}")


@dataclass
class ValidationConfig:
    """Held-out evaluation: responses to a fixed set of prompts, scored by ``reward.fn`` and logged under
    ``val/`` (accuracy, mean reward, response length, share cut at ``max_new_tokens``); ``megarl eval`` runs
    the same evaluation outside a run. Validation prompts never enter training: training prompts with the
    same text are removed.

    Attributes:
        enabled: validate during ``megarl train``.
        files: jsonl/parquet files of prompts, with the fields of ``data.prompt_key`` / ``data.answer_key`` and
            the same template; the default, GSM8K's test split, is prepared with the train split
            (``data.prepare``).
        num_prompts: how many prompts (of those within ``data.max_prompt_length``): the first ones, or a
            sample drawn with ``run.seed`` (``shuffle``), the same at every evaluation; 0 or -1 = all.
        shuffle: a seeded sample instead of the first ``num_prompts``.
        n: responses per prompt (accuracy is their mean, mean@n; with n > 1, pass@n is logged too).
        temperature: 0 = greedy (then n must be 1); top_p: nucleus sampling.
        max_new_tokens: response length limit, tokens; null = ``rollout.max_new_tokens``.
        every: also validate after every ``every``-th step (0 = only before and after training).
        before_train: validate before step 1 (logged as step 0). at_end: after the last step.
    """

    enabled: bool = True
    files: list[str] = field(default_factory=lambda: ["data/arithmetic/test.parquet"])
    num_prompts: int = 64
    shuffle: bool = False
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    every: int = 0
    before_train: bool = True
    at_end: bool = True

    def __post_init__(self):
        require(len(self.files) > 0, "validation.files", "list at least one jsonl or parquet file")
        require(self.num_prompts >= -1, "validation.num_prompts", f"must be >= 1, or 0 / -1 for all prompts, "
                 f"got {self.num_prompts}")
        require(self.n >= 1, "validation.n", f"must be >= 1, got {self.n}")
        require(self.temperature >= 0, "validation.temperature", "must be >= 0 (0 = greedy)")
        require(self.n == 1 or self.temperature > 0, "validation.n",
                 f"greedy decoding (temperature 0) gives {self.n} identical responses; set validation.n=1 or "
                 "validation.temperature > 0")
        require(0 < self.top_p <= 1, "validation.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.max_new_tokens is None or self.max_new_tokens >= 1, "validation.max_new_tokens",
                 "must be >= 1 or null (rollout.max_new_tokens)")
        require(self.every >= 0, "validation.every", "must be >= 0 (0 = only before and after training)")


# The environment of every rank of a SLURM job (``megarl submit``, ``megarl sweep --slurm``), exported by the
# batch script before ``srun``. One place for these defaults; a config overrides one with
# ``launch.env.NAME=VALUE`` and unsets one with ``launch.env.NAME=null``.
LAUNCH_ENV: dict[str, Optional[str]] = {
    "NCCL_DEBUG": "WARN",
    "NCCL_NVLS_ENABLE": "0",                   # NVLink multicast (NVLS) off: it fails on some fabrics/MIG
    "NCCL_IB_TIMEOUT": "22",                   # InfiniBand retry timeout (4.096 us * 2^22 ~ 17 s)
    "NCCL_IB_RETRY_CNT": "13",
    "NCCL_IB_HCA": None,                       # e.g. "mlx5": which InfiniBand adapters NCCL uses (NCCL picks)
    "NCCL_SOCKET_IFNAME": None,                # e.g. "^lo,docker": interfaces for NCCL's bootstrap (NCCL picks)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",    # a failed collective ends the job instead of hanging it
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",        # megatron-core's TP/SP communication overlap needs one queue
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class LaunchConfig:
    """How SLURM jobs start the ranks (``megarl submit``, ``megarl sweep --slurm``).

    Attributes:
        env: environment variables of every rank (defaults :data:`LAUNCH_ENV`); a null value is not exported.
        max_restarts: restarts of a run that fails (a killed rank, a lost peer or node, a stalled rank), each
            from its newest complete checkpoint: ``megarl submit`` requeues the job, ``megarl train`` runs the
            local world again (:mod:`megarl.launch.supervise`); config and data errors are never retried.
        save_before_end_s: ``megarl submit``: SLURM sends the ranks SIGUSR1 this many seconds before the job's
            time limit (``--signal=USR1@S``); they save a checkpoint after the step and the job is requeued to
            continue (0 = off).
    """

    env: dict[str, Optional[str]] = field(default_factory=lambda: dict(LAUNCH_ENV))
    max_restarts: int = 0
    save_before_end_s: int = 0

    def __post_init__(self):
        require(self.max_restarts >= 0, "launch.max_restarts", f"must be >= 0, got {self.max_restarts}")
        require(self.save_before_end_s >= 0, "launch.save_before_end_s",
                 f"must be >= 0 (seconds before the time limit; 0 = off), got {self.save_before_end_s}")
        for name in self.env:
            require(name.isidentifier(), f"launch.env.{name}", "is not a valid environment variable name")


@dataclass
class Config:
    """A whole run. Defaults: the CPU default (README's main job)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    @property
    def world_size(self) -> int:
        """Ranks the job needs: the actor's mesh with an explicit dp, else tp * cp * pp (dp = 1); at least every rank
        that ``placement.pools`` lists."""
        p = self.actor.parallel
        return max(p.replica_size * max(p.dp, 1), self.placement.explicit_world())

    @property
    def rollout_batch_size(self) -> int:
        """Sequences per RL step."""
        return self.data.prompts_per_step * self.rollout.n

    def __post_init__(self):
        alg = self.algorithm
        require(not alg.dynamic_sampling.enabled or self.rollout.n >= 2, "algorithm.dynamic_sampling.enabled",
                 f"drops groups whose rollout.n samples are all rewarded alike: needs rollout.n >= 2, got "
                 f"{self.rollout.n}")
        require(alg.overlong.buffer_tokens <= self.rollout.max_new_tokens, "algorithm.overlong.buffer_tokens",
                 f"{alg.overlong.buffer_tokens} is longer than rollout.max_new_tokens={self.rollout.max_new_tokens}")
        for role in ("actor", "critic"):
            offload = getattr(self, role).optim.cpu_offload
            require(not offload or self.model.dtype == "bfloat16", f"{role}.optim.cpu_offload",
                    f"{offload} needs model.dtype=bfloat16, got {self.model.dtype}: megatron's offloaded optimizer "
                    "cannot step an fp32 model's weight shards (views), and with float16 its update differed from the "
                    f"device optimizer's here; set model.dtype=bfloat16 or {role}.optim.cpu_offload=0")
        lora = self.actor.lora
        if lora.enabled:
            require(lora.sync == "merged" or self.rollout.engine == "vllm", "actor.lora.sync",
                    "adapter sends the adapters to vLLM's LoRA layers; the transformers engine takes merged "
                    "weights: set actor.lora.sync=merged or rollout.engine=vllm")
            pl = self.placement
            require(pl.reference == pl.actor and pl.reference_parallel is None, "placement.reference",
                    "with actor.lora the reference policy is the actor with its adapters off, on the actor's pool "
                    f"and layout: set placement.reference={pl.actor} and placement.reference_parallel=null")
            require(self.rollout.quantization is None, "rollout.quantization",
                    f"{self.rollout.quantization} rollouts with actor.lora are not supported: the merge writes W + BA "
                    "into the engine's weights in their dtype, and vLLM's LoRA layers over block-FP8 weights are "
                    "untested here; use rollout.quantization=null")
        if self.rollout.multi_turn.enabled:
            not_yet = "not with rollout.multi_turn.enabled=true yet (README 'Agentic RL')"
            require(not alg.dynamic_sampling.enabled, "algorithm.dynamic_sampling.enabled", f"must be false: {not_yet}")
            require(not alg.overlong.buffer_tokens and not alg.overlong.filter, "algorithm.overlong",
                    f"buffer_tokens must be 0 and filter false: an episode's length is not one response's; {not_yet}")
            require(self.rollout.engine == "hf" or self.rollout.tp == 1, "rollout.tp",
                    f"must be 1 with rollout.multi_turn.enabled=true, got {self.rollout.tp}: the ranks of one vLLM "
                    "engine must add the same requests at the same scheduler steps, which episodes timed by their "
                    "tools do not (use rollout data parallelism: engines of tp=1 on every rank)")
            require(not lora.enabled, "actor.lora.enabled", f"must be false: {not_yet}")
        if self.actor.moe.router_replay:
            require(self.rollout.model_runner != "v2", "rollout.model_runner",
                    "must be v1 or null with actor.moe.router_replay=true: vLLM 0.24's V2 model runner does not "
                    "return the routed experts")
            require(not self.rollout.multi_turn.enabled, "actor.moe.router_replay",
                    "is not wired for rollout.multi_turn.enabled=true yet (an episode's turns are not recorded "
                    "together): set actor.moe.router_replay=false")
        require(not self.critic.moe.router_replay, "critic.moe.router_replay",
                "replays the actor's routes only; set critic.moe.router_replay=false")
        rc = alg.rollout_correction
        if self.rollout.quantization is not None and rc.preset is None and rc.level is None:
            rc.preset = "token_tis"  # the FP8 model's log-probs differ from the bf16 actor's (RolloutCorrectionConfig)

    @property
    def loss_norm_tokens(self) -> int:
        """The constant of ``algorithm.loss_agg_mode=seq-mean-token-sum-norm`` (Dr. GRPO), tokens."""
        return self.algorithm.loss_norm_tokens or self.rollout.max_new_tokens


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides; typed and validated.

    Raises:
        ConfigError: an unknown key, a wrong type or an invalid value, naming the field.
        FileNotFoundError: the YAML file does not exist.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = OmegaConf.structured(Config)
    try:
        layers = [base]
        if path is not None:
            if not Path(path).is_file():
                if Path(path).suffix not in (".yaml", ".yml") and re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", str(path)):
                    raise ConfigError(f"{path}: an override needs a value, e.g. {path}=...; the config file, if "
                                      "any, comes first: megarl COMMAND CONFIG.yaml key=value ...")
                raise FileNotFoundError(f"config file {path} does not exist (see parallel_configs/)")
            layers.append(_load_yaml(path))
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if any(Path(o).suffix in (".yaml", ".yml") for o in bad):
                raise ConfigError(f"the config file must come first: megarl COMMAND CONFIG.yaml key=value ..., "
                                  f"got {bad} after overrides")
            if bad:
                raise ConfigError(f"overrides must be key=value, got {bad}")
            layers.append(_load_overrides(overrides))
        for layer in layers[1:]:
            _check_sections(base, layer)
        merged = OmegaConf.merge(*layers)
        try:
            return OmegaConf.to_object(merged)
        except _SectionFieldError:
            _name_section_error(merged)
            raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key or 'config'}: {str(e).splitlines()[0]}") from None


def _name_section_error(node, prefix: str = "") -> None:
    """Find the section of ``node`` (a merged config) whose ``__post_init__`` raises a
    :class:`_SectionFieldError`, innermost first, and raise it as a :class:`ConfigError` naming the field's
    full dotted path (``critic.optim.lr``)."""
    from omegaconf import DictConfig, OmegaConf

    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _name_section_error(child, f"{prefix}{key}.")
    try:
        OmegaConf.to_object(node)
    except _SectionFieldError as e:
        raise ConfigError(f"{prefix}{e.field_name}: {e.msg}") from None


def _load_yaml(path: str | os.PathLike):
    """A YAML config file as an OmegaConf mapping.

    Raises:
        ConfigError: naming the file: not YAML, or not a mapping of sections.
        FileFormatError: not UTF-8, naming the line and byte offset.
    """
    import yaml
    from omegaconf import DictConfig, OmegaConf

    from megarl.textfiles import read_text

    text = read_text(path)  # bytes that are not UTF-8: the line and offset named
    try:
        layer = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a config file maps sections (run, model, actor, ...) to their fields; this one "
                          f"holds a {type(layer).__name__.removesuffix('Config').lower()}")
    return layer


def _load_overrides(overrides: list[str]):
    """``key=value`` overrides as one OmegaConf mapping; each value is read as YAML (``a.b=[1, 2]``).

    Raises:
        ConfigError: naming the override whose value is not valid YAML.
    """
    import yaml
    from omegaconf import OmegaConf

    layers = []
    for item in overrides:
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except yaml.YAMLError as e:
            key, value = item.split("=", 1)
            raise ConfigError(f"{key}: the value {value!r} is not valid YAML ({' '.join(str(e).split())}); "
                              "quote it for a string, e.g. key='\"text, with commas\"'") from None
    return OmegaConf.merge(*layers)


def _check_sections(base, layer, prefix: str = "") -> None:
    """Refuse a plain value where the config has a section (``actor.parallel: 3``) or a list
    (``data.train_files: a.parquet``), naming the key (OmegaConf's own merge errors name no key or no fix).

    Raises:
        ConfigError: naming the dotted key and the section's fields.
    """
    from omegaconf import OmegaConf

    for key, value in layer.items_ex(resolve=False):
        if key in base and OmegaConf.is_list(base[key]) and value is not None and not OmegaConf.is_list(value):
            raise ConfigError(f"{prefix}{key}: must be a list, e.g. [{value}]")
        if key not in base or not OmegaConf.is_dict(base[key]):
            continue  # unknown keys and wrong values are named by OmegaConf's merge
        fields = list(base[key].keys())
        if not OmegaConf.is_dict(value):
            raise ConfigError(f"{prefix}{key}: is a section (fields {fields}), not a value; set a field, e.g. "
                              f"{prefix}{key}.{fields[0] if fields else 'name'}=...")
        _check_sections(base[key], value, f"{prefix}{key}.")


def absolute_paths(cfg: Config) -> Config:
    """A copy of ``cfg`` whose paths are absolute (``model.path``, ``model.tokenizer``, ``data.train_files``,
    ``data.gsm8k_source``, ``validation.files``, ``run.output_dir``), so that what a run records (its config.json, its checkpoints)
    means the same from any working folder. Names that are not paths (``default``, ``preset:NAME``, ``auto``,
    ``hub``) are kept."""
    def absolute(p: str | None) -> str | None:
        if p is None or p in ("default", "auto", "hub") or p.startswith("preset:"):
            return p
        return str(Path(p).expanduser().resolve())

    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, output_dir=absolute(cfg.run.output_dir)),
        model=dataclasses.replace(cfg.model, path=absolute(cfg.model.path), tokenizer=absolute(cfg.model.tokenizer)),
        data=dataclasses.replace(cfg.data, train_files=[absolute(f) for f in cfg.data.train_files],
                                 gsm8k_source=absolute(cfg.data.gsm8k_source)),
        validation=dataclasses.replace(cfg.validation, files=[absolute(f) for f in cfg.validation.files]))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data (for metrics, checkpoints and the summary)."""
    return dataclasses.asdict(cfg)
