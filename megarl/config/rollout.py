"""What each RL step generates and scores: the prompts (``data``), the rollout engine and its multi-turn episodes
(``rollout``), the reward (``reward``), and how the actor's weights reach the engine (``reshard``)."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.config.errors import require

QUANTIZATIONS = ("fp8",)  # rollout.quantization besides null: the engine weight formats (megarl.models.fp8)
MODEL_RUNNERS = ("v1", "v2")  # rollout.model_runner besides null (megarl.rollout.vllm_engine: VLLM_USE_V2_MODEL_RUNNER)
LOGPROBS_SOURCES = ("output", "sampler")  # rollout.logprobs (megarl.rollout.vllm_logprobs)
KV_CACHE_DTYPES = ("fp8",)  # rollout.kv_cache_dtype besides null: vLLM's kv_cache_dtype (fp8: E4M3 on CUDA)
# The smallest reshard bucket, MiB (reshard.bucket_mb, megarl bench reshard --bucket-mb): 64 KiB, a floor that
# catches a size given in the wrong unit; buckets of a few MiB and less already spend most of each round on
# the round's synchronisation, not on moving bytes.
MIN_BUCKET_MB = 1 / 16


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
            TP shards are whole 128-blocks (:func:`megarl.models.layout_vllm.check_vllm_fp8`). Its rollout log-probs
            are those of the FP8 model: ``algorithm.rollout_correction`` then defaults to token-level TIS
            (``preset: token_tis``; ``preset: none`` turns it off).
        kv_cache_dtype: the rollout engine's KV cache: null (the model dtype) or "fp8" (vLLM's ``kv_cache_dtype=
            "fp8"``: E4M3 keys and values, scale 1.0, and on Hopper FlashAttention 3 attends in FP8): half the
            bytes per cached token, so twice the tokens in the same ``gpu_memory_utilization`` and half the KV reads
            of each decode step. vllm engine. Its rollout log-probs are those of the FP8 cache: as with
            ``quantization``, ``algorithm.rollout_correction`` then defaults to token-level TIS. Not yet measured on
            a GPU (``perf/gpu_generation.sh``'s ``gen_fp8kv`` and ``step_fp8kv``). Not with ``quantization``: vLLM
            reads an FP8 model's cache scales from its checkpoint, which an engine of megarl's does not have.
        model_runner: vLLM's model runner: "v1", "v2" or null: V2 for Qwen2 (vLLM 0.24's default there is V1;
            V2 measured faster, perf/RESULTS.md), V1 with ``exact``, else vLLM's choice for the architecture (V2
            for Llama, Mistral, Qwen3; V1 where V2 lacks a feature the engine uses). V2 samples seeded requests
            in one kernel; V1 draws each seeded request's noise in a Python loop (:mod:`megarl.rollout.vllm_engine`).
        async_scheduling: vLLM's async scheduler (the next step is scheduled while the GPU runs this one); null =
            vLLM's default (on for megarl's engine).
        max_num_seqs: sequences vLLM decodes at once; null = vLLM's default (1024 on an H200, 256 on GPUs under
            70 GiB); a rollout batch above it decodes in waves.
        max_num_batched_tokens: tokens per vLLM step (prefill chunks); null = vLLM's default (16384 on an
            H200, 8192 under 70 GiB); at least max_num_seqs.
        kv_cache_memory_bytes: each vLLM engine's KV cache, bytes (vLLM's ``kv_cache_memory_bytes``); null = what
            ``gpu_memory_utilization`` leaves after vLLM's start-up memory profile. Set, vLLM skips that profile,
            which fails ("Error in memory profiling") when another process on the GPU frees memory meanwhile, such
            as a second job's engine going to sleep, and the cache is the same size on every start; vLLM still
            wants ``gpu_memory_utilization`` of the GPU free when it starts.
        cudagraph_capture_sizes: decode batch sizes vLLM captures as CUDA graphs (enforce_eager=false); null =
            vLLM's (1, 2, 4, multiples of 8 to 248, of 16 up to max_cudagraph_capture_size).
        max_cudagraph_capture_size: the largest captured batch (enforce_eager=false); null = vLLM's
            min(2 * max_num_seqs, 512). A decode step of more sequences runs without graphs.
        request_seeds: seed every sample on its own (its tokens do not depend on how prompts are batched or split
            over engines); false: vLLM's generator seeded by run.seed (reproducible for the same batches only),
            which saves the V1 runner's per-request noise loop.
        logprobs: where the vLLM engine's rollout log-probs are read: "sampler" (gathered on the GPU in vLLM's
            sampler: :mod:`megarl.rollout.vllm_logprobs`) or "output" (vLLM's ``logprobs=0`` output, one
            ``Logprob`` object per token built on the host); the same values bit for bit (tests/test_gpu_logprobs.py,
            V1 and V2 runners, eager and CUDA graphs, on an H100). The sampler's are copied once per ``generate``
            and, for multi-turn episodes and agent functions (vLLM's request path), step by step without waiting
            for the GPU, matched to each turn's tokens. null (the default): "sampler" on the vLLM engine (measured
            on an H100, perf/RESULTS.md: generation of the 1.5B case 1.26x faster on the V2 runner, 1.11x on V1),
            and "output" where the model runner lacks the sampler's hooks (a vLLM other than 0.24.0); set it to
            have that source or an error.
        exact: exact on-policy (README "Exact on-policy"; docs/DESIGN.md): vLLM in its batch-invariant mode
            (``VLLM_BATCH_INVARIANT=1``) and the trainer's old-log-prob pass batch-invariant with the same kernels
            (:mod:`megarl.kernels.batch_invariant`), so that the old log-probs equal the rollout's bit for bit
            (``mismatch/exact_tokens_frac`` 1.0); the combinations that cannot be exact are refused here and in
            :class:`megarl.config.Config`.
        overlap_scoring: score the groups that have finished while the others still generate (README "Overlap of
            generation and scoring"; :mod:`megarl.rollout.overlap`): their rewards, the actor's old log-probs (where
            the step has that pass) and the reference's log-probs run on a thread beside the engine, which is driven
            step by step (vLLM: request by request, its output log-probs); the results are the sequential step's.
            Colocated single-turn synchronous steps only; the rest is refused by :class:`megarl.config.Config`.
        engines_per_gpu: rollout engines on each rank's device, each in a process of its own
            (:mod:`megarl.rollout.engine_pool`): the prompts are split over them and each schedules on its own CPU
            core, so the GPU waits less for the host between decode steps; each vLLM engine gets
            ``gpu_memory_utilization / engines_per_gpu``, and the pool keeps one more copy of the rollout weights
            on the device (the staging tensors the reshard writes). 1 (the default): the engine in the rank's
            process.
            Above 1: TP = 1 engines, single-turn synchronous colocated steps without overlap, exact, FP8, LoRA or
            router replay (refused here and by :class:`megarl.config.Config`).

    The vLLM knobs (quantization to logprobs) apply to ``engine: vllm``; ``perf/gpu_generation.sh``
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
    kv_cache_dtype: Optional[str] = None
    model_runner: Optional[str] = None
    async_scheduling: Optional[bool] = None
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    cudagraph_capture_sizes: Optional[list[int]] = None
    max_cudagraph_capture_size: Optional[int] = None
    request_seeds: bool = True
    logprobs: Optional[str] = None
    exact: bool = False
    overlap_scoring: bool = False
    engines_per_gpu: int = 1

    def __post_init__(self):
        require(self.engine in ("hf", "vllm"), "rollout.engine", f"must be 'hf' or 'vllm', got {self.engine!r}")
        self._check_vllm_knobs()
        self._check_engines_per_gpu()
        if self.exact:
            require(self.quantization is None, "rollout.quantization",
                    f"{self.quantization} rollouts cannot be exact: the engine samples from the quantised model, the "
                    "trainer computes the bf16 one; set rollout.quantization=null or rollout.exact=false")
            require(self.kv_cache_dtype is None, "rollout.kv_cache_dtype",
                    f"{self.kv_cache_dtype} cannot be exact: the engine attends over the {self.kv_cache_dtype} cache, "
                    "the trainer over the bf16 keys and values; set rollout.kv_cache_dtype=null or rollout.exact=false")
            require(self.engine == "hf" or self.tp == 1, "rollout.tp",
                    f"{self.tp} cannot be exact yet: vLLM's row-parallel layers all-reduce partial sums over the TP "
                    "ranks, another reduction order than the trainer's one matmul (TP-invariant reductions are not "
                    "wired); set rollout.tp=1 (more engines: rollout data parallelism) or rollout.exact=false")
            require(self.model_runner != "v2", "rollout.model_runner",
                    "v2 cannot be exact yet: its sampler computes the log-probs with a Triton kernel of its own, the "
                    "trainer reproduces the V1 sampler's; set rollout.model_runner=v1 (exact's default) or "
                    "rollout.exact=false")
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

    def _check_engines_per_gpu(self) -> None:
        """What a pool of engines (:mod:`megarl.rollout.engine_pool`) cannot run, each refused with its fix."""
        k = self.engines_per_gpu
        require(k >= 1, "rollout.engines_per_gpu", f"must be >= 1, got {k}")
        if k == 1:
            return
        off = "or rollout.engines_per_gpu=1"
        require(self.tp == 1, "rollout.tp", f"{self.tp} with rollout.engines_per_gpu={k}: a pool's engines are TP = 1 "
                f"engines in processes of their own (one device each); set rollout.tp=1 {off}")
        require(self.quantization is None, "rollout.quantization", f"{self.quantization} with "
                f"rollout.engines_per_gpu={k} is untested (its weights and scales differ in dtype); set "
                f"rollout.quantization=null {off}")
        require(not self.exact, "rollout.exact", f"true with rollout.engines_per_gpu={k}: the exact mode pins vLLM's "
                f"kernels in the rank's process; set rollout.exact=false {off}")
        require(not self.overlap_scoring, "rollout.overlap_scoring", "true drives the engine request by request, "
                f"which a pool does not serve; set rollout.overlap_scoring=false {off}")
        require(not self.multi_turn.enabled, "rollout.multi_turn.enabled", "true drives the engine request by "
                f"request, which a pool does not serve; set rollout.multi_turn.enabled=false {off}")
        require(self.request_seeds, "rollout.request_seeds", "false seeds each engine's generator with run.seed, so "
                f"the pool's engines would draw the same noise; set rollout.request_seeds=true {off}")

    def _check_vllm_knobs(self) -> None:
        require(self.quantization in (None, *QUANTIZATIONS), "rollout.quantization",
                f"must be null (bf16) or one of {list(QUANTIZATIONS)}, got {self.quantization!r}")
        require(self.quantization is None or self.engine == "vllm", "rollout.quantization",
                f"{self.quantization} rollouts need rollout.engine=vllm (the hf engine runs the model dtype)")
        require(self.kv_cache_dtype in (None, *KV_CACHE_DTYPES), "rollout.kv_cache_dtype",
                f"must be null (the model dtype) or one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        require(self.kv_cache_dtype is None or self.engine == "vllm", "rollout.kv_cache_dtype",
                f"{self.kv_cache_dtype} needs rollout.engine=vllm (the hf engine caches the model dtype)")
        # vLLM 0.24 gives an FP8 checkpoint's attention layers k/v scale parameters, read from the checkpoint; an
        # engine of megarl's starts from dummy weights (random values, model_loader/weight_utils.py
        # initialize_dummy_weights), which its FP8 cache would then take as scales (quantization/kv_cache.py)
        require(self.kv_cache_dtype is None or self.quantization is None, "rollout.kv_cache_dtype",
                f"{self.kv_cache_dtype} with rollout.quantization={self.quantization}: vLLM would take the cache's "
                "scales from the engine's dummy weights (megarl writes none); set one of the two to null")
        require(self.model_runner in (None, *MODEL_RUNNERS), "rollout.model_runner",
                f"must be null (V2 for Qwen2, else vLLM's choice) or one of {list(MODEL_RUNNERS)}, "
                f"got {self.model_runner!r}")
        require(self.logprobs in (None, *LOGPROBS_SOURCES), "rollout.logprobs",
                f"must be null (the sampler's where it applies) or one of {list(LOGPROBS_SOURCES)}, "
                f"got {self.logprobs!r}")
        require(self.logprobs != "sampler" or self.engine == "vllm", "rollout.logprobs",
                f"{self.logprobs} reads vLLM's sampler, but rollout.engine={self.engine}; use rollout.engine=vllm or "
                "leave rollout.logprobs null")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "max_cudagraph_capture_size"):
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
                                                            "max_num_batched_tokens", "kv_cache_memory_bytes",
                                                            "cudagraph_capture_sizes", "max_cudagraph_capture_size")}
        set_fields = [f"rollout.{k}" for k, v in vllm_only.items() if v is not None]
        set_fields += [] if self.request_seeds else ["rollout.request_seeds"]
        require(self.engine == "vllm" or not set_fields, set_fields[0] if set_fields else "rollout",
                f"is a vLLM knob, but rollout.engine={self.engine}; use rollout.engine=vllm or leave its default")


# data.prepare's datasets; each writes its train.parquet and test.parquet
PREPARED = ("arithmetic", "calculator", "gsm8k", "reasoning_gym", "verifiers")


@dataclass
class DataConfig:
    """Prompt dataset.

    Attributes:
        train_files: jsonl or parquet files with one prompt per row.
        prepare: if the train files are missing, prepare them first: "arithmetic" (the CPU default's task,
            :mod:`megarl.data.arithmetic`), "calculator" (its 5-digit version, for the calculator tool), "gsm8k"
            (from ``gsm8k_source``), "reasoning_gym" (reasoning-gym's tasks named by ``prepare_kwargs``,
            :mod:`megarl.environments.reasoning_gym`), "verifiers" (a verifiers taskset's tasks,
            :mod:`megarl.environments.verifiers`) or null.
        prepare_kwargs: the preparation's settings (reasoning_gym: tasks, size, test_size, seed; verifiers:
            taskset, taskset_args, size, test_size); {} for the others.
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
    prepare_kwargs: dict[str, Any] = field(default_factory=dict)
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
        require(not self.prepare_kwargs or self.prepare in ("reasoning_gym", "verifiers"), "data.prepare_kwargs",
                f"are settings of data.prepare=reasoning_gym or verifiers, but data.prepare={self.prepare}; leave "
                "them empty")


JUDGE_BACKENDS = ("http",)  # reward.judge.backend: an OpenAI-compatible server (a "vllm" engine of our own: later)
JUDGE_VERDICTS = ("score", "choice")  # reward.judge.verdict
JUDGE_FIELDS = ("prompt", "response", "reference")  # the placeholders of reward.judge.rubric


@dataclass
class JudgeConfig:
    """A generative judge (LLM-as-judge) as a reward: a judge model reads each (prompt, response, reference)
    through a rubric and answers a verdict (:mod:`megarl.rewards.judge`). Off unless ``enabled``.

    Attributes:
        enabled: score with the judge; the step's reward is ``weight * judge + rule_weight * reward.fn``.
        backend: "http": an OpenAI-compatible chat-completions server at ``url`` (vLLM's ``vllm serve``, SGLang,
            a hosted API). (An engine of megarl's own, colocated with sleep, is planned as "vllm".)
        url: the server's base URL (``http://judge-host:8000/v1``; ``/chat/completions`` is appended unless given).
        model: the served model's name (the request's ``model``); null leaves the field out.
        rubric: the user message, a Python format string with ``{prompt}``, ``{response}`` (required) and
            ``{reference}`` (the ground truth; "" where there is none); double braces for literal ones.
        system: an optional system message.
        verdict: "score" (a number in ``score_range``) or "choice" (a label of ``choices``).
        score_range: [low, high]; a score outside it is unreadable; normalize: map it to [0, 1].
        choices: label -> reward for ``verdict=choice`` (labels matched case-insensitively), e.g. {"yes": 1, "no": 0}
            (quoted: YAML reads a bare yes / no as a boolean).
        pattern: the regular expression whose first group is the verdict (its last match counts); null = the
            built-in one of the verdict ("Score: 7", "Verdict: [[A]]"; a reply that is only the verdict also reads).
        error_score: the reward of an unreadable verdict or a timed-out request (null: no score, the sample is
            dropped from its group, ``megarl.algos.nonfinite``); counted in ``reward/judge_unreadable``,
            ``reward/judge_timeouts``.
        max_concurrency: requests in flight at once; timeout_s: seconds per request; max_retries: retries of a
            request that timed out, could not connect or got HTTP 429/5xx; backoff_s: the first retry's delay.
        max_tokens / temperature: the judge's sampling.
        weight / rule_weight: the judge's and ``reward.fn``'s weights in the reward (rule_weight 0: the judge
            alone, reward.fn is not called).
    """

    enabled: bool = False
    backend: str = "http"
    url: Optional[str] = None
    model: Optional[str] = None
    rubric: str = ("Rate the response to the question from 0 (wrong or unhelpful) to 10 (correct and complete)."
                   "\n\nQuestion: {prompt}\n\nResponse: {response}\n\nReference answer (may be empty): {reference}"
                   "\n\nEnd your reply with 'Score: N'.")
    system: Optional[str] = None
    verdict: str = "score"
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    normalize: bool = True
    choices: dict[str, float] = field(default_factory=dict)
    pattern: Optional[str] = None
    error_score: Optional[float] = 0.0
    max_concurrency: int = 32
    timeout_s: float = 120.0
    max_retries: int = 2
    backoff_s: float = 1.0
    max_tokens: int = 512
    temperature: float = 0.0
    weight: float = 1.0
    rule_weight: float = 0.0

    def __post_init__(self):
        if not self.enabled:
            return
        require(self.backend in JUDGE_BACKENDS, "reward.judge.backend",
                f"must be one of {list(JUDGE_BACKENDS)}, got {self.backend!r}; serve the judge with "
                "`vllm serve JUDGE` and give its URL (reward.judge.url)")
        require(self.url is not None and self.url.startswith(("http://", "https://")), "reward.judge.url",
                f"the judge needs an OpenAI-compatible server's http:// or https:// URL, got {self.url!r}; e.g. "
                "reward.judge.url=http://judge-host:8000/v1")
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.rubric) if f is not None]
        except ValueError as e:
            names = [f"<{e}>"]
        bad = [n for n in names if n not in JUDGE_FIELDS]
        require(not bad and "response" in names, "reward.judge.rubric",
                f"may use only the placeholders {{prompt}}, {{response}} (required) and {{reference}}, got "
                f"{['{' + n + '}' for n in names]}; write literal braces as {{{{ and }}}}")
        require(self.verdict in JUDGE_VERDICTS, "reward.judge.verdict",
                f"must be one of {list(JUDGE_VERDICTS)}, got {self.verdict!r}")
        require(len(self.score_range) == 2 and self.score_range[0] < self.score_range[1], "reward.judge.score_range",
                f"must be [low, high] with low < high, got {list(self.score_range)}")
        require(self.verdict != "choice" or len(self.choices) > 0, "reward.judge.choices",
                "verdict=choice needs the labels and their rewards, e.g. "
                "reward.judge.choices='{\"yes\": 1, \"no\": 0}'")
        if self.pattern is not None:
            try:
                groups = re.compile(self.pattern).groups
            except re.error as e:
                groups = f"not a regular expression ({e})"
            require(groups == 1, "reward.judge.pattern", f"must be a regular expression with one group (the "
                    f"verdict), got {self.pattern!r}: {groups if isinstance(groups, str) else f'{groups} groups'}")
        for name, low in (("max_concurrency", 1), ("max_retries", 0), ("max_tokens", 1)):
            require(getattr(self, name) >= low, f"reward.judge.{name}", f"must be >= {low}, got {getattr(self, name)}")
        require(self.timeout_s > 0 and self.backoff_s >= 0, "reward.judge.timeout_s",
                f"must be > 0 (and backoff_s >= 0), got {self.timeout_s} and {self.backoff_s}")
        require(self.weight != 0 or self.rule_weight != 0, "reward.judge.weight",
                "weight and rule_weight are both 0: no reward; set reward.judge.weight (the judge's) > 0")


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
        judge: a generative judge, alone or mixed with ``fn`` by weights (:class:`JudgeConfig`).
    """

    fn: str = "arithmetic"
    kwargs: dict[str, Any] = field(default_factory=dict)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


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
