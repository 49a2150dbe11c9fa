"""Multi-turn rollouts: many episodes at once, each advancing on its own, over one request-level engine.

Two parts, so that an agent written as ordinary code (an OpenAI-compatible endpoint in front of the engine)
can use the first without the second:

- :class:`GenerationLoop`: drives a :class:`~megarl.rollout.base.RequestEngine` from the calling thread (vLLM
  wants its engine stepped where it was built). Any thread :meth:`~GenerationLoop.submit`\\ s a request
  (prompt ids in) and gets a ``Future`` of its :class:`~megarl.rollout.base.Completion` (sampled ids and their
  log-probs out); the loop adds it to the engine at its next iteration, beside the requests already decoding,
  and resolves the future the iteration it finishes. An agent's call is exactly that; recording each call's
  ``(prompt_ids, sampled ids, log-probs)`` per episode and handing them to
  :func:`megarl.agents.episode.samples_from_calls` gives the trained samples.
- :func:`run_episodes`: one worker thread per episode (up to ``max_parallel_episodes`` at a time) runs the
  environment loop below as plain sequential code, blocking on its own futures only: while one episode's
  tools run, the others' turns decode, and its next turn joins the engine's running batch as soon as its tools
  answer (on vLLM that is the next scheduler iteration; on the transformers engine, its next ``step``). An
  episode's turns go to the same engine with prompts that extend each other, so vLLM's prefix cache serves
  every turn's history (``agent/prefix_cache_hit_rate``).

One episode (``rollout.multi_turn``): ``env.reset(row, prompt)`` gives the first messages; each turn samples at
most ``min(rollout.max_new_tokens, the episode's tokens left, the context left)`` tokens
(:func:`~megarl.rollout.base.turn_seed` seeds it), the parser reads its tool calls, the tools run
(:func:`~megarl.agents.tools.run_tool_calls`, ``tool_timeout_s`` each), ``env.step(turn)`` answers, and the
observation messages (each cut to ``max_observation_tokens``) are appended as tokens
(:mod:`megarl.agents.episode`). A turn cut at ``rollout.max_new_tokens`` goes on like any other (its
``finish_reason`` is "length"; the template closes it, a half-written call is malformed; ``agent/turns_cut``).
The episode ends when the environment says done, after ``max_turns`` turns, when the episode's
``max_episode_tokens`` (sampled and observation tokens after the first prompt) or the context would be
exceeded (a turn cut by either ends it too), or when the environment raises or runs past ``env_timeout_s`` in
``reset`` or ``step`` (its call is left running in a daemon thread). ``EpisodeResult.end`` says which; the
metrics count each.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch.distributed as dist

from megarl.agents.env import AssistantTurn, EnvironmentFactory, Message
from megarl.agents.episode import ChatRenderer, EpisodeTokens, TokenSample
from megarl.agents.tools import ERROR_KINDS, TimedCall, Tool, ToolResult, run_tool_calls
from megarl.rollout.base import Completion, RequestEngine, RolloutStats, SamplingConfig, turn_seed
from megarl.rollout.data_parallel import shard_bounds

log = logging.getLogger(__name__)

ENDS = ("done", "max_turns", "episode_budget", "context", "env_error", "env_timeout")
ENV_SEED_TURN = 2**31 - 1  # the "turn" of turn_seed that seeds an episode's environment (env.rng)


class GenerationLoop:
    """Requests from any thread, one engine stepped by the thread that calls :meth:`run` (module docstring).

    Args:
        engine: the request-level engine.

    Attributes:
        prompt_tokens / cached_tokens / generated_tokens: totals over the completed requests (tokens).
    """

    def __init__(self, engine: RequestEngine):
        self.engine = engine
        self._submitted: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._failed: BaseException | None = None
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0

    def submit(self, prompt_ids: Sequence[int], sampling: SamplingConfig, seed: int) -> Future:
        """Queue a request (``sampling.n == 1``; its ``max_new_tokens`` is this request's limit); returns the
        future of its :class:`~megarl.rollout.base.Completion` (set with the engine's error if it refuses it)."""
        with self._id_lock:
            request_id = f"megarl-{self._next_id}"
            self._next_id += 1
        future: Future = Future()
        if self._failed is not None:  # the loop has stopped on an engine error
            future.set_exception(self._failed)
        else:
            self._submitted.put((request_id, list(prompt_ids), sampling, seed, future))
        return future

    def run(self, finished: Callable[[], bool], poll_s: float = 0.01, pause: "WeightUpdate | None" = None) -> None:
        """Step the engine until ``finished()`` and nothing is left running: each iteration adds what was
        submitted, then runs one engine step (or, with nothing running, waits up to ``poll_s`` seconds for a
        submission). ``pause``: new weights that may arrive meanwhile (in-flight updates between turns): once
        ``pause.due()``, nothing more is added, the running requests finish with the weights they started
        with, ``pause()`` writes the new weights, and the requests submitted meanwhile (the episodes' next
        turns) run with them; every completion is stamped with the version that sampled it.

        Raises:
            whatever the engine's ``step`` raises (every waiting future gets it first, so no worker hangs).
        """
        try:
            while True:
                if pause is not None and pause.due():
                    if self.engine.has_unfinished_requests():  # the turns running end on the old weights
                        for c in self.engine.step():
                            self._finish(c)
                        continue
                    pause()
                    pause = None
                self._add_submitted(block=not self.engine.has_unfinished_requests(), timeout=poll_s)
                if self.engine.has_unfinished_requests():
                    for c in self.engine.step():
                        self._finish(c)
                elif finished() and self._submitted.empty():
                    return
        except BaseException as e:
            self._failed = e
            for future in self._futures.values():
                future.set_exception(e)
            self._futures.clear()
            while not self._submitted.empty():
                self._submitted.get_nowait()[-1].set_exception(e)
            raise

    def _add_submitted(self, block: bool, timeout: float) -> None:
        try:
            item = self._submitted.get(timeout=timeout) if block else self._submitted.get_nowait()
        except queue.Empty:
            return
        while True:
            request_id, prompt, sampling, seed, future = item
            try:
                self.engine.add_request(request_id, prompt, sampling, seed)
                self._futures[request_id] = future
                self.prompt_tokens += len(prompt)
            except Exception as e:  # noqa: BLE001 (the submitter gets the engine's refusal)
                future.set_exception(e)
            try:
                item = self._submitted.get_nowait()
            except queue.Empty:
                return

    def _finish(self, c: Completion) -> None:
        self.cached_tokens += c.cached_tokens
        self.generated_tokens += len(c.token_ids)
        self._futures.pop(c.request_id).set_result(c)


class WeightUpdate(Protocol):
    """New weights that may arrive while episodes run (:meth:`GenerationLoop.run`'s ``pause``)."""

    def due(self) -> bool:
        """Whether the new weights wait to be written (polled between engine steps; must not block)."""

    def __call__(self) -> None:
        """Write them into the engine (no request is running); it stamps its completions with their version."""


@dataclass
class EpisodeSettings:
    """How episodes run (``rollout.multi_turn`` and ``rollout.max_new_tokens``).

    Attributes:
        max_turns: turns per episode, >= 1.
        max_turn_tokens: tokens one turn may sample (``rollout.max_new_tokens``).
        max_episode_tokens: sampled and observation tokens after the first prompt; 0 = the context only.
        tool_timeout_s: seconds per tool call.
        env_timeout_s: seconds per environment call (``reset``, ``step``); past them the episode ends
            (``env_timeout``).
        max_observation_tokens: longer observation messages are cut (``truncated``); 0 = no limit.
        max_parallel_episodes: episodes (worker threads) at a time.
    """

    max_turns: int = 4
    max_turn_tokens: int = 64
    max_episode_tokens: int = 0
    tool_timeout_s: float = 10.0
    env_timeout_s: float = 60.0
    max_observation_tokens: int = 256
    max_parallel_episodes: int = 256


@dataclass
class EpisodeResult:
    """One finished episode.

    Attributes:
        prompt_index / sample_index: its prompt (global index) and which of the prompt's ``n`` episodes.
        samples: its trained sequences (:class:`~megarl.agents.episode.TokenSample`; more than one where it
            was split), in order.
        reward: the sum of the environment's rewards, or None where it gave none (then ``reward.fn`` scores
            ``last_text``).
        end: why it ended (one of :data:`ENDS`).
        last_text: the last assistant message's text (what ``reward.fn`` scores).
        messages: the whole history (for samples.jsonl).
        turns: turns sampled.
        tool_calls: calls read by the parser (malformed ones not counted).
        tool_errors: error kind -> count (:data:`~megarl.agents.tools.ERROR_KINDS`; an environment that raised
            ends the episode with ``end == "env_error"`` instead, one past ``env_timeout_s`` with "env_timeout").
        env_seconds: wall seconds in ``reset``, ``step`` and the tools.
        splits: times the history was split into a new sample.
        turns_cut: turns cut at ``rollout.max_new_tokens``.
        finish_reason: "length" when the episode was cut by its token budget or the context, or its last turn
            at ``rollout.max_new_tokens``; else "stop".
        metrics: the environment's figures of the episode (``Environment.metrics``: ``reward/<name>``, ...).
    """

    prompt_index: int
    sample_index: int
    samples: list[TokenSample]
    reward: float | None
    end: str
    last_text: str
    messages: list[Message]
    turns: int
    tool_calls: int
    tool_errors: dict[str, int]
    env_seconds: float
    splits: int
    turns_cut: int = 0
    last_cut: bool = False
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def finish_reason(self) -> str:
        return "length" if self.end in ("episode_budget", "context") or self.last_cut else "stop"

    @property
    def sampled_tokens(self) -> int:
        return sum(sum(s.mask) for s in self.samples)

    @property
    def observation_tokens(self) -> int:
        return sum(len(s.mask) - sum(s.mask) for s in self.samples)


@dataclass
class EpisodeBatch:
    """The episodes of one rollout, prompt-major (``episodes[k * n + j]``: episode ``j`` of prompt ``k``).

    Attributes:
        episodes: the results.
        n: episodes per prompt.
        stats: prompt tokens of every turn, sampled tokens, seconds (for the throughput figures).
        cached_tokens: prompt tokens the engine's prefix cache served.
        adapter_version: the LoRA adapters' version of the engine that ran them (one per rollout: its weights
            change between rollouts); None without LoRA.
    """

    episodes: list[EpisodeResult]
    n: int
    stats: RolloutStats
    cached_tokens: int = 0
    adapter_version: int | None = None

    @property
    def num_prompts(self) -> int:
        """Prompts of the rollout (``len(episodes) / n``)."""
        return len(self.episodes) // self.n

    def group(self, k: int) -> list[EpisodeResult]:
        """The ``n`` episodes of the ``k``-th prompt (DAPO's group: :mod:`megarl.trainer.dynamic_sampling`)."""
        return self.episodes[k * self.n:(k + 1) * self.n]

    def metrics(self) -> dict[str, float]:
        """Per-step figures (``agent/...``): turns, tool calls and errors by kind, environment seconds, tokens by
        role, episodes by how they ended, splits, prefix-cache hit rate; and the environments' own figures
        (``EpisodeResult.metrics``), each the mean over the episodes that report it."""
        eps = self.episodes
        count = max(len(eps), 1)
        errors = Counter()
        for e in eps:
            errors.update(e.tool_errors)
        calls = sum(e.tool_calls for e in eps)
        out = {
            "agent/turns_mean": float(np.mean([e.turns for e in eps])) if eps else 0.0,
            "agent/turns_max": float(max((e.turns for e in eps), default=0)),
            "agent/tool_calls_per_episode": calls / count,
            "agent/tool_use_rate": sum(e.tool_calls > 0 for e in eps) / count,
            "agent/tool_errors": float(sum(errors.values())),
            "agent/env_seconds": float(sum(e.env_seconds for e in eps)),
            "agent/sampled_tokens": float(sum(e.sampled_tokens for e in eps)),
            "agent/observation_tokens": float(sum(e.observation_tokens for e in eps)),
            "agent/samples_split": float(sum(e.splits for e in eps)),
            "agent/turns_cut": float(sum(e.turns_cut for e in eps)),
            "agent/env_timeouts": float(sum(e.end == "env_timeout" for e in eps)),
            "agent/prefix_cache_hit_rate": self.cached_tokens / max(self.stats.prompt_tokens, 1),
        }
        out.update({f"agent/tool_errors/{k}": float(errors.get(k, 0)) for k in ERROR_KINDS})
        ends = Counter(e.end for e in eps)
        out.update({f"agent/ended/{k}": ends.get(k, 0) / count for k in ENDS})
        for name in sorted({k for e in eps for k in e.metrics}):  # each over the episodes that report it
            values = [e.metrics[name] for e in eps if name in e.metrics]
            out[name] = float(np.mean(values))
        return out


def run_episodes(engine: RequestEngine, renderer: ChatRenderer, env_factory: EnvironmentFactory,
                 rows: Sequence[Mapping[str, Any]], prompts: Sequence[list[Message]], sampling: SamplingConfig,
                 settings: EpisodeSettings, *, call: int = 0, prompt_offset: int = 0,
                 pause: WeightUpdate | None = None) -> EpisodeBatch:
    """Run ``sampling.n`` episodes for every row (module docstring), interleaved on ``engine``; ``pause``: new
    weights taken between turns once due (:meth:`GenerationLoop.run`).

    Args:
        engine: a request-level engine with weights, awake.
        renderer: chat template, tools and tokenizer.
        env_factory: builds each episode's environment.
        rows / prompts: each prompt's dataset row and its chat messages (``data.prompt_key`` templated).
        sampling: temperature etc. and ``seed``; ``n`` episodes per prompt (``max_new_tokens`` is replaced by
            each turn's budget).
        call: the engine's call counter (part of every turn's seed). prompt_offset: the global index of the
            first prompt (data-parallel shares), for ``prompt_index`` and the seeds.

    Returns:
        The episodes, prompt-major. Nothing an environment or tool does raises here.

    Raises:
        RolloutError: from the engine (a sleeping engine, no weights).
    """
    start = time.perf_counter()
    loop = GenerationLoop(engine)
    tools = {t.name: t for t in renderer.tools}
    stop = tuple(getattr(engine, "spec").eos_token_ids) + tuple(sampling.stop_token_ids)
    context = engine.spec.max_position_embeddings
    jobs = [(k, j) for k in range(len(rows)) for j in range(sampling.n)]
    results: list[EpisodeResult | None] = [None] * len(jobs)

    def work(index: int) -> None:
        k, j = jobs[index]
        results[index] = _episode(loop, renderer, env_factory(), tools, rows[k], prompts[k], sampling, settings,
                                  stop, context, call, prompt_offset + k, j)

    with ThreadPoolExecutor(max_workers=max(1, min(settings.max_parallel_episodes, len(jobs))),
                            thread_name_prefix="episode") as pool:
        futures = [pool.submit(work, i) for i in range(len(jobs))]
        loop.run(lambda: all(f.done() for f in futures), pause=pause)
        for f in futures:
            f.result()  # an error of the framework itself (environment and tool errors are results)
    stats = RolloutStats(prompt_tokens=loop.prompt_tokens, generated_tokens=loop.generated_tokens,
                         seconds=time.perf_counter() - start)
    return EpisodeBatch(results, sampling.n, stats, loop.cached_tokens)


def _episode(loop: GenerationLoop, renderer: ChatRenderer, env, tools: Mapping[str, Tool], row, prompt,
             sampling: SamplingConfig, settings: EpisodeSettings, stop: Sequence[int], context: int, call: int,
             prompt_index: int, sample_index: int) -> EpisodeResult:
    """One episode, on a worker thread (module docstring)."""
    tokens = EpisodeTokens(renderer, stop)
    env.rng = random.Random(turn_seed(sampling.seed, call, prompt_index, sample_index, ENV_SEED_TURN))
    errors: Counter = Counter()
    state = {"env_s": 0.0, "calls": 0, "rewards": [], "text": "", "turns": 0, "used": 0, "cut": 0, "last_cut": False}

    def finish(end: str) -> EpisodeResult:
        if end != "env_error" and callable(getattr(env, "close", None)):
            t0 = time.perf_counter()
            try:
                closing = env.close(end)
            except Exception as e:  # noqa: BLE001
                log.warning("environment close failed (prompt %d): %s: %s", prompt_index, type(e).__name__, e)
                end, closing = "env_error", None
            state["env_s"] += time.perf_counter() - t0
            if closing is not None:
                state["rewards"].append(float(closing))
        rewards = state["rewards"]
        reward = 0.0 if end in ("env_error", "env_timeout") else (float(sum(rewards)) if rewards else None)
        return EpisodeResult(prompt_index, sample_index, tokens.trained_samples, reward, end, state["text"],
                             tokens.messages, state["turns"], state["calls"], dict(errors), state["env_s"],
                             tokens.splits, state["cut"], state["last_cut"],
                             {k: float(v) for k, v in dict(getattr(env, "metrics", None) or {}).items()})

    t0 = time.perf_counter()
    first, failed = _env_call(env.reset, settings.env_timeout_s, f"reset (prompt {prompt_index})", row,
                              [dict(m) for m in prompt])
    state["env_s"] += time.perf_counter() - t0
    if failed:
        tokens.messages = list(prompt)
        return finish(failed)
    tokens.begin(first)
    for turn in range(settings.max_turns):
        limits = {"turn": settings.max_turn_tokens,
                  "episode_budget": settings.max_episode_tokens - state["used"] if settings.max_episode_tokens
                  else settings.max_turn_tokens,
                  "context": context - len(tokens.current.ids)}
        binding = min(limits, key=lambda name: limits[name])  # ties: the order above
        if limits[binding] < 1:
            return finish(binding)
        done = loop.submit(tokens.current.ids, dataclasses.replace(sampling, n=1, max_new_tokens=limits[binding]),
                           turn_seed(sampling.seed, call, prompt_index, sample_index, turn)).result()
        state["turns"] += 1
        state["used"] += len(done.token_ids)
        state["text"] = text = tokens.add_turn(done.token_ids, done.logprobs.tolist(), done.policy_version,
                                               done.routed_experts)
        state["last_cut"] = done.finish_reason == "length"
        if state["last_cut"] and binding != "turn":
            return finish(binding)
        state["cut"] += state["last_cut"]
        t0 = time.perf_counter()
        calls, malformed = renderer.parser.parse(text, tools)
        results = run_tool_calls(calls, tools, settings.tool_timeout_s) if calls else []
        results += [ToolResult(None, f"error: could not read the tool call {m[:200]!r}", "malformed")
                    for m in malformed]
        state["calls"] += len(calls)
        errors.update(r.error for r in results if r.error)
        answer, failed = _env_call(env.step, settings.env_timeout_s, f"step (prompt {prompt_index}, turn {turn})",
                                   AssistantTurn(text, calls, results, turn, done.finish_reason))
        if failed:
            state["env_s"] += time.perf_counter() - t0
            return finish(failed)
        if answer.reward is not None:
            state["rewards"].append(float(answer.reward))
        observations = [_cut(renderer, m, settings.max_observation_tokens, errors) for m in answer.messages]
        state["env_s"] += time.perf_counter() - t0
        if answer.done:
            return finish("done")
        if turn + 1 == settings.max_turns:
            break
        ids, append_only, observed = tokens.observation_ids(observations)
        if settings.max_episode_tokens and state["used"] + observed >= settings.max_episode_tokens:
            return finish("episode_budget")
        if (len(tokens.current.ids) + len(ids) if append_only else len(ids)) >= context:
            return finish("context")
        tokens.add_observations(observations, ids, append_only)
        state["used"] += observed
    return finish("max_turns")


def _env_call(method: Callable[..., Any], timeout_s: float, what: str, *args: Any) -> tuple[Any, str | None]:
    """``method(*args)`` of an environment, given ``timeout_s`` seconds in a thread of its own
    (:class:`~megarl.agents.tools.TimedCall`): ``(its value, None)``, or ``(None, "env_error")`` where it raised
    (an ``Exception``) and ``(None, "env_timeout")`` where it ran past them (left running; a warning each)."""
    call = TimedCall(functools.partial(method, *args), {}, name=f"env-{method.__name__}")
    if not call.wait(time.perf_counter() + timeout_s):
        log.warning("environment %s ran past rollout.multi_turn.env_timeout_s=%g s: its episode ends "
                    "(agent/env_timeouts)", what, timeout_s)
        return None, "env_timeout"
    if isinstance(call.error, Exception):  # a broken environment ends its episode, not the run
        log.warning("environment %s failed: %s: %s", what, type(call.error).__name__, call.error)
        return None, "env_error"
    if call.error is not None:  # KeyboardInterrupt, SystemExit: as if called here
        raise call.error
    return call.value, None


def _cut(renderer: ChatRenderer, message: Message, limit: int, errors: Counter) -> Message:
    """``message`` with its content cut to ``limit`` tokens (and ``[truncated]`` said), counted in ``errors``."""
    content = message.get("content")
    if not limit or not isinstance(content, str):
        return dict(message)
    ids = renderer.encode(content)
    if len(ids) <= limit:
        return dict(message)
    errors["truncated"] += 1
    return {**message, "content": renderer.decode(ids[:limit]) + f" [truncated: {len(ids)} tokens]"}


def run_episodes_data_parallel(engine: RequestEngine | None, renderer: ChatRenderer, env_factory: EnvironmentFactory,
                               rows: Sequence[Mapping[str, Any]], prompts: Sequence[list[Message]],
                               sampling: SamplingConfig, settings: EpisodeSettings, *, call: int = 0,
                               group=None, pause: WeightUpdate | None = None, gather: bool = True) -> EpisodeBatch:
    """:func:`run_episodes` on this rank's contiguous share of the prompts (by its rank in ``group``), then every
    rank's episodes gathered, prompt-major, on every rank of ``group`` (stats: tokens summed, seconds of the
    slowest rank). Every rank of ``group`` calls it with the same arguments. ``gather=False``: this rank's
    share alone (the caller gathers it later with :func:`gather_episodes`); ``pause`` as :func:`run_episodes`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lo, hi = shard_bounds(len(rows), rank, world)
    local = run_episodes(engine, renderer, env_factory, rows[lo:hi], prompts[lo:hi], sampling, settings,
                         call=call, prompt_offset=lo, pause=pause)
    return gather_episodes(local, sampling.n, group) if gather else local


def gather_episodes(local: EpisodeBatch, n: int, group=None) -> EpisodeBatch:
    """Every rank's ``local`` episodes (contiguous shares of the prompts, in rank order) on every rank of
    ``group``, prompt-major (stats: tokens summed, seconds of the slowest rank)."""
    world = dist.get_world_size(group)
    if world == 1:
        return local
    parts: list[EpisodeBatch | None] = [None] * world
    dist.all_gather_object(parts, local, group=group)
    return EpisodeBatch([e for p in parts for e in p.episodes], n,
                        RolloutStats(prompt_tokens=sum(p.stats.prompt_tokens for p in parts),
                                     generated_tokens=sum(p.stats.generated_tokens for p in parts),
                                     seconds=max(p.stats.seconds for p in parts)),
                        sum(p.cached_tokens for p in parts))
