"""Several rollout engines on this rank's device, each in a process of its own (``rollout.engines_per_gpu``).

Why: one vLLM engine schedules, samples and builds its outputs on one CPU core while the GPU waits between its
decode steps (issue 47's profile of the 1.5B case on an H100: the GPU's kernels take 5.8 ms of a 13.9 ms step).
Two standalone engines on one H100, each with half the batch and a core of its own, generated 40.4k tokens/s
against 21.6k for one. :class:`EnginePool` gives the trainer that as one
:class:`~megarl.rollout.base.RolloutEngine`:

- each worker is a spawned process that builds its engine with ``factory`` (the trainer's: ``make_engine`` with
  ``1 / engines_per_gpu`` of the memory share) on this rank's device, one after the other (vLLM measures the
  free memory when it starts); a vLLM worker runs in a ``torch.distributed`` world of its own (one rank);
- weights: the reshard writes this rank's engine tensors once, into the pool's staging tensors (one copy of the
  rollout weights in ordinary device memory, allocated at the first update); every worker maps them
  (``torch.multiprocessing``: shared memory on the CPU, CUDA IPC on the GPU) and copies them into its engine's
  own weights at each update;
- ``generate`` splits the prompts into contiguous shares (:func:`~megarl.rollout.data_parallel.shard_bounds`),
  each worker samples its share at its global prompt offset, and the samples come back in prompt order. Seeded
  by global prompt index and call (:func:`~megarl.rollout.base.sample_seed`), they are the samples one engine
  draws, up to float rounding between batch shapes (as with rollout data parallelism).

What a pool cannot do is refused by the config (:class:`megarl.config.rollout.RolloutConfig`,
:class:`megarl.config.Config`): engines of TP > 1, FP8 rollouts (mixed dtypes), LoRA, router replay, multi-turn
episodes and overlap with scoring (request by request), exact on-policy, and a rollout pool of its own.
"""

from __future__ import annotations

import os
import time
import traceback
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.multiprocessing as mp

from megarl.models.layout import Layout
from megarl.rollout.base import RolloutEngine, RolloutError, RolloutOutput, RolloutStats, SamplingConfig, WriteFn
from megarl.rollout.data_parallel import shard_bounds

_POLL_S = 1.0  # how often an idle worker checks that its parent is alive, seconds


def _own_world(device: torch.device) -> None:
    """A ``torch.distributed`` world of one rank for a worker's vLLM engine (its external launcher reads it), on
    ``device``."""
    from megarl.parallel.mesh import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(device.index or 0), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    torch.cuda.set_device(device)


def _copy_into(dst: dict[str, torch.Tensor], staged: dict[str, torch.Tensor]) -> None:
    """Copy the staging tensors into an engine's own (``dst``: the ``write`` argument of
    :meth:`~megarl.rollout.base.RolloutEngine.update_weights`), name by name."""
    for name, tensor in dst.items():
        tensor.copy_(staged[name])


def _serve(index: int, factory: Callable[[], RolloutEngine], device: str, conn) -> None:
    """A worker's loop: build the engine, then answer the pool's commands until ``stop`` or its parent is gone.

    Each answer is ``("ok", value)`` or ``("error", message)``; the commands are :class:`EnginePool`'s."""
    parent = os.getppid()
    try:
        if torch.device(device).type == "cuda":
            _own_world(torch.device(device))
        engine = factory()
        layout = engine.weight_layout([0]).tensors(0)
        conn.send(("ok", {"spec": engine.spec, "dtype": engine.dtype,
                          "tensors": {n: tuple(lt.shape) for n, lt in layout.items()}}))
    except BaseException:
        conn.send(("error", f"engine worker {index} could not start:\n{traceback.format_exc()}"))
        return
    staged: dict[str, torch.Tensor] = {}
    while True:
        if not conn.poll(_POLL_S):
            if os.getppid() != parent:
                return
            continue
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            return  # the pool's end of the pipe is closed: its process is gone
        try:
            if command == "stop":
                return
            if command == "stage":
                staged = args
                value = None
            elif command == "update":
                value = engine.update_weights(lambda dst: _copy_into(dst, staged))
            elif command == "generate":
                prompts, sampling, offset, calls, versions = args
                engine.calls = calls
                engine.policy_version, engine.adapter_version = versions
                value = engine.generate(prompts, sampling, prompt_offset=offset)
            elif command == "layout":
                value = engine.weight_layout(args)
            elif command == "sleep":
                value = engine.sleep(args)
            elif command == "wake_up":
                value = engine.wake_up()
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", value))
        except Exception as e:  # the pool raises it as a RolloutError; the worker goes on
            conn.send(("error", f"engine worker {index}: {type(e).__name__}: {e}"))


class EnginePool:
    """A :class:`~megarl.rollout.base.RolloutEngine` made of ``size`` engines on ``device``, each in a spawned
    process (module docstring).

    Args:
        factory: builds one engine in a worker; picklable (a module-level function or a ``functools.partial`` of
            one), since workers are spawned.
        size: engines, >= 1.
        device: where the engines and the staging tensors live (``"cpu"`` or ``"cuda:i"``).

    Attributes:
        spec: the engines' model (as the first engine reports it: vLLM cuts ``max_position_embeddings`` to its
            context).
        dtype: the engines' weight dtype (the staging tensors').
        calls: ``generate`` calls so far; part of every sample's seed (every worker's engine is set to it).
        policy_version / adapter_version: stamped on every sample (set by whoever writes the weights).

    Raises:
        RolloutError: ``size`` < 1, or a worker could not build its engine (with its traceback).
    """

    def __init__(self, factory: Callable[[], RolloutEngine], size: int, device: str | torch.device = "cpu"):
        if size < 1:
            raise RolloutError(f"an engine pool needs at least one engine, got {size}")
        self.device = torch.device(device)
        self.calls = 0
        self.policy_version: int | None = None
        self.adapter_version: int | None = None
        self._staging: dict[str, torch.Tensor] | None = None
        self._workers: list[tuple[Any, Any]] = []
        ctx = mp.get_context("spawn")
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        for index in range(size):  # one after the other: vLLM sizes its KV cache from the memory free at its start
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(index, factory, str(self.device), child),
                                  name=f"megarl-engine-{index}")
            process.start()
            child.close()
            self._workers.append((process, parent))
            try:
                info = self._answer(index)
            except RolloutError:
                self.close()  # the workers started before it
                raise
        self.spec, self.dtype, self._tensors = info["spec"], info["dtype"], info["tensors"]

    @property
    def size(self) -> int:
        """Engines in the pool."""
        return len(self._workers)

    def _answer(self, index: int) -> Any:
        """Worker ``index``'s answer to its last command.

        Raises:
            RolloutError: its error, or the worker exited (with its exit code)."""
        try:
            status, value = self._workers[index][1].recv()
        except (EOFError, ConnectionError, OSError):
            raise self._exited(index) from None
        if status != "ok":
            raise RolloutError(value)
        return value

    def _exited(self, index: int) -> RolloutError:
        """The error that worker ``index`` has exited (its exit code, once it is reaped)."""
        process = self._workers[index][0]
        process.join(timeout=5)
        return RolloutError(f"engine worker {index} (pid {process.pid}) exited with code {process.exitcode}; its "
                            "engine and samples are lost")

    def _ask(self, messages: dict[int, tuple[str, Any]]) -> list[Any]:
        """Send each worker its message at once, then take the answers in worker order; the first error is raised
        after every worker that got its message has answered (so no answer is left behind for the next command).

        Raises:
            RolloutError: a worker's error, or a worker that exited."""
        sent, error = [], None
        for index, message in messages.items():
            try:
                self._workers[index][1].send(message)
                sent.append(index)
            except (BrokenPipeError, ConnectionError, OSError):
                error = error or self._exited(index)
        answers = []
        for index in sent:
            try:
                answers.append(self._answer(index))
            except RolloutError as e:
                error = error or e
        if error is not None:
            raise error
        return answers

    def _all(self, command: str, args: Any = None) -> list[Any]:
        """``command`` to every worker (:meth:`_ask`)."""
        return self._ask({index: (command, args) for index in range(self.size)})

    def weight_layout(self, ranks: Iterable[int]) -> Layout:
        """The engines' layout on ``ranks`` (every engine of the pool holds the same tensors)."""
        return self._ask({0: ("layout", list(ranks))})[0]

    def update_weights(self, write: WriteFn) -> Any:
        """``write`` fills the staging tensors (this rank's entry of :meth:`weight_layout`, :attr:`dtype`), then
        every engine copies them into its own weights (:meth:`RolloutEngine.update_weights`).

        Returns:
            What ``write`` returns (the reshard executor's stats).

        Raises:
            RolloutError: an engine asleep, or a worker's error.
        """
        if self._staging is None:  # allocated once and mapped by every worker (shared memory / CUDA IPC)
            self._staging = {n: torch.empty(shape, dtype=self.dtype, device=self.device)
                             for n, shape in self._tensors.items()}
            if self.device.type == "cpu":
                for t in self._staging.values():
                    t.share_memory_()
            self._all("stage", self._staging)
        result = write(dict(self._staging))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the workers read the staging tensors on their own streams
        self._all("update")
        return result

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_offset: int = 0) -> RolloutOutput:
        """Every engine samples its contiguous share of the prompts at once (module docstring).

        Returns:
            Prompt-major samples, as one engine's; stats: tokens summed, seconds of the whole call.

        Raises:
            RolloutError: a bad prompt, an engine asleep or without weights, a worker gone.
        """
        start = time.perf_counter()
        prompts = [list(p) for p in prompt_token_ids]
        versions = (self.policy_version, self.adapter_version)
        shares = [shard_bounds(len(prompts), k, self.size) for k in range(self.size)]
        # the engines with a share (fewer prompts than engines: the first ones), and the first one without prompts
        outputs = self._ask({k: ("generate", (prompts[lo:hi], sampling, prompt_offset + lo, self.calls, versions))
                             for k, (lo, hi) in enumerate(shares) if hi > lo or k == 0})
        self.calls += 1
        stats = RolloutStats(prompt_tokens=sum(o.stats.prompt_tokens for o in outputs),
                             generated_tokens=sum(o.stats.generated_tokens for o in outputs),
                             seconds=time.perf_counter() - start)
        return RolloutOutput([s for o in outputs for s in o.samples], sampling.n, stats)

    def sleep(self, level: int = 1) -> None:
        """Every engine sleeps (:meth:`RolloutEngine.sleep`); the staging tensors stay."""
        self._all("sleep", level)

    def wake_up(self) -> None:
        """Every engine wakes up (:meth:`RolloutEngine.wake_up`)."""
        self._all("wake_up")

    def close(self) -> None:
        """Stop the workers (also when the pool is garbage-collected or the process exits)."""
        self._finalizer()


def _stop(workers: list[tuple[Any, Any]]) -> None:
    """Ask each worker to stop, then end the ones that do not within 10 s."""
    for process, conn in workers:
        try:
            conn.send(("stop", None))
        except (BrokenPipeError, ConnectionError, OSError):
            pass
    for process, _ in workers:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
