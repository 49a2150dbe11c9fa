"""The sampled tokens' log-probs taken on the GPU inside vLLM 0.24.0's sampler (``rollout.logprobs: sampler``).

Why. Asking vLLM for the sampled token's log-prob (``SamplingParams(logprobs=0)``) costs ~6 ms of host time per
decode step of 512 sequences on an H100 (13.9 ms against 8.0 ms without; issue 47): the model runner copies the
logprob tensors to lists (``LogprobsTensors.tolists``), the scheduler slices them per request
(``LogprobsLists.slice_request``) and the output processor builds one ``Logprob`` dict per token and request
(``vllm/v1/engine/logprobs.py``: ``LogprobsProcessor``). The GPU work is a gather. Here the requests go out with
``logprobs=None`` and a :class:`SampledLogprobs` wrapped around the sampler of the engine's model runner (in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) gathers each step's sampled-token log-probs into one small GPU
tensor and keeps references to it and to the rows' request ids; after ``LLM.generate`` one device-to-host copy
per field and a numpy scatter (:func:`assemble`) give every request its log-probs.

Same values as vLLM's own ``logprobs=0`` output, bit for bit (read in the 0.24.0 wheel; megarl's engines run
``logprobs_mode="processed_logprobs"``, which :class:`SampledLogprobs` checks):

- V1 model runner (``vllm/v1/worker/gpu_model_runner.py``, ``vllm/v1/sample/sampler.py``). ``Sampler.forward``
  calls ``Sampler.sample(logits, sampling_metadata)``, which returns ``(sampled, processed_logprobs)``:
  ``TopKTopPSampler.forward_native`` computes ``processed_logprobs`` (``log_softmax`` of the logits after
  penalties, temperature and top-k/top-p) whether or not logprobs are asked for (FlashInfer, which would not, is
  never chosen with a processed mode), except on an all-greedy batch, where ``sample`` returns None when no
  request asks and ``Sampler.compute_logprobs(logits)`` of the same float32 logits when one does. vLLM's
  ``Sampler.gather_logprobs`` then takes ``logprobs.gather(-1, sampled.long().unsqueeze(-1))``. The wrapper of
  ``sampler.sample`` (an instance attribute) does exactly that on the same tensor; the wrapper of
  ``GPUModelRunner._sample`` records the step's rows: ``input_batch.req_ids[:num_reqs]``, the index of the
  sampled token in prompt + output (``optimistic_seq_lens_cpu``: computed + scheduled tokens) and whether the
  runner keeps it (``discard_request_mask``: chunked-prefill rows that sample no token, recomputed prefixes
  after a preemption included).
- V2 model runner (``vllm/v1/worker/gpu/model_runner.py``, ``vllm/v1/worker/gpu/sample/sampler.py``,
  ``sample/logprob.py``). ``Sampler.__call__`` calls ``self.sample(logits, expanded_idx_mapping, idx_mapping_np,
  pos, ...)`` returning ``(sampled, processed_logits)`` (the same tensors with or without logprobs: FlashInfer
  is used only with top-k/top-p, no explicit seeds and no processed logprobs asked for; refused below), and
  with ``logprobs=0`` ``compute_topk_logprobs(processed_logits, 0, sampled)`` is
  ``compute_token_logprobs(processed_logits, sampled.unsqueeze(-1))``, a Triton kernel this module calls on the
  same tensors. The wrapper of ``GPUModelRunner.sample(hidden_states, input_batch, grammar_output)`` records
  ``input_batch.req_ids``, ``pos + 1`` (``pos``: the position of the row's last input token) and
  ``num_sampled > 0`` (0 for a chunked-prefill row).

The sampler runs outside CUDA graphs (after ``compute_logits``) in both runners, so graphs change nothing here.
A row belongs to vLLM's internal request id (the external id plus ``-`` and 8 random characters,
``InputProcessor.assign_request_id``). Which rows become output tokens (:func:`assemble`): a kept row samples the
token at its index; the scheduler drops a kept row's token only for a request already finished (async
scheduling runs a step past the stop, ``Scheduler.update_from_output``), whose index then lies past the
output; a preempted request is recomputed with its output tokens as context and samples the next index. So
output token ``t`` of a request is the last kept row at index ``prompt_len + t``, and the captured token there
must be the output's token: :func:`assemble` checks both (every output token covered, every token equal) and
raises otherwise, so a vLLM whose internals differ fails loudly instead of returning wrong log-probs.

Request by request (multi-turn episodes and agent functions: :meth:`~megarl.rollout.vllm_engine.VLLMRolloutEngine.
add_request` / ``step``, read in ``vllm/v1/engine/llm_engine.py`` and ``vllm/v1/engine/core.py``).
``LLMEngine.add_request`` returns the internal id, which :meth:`SampledLogprobs.add` keeps with the prompt length
and ``max_tokens``; ``LLMEngine.step`` runs the model runner (its sampler hooks) in this thread, with async
scheduling (``EngineCore.step_with_batch_queue``) scheduling and launching batch ``n + 1`` before it waits for batch
``n``'s output, so the step that returns a request as finished may leave a batch on the GPU. So each sampler call's
rows start for the host in the hook (``non_blocking`` copies to pinned memory and a CUDA event, on the sampling
stream right after the sampler, before vLLM's runner copies the sampled tokens out) and are written into an
:class:`OutputTable` once their event has passed, in order; a request that finishes waits only for copies that it
lacks (its tokens' rows come from batches whose sampled tokens vLLM has read back, so their copies are done: the
wait is a safeguard). Its tokens are then checked as in :func:`assemble` (the same :class:`OutputTable`), and its
cells freed; rows that arrive later (the async step past the stop) belong to no open request and are ignored. A
request that vLLM ends otherwise than "stop" / "length" (aborted) is dropped unchecked (the engine then fails on its
finish reason). A preempted request keeps its internal id and is recomputed as above; an episode's next turn is a
new request.

Not covered (refused): speculative decoding (rows of several tokens) and a vLLM out of this process.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence, get_args

import numpy as np
import torch

from megarl.rollout.base import FinishReason, RolloutError

LOGPROBS_MODE = "processed_logprobs"  # megarl's (megarl.rollout.vllm_engine.llm_kwargs)


@dataclass
class Step:
    """One sampler call's rows, as recorded (GPU tensors kept by reference until :meth:`SampledLogprobs.run` ends).

    Attributes:
        req_ids: row -> vLLM's internal request id (``rows`` of them).
        index: ``[rows]`` int64, the sampled token's index in prompt + output (numpy on V1, GPU tensor on V2).
        kept: ``[rows]`` bool, whether the runner keeps the row's token (numpy on V1, GPU tensor on V2).
        tokens: ``[rows]`` int32/int64 GPU tensor, the sampled tokens.
        logprobs: ``[rows]`` float32 GPU tensor, their log-probs.
        copied: on the request path, the CUDA event after the tensors' copies to the host (:func:`_to_host`;
            None: nothing was on a GPU, or not copied yet).
    """

    req_ids: Sequence[str]
    index: Any
    kept: Any
    tokens: torch.Tensor
    logprobs: torch.Tensor
    copied: Any = None


def _host(parts: list) -> np.ndarray:
    """The concatenation of numpy arrays or of tensors (one device-to-host copy) as one numpy array."""
    if not parts:
        return np.zeros(0)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return torch.cat([p.reshape(-1) for p in parts]).cpu().numpy()


def _fail(what: str) -> RolloutError:
    return RolloutError(f"log-prob capture: {what}; vLLM's model runner differs from 0.24.0's; use "
                        "rollout.logprobs=output")


class OutputTable:
    """Each open request's output tokens and log-probs as its sampler rows give them (module docstring: output
    token ``t`` is the last kept row of the request at index prompt length + ``t``), written step by step and
    read when the request ends.

    One flat numpy arena holds every open request's ``capacity`` cells (token int64, -1 while no row wrote it;
    log-prob float32); closed requests' cells are reclaimed when the arena is full (live cells moved to the
    front, the arena doubled when they fill half of it). Rows of requests that are not open are ignored.
    """

    def __init__(self):
        self._slot: dict[str, int] = {}  # open request -> slot
        self._free: list[int] = []
        self._base = np.zeros(0, np.int64)  # slot -> first cell, capacity, prompt length
        self._capacity = np.zeros(0, np.int64)
        self._prompt = np.zeros(0, np.int64)
        self._tokens = np.zeros(0, np.int64)
        self._values = np.zeros(0, np.float32)
        self._end = 0  # cells used so far (the live ones and reclaimable ones)

    def __contains__(self, request: str) -> bool:
        return request in self._slot

    def open(self, request: str, prompt_len: int, capacity: int) -> None:
        """Start collecting ``request`` (vLLM's internal id; not open yet) of a ``prompt_len``-token prompt,
        up to ``capacity`` output tokens (rows past them are ignored)."""
        assert request not in self._slot, request
        if not self._free:
            grow = max(len(self._base), 16)
            self._base, self._capacity, self._prompt = (np.concatenate([a, np.zeros(grow, np.int64)])
                                                        for a in (self._base, self._capacity, self._prompt))
            self._free = list(range(len(self._base) - 1, len(self._base) - grow - 1, -1))
        if self._end + capacity > len(self._tokens):
            self._compact(capacity)
        slot = self._free.pop()
        self._slot[request] = slot
        self._base[slot], self._capacity[slot], self._prompt[slot] = self._end, capacity, prompt_len
        self._tokens[self._end:self._end + capacity] = -1
        self._end += capacity

    def _compact(self, need: int) -> None:
        """Move the open requests' cells to the front of an arena with room for ``need`` more."""
        live = np.fromiter(self._slot.values(), np.int64, len(self._slot))
        sizes = self._capacity[live]
        used = int(sizes.sum())
        size = max(len(self._tokens), 1024)
        while used + need > size // 2:
            size *= 2
        base = np.cumsum(sizes) - sizes
        source = np.repeat(self._base[live] - base, sizes) + np.arange(used)
        tokens, values = np.full(size, -1, np.int64), np.zeros(size, np.float32)
        tokens[:used], values[:used] = self._tokens[source], self._values[source]
        self._tokens, self._values, self._end = tokens, values, used
        self._base[live] = base

    def owners(self, steps: Sequence[Step]) -> np.ndarray:
        """``[rows of steps]`` int64: each row's slot, -1 where its request is not open."""
        parts, last_ids, last = [], None, None
        for step in steps:
            if last_ids is None or step.req_ids != last_ids:  # the batch is often the same as the step before
                last = np.array([self._slot.get(r, -1) for r in step.req_ids], dtype=np.int64)
                last_ids = step.req_ids
            parts.append(last)
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def write(self, steps: Sequence[Step]) -> None:
        """Write the rows of ``steps`` (in order; their tensors copied to the host here, one copy a field)."""
        owner = self.owners(steps)
        index = _host([s.index for s in steps]).astype(np.int64)
        kept = _host([s.kept for s in steps]).astype(bool)
        tokens = _host([s.tokens for s in steps]).astype(np.int64)
        values = _host([s.logprobs for s in steps]).astype(np.float32)
        if not len(owner) == len(index) == len(kept) == len(tokens) == len(values):
            raise RolloutError(f"log-prob capture: rows of unequal counts (requests {len(owner)}, indices "
                               f"{len(index)}, kept {len(kept)}, tokens {len(tokens)}, log-probs {len(values)})")
        rows = np.nonzero(kept & (owner >= 0))[0]
        slot = owner[rows]
        position = index[rows] - self._prompt[slot]
        inside = (position >= 0) & (position < self._capacity[slot])
        rows, cells = rows[inside], self._base[slot[inside]] + position[inside]
        # the last row of each cell: unique over the reversed rows finds each cell's first occurrence there
        cells, first_reversed = np.unique(cells[::-1], return_index=True)
        last = rows[::-1][first_reversed]
        self._tokens[cells], self._values[cells] = tokens[last], values[last]

    def _cells(self, outputs: dict[str, Sequence[int]]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        names = list(outputs)
        length = np.array([len(outputs[n]) for n in names], dtype=np.int64)
        offset = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
        slots = np.array([self._slot[n] for n in names], dtype=np.int64)
        base = self._base[slots]
        over = np.nonzero(length > self._capacity[slots])[0]
        if len(over):
            k = int(over[0])
            raise RolloutError(f"log-prob capture: request {names[k]!r} has {length[k]} output tokens, more than its "
                               f"{self._capacity[slots[k]]} (max_tokens)")
        cells = np.repeat(base - offset[:-1], length) + np.arange(offset[-1])
        want = np.concatenate([np.asarray(outputs[n], dtype=np.int64) for n in names]) if names else length
        return names, offset, cells, want

    def filled(self, outputs: dict[str, Sequence[int]]) -> bool:
        """Whether every output token of the open requests ``outputs`` (id -> output token ids) has a row."""
        return bool((self._tokens[self._cells(outputs)[2]] >= 0).all())

    def close(self, outputs: dict[str, Sequence[int]]) -> dict[str, np.ndarray]:
        """Stop collecting the open requests ``outputs`` (id -> output token ids, at most their capacity) and
        return their log-probs: id -> ``[len(output token ids)]`` float32 numpy array.

        Raises:
            RolloutError: an output token without a kept row, or whose row sampled another token.
        """
        names, offset, cells, want = self._cells(outputs)
        got, flat = self._tokens[cells], self._values[cells]
        self.drop(names)
        missing = np.nonzero(got < 0)[0]
        if len(missing):
            r = int(np.searchsorted(offset, missing[0], side="right") - 1)
            raise _fail(f"{len(missing)} of {len(want)} output tokens have no sampler row (e.g. request "
                        f"{names[r]!r} token {int(missing[0] - offset[r])})")
        wrong = np.nonzero(got != want)[0]
        if len(wrong):
            k = int(wrong[0])
            r = int(np.searchsorted(offset, k, side="right") - 1)
            raise _fail(f"{len(wrong)} output tokens differ from their sampler rows' (request {names[r]!r} token "
                        f"{k - offset[r]}: output {want[k]}, row {got[k]})")
        return {n: flat[offset[i]:offset[i + 1]] for i, n in enumerate(names)}

    def drop(self, requests: Sequence[str]) -> None:
        """Stop collecting the open ``requests`` (their cells are reclaimed later)."""
        self._free.extend(self._slot.pop(r) for r in requests)


def assemble(steps: Sequence[Step], requests: dict[str, tuple[int, Sequence[int]]]) -> dict[str, np.ndarray]:
    """Every request's sampled-token log-probs from the recorded sampler rows (module docstring).

    Args:
        steps: the sampler calls in order.
        requests: vLLM's internal request id -> (prompt length, output token ids) of each finished request;
            rows of other requests are ignored.

    Returns:
        internal request id -> ``[len(output token ids)]`` float32 numpy array: output token ``t``'s log-prob is
        that of the last kept row of the request at index ``prompt length + t``.

    Raises:
        RolloutError: an output token without a kept row, or whose row sampled another token.
    """
    table = OutputTable()
    for name, (prompt_len, tokens) in requests.items():
        table.open(name, prompt_len, len(tokens))
    table.write(steps)
    return table.close({name: tokens for name, (_, tokens) in requests.items()})


class OutputLogprobs:
    """``rollout.logprobs: output``: vLLM's own log-prob output (requests ask ``logprobs=0``); the interface of
    :class:`SampledLogprobs`, whose log-prob arrays are None here (the outputs carry them)."""

    asks_vllm = True  # the requests ask vLLM for the sampled token's log-prob

    def run(self, generate: Callable[[], list], prompt_lengths: Sequence[int]) -> tuple[list, list[None]]:
        outputs = generate()
        return outputs, [None] * len(outputs)

    def add(self, request_id: str, prompt_len: int, max_tokens: int, submit: Callable[[], str]) -> None:
        submit()

    def step(self, engine_step: Callable[[], list]) -> list[tuple[Any, None]]:
        return [(out, None) for out in engine_step() if out.finished]


class SampledLogprobs:
    """The sampled tokens' log-probs of one in-process vLLM engine, captured in its model runner's sampler
    (module docstring). Install once per engine; :meth:`run` runs ``LLM.generate`` recording; :meth:`add` and
    :meth:`step` drive ``LLMEngine`` request by request (multi-turn episodes).

    Args:
        runner: the engine's model runner (``llm.llm_engine.model_executor.driver_worker.worker.model_runner``).
        v2: whether it is vLLM's V2 model runner (``vllm_config.use_v2_model_runner``).

    Raises:
        RolloutError: the runner's sampler is not in ``processed_logprobs`` mode, lacks what is wrapped here, or
            (V2) may sample with FlashInfer.
    """

    asks_vllm = False  # the requests ask vLLM for no log-probs

    def __init__(self, runner, *, v2: bool):
        sampler = getattr(runner, "sampler", None)
        mode = getattr(sampler, "logprobs_mode", None)
        if mode != LOGPROBS_MODE:
            raise RolloutError(f"rollout.logprobs=sampler: the sampler's logprobs_mode is {mode!r}, megarl's engines "
                               f"run {LOGPROBS_MODE!r}")
        needed = ("sample",) if v2 else ("_sample", "input_batch", "optimistic_seq_lens_cpu", "discard_request_mask")
        missing = [name for name in needed if not hasattr(runner, name)] + (
            [] if hasattr(sampler, "sample") else ["sampler.sample"])
        if missing:
            raise RolloutError(f"rollout.logprobs=sampler: vLLM's {'V2' if v2 else 'V1'} model runner has no {missing} "
                               "(not vLLM 0.24.0?); use rollout.logprobs=output")
        if v2 and getattr(sampler, "use_flashinfer", False):
            raise RolloutError("rollout.logprobs=sampler: vLLM's V2 sampler may sample with FlashInfer (whose "
                               "processed logits differ); unset VLLM_USE_FLASHINFER_SAMPLER")
        self._steps: list[Step] | None = None  # None: not recording
        self._copy = False  # whether each step's rows start for the host as recorded (the request path)
        self._pending: tuple | None = None  # the sampler's log-probs (and V2 positions) of the call in progress
        self._table = OutputTable()  # the request path's (add / step)
        self._internal: dict[str, str] = {}  # its running requests: external id -> vLLM's internal id
        self._copies: deque[Step] = deque()  # its recorded steps on their way to the host
        (self._wrap_v2 if v2 else self._wrap_v1)(runner, sampler)

    # ------------------------------------------------------------------ hooks
    def _wrap_v1(self, runner, sampler) -> None:
        sample, run_sample = sampler.sample, runner._sample

        def sample_hook(logits, sampling_metadata, *args, **kwargs):
            sampled, processed = sample(logits, sampling_metadata, *args, **kwargs)
            if self._steps is not None:  # processed is None only on an all-greedy batch (module docstring)
                logprobs = processed if processed is not None else sampler.compute_logprobs(logits)
                self._pending = (logprobs.gather(-1, sampled.long().unsqueeze(-1)).view(-1),)
            return sampled, processed

        def run_sample_hook(logits, spec_decode_metadata, *args, **kwargs):
            self._pending = None
            out = run_sample(logits, spec_decode_metadata, *args, **kwargs)
            if self._steps is not None:
                if spec_decode_metadata is not None or self._pending is None:
                    raise RolloutError("rollout.logprobs=sampler: a sampler step without the sampled log-probs "
                                       "(speculative decoding?); use rollout.logprobs=output")
                rows = runner.input_batch.num_reqs
                self._record(Step(list(runner.input_batch.req_ids[:rows]),
                                  runner.optimistic_seq_lens_cpu[:rows].numpy().copy(),
                                  ~runner.discard_request_mask.np[:rows].astype(bool),
                                  out.sampled_token_ids.view(-1), self._pending[0]))
            return out

        sampler.sample, runner._sample = sample_hook, run_sample_hook

    def _wrap_v2(self, runner, sampler) -> None:
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        sample, run_sample = sampler.sample, runner.sample

        def sample_hook(logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs):
            sampled, processed = sample(logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs)
            if self._steps is not None:
                self._pending = (compute_token_logprobs(processed, sampled.unsqueeze(-1)).view(-1), pos)
            return sampled, processed

        def run_sample_hook(hidden_states, input_batch, grammar_output, *args, **kwargs):
            self._pending = None
            out = run_sample(hidden_states, input_batch, grammar_output, *args, **kwargs)
            if self._steps is not None:
                if input_batch.num_draft_tokens or self._pending is None:
                    raise RolloutError("rollout.logprobs=sampler: a sampler step without the sampled log-probs "
                                       "(speculative decoding?); use rollout.logprobs=output")
                sampler_output, num_sampled = out[0], out[1]
                logprobs, pos = self._pending
                self._record(Step(input_batch.req_ids, pos + 1, num_sampled > 0,
                                  sampler_output.sampled_token_ids.view(-1), logprobs))
            return out

        sampler.sample, runner.sample = sample_hook, run_sample_hook

    def _record(self, step: Step) -> None:
        """Keep a sampler call's rows (on the request path with their copies to the host started, on the stream
        that sampled them, before vLLM's runner copies the sampled tokens out)."""
        self._steps.append(_to_host(step) if self._copy else step)

    # ------------------------------------------------------------------ a generate call
    def run(self, generate: Callable[[], list], prompt_lengths: Sequence[int]) -> tuple[list, list[np.ndarray]]:
        """Call ``generate()`` (``LLM.generate`` of ``n=1`` requests) while recording the sampler's rows, and
        return its outputs (vLLM ``RequestOutput``s, their external ``request_id``) with their log-probs; the
        requests' prompts are ``prompt_lengths`` tokens long, in the outputs' order.

        Returns:
            ``(outputs, logprobs)``: one ``[len(outputs[i].outputs[0].token_ids)]`` float32 numpy array per output.

        Raises:
            RolloutError: a request without rows, or rows that do not match its tokens (:func:`assemble`).
        """
        self._steps, self._pending = [], None
        try:
            outputs = generate()
            steps = self._steps
        finally:
            self._steps, self._pending = None, None
        return outputs, self._logprobs(steps, outputs, prompt_lengths)

    @staticmethod
    def _logprobs(steps: list[Step], outputs: Sequence[Any], prompt_lengths: Sequence[int]) -> list[np.ndarray]:
        """:func:`assemble` of ``steps`` for ``outputs``, from vLLM's internal request ids to the external ones."""
        external = {out.request_id: (length, out.outputs[0].token_ids) for out, length in zip(outputs, prompt_lengths)}
        internal, seen, last = {}, set(), None
        for step in steps:  # vLLM's internal id is the external one, '-' and 8 random characters
            if step.req_ids == last:
                continue
            last = step.req_ids
            for r in set(last) - seen:
                seen.add(r)
                base = r if r in external else r.rsplit("-", 1)[0]
                if base in external:
                    internal[r] = base
        found = set(internal.values())
        lost = [o.request_id for o in outputs if o.request_id not in found]
        if lost:
            raise RolloutError(f"log-prob capture: no sampler rows of the requests {lost[:5]}; use "
                               "rollout.logprobs=output")
        by_internal = assemble(steps, {r: external[e] for r, e in internal.items()})
        by_external = {}
        for r, e in internal.items():
            if e in by_external:
                raise RolloutError(f"log-prob capture: two internal requests ({r!r} and another) for {e!r}")
            by_external[e] = by_internal[r]
        return [by_external[o.request_id] for o in outputs]

    # ------------------------------------------------------------------ request by request
    def add(self, request_id: str, prompt_len: int, max_tokens: int, submit: Callable[[], str]) -> None:
        """Hand one request to vLLM and collect its sampler rows from the next :meth:`step` on: ``submit()``
        adds it (``LLMEngine.add_request``, which returns vLLM's internal id); its prompt is ``prompt_len``
        tokens, its output at most ``max_tokens``.

        Raises:
            RolloutError: a request ``request_id`` is still running here (its output would be ambiguous);
                whatever ``submit`` raises (nothing is collected then).
        """
        if request_id in self._internal:
            raise RolloutError(f"rollout.logprobs=sampler: request {request_id!r} is still running; request ids "
                               "must be unique among running requests")
        internal = submit()
        self._table.open(internal, prompt_len, max_tokens)
        self._internal[request_id] = internal

    def step(self, engine_step: Callable[[], list]) -> list[tuple[Any, np.ndarray | None]]:
        """Run ``engine_step()`` (``LLMEngine.step``: one scheduler iteration of requests added by :meth:`add`)
        recording the sampler's rows, and return its finished outputs (vLLM ``RequestOutput``s) with their
        log-probs: ``[len(outputs[0].token_ids)]`` float32 numpy arrays, None for a request that ended otherwise
        than "stop" or "length" (aborted by vLLM: its rows are dropped unchecked).

        Each sampler call's rows start for the host as recorded (:meth:`_record`) and are written into the table
        once copied, in order (the last kept row of a token wins across steps too); a finished request waits
        only for copies it lacks, so the batch that vLLM's async scheduling keeps in flight stays in flight.

        Raises:
            RolloutError: a finished request that :meth:`add` did not add, or one whose rows do not match its
                tokens (:meth:`OutputTable.close`).
        """
        self._steps, self._pending, self._copy = [], None, True
        try:
            outputs = engine_step()
            self._copies.extend(self._steps)
        finally:
            self._steps, self._pending, self._copy = None, None, False
        self._write_copied(wait=False)
        finished, ended = [], {}
        for out in outputs:
            if not out.finished:
                continue
            internal = self._internal.pop(out.request_id, None)
            if internal is None:
                raise RolloutError(f"log-prob capture: vLLM finished request {out.request_id!r}, which was not "
                                   "added through rollout.logprobs=sampler")
            finished.append((out, internal))
            if out.outputs[0].finish_reason in get_args(FinishReason):
                ended[internal] = out.outputs[0].token_ids
            else:
                self._table.drop([internal])
        while self._copies and not self._table.filled(ended):
            self._write_copied(wait=True, count=1)
        values = self._table.close(ended)
        return [(out, values.get(internal)) for out, internal in finished]

    def _write_copied(self, wait: bool, count: int | None = None) -> None:
        """Write the steps whose copies arrived (``wait``: the first ``count`` steps, waiting for them)."""
        ready = []
        while self._copies and (count is None or len(ready) < count):
            event = self._copies[0].copied
            if event is not None and not event.query():
                if not wait:
                    break
                event.synchronize()
            ready.append(self._copies.popleft())
        if ready:
            self._table.write(ready)


def _to_host(step: Step) -> Step:
    """``step`` with its tensors copied to host memory without waiting (pinned, ``non_blocking``) and, where one
    was on a GPU, the CUDA event after the copies as ``copied``."""
    fields = (step.index, step.kept, step.tokens, step.logprobs)
    on_gpu = any(isinstance(f, torch.Tensor) and f.is_cuda for f in fields)
    host = [f.to("cpu", non_blocking=True) if isinstance(f, torch.Tensor) else f for f in fields]
    event = torch.cuda.Event() if on_gpu else None
    if event is not None:
        event.record()
    return Step(step.req_ids, *host, copied=event)
