"""Scoring finished groups while the rest still generate (``rollout.overlap_scoring``).

In the long tail of a step's generation few sequences remain and the GPU is mostly idle (a decode step of a few
sequences is bound by the host). With the rollout engine colocated, the actor's and reference's weights stay on
the GPU while the engine generates, so the step's work on a group that has finished (its rewards, the actor's old
log-probs, the reference's log-probs) can run in that time instead of after the last sample.

How (:class:`OverlapScoring`):

1. Every rank drives its engine's share of the prompts step by step (:func:`open_stream`: the transformers
   engine's :meth:`~megarl.rollout.hf_engine.HFRolloutEngine.generate_stream`, or any
   :class:`~megarl.rollout.base.RequestEngine`, vLLM's ``LLMEngine.add_request`` / ``step``, with the seeds
   :meth:`generate` would give), and every ``POLL_STEPS`` engine steps all ranks exchange the samples that
   finished (one ``all_gather_object`` on a gloo group of their own). So every rank holds the same finished set
   after each exchange, and the decisions below are a function of it alone: every rank takes them alike.
2. Units: the finished groups (all ``n`` samples done) not yet scored, lowest prompt first, ``unit_groups`` at a
   time while generation runs; after its end, every remaining group, in units of ``unit_groups`` (the last one
   smaller). A unit's rows divide over the roles' data-parallel ranks (``unit_groups`` is a multiple of
   :func:`unit_base`).
3. A thread of the process scores the units in order (``score(samples) -> {name: tensor}``: the trainer's rewards
   and forward passes of the unit's samples, collectives on the trainer's groups, on a CUDA stream of its own)
   while the main thread goes on driving the engine; after the last sample, the main thread waits for the last
   units and :meth:`OverlapScoring.frames` lays their results out as the whole batch's.

Identical results: the samples are the engine's own (the same seeds and requests as :meth:`generate`); the
rewards are per sample; a row's log-probs do not depend on the other rows of its pass where the pass is
row-invariant (megarl's passes on the CPU; the batch-invariant pass of ``rollout.exact`` anywhere), which
``tests/test_overlap_scoring.py`` checks against the sequential step bit for bit (metrics and weights, TP=2, DP=2,
PP=2). On a GPU the bf16 GEMMs and attention of a pass on fewer rows may round differently (``perf/gpu_overlap.sh``
compares every metric of the SmolLM2 GSM8K step with and without the overlap). On several GPUs the thread's NCCL
collectives run beside the engine's own (vLLM TP), on other streams: not yet run on GPUs.

Not covered (refused by :class:`megarl.config.Config` and the trainer's preflight): multi-turn episodes, dynamic
sampling, a rollout pool of its own (or roles on other pools), asynchronous mode, offloaded actor parameters, a
reward model or judge (batched scoring), on-policy distillation's teacher, ``rollout.request_seeds=false`` and MoE
actors (the old-log-prob pass counts routing over the whole batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megarl.data.batch import build_batch
from megarl.parallel.megatron_cpu import in_thread
from megarl.rollout.base import (RolloutOutput, RolloutStats, Sample, SamplingConfig, check_prompts, sample_rows,
                                 sample_seed)
from megarl.rollout.data_parallel import shard_bounds

POLL_STEPS = 4  # engine steps between two exchanges of the finished samples


def unit_base(n: int, row_multiple: int) -> int:
    """The fewest groups of ``n`` samples whose rows are a multiple of ``row_multiple``: what a unit's groups must
    be a multiple of."""
    return row_multiple // math.gcd(row_multiple, n)


def unit_groups(num_prompts: int, base: int) -> int:
    """Groups per unit: an eighth of the step's groups (at least one), rounded up to a multiple of ``base``."""
    return base * math.ceil(max(1, num_prompts // 8) / base)


def open_stream(engine: Any, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                prompt_offset: int = 0) -> Iterator[list[Sample]]:
    """``engine``'s generation of ``prompt_token_ids`` one engine step per ``next``, yielding the samples that
    finished in it: ``engine.generate_stream`` where it has one (the transformers engine), else its requests
    (:class:`~megarl.rollout.base.RequestEngine`: vLLM), one per sample, seeded with :func:`~megarl.rollout.base.
    sample_seed` of the engine's call counter as :meth:`~megarl.rollout.base.RolloutEngine.generate` seeds them
    (the counter is advanced by one, as a call of ``generate`` does).

    Raises:
        RolloutError: a bad prompt, a sleeping engine or no weights (at the first ``next`` for the transformers
            engine).
    """
    stream = getattr(engine, "generate_stream", None)
    if stream is not None:
        return stream(prompt_token_ids, sampling, prompt_offset=prompt_offset)
    return _request_stream(engine, prompt_token_ids, sampling, prompt_offset)


def _request_stream(engine, prompt_token_ids, sampling: SamplingConfig, prompt_offset: int) -> Iterator[list[Sample]]:
    call = engine.calls
    engine.calls += 1
    rows = sample_rows(len(prompt_token_ids), sampling.n)
    one, adapters = dataclasses.replace(sampling, n=1), engine.adapter_version
    for r, (k, j) in enumerate(rows):
        engine.add_request(f"overlap-{call}-{r}", prompt_token_ids[k], one,
                           sample_seed(sampling.seed, call, prompt_offset + k, j))
    while engine.has_unfinished_requests():
        done = []
        for c in engine.step():
            k, j = rows[int(c.request_id.rsplit("-", 1)[1])]
            done.append(Sample(prompt_offset + k, j, c.token_ids, c.logprobs, c.finish_reason, adapters,
                               c.routed_experts, c.policy_version))
        yield done


class _Scorer:
    """A thread that runs ``score`` on the units handed to it, in order (on a CUDA stream of its own)."""

    def __init__(self, score: Callable[[list[Sample]], dict[str, torch.Tensor]]):
        self.score, self.results, self.error = score, [], None
        self.busy_s = 0.0
        self.queue: queue.Queue = queue.Queue()
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.thread = threading.Thread(target=self._run, name="megarl-overlap-scoring", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        stream = contextlib.nullcontext()
        if self.device is not None:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.stream(torch.cuda.Stream())
        with stream, in_thread():  # megatron on the CPU: its device patches in this thread too
            while (item := self.queue.get()) is not None:
                if self.error is not None:
                    continue
                start = time.perf_counter()
                try:
                    self.results.append((item[0], self.score(item[1])))
                except BaseException as e:  # noqa: BLE001 -- raised again on the main thread (close)
                    self.error = e
                self.busy_s += time.perf_counter() - start
            if self.device is not None:
                torch.cuda.current_stream().synchronize()

    def close(self) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.results


class OverlapScoring:
    """The overlap of generation with the scoring of finished groups (module docstring) on this rank.

    Construct on every rank of the world at the same point (it creates a gloo group over the world).

    Args:
        roles: the trainer's :class:`~megarl.workers.role.Role` handles by name (``actor``, ``reference``, ...).
        pools: the roles' pools (:class:`~megarl.parallel.placement.PoolGroups` by name): a unit's rows are a
            multiple of each one's DP size times its micro-batch multiple, and padded as the actor's TP x CP needs.
        rewards: ``(prompts, responses, truths) -> [B]`` float32 scores on every rank (the trainer's reward pool).
        tokenizer: decodes the responses for ``rewards``.
        pad_id: the batch's padding token (:func:`~megarl.data.batch.build_batch`).
        old_pass: ``(rows=, step=)`` -> whether the step runs an old-log-prob pass of its own (the reason, or None:
            :func:`~megarl.trainer.old_logprobs.old_logprob_pass`).
        exact: ``rollout.exact``'s batch-invariant old-log-prob pass.

    Attributes:
        metrics: the last :meth:`generate`'s figures: ``overlap/units`` (units scored), ``overlap/early_units``
            (of them, handed over before the last sample finished), ``overlap/scoring_s`` (the scoring thread's
            busy seconds), ``overlap/wait_s`` (seconds between the last sample and the last unit's end).
    """

    def __init__(self, roles: dict[str, Any], pools: dict[str, Any], rewards: Callable, tokenizer: Any, *,
                 pad_id: int, old_pass: Callable[..., Any], exact: bool = False):
        self.roles, self.rewards, self.tokenizer, self.old_pass = roles, rewards, tokenizer, old_pass
        self.row_multiple = math.lcm(*(pools[r].mesh.dp * pools[r].mesh.microbatch_multiple for r in roles))
        self.pad_id, self.seq_multiple, self.exact = pad_id, 8 * pools["actor"].mesh.tp * pools["actor"].mesh.cp, exact
        self.group = dist.new_group(backend="gloo")
        self.metrics: dict[str, float] = {}
        self._results: list[tuple[list[int], dict[str, torch.Tensor]]] = []
        self._n = 0

    def score(self, prompts: Any, old_pass: bool, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """A unit's ``scores`` ``[rows]`` and, where the step runs those passes, ``old_logprobs`` (``old_pass``)
        and ``ref_logprobs`` ``[rows, R_unit]`` float32 on every training rank, as the sequential step computes them
        (:meth:`~megarl.trainer.trainer.Trainer.train_on`); ``prompts``: the step's
        :class:`~megarl.data.loader.PromptBatch`. Collectives on the trainer's groups (the scoring thread's)."""
        out = {"scores": self.rewards(*prompts.reward_inputs(samples, self.tokenizer))}
        batch = build_batch([prompts.input_ids[s.prompt_index] for s in samples], [s.token_ids for s in samples],
                            [s.logprobs for s in samples], [s.prompt_index for s in samples],
                            pad_token_id=self.pad_id, seq_multiple=self.seq_multiple)
        shape = batch["response_mask"].shape
        if old_pass:
            out["old_logprobs"] = self.roles["actor"].run_shared(
                lambda actor: actor.compute_logprobs(batch, exact=self.exact)["logprobs"], shape)
        if "reference" in self.roles:
            out["ref_logprobs"] = self.roles["reference"].run_shared(
                lambda ref: ref.compute_logprobs(batch)["logprobs"], shape)
        return out

    def generate(self, engine: Any, prompts: Any, sampling: SamplingConfig, *, group, step: int) -> RolloutOutput:
        """Generate ``sampling.n`` samples of every prompt of ``prompts`` (a :class:`~megarl.data.loader.
        PromptBatch`; this rank its share among the rollout data-parallel ``group``, as :func:`~megarl.rollout.
        data_parallel.generate_data_parallel` does) while :meth:`score` runs on the finished groups
        (:func:`unit_groups` at a time, module docstring); returns every sample, prompt-major, on every rank
        (stats: prompt and generated tokens of all, seconds until the last sample); their scores and passes are
        then :meth:`frames`. ``step``: the steps done before this one. Call on every rank with the same arguments.

        Raises:
            RolloutError: a bad prompt (checked on every rank before sharding, so all ranks raise), or from the
                engine.
            Exception: what :meth:`score` raised (on the rank where it did; the other ranks' collectives then
                end at ``trainer.timeout_s``).
        """
        start = time.perf_counter()
        ids, n = prompts.input_ids, sampling.n
        num = len(ids)
        check_prompts(ids, max_context=engine.spec.max_position_embeddings, vocab_size=engine.spec.vocab_size)
        per_unit = unit_groups(num, unit_base(n, self.row_multiple))
        lo, hi = shard_bounds(num, dist.get_rank(group), dist.get_world_size(group))
        stream = open_stream(engine, list(ids[lo:hi]), sampling, prompt_offset=lo)
        old_pass = self.old_pass(rows=num * n, step=step) is not None
        scorer = _Scorer(functools.partial(self.score, prompts, old_pass))
        finished: dict[tuple[int, int], Sample] = {}
        pending = list(range(num))  # groups not handed to the scorer yet
        local_done, units, early = False, 0, 0
        try:
            while True:
                new: list[Sample] = []
                for _ in range(POLL_STEPS if not local_done else 0):
                    try:
                        new += next(stream)
                    except StopIteration:
                        local_done = True
                        break
                parts: list[Any] = [None] * dist.get_world_size(self.group)
                dist.all_gather_object(parts, (new, local_done), group=self.group)
                finished.update(((s.prompt_index, s.sample_index), s) for samples, _ in parts for s in samples)
                all_done = all(done for _, done in parts)
                ready = [k for k in pending if all((k, j) in finished for j in range(n))]
                while ready and (len(ready) >= per_unit or all_done):
                    take, ready = ready[:per_unit], ready[per_unit:]
                    scorer.queue.put((take, [finished[(k, j)] for k in take for j in range(n)]))
                    pending = [k for k in pending if k not in set(take)]
                    units, early = units + 1, early + (not all_done)
                if all_done:
                    break
        except BaseException:
            scorer.queue.put(None)  # its last unit may wait on the other ranks: the thread is not waited for
            raise
        seconds = time.perf_counter() - start
        self._results, self._n = scorer.close(), n
        samples = [finished[(k, j)] for k in range(num) for j in range(n)]
        self.metrics = {"overlap/units": units, "overlap/early_units": early, "overlap/scoring_s": scorer.busy_s,
                        "overlap/wait_s": time.perf_counter() - start - seconds}
        stats = RolloutStats(prompt_tokens=n * sum(len(p) for p in ids),
                             generated_tokens=sum(len(s.token_ids) for s in samples), seconds=seconds)
        return RolloutOutput(samples, n, stats)

    def frames(self, name: str, frame: Sequence[int]) -> torch.Tensor:
        """The last :meth:`generate`'s units' ``name`` (``[rows]`` per unit, or ``[rows, R_unit]`` per-token
        frames) as the whole batch's ``frame`` (``[B]`` or ``[B, R]``, rows prompt-major, columns past a unit's
        width 0), float32.

        Raises:
            KeyError: the units did not compute ``name``.
        """
        out = torch.zeros(tuple(frame), dtype=torch.float32)
        for groups, result in self._results:
            rows = torch.tensor([k * self._n + j for k in groups for j in range(self._n)])
            value = result[name]
            if value.dim() == 1:
                out[rows] = value.float()
            else:
                out[rows, :value.shape[1]] = value.float()
        return out
