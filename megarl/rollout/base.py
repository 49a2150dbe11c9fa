"""The rollout-engine interface: sampling settings, generation outputs, and the protocol every engine follows.

The trainer talks to a rollout engine (vLLM on GPU, transformers on CPU) only through :class:`RolloutEngine`:

1. ``wake_up()`` and ``update_weights(write)``: the reshard executor writes the actor's weights straight into
   the engine's own parameters, laid out as ``weight_layout(ranks)`` says;
2. ``generate(prompt_token_ids, sampling)``: ``sampling.n`` samples per prompt, each with its response token
   ids, the log-prob of every sampled token and why it ended;
3. ``sleep()``: give the engine's memory back for the training phase.

Log-prob semantics (every engine): the log-prob of a sampled token is taken under ``softmax(logits /
temperature)`` over the full vocab (``softmax(logits)`` when greedy), before top-k/top-p truncation. That is
what the actor's teacher-forced log-probs compute (:func:`megarl.models.logprobs.vocab_parallel_logprobs`),
so the PPO ratio is 1 on the first update when the weights agree.

Seeding (every engine): the sample ``j`` of the prompt at global index ``i`` in the ``c``-th ``generate`` call
of an engine draws its random numbers from :func:`sample_seed` ``(sampling.seed, c, i, j)`` alone, so the
samples do not depend on how prompts are batched or split across data-parallel ranks (up to floating-point
differences of the logits between batch shapes, which can flip a near-tie).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from megarl.models.layout import Layout
from megarl.models.spec import ModelSpec
from megarl.models.weights import fill_local_tensors, state_dict_reader

FinishReason = Literal["stop", "length"]
WriteFn = Callable[[dict[str, torch.Tensor]], Any]


class RolloutError(ValueError):
    """Sampling settings or prompts that an engine cannot generate from, or an engine in the wrong state."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses, validated at construction.

    Attributes:
        n: samples per prompt (GRPO/RLOO groups), >= 1.
        temperature: softmax temperature, >= 0; 0 means greedy (argmax).
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability reaches
            ``top_p``; in (0, 1], 1 = off.
        top_k: keep the ``top_k`` most likely tokens; -1 = off, else >= 1.
        max_new_tokens: response length limit, tokens, >= 1 (also cut at the model's context length).
        stop_token_ids: tokens that end a response besides the model's EOS tokens (the stop token is kept
            in the response, with its log-prob).
        seed: base seed of every random draw (see :func:`sample_seed`).

    Raises:
        RolloutError: a field outside its range (the message names the field).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.n < 1:
            raise RolloutError(f"sampling.n must be >= 1 (samples per prompt), got {self.n}")
        if self.temperature < 0:
            raise RolloutError(f"sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RolloutError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise RolloutError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise RolloutError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise RolloutError(f"sampling.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        """Argmax decoding (``temperature == 0``)."""
        return self.temperature == 0


@dataclass(frozen=True)
class Sample:
    """One generated response.

    Attributes:
        prompt_index: index of its prompt in the whole prompt list (across data-parallel ranks).
        sample_index: which of the ``n`` samples of that prompt, ``0 .. n-1``.
        token_ids: the response tokens, ending with the stop token when ``finish_reason == "stop"``.
        logprobs: ``[len(token_ids)]`` float32, log-prob of each sampled token (module docstring).
        finish_reason: "stop" (an EOS or stop token was sampled) or "length" (``max_new_tokens`` or the
            context length was reached).
        adapter_version: the version (step) of the LoRA adapters it was sampled with, merged into the weights
            or applied by the engine's LoRA layers (the engine's ``adapter_version`` when the request started);
            None without LoRA.
        routed_experts: ``[prompt + response tokens - 1, layers, top_k]`` int16, the experts each token of the
            prompt and the response (all but the last) was routed to in each MoE layer, by an engine that records
            them (the transformers engine, for an MoE model; vLLM with ``record_routes``:
            :mod:`megarl.models.router_replay`); else None.
        policy_version: the version (step) of the policy weights that sampled every one of its tokens (the
            engine's ``policy_version`` when the request started: its weights change only between requests);
            None where nobody set it.
    """

    prompt_index: int
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    adapter_version: int | None = None
    routed_experts: torch.Tensor | None = None
    policy_version: int | None = None


@dataclass(frozen=True)
class Completion:
    """One finished request of a :class:`RequestEngine` (one turn of an episode).

    Attributes:
        request_id: the id it was added under.
        token_ids: the sampled tokens, ending with the stop token when ``finish_reason == "stop"``.
        logprobs: ``[len(token_ids)]`` float32, log-prob of each sampled token (module docstring).
        finish_reason: "stop" or "length" (its ``max_new_tokens`` or the context was reached).
        cached_tokens: prompt tokens the engine's prefix cache held already (vLLM's ``num_cached_tokens``;
            0 where the engine keeps no cache between requests).
        policy_version: the version of the weights that sampled its tokens (as :attr:`Sample.policy_version`).
        routed_experts: ``[prompt + sampled tokens - 1, layers, top_k]`` int16, the experts each token of the
            request's prompt (prefilled) and of its sampled tokens but the last was routed to, as
            :attr:`Sample.routed_experts`; None where the engine records none.
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: torch.Tensor
    finish_reason: FinishReason
    cached_tokens: int = 0
    policy_version: int | None = None
    routed_experts: torch.Tensor | None = None


@dataclass(frozen=True)
class RolloutStats:
    """Throughput of one ``generate`` call (summed over data-parallel ranks; seconds of the slowest rank).

    Attributes:
        prompt_tokens: prompt tokens processed, counted once per sample (tokens).
        generated_tokens: response tokens generated (tokens).
        seconds: wall-clock time of the call (seconds).
    """

    prompt_tokens: int
    generated_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall-clock time."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RolloutOutput:
    """The samples of one ``generate`` call, grouped by prompt.

    Attributes:
        samples: prompt-major: ``samples[k * n + j]`` is sample ``j`` of the ``k``-th prompt of the call.
        n: samples per prompt.
        stats: throughput.
    """

    samples: list[Sample]
    n: int
    stats: RolloutStats

    @classmethod
    def collect(cls, samples: list[Sample], n: int, prompts: Sequence[Sequence[int]],
                seconds: float) -> "RolloutOutput":
        """The output of a call that generated ``samples`` (``n`` per prompt of ``prompts``) in ``seconds``."""
        stats = RolloutStats(prompt_tokens=n * sum(len(p) for p in prompts),
                             generated_tokens=sum(len(s.token_ids) for s in samples), seconds=seconds)
        return cls(samples, n, stats)

    @property
    def num_prompts(self) -> int:
        """Prompts of the call (``len(samples) / n``)."""
        return len(self.samples) // self.n

    def group(self, k: int) -> list[Sample]:
        """The ``n`` samples of the ``k``-th prompt of the call."""
        return self.samples[k * self.n:(k + 1) * self.n]

    def padded(self, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The responses as right-padded tensors, in sample order.

        Returns:
            ``(token_ids [N, L] int64 padded with pad_token_id, logprobs [N, L] float32 padded with 0,
            lengths [N] int64)``, ``N = len(samples)``, ``L`` the longest response (tokens).
        """
        lengths = torch.tensor([len(s.token_ids) for s in self.samples], dtype=torch.int64)
        width = int(lengths.max()) if len(self.samples) else 0
        ids = torch.full((len(self.samples), width), pad_token_id, dtype=torch.int64)
        logprobs = torch.zeros(len(self.samples), width, dtype=torch.float32)
        for k, s in enumerate(self.samples):
            ids[k, :len(s.token_ids)] = torch.tensor(s.token_ids, dtype=torch.int64)
            logprobs[k, :len(s.token_ids)] = s.logprobs
        return ids, logprobs, lengths


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine (vLLM on GPU, transformers on CPU).

    Attributes:
        spec: the model the engine runs.
        adapter_version: the version of the LoRA adapters its weights hold (set by whoever writes them), stamped
            on every sample (:attr:`Sample.adapter_version`); None without LoRA.
        policy_version: the version (step) of the policy weights it holds (set by whoever writes them),
            stamped on every sample and completion (:attr:`Sample.policy_version`); None until set.
    """

    spec: ModelSpec
    adapter_version: int | None
    policy_version: int | None

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_offset: int = 0) -> RolloutOutput:
        """Sample ``sampling.n`` responses for every prompt.

        Args:
            prompt_token_ids: token ids of each prompt (no padding).
            sampling: how to sample.
            prompt_offset: global index of the first prompt (its samples' ``prompt_index`` and seeds), for
                data-parallel shards.

        Raises:
            RolloutError: a bad prompt (:func:`check_prompts`), or the engine is asleep or has no weights.
        """

    def weight_layout(self, ranks: Iterable[int]) -> Layout:
        """The destination layout of this engine on global ``ranks`` (what ``update_weights`` hands over)."""

    def update_weights(self, write: WriteFn) -> Any:
        """Let ``write`` fill the engine's own weight tensors in place, then make them take effect.

        ``write`` receives ``{local name: tensor}``, the names and shapes of this rank's entry of
        :meth:`weight_layout`, and must write every tensor (the reshard executor, or :func:`state_dict_writer`).

        Returns:
            What ``write`` returns (e.g. the executor's ``ReshardStats``).
        """

    def sleep(self, level: int = 1) -> None:
        """Release memory for the training phase (level 1: KV cache; level 2: the weights too)."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep`; after a level-2 sleep, ``update_weights`` must run before ``generate``."""


@runtime_checkable
class RequestEngine(Protocol):
    """An engine that takes requests one at a time and finishes each on its own (what multi-turn episodes
    need: :mod:`megarl.agents.rollout` adds an episode's next turn as soon as its tools have answered, while
    the other requests decode). vLLM drives its ``LLMEngine`` request by request; the transformers engine
    generates the requests added since its last :meth:`step` as one batch.

    Log-probs and seeding as for :meth:`RolloutEngine.generate`: a request's random draws come from its
    ``seed`` alone.
    """

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingConfig,
                    seed: int) -> None:
        """Queue one request: ``sampling.n`` must be 1; ``sampling.max_new_tokens`` is this request's limit
        (cut further at the context).

        Raises:
            RolloutError: a bad prompt (:func:`check_prompts`), ``n != 1``, a sleeping engine or no weights.
        """

    def step(self) -> list[Completion]:
        """Advance generation and return the requests that finished (in any order; none yet is ``[]``)."""

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued or running."""


def check_prompts(prompt_token_ids: Sequence[Sequence[int]], *, max_context: int,
                  vocab_size: int) -> list[list[int]]:
    """Validate prompts and return them as lists of ints.

    A prompt must be non-empty, hold ids in ``[0, vocab_size)``, and leave room for at least one response
    token in the context (at most ``max_context - 1`` tokens).

    Raises:
        RolloutError: naming the prompt index and, for a long prompt, its length and the limit.
    """
    out = []
    for i, prompt in enumerate(prompt_token_ids):
        ids = [int(t) for t in prompt]
        if not ids:
            raise RolloutError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(ids) >= max_context:
            raise RolloutError(f"prompt {i} has {len(ids)} tokens, which leaves no room for a response in the "
                               f"context of {max_context} tokens (at most {max_context - 1} prompt tokens)")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RolloutError(f"prompt {i} has token ids outside the vocab [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def check_ready(asleep: bool, has_weights: bool) -> None:
    """An engine can generate only awake and with weights.

    Raises:
        RolloutError: naming the call that fixes it (``wake_up`` or ``update_weights``).
    """
    if asleep:
        raise RolloutError("generate on a sleeping engine: call wake_up() first")
    if not has_weights:
        raise RolloutError("the engine has no weights: call update_weights() before generate()")


def sample_rows(num_prompts: int, n: int) -> list[tuple[int, int]]:
    """``(prompt k, sample j)`` of every sample of a call, prompt-major (the order of ``RolloutOutput``)."""
    return [(k, j) for k in range(num_prompts) for j in range(n)]


def sample_seed(seed: int, call: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit seed of one sample's random draws: a hash of the base seed, the engine's call counter, the
    global prompt index and the sample index (numpy's ``SeedSequence``), independent of batching."""
    state = np.random.SeedSequence([seed, call, prompt_index, sample_index]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def turn_seed(seed: int, call: int, prompt_index: int, sample_index: int, turn: int) -> int:
    """The seed of turn ``turn`` (0-based) of an episode: :func:`sample_seed` for the first turn (a one-turn
    episode samples as :meth:`RolloutEngine.generate` would), a hash of all five numbers for the others."""
    if turn == 0:
        return sample_seed(seed, call, prompt_index, sample_index)
    state = np.random.SeedSequence([seed, call, prompt_index, sample_index, turn]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def state_dict_writer(state_dict: Mapping[str, torch.Tensor], layout: Layout, rank: int) -> WriteFn:
    """A ``write`` for :meth:`RolloutEngine.update_weights` that copies from a canonical (HF) state dict.

    Args:
        state_dict: canonical name -> whole tensor (e.g. ``AutoModelForCausalLM.state_dict()``); extra
            entries (a tied ``lm_head.weight``) are ignored.
        layout: the engine's :meth:`~RolloutEngine.weight_layout`.
        rank: the global rank whose local tensors are written.

    Raises (when called):
        SpecError: a tensor missing from the state dict or the engine, or of another shape.
    """
    read = state_dict_reader(state_dict, layout.canonical)

    def write(tensors: dict[str, torch.Tensor]) -> None:
        fill_local_tensors(layout.tensors(rank), tensors, read)

    return write
