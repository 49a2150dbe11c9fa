"""The vLLM rollout engine (GPU): vLLM 0.24.0 running in the training process, its weights written in place.

Construction. The engine writes ``spec.to_hf_config()`` (config.json only; with block-FP8 weights its
``quantization_config``, :func:`write_model_dir`) into a temporary directory and starts ``vllm.LLM`` on it with
dummy weights, no tokenizer (prompts and responses are token ids) and sleep mode, with the knobs of
:class:`VLLMSettings` (the same ``LLM`` arguments as the standalone baseline of ``megarl bench step``:
:func:`llm_kwargs`), in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the model is a Python object here
(``llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()``) and the reshard executor
writes the actor's shards straight into its parameters (:meth:`VLLMRolloutEngine.update_weights`). Its
sampled-token log-probs are those of :mod:`megarl.rollout.base` (``logprobs_mode="processed_logprobs"``, see
:mod:`megarl.rollout.sampler`).

Engines and ranks (``distributed_executor_backend="external_launcher"``, read in vLLM 0.24.0's source). Every
rank of the job's ``torch.distributed`` world runs one engine and joins it with its own ``RANK`` and
``LOCAL_RANK`` (``vllm/v1/executor/uniproc_executor.py``: ``ExecutorWithExternalLauncher._distributed_args``).
vLLM takes the world as initialised (``vllm/distributed/parallel_state.py``: ``init_distributed_environment``
skips ``init_process_group`` when torch.distributed is up, and ``_WORLD`` spans ``get_world_size()`` ranks) and
lays it out as ``arange(world).reshape(-1, dp, pp, pcp, tp)`` (``initialize_model_parallel``): the leading
dimension is the "ExternalDP" of independent engines, so with ``data_parallel_size=1`` (the default, kept
here) the TP groups are consecutive blocks of ``tp`` ranks and ``world / tp`` engines generate independently,
which is what :func:`~megarl.models.layout_vllm.vllm_layout` assumes; ``world == tp * pp * dp`` is not required
(``ParallelConfig.world_size`` stays ``tp * pp``; only vLLM's own DP, ``data_parallel_size > 1``, would put
engines in lockstep and multiply it in). The ranks of one engine must make the same calls with the same
prompts (every rank runs the same deterministic scheduler); requests are seeded, so they sample alike.
Construction is collective: every rank of the world builds its engine at the same time (vLLM creates its
process groups and takes the minimum free memory over the world).

Generation: one vLLM request per (prompt, sample), ``n=1``, seeded by
:func:`~megarl.rollout.base.sample_seed` (``rollout.request_seeds``, the default; else vLLM's own generator),
asking for the sampled token's log-prob only (``logprobs=0``; the sampler puts the sampled token first,
``vllm/v1/engine/logprobs.py``), or, with ``rollout.logprobs: sampler``, for none, the same values then taken
in the model runner's sampler on the GPU (:mod:`megarl.rollout.vllm_logprobs`; request by request too).

What these cost per decode step (vLLM 0.24.0's source; measured by ``perf/gpu_generation.sh``): a seeded
request gets a ``torch.Generator`` of its own, and the V1 model runner's sampler
(``vllm/v1/sample/ops/topk_topp_sampler.py``: ``random_sample``) then draws every seeded row's noise in a
Python loop, one ``exponential_`` launch per request and step ("TODO(woosuk): This can be slow because we handle
each request one by one"), 512 launches a step for an RL batch; the V2 model runner
(``vllm/v1/worker/gpu/sample/gumbel.py``) draws all rows in one Triton kernel from per-request seeds (Philox of
seed and position) for free. The sampled log-prob is a ``log_softmax`` over the vocab on the GPU, a gather and a
rank count, then one ``Logprob`` object per token in the output processor (``vllm/v1/engine/logprobs.py``) on the
CPU. Stop ids are a set lookup per request and step in the scheduler (``check_stop``). vLLM 0.24 runs
``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen3ForCausalLM`` on the V2 runner by default and
``Qwen2ForCausalLM`` on V1 (``vllm/config/vllm.py``: ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``); megarl runs
Qwen2 on V2 too unless ``rollout.model_runner`` says otherwise (:data:`V2_RUNNER_ARCHITECTURES`). A stop token is
kept in the response: the scheduler appends every sampled token before checking ``stop_token_ids``
(``vllm/v1/core/sched/utils.py: check_stop``) and, without a tokenizer, the output keeps all of them
(``vllm/v1/engine/detokenizer.py``).

Request by request (:class:`~megarl.rollout.base.RequestEngine`, multi-turn episodes), read in vLLM 0.24.0's
``vllm/v1/engine/llm_engine.py`` and ``vllm/entrypoints/offline_utils.py`` (what ``LLM.generate`` itself does):
:meth:`VLLMRolloutEngine.add_request` hands one request to ``llm.llm_engine.add_request(request_id, tokens_input(ids),
SamplingParams(..., output_kind=FINAL_ONLY))`` (a ``TokensInput`` is taken as already rendered; the output keeps the id
given, ``RequestOutput.request_id`` is the external one), and :meth:`VLLMRolloutEngine.step` runs one
``llm_engine.step()`` (one scheduler iteration: a decode step of every running request, prefill of new ones) and returns
the requests that finished in it (``rollout.logprobs: sampler``: log-probs from each step's sampler rows,
:mod:`megarl.rollout.vllm_logprobs`). So an episode's next turn joins the running batch at the next iteration, and its
prompt (the previous turn's prompt, its sampled tokens and the observation) hits the prefix cache
(``enable_prefix_caching=True``; ``RequestOutput.num_cached_tokens`` is reported per turn). With ``rollout.tp > 1`` the
ranks of one engine would have to add the same requests at the same iterations (their schedulers run in lockstep under
the external launcher), which episodes timed by their tools do not; multi-turn rollouts refuse it
(:mod:`megarl.trainer.preflight`).

A rollout pool of its own (``placement.rollout`` disjoint from the training ranks,
:mod:`megarl.trainer.pipeline`): the engines run on the pool's ranks only, ``rollout.tp`` consecutive ranks
of the pool each, and the other ranks take part in what vLLM's construction does over the whole world
(:func:`join_engine_construction`). Weights still arrive through our reshard executor, shard to shard from the
actor's Megatron shards into each engine rank's own parameters, over the world's NCCL. vLLM 0.24's
``vllm.distributed.weight_transfer`` (``WeightTransferEngine`` with NCCL and IPC backends) was the other
candidate, and it is not used: its trainer side streams whole tensors under their HF names (``WeightSource``
yields "fully-materialized" parameters; one trainer rank sends, after a gather), which is the full-model
gather the reshard exists to avoid, and its control plane (``init_weight_transfer_engine`` /
``update_weights`` RPCs) serves an engine in another process (``vllm serve``, Ray), while ours is a Python
object in this process whose parameters the executor can write directly. A megarl backend for that API would
have to carry the plan's pieces through its RPC dicts to workers that run the same executor: the same bytes,
plus a process boundary.

LoRA adapter sync (``actor.lora.sync=adapter``; ``lora_rank > 0``): the engine starts with vLLM's LoRA layers
(``enable_lora``, one adapter slot, ``max_lora_rank`` the smallest vLLM allows at or above the rank). Its base
weights are written once through :meth:`VLLMRolloutEngine.update_weights` (with LoRA on, vLLM's layers hold the base
as ``<module>.base_layer.weight``; the names here leave ``base_layer`` out, so the layout is the plain model's), and
each step :meth:`~VLLMRolloutEngine.update_adapters` hands vLLM the new adapters in memory, read in vLLM 0.24.0's
source: ``LoRAModel.from_lora_tensors`` (``vllm/lora/lora_model.py``) builds the adapter from PEFT-named whole
tensors (vLLM's LoRA layers cut their own TP shards in ``set_lora``), the worker's ``LRUCacheWorkerLoRAManager``
(``model_runner.lora_manager``, ``vllm/lora/worker_manager.py``) registers and activates it in its adapter manager
(``add_adapter`` / ``activate_adapter``, which pack q/k/v and gate/up), and the requests name it by a
``LoRARequest`` with a new id per version (a request whose id is registered is served without reading
``lora_path``). Each sample records the version its request named.

Router replay (``record_routes``, :mod:`megarl.models.router_replay`), read in vLLM 0.24.0's source: the engine
starts with ``enable_return_routed_experts`` (``vllm/config/model.py``), and every finished ``CompletionOutput``
carries ``routed_experts`` (``vllm/outputs.py``), a numpy array ``[prompt + response tokens - 1,
num_hidden_layers, top_k]`` of expert ids, uint8 for <= 256 experts, else uint16 (``vllm/model_executor/layers/
fused_moe/routed_experts_capturer.py``: ``RoutedExpertsManager``), row ``t`` token ``t`` of prompt + response,
layer ``i`` the MoE runner of ``model.layers.i`` (``vllm/v1/worker/gpu_model_runner.py``:
``_bind_routed_experts_capturer``), the top-k ids as the router's ``select_experts`` returned them. The output
processor concatenates the request's chunks on finish (``vllm/v1/engine/output_processor.py``:
``_new_completion_output``); the scheduler emits them (``vllm/v1/core/sched/scheduler.py``:
``update_from_output``): at the step its prefill completes, the whole prompt's rows read back from the
scheduler's buffer indexed by KV-cache slot (``RoutedExpertsManager.get(block_ids, num_prompt_tokens)``; prompt
tokens found in the prefix cache get the routes stored when their block was computed, under the same weights:
the engine drops the cache at every weight update), then one row per decode step, the token that step ran (the
previous sampled token). The last sampled token is never run: that is megarl's ``Sample.routed_experts``
exactly, converted to int16 (:func:`completion_routes`). vLLM refuses it with pipeline parallelism, context
parallelism and KV connectors (megarl uses none) and its V2 model runner does not capture routes
(``vllm/config/vllm.py``: ``_get_v2_model_runner_unsupported_features``; the config refuses
``rollout.model_runner=v2``; vLLM's own choice falls back to V1). The request path (:meth:`VLLMRolloutEngine.
add_request`, an episode's turns) returns the same rows per request (:func:`request_output_to_completion`): a
turn's history from the prefix cache has the routes of the turn that first ran it, which is what
:class:`~megarl.agents.episode.TokenSample` keeps.

Memory: ``sleep(1)`` moves the weights to CPU and drops the KV cache; ``sleep(2)`` drops both. vLLM's
``CuMemAllocator`` keeps the virtual addresses, so the parameter tensors held here stay valid across sleeps.
One engine per process: vLLM's parallel state is process-global.

Block-FP8 weights (``rollout.quantization: fp8``, :mod:`megarl.models.fp8`): the config carries vLLM's
serialized-FP8 ``quantization_config`` (``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic
activations), so vLLM creates every linear weight as E4M3 with its ``weight_scale_inv`` (no bf16 copy), and
DeepGEMM is off (``VLLM_USE_DEEP_GEMM=0``) so that these tensors stay as created (see
:mod:`megarl.models.fp8`); the reshard quantises the actor's shards into them
(:func:`~megarl.models.layout_vllm.vllm_layout` with ``quantization="fp8"``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from megarl.config import QUANTIZATIONS
from megarl.config.rollout import LOGPROBS_SOURCES
from megarl.kernels.batch_invariant import BATCH_INVARIANT_ENV, EXACT_KV_BLOCK_SIZE
from megarl.models.fp8 import BLOCK
from megarl.models.layout import Layout, local_views
from megarl.models.layout_vllm import check_vllm_fp8, check_vllm_rope, check_vllm_tp, vllm_layout, vllm_rank_tensors
from megarl.models.spec import FAMILIES, ModelSpec, SpecError
from megarl.parallel.mesh import init_distributed
from megarl.rollout.base import (
    Completion,
    RolloutError,
    RolloutOutput,
    Sample,
    SamplingConfig,
    WriteFn,
    check_prompts,
    check_ready,
    sample_rows,
    sample_seed,
)
from megarl.rollout.vllm_logprobs import OutputLogprobs, SampledLogprobs

log = logging.getLogger(__name__)

# Set before vllm is imported (vllm.envs reads them): in-process engine core (the model is reachable here and
# external_launcher needs deterministic in-process scheduling), no FlashInfer sampler JIT (nothing to download
# on the GPU machine), offline, no usage reports; NVLink SHARP (NVLS) off for NCCL (GPU.md).
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "NCCL_NVLS_ENABLE": "0"}
FINISH_REASONS = ("stop", "length")
# Architectures vLLM 0.24 runs on its V1 model runner (not in its DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES) that megarl
# runs on V2 when rollout.model_runner is null: measured faster there on an H100 (perf/RESULTS.md: the 1.5B case's
# generation 3.11 s on V2 against 4.92 s on V1 with the sampler's log-probs; the step 8.91 s against 9.96 s) and
# with the same rollout-vs-trainer log-prob difference.
V2_RUNNER_ARCHITECTURES = frozenset({"Qwen2ForCausalLM"})
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks (0.24.0)


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM 0.24 knobs of generation speed and weights format, one field per ``rollout.*`` field of the same
    name (validated there, :class:`megarl.config.RolloutConfig`); None leaves vLLM's own default, except where an
    attribute below says otherwise (``model_runner``, ``logprobs``).

    Attributes:
        model_runner: "v1" or "v2" (``VLLM_USE_V2_MODEL_RUNNER``); None: V2 for the architectures of
            :data:`V2_RUNNER_ARCHITECTURES` (Qwen2), V1 with ``exact``, else vLLM's choice for the architecture (V2
            for Llama, Mistral, Qwen3; V1 where V2 lacks a feature, such as routed-experts capture).
        async_scheduling: vLLM's async scheduler (schedule step n + 1 while step n runs on the GPU; two batches
            in flight); None: vLLM's default, which is on for this engine (the external launcher is a
            ``UniProcExecutor``, which supports it).
        max_num_seqs: sequences decoded at once; None: 1024 on an H200 (vLLM's default for the offline
            ``LLM`` on GPUs of >= 70 GiB; 256 on smaller ones).
        max_num_batched_tokens: tokens per engine step (prefill chunks); None: 16384 on an H200 (8192 on GPUs
            under 70 GiB).
        kv_cache_memory_bytes: the KV cache, bytes; None: what ``gpu_memory_utilization`` leaves after vLLM's
            start-up memory profile (which a set value skips: ``rollout.kv_cache_memory_bytes``).
        cudagraph_capture_sizes: batch sizes captured as CUDA graphs (``compilation_config``); None: vLLM's
            1, 2, 4, 8, ..., 248 by 8, then by 16 up to ``max_cudagraph_capture_size``.
        max_cudagraph_capture_size: the largest captured batch; None: ``min(2 * max_num_seqs, 512)`` (a decode
            batch above it runs without graphs).
        request_seeds: seed every request (:func:`~megarl.rollout.base.sample_seed`: samples independent of
            batching); False: vLLM's generator, seeded once by ``run.seed`` (samples then depend on the batch).
        quantization: None (the model dtype) or "fp8" (block-FP8 weights, module docstring).
        kv_cache_dtype: None (the model dtype) or "fp8" (vLLM's FP8 KV cache, ``rollout.kv_cache_dtype``).
        logprobs: "output" (vLLM's ``logprobs=0`` output) or "sampler" (the same values from vLLM's sampler on the
            GPU, :mod:`megarl.rollout.vllm_logprobs`), in ``generate`` and request by request; None: "sampler",
            and "output" where the model runner lacks the sampler's hooks (a vLLM other than 0.24.0).
        exact: vLLM's batch-invariant mode (``rollout.exact``: :data:`~megarl.kernels.batch_invariant.
            BATCH_INVARIANT_ENV`; vLLM then picks a batch-invariant attention backend, one KV split, no cascade
            attention, no custom all-reduce).
    """

    model_runner: str | None = None
    async_scheduling: bool | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    request_seeds: bool = True
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    logprobs: str | None = None
    exact: bool = False

    @classmethod
    def from_config(cls, rollout) -> "VLLMSettings":
        """The settings of a :class:`megarl.config.RolloutConfig` (its fields of the same names)."""
        values = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(cls)}
        if values["cudagraph_capture_sizes"] is not None:
            values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """The fields as JSON-able values (for a child process, :mod:`megarl.bench.vllm_standalone`)."""
        return dataclasses.asdict(self)

    def environment(self, architecture: str | None = None) -> dict[str, str]:
        """The variables vLLM must see (set before it is imported) for a model of ``architecture`` (a Hugging
        Face ``architectures[0]``; None: unknown): the model runner (V1 with ``exact``, whatever the architecture's
        default: vLLM 0.24 picks V2 for Llama, Mistral and Qwen3, whose sampler is another log-prob kernel; V2 for
        :data:`V2_RUNNER_ARCHITECTURES`); DeepGEMM off for FP8; the batch-invariant mode (``exact``)."""
        env = dict(BATCH_INVARIANT_ENV) if self.exact else {}
        runner = self.model_runner or ("v1" if self.exact else  # exact: V1's sampler (vllm_logprobs)
                                       "v2" if architecture in V2_RUNNER_ARCHITECTURES else None)
        if runner is not None:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        if self.quantization == "fp8":
            env["VLLM_USE_DEEP_GEMM"] = "0"
        return env


def llm_kwargs(settings: VLLMSettings, *, model_dir: str, context: int, seed: int, enforce_eager: bool,
               gpu_memory_utilization: float) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of megarl's engines, shared by the rollout engine and the standalone
    baseline of ``megarl bench step`` (which adds the rollout engine's ``tensor_parallel_size``,
    ``distributed_executor_backend`` and ``enable_sleep_mode``): the model directory of :func:`write_model_dir`
    with dummy weights and no tokenizer, bf16, sampled-token log-probs of the processed distribution
    (:mod:`megarl.rollout.sampler`), the prefix cache on (multi-turn episodes reuse it), and the knobs of
    ``settings`` that are not None; ``exact`` with torch.compile (not ``enforce_eager``) keeps vLLM's custom ops
    on, whose CUDA paths are the batch-invariant kernels (``vllm/model_executor/layers/layernorm.py``)."""
    kwargs: dict[str, Any] = dict(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
                                  enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                                  seed=seed, max_model_len=context, logprobs_mode="processed_logprobs",
                                  enable_prefix_caching=True)  # exact: the KV page the trainer's attention reads
    kwargs.update({"block_size": EXACT_KV_BLOCK_SIZE} if settings.exact else {})  # (kernels.batch_invariant)
    for name in ("async_scheduling", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
                 "kv_cache_memory_bytes"):
        if getattr(settings, name) is not None:
            kwargs[name] = getattr(settings, name)
    compilation = {name: list(v) if isinstance(v, tuple) else v
                   for name in ("cudagraph_capture_sizes", "max_cudagraph_capture_size")
                   if (v := getattr(settings, name)) is not None}
    if settings.exact and not enforce_eager:  # compiled, vLLM's RMSNorm, rotary and SiLU-and-mul ops would be
        compilation["custom_ops"] = ["all"]   # Inductor's fusions; the batch-invariant kernels are the custom ops'
    if compilation:
        kwargs["compilation_config"] = compilation
    return kwargs


def write_model_dir(spec: ModelSpec, path: str | os.PathLike, quantization: str | None = None) -> None:
    """Write the engine's model directory: ``spec``'s config.json and, for ``quantization="fp8"``, vLLM's
    serialized block-FP8 ``quantization_config`` (``vllm/model_executor/layers/quantization/fp8.py``:
    ``Fp8Config.from_config`` reads ``quant_method``, ``activation_scheme``, ``weight_block_size``)."""
    config = spec.to_hf_config()
    if quantization == "fp8":
        config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK], "fmt": "e4m3"}
    config.save_pretrained(str(path))


def prepare_environment(rank: int, local_rank: int, settings: VLLMSettings | None = None,
                        architecture: str | None = None) -> None:
    """Set :data:`VLLM_ENV`, the variables of ``settings`` for a model of ``architecture``
    (:meth:`VLLMSettings.environment`) and the ``RANK`` / ``LOCAL_RANK`` that vLLM's external launcher reads.

    ``VLLM_ENABLE_V1_MULTIPROCESSING``, the two ranks and the settings' variables are forced (the engine cannot
    work otherwise, or would not be what was asked); the other variables keep a value the user set.
    """
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", RANK=str(rank), LOCAL_RANK=str(local_rank),
                      **(settings or VLLMSettings()).environment(architecture))


def join_engine_construction(tp: int) -> None:
    """On a rank outside the rollout pool, take part in the world-wide steps of the engines' construction
    (:class:`VLLMRolloutEngine` on the pool's ranks, at the same time), read in vLLM 0.24.0's source:
    ``init_distributed_environment`` and ``initialize_model_parallel`` create every group with
    ``torch.distributed.new_group`` over the world (collective on every rank, members or not), and
    ``ExecutorWithExternalLauncher.determine_available_memory`` takes the minimum KV-cache budget over the
    world's CPU group (this rank offers no limit). The groups are laid out as the engines' ranks lay them out
    (``arange(world).reshape(-1, dp=1, pp=1, pcp=1, tp)``), so the rollout pool's engines are whole TP blocks
    when the pool is a run of whole blocks of ``tp`` ranks.

    Raises:
        RolloutError: no CUDA device. ImportError: vllm is not installed.
    """
    if not torch.cuda.is_available():
        raise RolloutError("the vLLM engine needs a CUDA GPU; use rollout.engine=hf on a CPU machine")
    rank = dist.get_rank()
    prepare_environment(rank, torch.cuda.current_device())
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized, get_world_group,
                                                 init_distributed_environment)

    init_distributed_environment(world_size=dist.get_world_size(), rank=rank, local_rank=torch.cuda.current_device(),
                                 backend="nccl")
    ensure_model_parallel_initialized(tp, 1)
    budget = torch.tensor([torch.iinfo(torch.int64).max], dtype=torch.int64)
    dist.all_reduce(budget, group=get_world_group().cpu_group, op=dist.ReduceOp.MIN)


def request_params(prompt: Sequence[int], sampling: SamplingConfig, *, context: int, stop_token_ids: list[int],
                   seed: int | None, logprobs: bool = True) -> dict[str, Any]:
    """The ``vllm.SamplingParams`` keyword arguments of one sample of ``prompt`` (``seed`` None: vLLM's generator).

    ``n=1``; temperature 0 is greedy in vLLM too; top-k -1 (off) becomes vLLM's 0 (off); ``max_tokens`` is
    ``min(sampling.max_new_tokens, context - len(prompt))`` tokens; ``logprobs=0`` returns the sampled token's
    log-prob alone (``logprobs=False``: None, vLLM returns none: :mod:`megarl.rollout.vllm_logprobs` takes them);
    no detokenisation (there is no tokenizer).
    """
    return dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=0 if sampling.top_k == -1 else sampling.top_k,
                max_tokens=min(sampling.max_new_tokens, context - len(prompt)), stop_token_ids=stop_token_ids,
                seed=seed, logprobs=0 if logprobs else None, detokenize=False)


def completion_to_sample(completion, prompt_index: int, sample_index: int, adapter_version: int | None = None,
                         routes: torch.Tensor | None = None, policy_version: int | None = None,
                         logprobs=None) -> Sample:
    """A :class:`~megarl.rollout.base.Sample` from a vLLM ``CompletionOutput`` (``token_ids``, ``logprobs``:
    one ``{token id: Logprob}`` per token, ``finish_reason``), sampled with LoRA adapters ``adapter_version``
    by the weights of ``policy_version``, with its ``routes`` (:func:`completion_routes`; None: none recorded);
    ``logprobs`` (a float32 numpy array, one per token: :class:`~megarl.rollout.vllm_logprobs.SampledLogprobs`)
    replaces the output's.

    Raises:
        RolloutError: a finish reason other than "stop" / "length" (an aborted or failed request), or
            log-probs missing for some tokens.
    """
    tokens = tuple(int(t) for t in completion.token_ids)
    reason = completion.finish_reason
    if reason not in FINISH_REASONS:
        raise RolloutError(f"vLLM request for prompt {prompt_index} sample {sample_index} ended with "
                           f"finish_reason={reason!r}, expected one of {FINISH_REASONS}")
    given = logprobs is not None
    logprobs = logprobs if given else completion.logprobs or []
    if len(logprobs) != len(tokens):
        raise RolloutError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens (prompt "
                           f"{prompt_index} sample {sample_index})")
    values = (torch.from_numpy(logprobs).to(torch.float32) if given else
              torch.tensor([position[t].logprob for position, t in zip(logprobs, tokens)], dtype=torch.float32))
    return Sample(prompt_index, sample_index, tokens, values, reason, adapter_version, routes, policy_version)


def completion_routes(completion, prompt_len: int, spec: ModelSpec) -> torch.Tensor:
    """The :attr:`~megarl.rollout.base.Sample.routed_experts` of a finished vLLM ``CompletionOutput`` of a
    ``prompt_len``-token prompt: its ``routed_experts`` (module docstring: ``[prompt_len + len(token_ids) - 1,
    num_layers, moe_top_k]`` uint8/uint16, the same rows) as int16 (:data:`~megarl.models.router_replay.
    ROUTES_DTYPE`).

    Raises:
        RolloutError: no routes (the engine was started without ``enable_return_routed_experts``) or routes of
            another shape.
    """
    routes = completion.routed_experts
    want = (prompt_len + len(completion.token_ids) - 1, spec.num_layers, spec.moe_top_k)
    if routes is None or tuple(routes.shape) != want:
        raise RolloutError(f"vLLM returned routed_experts of shape {None if routes is None else routes.shape}, "
                           f"expected {want} (prompt + response tokens - 1, layers, top_k)")
    return torch.from_numpy(routes.astype("int16"))


def request_output_to_completion(output, policy_version: int | None = None, spec: ModelSpec | None = None,
                                 logprobs=None) -> Completion:
    """A :class:`~megarl.rollout.base.Completion` from a finished vLLM ``RequestOutput`` of one request
    (``outputs[0]``: its only sample; ``num_cached_tokens``: prompt tokens found in the prefix cache), sampled
    by the weights of ``policy_version``; with ``spec`` (an engine recording routes) its routes
    (:func:`completion_routes` of the request's prompt); ``logprobs`` as for :func:`completion_to_sample`.

    Raises:
        RolloutError: as :func:`completion_to_sample` (an aborted request, missing log-probs) and
            :func:`completion_routes`.
    """
    sample = completion_to_sample(output.outputs[0], -1, 0, logprobs=logprobs)
    routes = None if spec is None else completion_routes(output.outputs[0], len(output.prompt_token_ids), spec)
    return Completion(output.request_id, sample.token_ids, sample.logprobs, sample.finish_reason,
                      int(output.num_cached_tokens or 0), policy_version, routes)


class VLLMRolloutEngine:
    """A :class:`~megarl.rollout.base.RolloutEngine` running vLLM 0.24.0 (bf16) on this rank's GPU.

    Args:
        spec: the model (Llama, Mistral or Qwen2 family).
        tp: vLLM tensor parallelism; engine ``k`` is world ranks ``[k * tp, (k + 1) * tp)``; must divide the
            world size.
        gpu_memory_utilization: fraction of the GPU's total memory that vLLM may use (weights, activations
            and KV cache), in (0, 1]; that much must be free when the engine starts (vLLM raises otherwise).
        enforce_eager: no CUDA graphs and no torch.compile (starts faster; False decodes faster).
        max_model_len: context length of the engine (prompt + response), tokens, in [2,
            ``spec.max_position_embeddings``]; None = ``spec.max_position_embeddings``.
        seed: vLLM's global seed (it seeds Python's, numpy's and torch's global RNGs at construction).
        lora_rank: start vLLM's LoRA layers for adapters of this rank (module docstring); 0 = none.
        settings: the vLLM knobs of :class:`VLLMSettings` (default: vLLM's defaults, seeded requests, bf16).
        record_routes: return every sample's routed experts (``Sample.routed_experts``; module docstring), for
            router replay; an MoE model only.

    Attributes:
        spec: the model, with ``max_position_embeddings`` cut to ``max_model_len``: the context that prompts
            are checked against (:func:`~megarl.rollout.data_parallel.generate_data_parallel` reads it).
        tp / tp_rank: the engine's TP size and this rank's place in it.
        settings: the :class:`VLLMSettings`.
        llm: the ``vllm.LLM``.
        model: vLLM's model on this rank (its parameters are the engine's weights, written in place).
        calls: ``generate`` calls so far; part of every sample's seed, so a resumed run restores it.
        adapter_version: the LoRA adapters' version its weights (merged) or its LoRA layers hold; None without.
        policy_version: the version of the policy weights it holds (None until set), stamped on every sample and
            completion.
        record_routes: whether samples (and completions) carry their routed experts.

    Raises:
        RolloutError: no CUDA device, bad sizes, a LoRA rank above vLLM's largest, ``record_routes`` for a dense
            model, or vLLM's TP group is not the expected block of ranks.
        SpecError: the model does not split at TP=``tp`` (:func:`~megarl.models.layout_vllm.check_vllm_tp`; with FP8
            :func:`~megarl.models.layout_vllm.check_vllm_fp8`), its RoPE is not what vLLM builds for its family
            (:func:`~megarl.models.layout_vllm.check_vllm_rope`), or vLLM's parameter names or shapes differ from
            :func:`~megarl.models.layout_vllm.vllm_rank_tensors`.
        ImportError: vllm is not installed.
    """

    def __init__(self, spec: ModelSpec, *, tp: int = 1, gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, max_model_len: int | None = None, seed: int = 0, lora_rank: int = 0,
                 settings: VLLMSettings | None = None, record_routes: bool = False):
        if not torch.cuda.is_available():
            raise RolloutError("the vLLM engine needs a CUDA GPU; use rollout.engine=hf on a CPU machine")
        if not 0 < gpu_memory_utilization <= 1:
            raise RolloutError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        context = spec.max_position_embeddings if max_model_len is None else max_model_len
        if not 2 <= context <= spec.max_position_embeddings:
            raise RolloutError(f"max_model_len must be in [2, {spec.max_position_embeddings}] (the model's "
                               f"max_position_embeddings), got {max_model_len}")
        self.settings = settings = settings or VLLMSettings()
        if settings.logprobs not in (None, *LOGPROBS_SOURCES):
            raise RolloutError(f"logprobs must be None or one of {LOGPROBS_SOURCES}, got {settings.logprobs!r}")
        if settings.quantization is not None and settings.quantization not in QUANTIZATIONS:
            raise RolloutError(f"quantization must be null or one of {QUANTIZATIONS}, got {settings.quantization!r}")
        check_vllm_rope(spec)
        if settings.quantization == "fp8":
            check_vllm_fp8(spec, tp)
        else:
            check_vllm_tp(spec, tp)
        if record_routes and not spec.is_moe:
            raise RolloutError(f"record_routes needs a mixture-of-experts model; a {spec.family} model routes no "
                               "tokens")
        self.record_routes = record_routes
        extra = {"enable_return_routed_experts": True} if record_routes else {}
        if lora_rank:
            fits = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
            if not fits:
                raise RolloutError(f"vLLM 0.24 serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {lora_rank}; use "
                                   "actor.lora.sync=merged")
            extra.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
        init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        if world % tp:
            raise RolloutError(f"vLLM tp={tp} does not divide the world size {world}")
        architecture = FAMILIES[spec.family].hf_architecture
        prepare_environment(rank, torch.cuda.current_device(), settings, architecture)
        import vllm
        from vllm.distributed.parallel_state import get_tp_group

        from megarl.rollout import vllm_models

        vllm_models.register(architecture)  # Qwen3.5 text models: vLLM 0.24 registers only its vision-language ones

        self.spec = spec.replace(max_position_embeddings=context)
        self.tp, self.tp_rank = tp, rank % tp
        self._config_dir = tempfile.TemporaryDirectory(prefix="megarl-vllm-")
        write_model_dir(spec, self._config_dir.name, settings.quantization)
        self.llm = vllm.LLM(**llm_kwargs(settings, model_dir=self._config_dir.name, context=context, seed=seed,
                                         enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization),
                            enable_sleep_mode=True, tensor_parallel_size=tp,
                            distributed_executor_backend="external_launcher", **extra)
        group = get_tp_group().ranks
        first = rank - self.tp_rank
        if list(group) != list(range(first, first + tp)):
            raise RolloutError(f"vLLM put rank {rank} in the TP group {group}, expected ranks "
                               f"[{first}, {first + tp}) (consecutive blocks of tp={tp})")
        self._runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        self.model = self._runner.get_model()
        v2 = bool(self.llm.llm_engine.vllm_config.use_v2_model_runner)
        self._logprobs = self._logprob_source(settings.logprobs, v2)
        self._params = {n.replace(".base_layer.", "."): p.detach()  # LoRA layers wrap the base (module docstring)
                        for n, p in self.model.named_parameters()}  # fused experts viewed 2-D:
        self._params = local_views(self._params, self._rank_tensors())
        self._check_parameters()
        self.calls = 0
        self.adapter_version: int | None = None
        self.policy_version: int | None = None
        self._lora_request = None  # the adapters' request once update_adapters ran
        self._has_weights = False
        self._asleep = False
        self._cache_empty = True  # nothing generated since the last prefix-cache reset

    @property
    def has_weights(self) -> bool:
        """Whether the engine holds weights (written since its start or its last level-2 sleep)."""
        return self._has_weights

    @property
    def logprobs_source(self) -> str:
        """Where this engine reads the rollout log-probs: "sampler" (requests ask vLLM for none) or "output"
        (requests ask ``logprobs=0``), :attr:`VLLMSettings.logprobs` resolved."""
        return "output" if self._logprobs.asks_vllm else "sampler"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def _logprob_source(self, asked: str | None, v2: bool) -> SampledLogprobs | OutputLogprobs:
        """The rollout log-probs' source (:attr:`VLLMSettings.logprobs`): the sampler's capture, or vLLM's output
        where ``asked`` is "output", or is None and the model runner lacks the capture's hooks (logged once).

        Raises:
            RolloutError: ``asked`` is "sampler" and the model runner lacks the hooks.
        """
        if asked == "output":
            return OutputLogprobs()
        try:
            return SampledLogprobs(self._runner, v2=v2)
        except RolloutError as e:
            if asked == "sampler":
                raise
            log.warning("rollout log-probs from vLLM's output, not its sampler (rollout.logprobs: null): %s", e)
            return OutputLogprobs()

    def _rank_tensors(self):
        return vllm_rank_tensors(self.spec, self.tp, self.tp_rank, self.settings.quantization)

    def _check_parameters(self) -> None:
        """Raise SpecError where vLLM's parameters (names, shapes) differ from this rank's layout entry."""
        have = {n: tuple(p.shape) for n, p in self._params.items()}
        want = {n: lt.shape for n, lt in self._rank_tensors().items()}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))
            raise SpecError(f"vLLM's parameters on TP rank {self.tp_rank} differ from megarl's vLLM layout "
                            f"(name, shape) in one but not the other: {diff[:6]}")

    # ------------------------------------------------------------------ weights and memory
    def weight_layout(self, ranks: Iterable[int]) -> Layout:
        """vLLM's TP shards on ``ranks`` (:func:`~megarl.models.layout_vllm.vllm_layout`, block-FP8 with
        ``settings.quantization``): engine ``k`` is ``ranks[k*tp:(k+1)*tp]``; with tied embeddings there is no
        ``lm_head.weight``."""
        return vllm_layout(self.spec, self.tp, ranks, self.settings.quantization)

    def update_weights(self, write: WriteFn) -> Any:
        """Call ``write({name: parameter})`` on this rank's vLLM parameters (bf16, on this GPU; with FP8 the
        linear weights E4M3 and their float32 ``weight_scale_inv``), written in place, then drop the prefix cache
        (its KV entries were computed with the old weights).

        Returns:
            What ``write`` returns (e.g. the reshard executor's stats).

        Raises:
            RolloutError: the engine is asleep (call :meth:`wake_up` first), or vLLM could not reset its
                prefix cache.
        """
        if self._asleep:
            raise RolloutError("update_weights on a sleeping engine: call wake_up() first")
        result = write(self._params)
        if not self._cache_empty:
            self._reset_prefix_cache()
        self._has_weights = True
        return result

    def update_adapters(self, adapters: dict[str, torch.Tensor], lora, *, version: int) -> None:
        """Serve the LoRA adapters ``adapters`` (whole canonical factors by name,
        :func:`~megarl.models.layout_lora.adapter_layout`; this rank's copy) from now on, as adapter version ``version``
        (module docstring); the previous version is dropped, and so is the prefix cache.

        Raises:
            RolloutError: the engine was started without LoRA (``lora_rank=0``) or is asleep.
        """
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        from megarl.models.peft import adapter_config, peft_tensors

        manager = getattr(self._runner, "lora_manager", None)
        if manager is None:
            raise RolloutError("update_adapters on an engine started without LoRA layers (lora_rank=0)")
        if self._asleep:
            raise RolloutError("update_adapters on a sleeping engine: call wake_up() first")
        helper = PEFTHelper.from_dict({**adapter_config(self.spec, lora, None),
                                       "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = LoRAModel.from_lora_tensors(version + 1, peft_tensors(self.spec, lora, adapters), helper,
                                            device="cpu", dtype=manager.lora_config.lora_dtype,
                                            model_vocab_size=manager.vocab_size,
                                            weights_mapper=getattr(self.model, "hf_to_vllm_mapper", None))
        adapters_of = manager._adapter_manager
        adapters_of.remove_all_adapters()
        adapters_of.add_adapter(model)
        adapters_of.activate_adapter(model.id)
        self._lora_request = LoRARequest(f"megarl-v{version}", version + 1, lora_path="megarl-in-memory")
        self.adapter_version = version
        if not self._cache_empty:
            self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        """Drop vLLM's prefix cache. Its cost grows with the number of KV-cache blocks, not with the model
        (vLLM's ``BlockPool.reset_prefix_cache`` visits every block in Python): ~0.45 s on an H200 for the
        tiny model of ``perf/gpu_vllm.sh`` (256 bytes of KV per token: ~10M blocks at
        ``gpu_memory_utilization=0.3``), a few ms for real models; done at wake-up, so ``time/reshard`` counts
        the weights alone."""
        if not self.llm.reset_prefix_cache():
            raise RolloutError("vLLM could not reset its prefix cache after the weight update (requests "
                               "still running?); its cached KV would belong to the old weights")
        self._cache_empty = True

    def sleep(self, level: int = 1) -> None:
        """Give GPU memory back for the training phase (vLLM sleep mode; a sleeping engine stays asleep).

        Level 1 drops the KV cache and moves the weights to CPU (restored by :meth:`wake_up`); level 2 drops
        both, and :meth:`update_weights` must run after :meth:`wake_up`.

        Raises:
            RolloutError: a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise RolloutError(f"sleep level must be 1 (KV cache; weights to CPU) or 2 (KV cache and weights), "
                               f"got {level}")
        if self._asleep:
            return
        self.llm.sleep(level=level)
        if level == 2:
            self._has_weights = False
        self._asleep = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: GPU memory back (weights restored after level 1, uninitialised after level 2).
        The blocks torch's caching allocator still holds from the training passes (their activations) go back to
        the driver first (``empty_cache``, as verl does before its wake-up), so that vLLM's pool can map them."""
        if self._asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self._reset_prefix_cache()  # its KV is stale: new weights come next (see _reset_prefix_cache)
        self._asleep = False

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_offset: int = 0) -> RolloutOutput:
        """Sample ``sampling.n`` responses per prompt (see :meth:`~megarl.rollout.base.RolloutEngine.generate`).

        A response ends at the first token of ``spec.eos_token_ids`` or ``sampling.stop_token_ids`` (finish
        "stop", the token kept with its log-prob), or after ``min(max_new_tokens, max_model_len - prompt
        length)`` tokens (finish "length"). All ranks of one engine (TP group) must call this together with the
        same arguments.

        Returns:
            Prompt-major samples: ``samples[k * n + j]`` is sample ``j`` of prompt ``prompt_offset + k``;
            log-probs float32 on CPU.

        Raises:
            RolloutError: a bad prompt (:func:`~megarl.rollout.base.check_prompts` against ``max_model_len``),
                a sleeping engine, no weights loaded yet (:meth:`update_weights`), or a request that vLLM
                aborted.
        """
        from vllm import SamplingParams, TokensPrompt

        check_ready(self._asleep, self._has_weights)
        context = self.spec.max_position_embeddings
        prompts = check_prompts(prompt_token_ids, max_context=context, vocab_size=self.spec.vocab_size)
        call, self.calls = self.calls, self.calls + 1
        self._cache_empty = False  # this call's prompts are cached now
        start = time.perf_counter()
        stop = sorted(set(self.spec.eos_token_ids) | set(sampling.stop_token_ids))
        rows, seeded = sample_rows(len(prompts), sampling.n), self.settings.request_seeds
        params = [SamplingParams(**request_params(prompts[k], sampling, context=context, stop_token_ids=stop,
                                                  seed=sample_seed(sampling.seed, call, prompt_offset + k, j)
                                                  if seeded else None, logprobs=self._logprobs.asks_vllm))
                  for k, j in rows]
        request, version = self._lora_request, self.adapter_version  # one version for the whole call

        def run() -> list:
            return self.llm.generate([TokensPrompt(prompt_token_ids=prompts[k]) for k, _ in rows], params,
                                     use_tqdm=False, lora_request=request) if rows else []
        outputs, values = self._logprobs.run(run, [len(prompts[k]) for k, _ in rows])
        samples = [completion_to_sample(out.outputs[0], prompt_offset + k, j, version,
                                        completion_routes(out.outputs[0], len(prompts[k]), self.spec)
                                        if self.record_routes else None, self.policy_version, logprobs)
                   for (k, j), out, logprobs in zip(rows, outputs, values)]
        return RolloutOutput.collect(samples, sampling.n, prompts, time.perf_counter() - start)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingConfig,
                    seed: int) -> None:
        """Hand one request to vLLM's ``LLMEngine`` (module docstring; :class:`~megarl.rollout.base.
        RequestEngine`); it decodes from the next :meth:`step` on, beside the requests already running.

        Raises:
            RolloutError: ``sampling.n != 1``, a bad prompt, a sleeping engine or no weights.
        """
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        check_ready(self._asleep, self._has_weights)
        if sampling.n != 1:
            raise RolloutError(f"add_request takes one sample per request (sampling.n=1), got n={sampling.n}")
        context = self.spec.max_position_embeddings
        prompt = check_prompts([prompt_token_ids], max_context=context, vocab_size=self.spec.vocab_size)[0]
        self._cache_empty = False
        stop = sorted(set(self.spec.eos_token_ids) | set(sampling.stop_token_ids))
        params = SamplingParams(**request_params(prompt, sampling, context=context, stop_token_ids=stop, seed=seed,
                                                 logprobs=self._logprobs.asks_vllm),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        self._logprobs.add(request_id, len(prompt), params.max_tokens, lambda: self.llm.llm_engine.add_request(
            request_id, tokens_input(prompt), params, lora_request=self._lora_request))

    def step(self) -> list[Completion]:
        """One iteration of vLLM's scheduler; the requests that finished in it."""
        spec = self.spec if self.record_routes else None
        return [request_output_to_completion(out, self.policy_version, spec, values)
                for out, values in self._logprobs.step(self.llm.llm_engine.step)]

    def has_unfinished_requests(self) -> bool:
        """Whether vLLM holds a request that has not finished."""
        return self.llm.llm_engine.has_unfinished_requests()
