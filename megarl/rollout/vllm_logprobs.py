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

Not covered (refused): speculative decoding (rows of several tokens), a vLLM out of this process, and the
request-by-request path of multi-turn episodes (``add_request`` / ``step``), which keeps ``logprobs=0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from megarl.rollout.base import RolloutError

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
    """

    req_ids: Sequence[str]
    index: Any
    kept: Any
    tokens: torch.Tensor
    logprobs: torch.Tensor


def _host(parts: list) -> np.ndarray:
    """The concatenation of numpy arrays or of tensors (one device-to-host copy) as one numpy array."""
    if not parts:
        return np.zeros(0)
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    return torch.cat([p.reshape(-1) for p in parts]).cpu().numpy()


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
    names = list(requests)
    if not names:
        return {}
    number = {name: i for i, name in enumerate(names)}
    prompt = np.array([requests[n][0] for n in names], dtype=np.int64)
    length = np.array([len(requests[n][1]) for n in names], dtype=np.int64)
    offset = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
    want = np.fromiter((t for n in names for t in requests[n][1]), dtype=np.int64, count=int(offset[-1]))
    owners, last_ids, last_owner = [], None, None
    for step in steps:
        if last_ids is None or step.req_ids != last_ids:  # the batch is often the same as the step before
            last_owner = np.array([number.get(r, -1) for r in step.req_ids], dtype=np.int64)
            last_ids = step.req_ids
        owners.append(last_owner)
    owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
    index = _host([s.index for s in steps]).astype(np.int64)
    kept = _host([s.kept for s in steps]).astype(bool)
    tokens = _host([s.tokens for s in steps]).astype(np.int64)
    values = _host([s.logprobs for s in steps]).astype(np.float32)
    if not len(owner) == len(index) == len(kept) == len(tokens) == len(values):
        raise RolloutError(f"log-prob capture: rows of unequal counts (requests {len(owner)}, indices {len(index)}, "
                           f"kept {len(kept)}, tokens {len(tokens)}, log-probs {len(values)})")
    safe = np.maximum(owner, 0)
    position = index - prompt[safe]
    use = kept & (owner >= 0) & (position >= 0) & (position < length[safe])
    rows = np.nonzero(use)[0]
    keys = offset[safe[rows]] + position[rows]
    # the last row of each key: unique over the reversed rows finds each key's first occurrence there
    unique, first_reversed = np.unique(keys[::-1], return_index=True)
    last = rows[::-1][first_reversed]
    if len(unique) != len(want):
        missing = np.setdiff1d(np.arange(len(want)), unique)[:5]
        request = np.searchsorted(offset, missing, side="right") - 1
        raise RolloutError(f"log-prob capture: {len(want) - len(unique)} of {len(want)} output tokens have no sampler "
                           f"row (e.g. request {names[request[0]]!r} token {int(missing[0] - offset[request[0]])}); "
                           "vLLM's model runner differs from 0.24.0's; use rollout.logprobs=output")
    wrong = np.nonzero(tokens[last] != want[unique])[0]
    if len(wrong):
        k = int(unique[wrong[0]])
        request = int(np.searchsorted(offset, k, side="right") - 1)
        raise RolloutError(f"log-prob capture: {len(wrong)} output tokens differ from their sampler rows' (request "
                           f"{names[request]!r} token {k - offset[request]}: output {want[k]}, row "
                           f"{tokens[last[wrong[0]]]}); vLLM's model runner differs from 0.24.0's; use "
                           "rollout.logprobs=output")
    flat = np.empty(len(want), dtype=np.float32)
    flat[unique] = values[last]
    return {n: flat[offset[i]:offset[i + 1]] for i, n in enumerate(names)}


class SampledLogprobs:
    """The sampled tokens' log-probs of one in-process vLLM engine, captured in its model runner's sampler
    (module docstring). Install once per engine; :meth:`run` runs ``LLM.generate`` recording.

    Args:
        runner: the engine's model runner (``llm.llm_engine.model_executor.driver_worker.worker.model_runner``).
        v2: whether it is vLLM's V2 model runner (``vllm_config.use_v2_model_runner``).

    Raises:
        RolloutError: the runner's sampler is not in ``processed_logprobs`` mode, lacks what is wrapped here, or
            (V2) may sample with FlashInfer.
    """

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
        self._pending: tuple | None = None  # the sampler's log-probs (and V2 positions) of the call in progress
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
                self._steps.append(Step(list(runner.input_batch.req_ids[:rows]),
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
                self._steps.append(Step(input_batch.req_ids, pos + 1, num_sampled > 0,
                                        sampler_output.sampled_token_ids.view(-1), logprobs))
            return out

        sampler.sample, runner.sample = sample_hook, run_sample_hook

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
