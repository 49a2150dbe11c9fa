"""Fake model runners of vLLM 0.24.0 (V1 and V2) and the sampler rows of a continuous-batching run, for
:mod:`megarl.rollout.vllm_logprobs` on a CPU.

A fake ``LLM.generate`` of requests that ask for no log-probs runs :func:`sampler_rows` and hands each step's rows
to its runner's sampling entry point (V1: ``GPUModelRunner._sample``, which calls ``Sampler.forward`` ->
``Sampler.sample``; V2: ``GPUModelRunner.sample``, which calls ``Sampler.__call__`` -> ``Sampler.sample``), with
the batch state that vLLM's runners hold at that point (V1: ``input_batch.req_ids`` mutated in place,
``optimistic_seq_lens_cpu``, ``discard_request_mask``; V2: a fresh ``input_batch`` with ``req_ids``,
``positions`` and ``logits_indices``, and ``num_sampled`` in the sampler output). The logits of a row are
log-probs already: -inf but at the row's token, which holds its log-prob; the fake samplers take the argmax and
return the logits as the processed log-probs (V1; None on an all-greedy step, as vLLM's does when no request
asks), or as the processed logits (V2, whose ``compute_token_logprobs`` fake gathers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

MAX_RUNNING = 3  # requests decoded at once: the batch changes as requests finish and join
CHUNK = 2  # prompt tokens of a first prefill chunk (a prompt longer than this prefills in two steps)


@dataclass
class Row:
    req_id: str
    index: int  # the sampled token's index in prompt + output
    kept: bool  # whether the runner keeps the token (False: a chunked-prefill row)
    token: int
    logprob: float


class Batch:
    """The continuous batching of :func:`sampler_rows` one engine step at a time, requests joining between steps
    (the fake ``LLMEngine``'s request path): :meth:`add` queues one (internal id, prompt length, output tokens,
    their log-probs), :meth:`step` returns the step's rows and the ids of the requests whose last token it
    sampled (finished now; their row past the stop comes with the next step)."""

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)
        self._waiting: list[tuple[int, tuple]] = []
        self._running: list[list] = []  # [request, tokens made, phase, preempt at]
        self._added = 0

    def add(self, request: tuple[str, int, list[int], list[float]]) -> None:
        self._waiting.append((self._added, request))
        self._added += 1

    def busy(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> tuple[list[Row], list[str]]:
        garbage = (lambda: (self._rng.randrange(1000), -self._rng.random() * 5))
        while self._waiting and len(self._running) < MAX_RUNNING:
            k, request = self._waiting.pop(0)
            self._running.append([request, 0, "chunk" if request[1] > CHUNK else "last", 2 if k % 3 == 1 else -1])
        rows, done, finished = [], [], []
        for state in self._running:
            request, made, phase, preempt_at = state
            rid, plen, tokens, values = request
            if phase == "chunk":  # a first prefill chunk (of the prompt, or of prompt + output when recomputed)
                rows.append(Row(rid, CHUNK if made == 0 else plen + made - 1, False, *garbage()))
                state[2] = "last"
            elif phase == "extra":  # async scheduling: a step past the stop
                rows.append(Row(rid, plen + made, True, *garbage()))
                done.append(state)
            else:
                rows.append(Row(rid, plen + made, True, tokens[made], values[made]))
                state[1] = made = made + 1
                if made == len(tokens):
                    state[2] = "extra"
                    finished.append(rid)
                elif made == preempt_at and len(tokens) >= 3:  # preempted: recomputed in two chunks
                    state[2], state[3] = "chunk", -1
                else:
                    state[2] = "decode"
        self._running = [s for s in self._running if s not in done]
        return rows, finished


def sampler_rows(requests: list[tuple[str, int, list[int], list[float]]], seed: int = 0) -> list[list[Row]]:
    """The sampler rows of each engine step for ``requests`` (internal id, prompt length, output tokens, their
    log-probs), as vLLM's runners produce them: at most :data:`MAX_RUNNING` running; a prompt longer than
    :data:`CHUNK` prefills in two steps (the first row sampled and discarded); one decode row per step; a request
    is preempted once (every third request with >= 3 tokens, after 2 tokens) and recomputed in two chunks (the
    first row's index inside its output, discarded); one more kept row after a request's last token (async
    scheduling runs a step past the stop; the scheduler drops it). Rows that are not output tokens carry
    random tokens and log-probs."""
    batch = Batch(seed)
    for request in requests:
        batch.add(request)
    steps = []
    while batch.busy():
        rows, _ = batch.step()
        if rows:
            steps.append(rows)
    return steps


class _SamplerV1:
    """``vllm.v1.sample.sampler.Sampler``: ``forward`` calls ``sample``."""

    logprobs_mode = "processed_logprobs"

    def __call__(self, logits, sampling_metadata):
        sampled, _ = self.sample(logits, sampling_metadata)
        return SimpleNamespace(sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1))

    def sample(self, logits, sampling_metadata):
        return logits.argmax(dim=-1), None if sampling_metadata.all_greedy else logits.clone()

    @staticmethod
    def compute_logprobs(logits):
        return logits.clone()


class _SamplerV2:
    """``vllm.v1.worker.gpu.sample.sampler.Sampler``: ``__call__`` calls ``sample``."""

    logprobs_mode = "processed_logprobs"
    use_flashinfer = False

    def __call__(self, logits, input_batch):
        pos = input_batch.positions[input_batch.logits_indices]
        sampled, _ = self.sample(logits, None, None, pos, None, None, return_logprobs=False)
        return SimpleNamespace(sampled_token_ids=sampled.view(-1, 1), num_sampled=input_batch.fake_num_sampled,
                               num_rejected=torch.zeros_like(input_batch.fake_num_sampled))

    def sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos,
               return_logprobs=False):
        return logits.argmax(dim=-1), logits.clone()


def _logits(rows: list[Row], vocab: int) -> torch.Tensor:
    logits = torch.full((len(rows), max(vocab, 1000)), float("-inf"))
    for i, row in enumerate(rows):
        logits[i, row.token] = row.logprob
    return logits


class RunnerV1:
    """``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` as far as the log-prob capture reads it."""

    def __init__(self, model, max_rows: int = 64):
        self._model = model
        self.sampler = _SamplerV1()
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0)
        self.optimistic_seq_lens_cpu = torch.zeros(max_rows, dtype=torch.int32)
        self.discard_request_mask = SimpleNamespace(np=np.zeros(max_rows, dtype=bool))

    def get_model(self):
        return self._model

    def _sample(self, logits, spec_decode_metadata):
        return self.sampler(logits, self._metadata)

    def run_step(self, rows: list[Row], vocab: int, greedy: bool) -> None:
        n = len(rows)
        self.input_batch.req_ids[:] = [r.req_id for r in rows] + ["stale"]  # vLLM keeps one list, in place
        self.input_batch.num_reqs = n
        self.optimistic_seq_lens_cpu[:n] = torch.tensor([r.index for r in rows], dtype=torch.int32)
        self.discard_request_mask.np[:n] = [not r.kept for r in rows]
        self._metadata = SimpleNamespace(all_greedy=greedy)
        self._sample(_logits(rows, vocab), None)


class RunnerV2:
    """``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` as far as the log-prob capture reads it."""

    def __init__(self, model):
        self._model = model
        self.sampler = _SamplerV2()

    def get_model(self):
        return self._model

    def sample(self, hidden_states, input_batch, grammar_output):
        out = self.sampler(hidden_states, input_batch)
        return out, out.num_sampled, out.num_rejected

    def run_step(self, rows: list[Row], vocab: int, greedy: bool) -> None:
        n = len(rows)
        batch = SimpleNamespace(req_ids=[r.req_id for r in rows], num_draft_tokens=0,
                                positions=torch.tensor([r.index - 1 for r in rows] + [0], dtype=torch.int64),
                                logits_indices=torch.arange(n),
                                fake_num_sampled=torch.tensor([int(r.kept) for r in rows], dtype=torch.int32))
        self.sample(_logits(rows, vocab), batch, None)
