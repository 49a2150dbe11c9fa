"""A fake ``vllm`` (0.24.0's surface that :mod:`megarl.rollout.vllm_engine` uses) for CPU tests of the data flow
around vLLM engines of TP > 1 in a gloo world: no GPU, no model forward (but for the routed experts, below).

Like ``vllm.LLM(distributed_executor_backend="external_launcher")``, an :class:`LLM` joins the torch.distributed
world as consecutive TP groups of ``tensor_parallel_size`` ranks and holds this rank's TP shard of every
parameter (names and shapes of :func:`megarl.models.layout_vllm.vllm_rank_tensors`, zero until written). Its
:meth:`LLM.generate` does what a TP engine needs of its ranks and what the tests check:

- every rank of the TP group must make the call with the same requests (checked with one all-gather over the
  group; a rank with other requests raises, as a real engine would hang or diverge);
- the engine's model is the union of its ranks' shards: they are all-gathered over the group and assembled
  into the canonical (HF) tensors, and a replicated block (KV heads where TP > KV heads) must agree on every
  rank holding it;
- the sampled tokens are a deterministic function of the assembled weights (:func:`fingerprint`), the prompt
  and the request's seed (:func:`fake_completion`), so the ranks of one engine return the same samples and
  an engine with any wrong weight returns other ones.

Request by request, like 0.24.0's ``LLMEngine`` (``llm.llm_engine``: ``add_request(request_id, tokens_input(ids),
params)``, ``step()``, ``has_unfinished_requests()``): a request's completion is the same function of the weights,
prompt and seed, produced by the continuous batching of :class:`vllm.runners.Batch` (requests joining between
steps, at most 3 running, chunked prefill, a preemption, a row past the stop), whose rows go to the model runner's
sampler step by step (what ``rollout.logprobs: sampler`` reads; the output carries log-probs only if asked), returned
the step its last token is sampled with ``RequestOutputKind.FINAL_ONLY`` (all that megarl asks for), with
``num_cached_tokens``: the longest run of whole 16-token blocks of its prompt that an earlier request's prompt and
output began with (vLLM's prefix cache hashes full blocks and always computes the last prompt token).
``add_request`` returns vLLM's internal id (the id, '-' and 8 characters).

With ``enable_return_routed_experts`` (an MoE model), :meth:`LLM.generate`'s completions carry vLLM's
``routed_experts`` (:func:`fake_routes`): the experts that the transformers model of the assembled weights routes
each token to.

Its constructor takes the ``vllm.LLM`` keyword arguments megarl passes and nothing else (vLLM's ``EngineArgs``
refuses unknown ones too), checks their types as vLLM's configs do, and, when config.json carries vLLM's
serialized block-FP8 ``quantization_config`` (``weight_block_size: [128, 128]``), holds the linear weights as
E4M3 with float32 ``weight_scale_inv`` (the model is then assembled from their dequantised values) and requires
``VLLM_USE_DEEP_GEMM=0`` (megarl's condition for those tensors staying as created, megarl.models.fp8).

:func:`install` puts this package first on ``sys.path`` and lets :class:`~megarl.rollout.vllm_engine.
VLLMRolloutEngine` start without CUDA (it checks for a GPU before importing vllm).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

__version__ = "0.24.0+fake"

_TP_GROUP = None  # the group of the LLM built last (vLLM's parallel state is process-global too)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: Any = None
    ignore_eos: bool = False  # the EOS token of the model's config stops nothing; stop_token_ids still do


def TokensPrompt(prompt_token_ids):  # noqa: N802 (vLLM's name: a TypedDict)
    return {"prompt_token_ids": list(prompt_token_ids)}


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list
    logprobs: list
    finish_reason: str
    routed_experts: Any = None  # numpy [prompt + response tokens - 1, layers, top_k] with enable_return_routed_experts


@dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list
    request_id: str = ""
    finished: bool = True
    num_cached_tokens: int = 0


BLOCK_SIZE = 16  # tokens of one KV-cache block (vLLM's default on CUDA)


def fingerprint(canonical: dict[str, torch.Tensor]) -> int:
    """An int of the canonical tensors' names and values (as float32), stable across processes."""
    h = hashlib.sha256()
    for name in sorted(canonical):
        h.update(name.encode())
        h.update(canonical[name].detach().float().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def fake_completion(weights: int, prompt: list[int], params: SamplingParams, vocab_size: int) -> CompletionOutput:
    """The engine's "sampling": tokens and log-probs drawn from a generator seeded by the weights' fingerprint,
    the prompt and the request's seed; the response ends at a stop token (kept, finish "stop") or after
    ``max_tokens`` (finish "length")."""
    seed = int.from_bytes(hashlib.sha256(repr((weights, tuple(prompt), params.seed)).encode()).digest()[:7], "little")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (params.max_tokens,), generator=g).tolist()
    values = (-torch.rand(params.max_tokens, generator=g) * 3).tolist()
    reason = "length"
    for i, t in enumerate(tokens):
        if t in params.stop_token_ids:
            tokens, values, reason = tokens[:i + 1], values[:i + 1], "stop"
            break
    return CompletionOutput(tokens, [{t: Logprob(v)} for t, v in zip(tokens, values)], reason)


def fake_routes(model, prompt: list[int], tokens: list[int], num_experts: int, top_k: int):
    """vLLM 0.24.0's ``CompletionOutput.routed_experts`` of a finished request (``vllm/outputs.py``), with the
    experts that ``model`` (the transformers model of the engine's weights) routes the sequence's tokens to,
    teacher forced, top-k in descending score order like vLLM's ``select_experts``.

    What vLLM returns: the output processor concatenates the request's chunks (``vllm/v1/engine/
    output_processor.py``: ``_new_completion_output``, ``np.concatenate(self.routed_experts_chunks, axis=0)``), which
    the scheduler emits (``vllm/v1/core/sched/scheduler.py``: ``update_from_output``) as the whole prompt's rows at
    the step its prefill completes (``RoutedExpertsManager.get(block_ids, request.num_prompt_tokens)``), then one row
    per decode step, that of the token the step ran (``routing_data[end - len(new_token_ids):end]``: the previous
    sampled token; the last one is never run); ``[tokens, num_hidden_layers, top_k]``, uint8 for at most 256
    experts, else uint16 (``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``:
    ``RoutedExpertsManager``, ``expert_id_dtype``).
    """
    import numpy as np

    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits  # per layer [T, experts]
    rows = torch.stack([lg.topk(top_k, dim=-1).indices for lg in logits], dim=1)  # the prompt's, then one a step
    return rows.numpy().astype(np.uint8 if num_experts <= 256 else np.uint16)


class _Model:
    """This rank's parameters, reachable as ``llm.llm_engine.model_executor.driver_worker.worker.model_runner
    .get_model()`` like vLLM's model object (``driver_worker`` and ``worker`` are itself; ``model_runner`` is set
    by :class:`_LLMEngine`)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())

    def get_model(self):
        return self

    def __getattr__(self, name):  # llm_engine.model_executor.driver_worker.worker -> self
        if name.startswith("_"):
            raise AttributeError(name)
        return self


class _LLMEngine:
    """``llm.llm_engine``: the model object behind ``model_executor...`` and the request-level API (module
    docstring); ``model_executor.driver_worker.worker.model_runner`` is a fake V1 or V2 model runner
    (``VLLM_USE_V2_MODEL_RUNNER``, :mod:`vllm.runners`), ``vllm_config.use_v2_model_runner`` says which."""

    def __init__(self, llm: "LLM"):
        from vllm.runners import Batch, RunnerV1, RunnerV2

        self._llm = llm
        self.model_executor = _Model(llm.params)
        v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"
        self.model_executor.model_runner = (RunnerV2 if v2 else RunnerV1)(self.model_executor)
        self.vllm_config = SimpleNamespace(use_v2_model_runner=v2)
        self._running: dict[str, tuple] = {}  # internal id -> (request id, prompt, completion, params)
        self._batch = Batch(seed=0)  # their continuous batching (vllm.runners)
        self._cached_blocks: set[tuple[int, ...]] = set()
        self.added: list[tuple[str, list[int]]] = []  # every request's id and prompt, in order
        self.asked: list[int | None] = []  # every request's SamplingParams.logprobs, in order

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams, lora_request=None) -> str:
        assert isinstance(request_id, str), request_id
        assert prompt.get("type") == "token", prompt  # an already rendered TokensInput
        assert not self._llm.asleep, "add_request on a sleeping engine"
        assert request_id not in {r[0] for r in self._running.values()}, f"duplicate request id {request_id}"
        ids = list(prompt["prompt_token_ids"])
        weights = fingerprint(self._llm._assemble())
        completion = fake_completion(weights, ids, params, self._llm.spec.vocab_size)
        self.added.append((request_id, ids))
        self.asked.append(params.logprobs)
        internal = f"{request_id}-{hashlib.sha256(repr(self.added).encode()).hexdigest()[:8]}"  # as vLLM's
        self._running[internal] = (request_id, ids, completion, params)
        self._batch.add((internal, len(ids), list(completion.token_ids),
                         [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]))
        if params.logprobs is None:
            completion.logprobs = None
        return internal

    def _cached(self, ids: list[int]) -> int:
        blocks = 0
        while (blocks + 1) * BLOCK_SIZE <= len(ids) - 1 and tuple(ids[:(blocks + 1) * BLOCK_SIZE]) in self._cached_blocks:
            blocks += 1
        return blocks * BLOCK_SIZE

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: the batch's rows go to the model runner's sampler, and the requests whose last
        token it sampled finish."""
        rows, done = self._batch.step()
        if rows:
            greedy = all(self._running[r.req_id][3].temperature == 0 for r in rows if r.req_id in self._running)
            self.model_executor.model_runner.run_step(rows, self._llm.spec.vocab_size, greedy)
        finished = []
        for internal in done:
            rid, ids, completion, _ = self._running.pop(internal)
            cached = self._cached(ids)
            full = ids + list(completion.token_ids)
            self._cached_blocks.update(tuple(full[:b]) for b in range(BLOCK_SIZE, len(full) + 1, BLOCK_SIZE))
            finished.append(RequestOutput(ids, [completion], rid, True, cached))
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)


class _GroupCoordinator:
    def __init__(self, ranks: list[int]):
        self.ranks = ranks


# the vllm.LLM keyword arguments megarl passes (megarl.rollout.vllm_engine.llm_kwargs and the engine), with the
# types of vLLM 0.24.0's EngineArgs fields (vllm/engine/arg_utils.py)
_ENGINE_ARGS = {"skip_tokenizer_init": bool, "load_format": str, "enforce_eager": bool, "enable_sleep_mode": bool,
                "gpu_memory_utilization": float, "max_model_len": int, "logprobs_mode": str, "async_scheduling": bool,
                "max_num_seqs": int, "max_num_batched_tokens": int, "compilation_config": dict, "enable_lora": bool,
                "max_lora_rank": int, "max_loras": int, "enable_prefix_caching": bool,
                "enable_return_routed_experts": bool}


class LLM:
    """One fake engine of ``tensor_parallel_size`` consecutive ranks (see the module docstring).

    Attributes:
        generated: the prompts of every :meth:`generate` call on this rank, in call order.
        seen_weights: the :func:`fingerprint` of the assembled model at each call.
    """

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 dtype: str = "bfloat16", seed: int = 0, **kwargs: Any):
        global _TP_GROUP
        from megarl.models.spec import ModelSpec
        from megarl.models.layout_vllm import vllm_rank_tensors

        unknown = set(kwargs) - set(_ENGINE_ARGS)
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        for name, value in kwargs.items():
            if value is not None and not isinstance(value, _ENGINE_ARGS[name]):
                raise TypeError(f"fake vLLM: {name}={value!r} is not {_ENGINE_ARGS[name]}")
        bad = set(kwargs.get("compilation_config") or {}) - {"cudagraph_capture_sizes", "max_cudagraph_capture_size"}
        assert not bad, f"fake vLLM: compilation_config keys megarl does not set: {bad}"
        self.kwargs = kwargs
        assert distributed_executor_backend == "external_launcher", distributed_executor_backend
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        rank, world, tp = int(os.environ["RANK"]), dist.get_world_size(), tensor_parallel_size
        assert rank == dist.get_rank(), (rank, dist.get_rank())
        config = json.loads((Path(model) / "config.json").read_text())
        quant = config.get("quantization_config")
        self.quantization = None
        if quant is not None:
            assert quant == {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                             "fmt": "e4m3"}, quant
            assert os.environ.get("VLLM_USE_DEEP_GEMM") == "0", "block FP8 needs VLLM_USE_DEEP_GEMM=0 (megarl.models.fp8)"
            self.quantization = "fp8"
        self.spec = ModelSpec.from_hf_config(config)
        self.tp, self.tp_rank = tp, rank % tp
        first = rank - self.tp_rank
        for start in range(0, world, tp):  # collective: every rank creates every engine's group
            group = dist.new_group(list(range(start, start + tp)))
            if start == first:
                self.group = group
        self.ranks = list(range(first, first + tp))
        _TP_GROUP = _GroupCoordinator(self.ranks)
        self.dtype = getattr(torch, dtype)
        self.layout = vllm_rank_tensors(self.spec, tp, self.tp_rank, self.quantization)
        scales = {lt.scale for lt in self.layout.values() if lt.scale}
        self.params = {n: torch.nn.Parameter(torch.zeros(lt.shape, dtype=torch.float8_e4m3fn if lt.scale else
                                                         torch.float32 if n in scales else self.dtype),
                                             requires_grad=False)
                       for n, lt in self.layout.items()}
        self.llm_engine = _LLMEngine(self)
        self._counter = itertools.count()  # request ids of generate, as vLLM's LLM.request_counter
        self.generated: list[list[list[int]]] = []
        self.seen_weights: list[int] = []
        self.asleep = False

    def _assemble(self) -> dict[str, torch.Tensor]:
        """The canonical tensors from every TP rank's shard (all-gathered over the engine's group)."""
        from megarl.models.layout import canonical_shapes
        from megarl.models.layout_vllm import vllm_rank_tensors

        from megarl.models.fp8 import dequantize_blocks

        values = {n: dequantize_blocks(p.detach(), self.params[lt.scale].detach()) if lt.scale else p.detach().clone()
                  for n, p in self.params.items() if (lt := self.layout[n]).blocks}
        shards = [None] * self.tp
        dist.all_gather_object(shards, values, group=self.group)
        dtype = torch.float32 if self.quantization else self.dtype
        full = {n: torch.full(s, float("nan"), dtype=dtype) for n, s in canonical_shapes(self.spec).items()}
        for r, shard in enumerate(shards):
            for name, lt in vllm_rank_tensors(self.spec, self.tp, r, self.quantization).items():
                for b in lt.blocks:
                    have, new = full[b.name][b.src_box], shard[name][b.dst_box]
                    if not torch.isnan(have).all() and not torch.equal(have, new):
                        raise RuntimeError(f"fake vLLM: TP ranks hold different copies of {b.name} {b.src_box}")
                    full[b.name][b.src_box] = new
        return full

    def generate(self, prompts, sampling_params, use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        assert not self.asleep, "generate on a sleeping engine"
        ids = [p["prompt_token_ids"] for p in prompts]
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(ids)
        requests = [(p, (s.seed, s.max_tokens, tuple(s.stop_token_ids))) for p, s in zip(ids, params)]
        everyone = [None] * self.tp
        dist.all_gather_object(everyone, requests, group=self.group)
        if any(other != requests for other in everyone):
            raise RuntimeError(f"fake vLLM: the ranks {self.ranks} of one engine made different generate calls "
                               f"(request counts {[len(o) for o in everyone]})")
        canonical = self._assemble()
        weights = fingerprint(canonical)
        self.generated.append(ids)
        self.seen_weights.append(weights)
        outputs = [RequestOutput(p, [fake_completion(weights, p, s, self.spec.vocab_size)], str(next(self._counter)))
                   for p, s in zip(ids, params)]
        asked = {s.logprobs is not None for s in params}
        assert len(asked) <= 1, "fake vLLM: requests of one call ask for log-probs alike"
        if asked == {False}:
            self._run_sampler(outputs, params)
        if self.kwargs.get("enable_return_routed_experts"):
            model = self._transformers_model(canonical)
            for out in outputs:
                c = out.outputs[0]
                c.routed_experts = fake_routes(model, out.prompt_token_ids, c.token_ids, self.spec.num_experts,
                                               self.spec.moe_top_k)
        return outputs

    def _run_sampler(self, outputs: list[RequestOutput], params: list[SamplingParams]) -> None:
        """Requests without log-probs: vLLM returns none (``logprobs`` None); its model runner's sampler produced
        the tokens step by step (:func:`vllm.runners.sampler_rows` under internal ids: the external id, '-' and 8
        characters), which the runner's hooks (megarl.rollout.vllm_logprobs) see."""
        from vllm.runners import sampler_rows

        runner = self.llm_engine.model_executor.model_runner
        requests = []
        for out in outputs:
            c = out.outputs[0]
            requests.append((f"{out.request_id}-{hashlib.sha256(out.request_id.encode()).hexdigest()[:8]}",
                             len(out.prompt_token_ids), list(c.token_ids), [lp[t].logprob for lp, t in
                                                                             zip(c.logprobs, c.token_ids)]))
            c.logprobs = None
        greedy = all(s.temperature == 0 for s in params)
        for rows in sampler_rows(requests, seed=len(self.generated)):
            runner.run_step(rows, self.spec.vocab_size, greedy)

    def _transformers_model(self, canonical: dict[str, torch.Tensor]):
        """The transformers model (float32) of the assembled weights, for :func:`fake_routes`."""
        from megarl.rollout.base import state_dict_writer
        from megarl.rollout.hf_engine import HFRolloutEngine

        engine = HFRolloutEngine(self.spec)
        engine.update_weights(state_dict_writer(canonical, engine.weight_layout([0]), 0))
        return engine.model

    def reset_prefix_cache(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> None:
        self.asleep = True

    def wake_up(self) -> None:
        self.asleep = False


@contextlib.contextmanager
def _pretend_cuda():
    saved = torch.cuda.is_available, torch.cuda.current_device
    torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: 0)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.current_device = saved


def install() -> None:
    """Make ``import vllm`` find this fake and let :class:`~megarl.rollout.vllm_engine.VLLMRolloutEngine` start
    on a CPU (CUDA pretended during its construction only). Call in each rank's process before building one."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from megarl.rollout import vllm_engine

    init = vllm_engine.VLLMRolloutEngine.__init__
    if getattr(init, "fake_cuda", False):
        return

    def patched(self, *args, **kwargs):
        with _pretend_cuda():
            init(self, *args, **kwargs)

    patched.fake_cuda = True
    vllm_engine.VLLMRolloutEngine.__init__ = patched
