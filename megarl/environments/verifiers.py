"""verifiers environments (PyPI ``verifiers==0.4.0``, its ``verifiers.v1`` stack) trained as they are: megarl
samples every token, verifiers only ever sees messages.

verifiers 0.4.0 splits an environment into a **taskset** (an installed module exporting a ``vf.Taskset``: its
tasks, each a ``vf.TaskData`` with a prompt and a system prompt, and a ``vf.Task`` whose ``@vf.reward`` methods
are the rubric, weighted, ``@vf.metric`` its figures and ``@vf.stop`` its stop conditions) and an **env** (a
``vf.Env`` whose ``run(task, agents)`` is the multi-turn loop: ``async with agents.<seat>.interaction(task) as
it: segment = await it.turn(user_message)``, then ``finalize``; the taskset's own, else ``SingleAgentEnv``: one
reply). ``rollout.multi_turn.env: verifiers`` loads both by id (``vf.resolve_env_config`` /
``vf.load_environment``) and runs ``Env.run`` with the policy in the seat::

    rollout:
      multi_turn:
        enabled: true
        env: verifiers
        env_kwargs: {taskset: my_taskset, taskset_args: {difficulty: 2}, env: "", env_args: {}}

Each episode runs the verifiers coroutines (``setup``, ``run``, ``finalize``) on an event loop of its own thread;
every ``turn(message)`` becomes the episode's observation (a user message; none for the opening turn of a task
with a prompt), the policy's reply (sampled by megarl, token-exact, :mod:`megarl.agents.episode`) comes back as
the ``Segment``'s assistant message, and the ``@vf.stop`` conditions on the trace end the exchange. A reply that
calls one of megarl's tools (``rollout.multi_turn.tools``) gets the results and the policy goes on, as a
harness's tool loop would; verifiers' own MCP toolsets (``Task.toolsets``) and harness programs are not run.
When the exchange ends (the env is done, a stop condition, or megarl's turn and token budgets), the trace of the
messages is scored by the task's own ``vf.Task.score`` (every ``@vf.reward``, weighted; judges too) and the
env's ``finalize``: the episode's reward is the trace's ``reward`` (the weighted sum), each reward function's
score is logged as ``reward/<name>`` and each metric as ``verifiers/<name>``.

The data: the taskset's own tasks (``data.prepare=verifiers``, ``data.prepare_kwargs: {taskset, taskset_args,
size, test_size}``: rows ``question`` (the task's prompt text), ``ground_truth`` (its ``answer`` field where it
has one) and ``vf_task`` (the task data, JSON), which the episode rebuilds the task from), or megarl's own rows
(no ``vf_task``): the task is the taskset's data type built from the row's fields of the same names, with the
prompt's user text and system message.

Refused before the run: a taskset or env id that does not import, arguments its config refuses, an env of more
than one seat (the policy plays one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import queue
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from megarl.agents.env import AssistantTurn, EnvError, Environment, Message, StepResult, tool_messages
from megarl.environments import import_package

PACKAGE = "verifiers==0.4.0"
FIELD = "rollout.multi_turn.env_kwargs"


def _vf(field: str = "rollout.multi_turn.env", error: type[Exception] = EnvError):
    return import_package("verifiers.v1", PACKAGE, field, error)


@functools.lru_cache(maxsize=8)
def _load(spec_json: str):
    """``(env, seat)``: the verifiers env of a spec (JSON of the constructor's arguments) and its one seat."""
    vf = _vf()
    from verifiers.v1.configs.agent import agent_config_fields

    spec = json.loads(spec_json)
    try:
        config = vf.resolve_env_config({"id": spec["env"], "taskset": {"id": spec["taskset"],
                                                                        **spec["taskset_args"]},
                                        **spec["env_args"]})
        env = vf.load_environment(config)
    except Exception as e:  # noqa: BLE001 (an import, a validation or a constructor of the user's module)
        raise EnvError(f"{FIELD}: verifiers cannot load taskset {spec['taskset']!r}"
                       + (f" with env {spec['env']!r}" if spec["env"] else "")
                       + f": {type(e).__name__}: {' '.join(str(e).split())[:400]}") from None
    seats = list(agent_config_fields(env.config))
    if len(seats) != 1:
        raise EnvError(f"{FIELD}.env: verifiers env {type(env).__name__} has seats {seats}; the policy plays "
                       "one, so megarl trains envs of one seat (SingleAgentEnv, a game against the engine)")
    return env, seats[0]


def _spec(taskset: str, taskset_args: Mapping[str, Any] | None, env: str, env_args: Mapping[str, Any] | None) -> str:
    if not isinstance(taskset, str) or not taskset:
        raise EnvError(f"{FIELD}.taskset: name an installed verifiers taskset (its module), got {taskset!r}")
    return json.dumps({"taskset": taskset, "taskset_args": dict(taskset_args or {}), "env": env or "",
                       "env_args": dict(env_args or {})}, sort_keys=True)


class VerifiersEnvironment(Environment):
    """One episode of a verifiers env (module docstring), the policy in its seat.

    Args:
        taskset: the taskset's id (an importable module exporting its ``vf.Taskset``).
        taskset_args: fields of the taskset's config (``vf.TasksetConfig`` subclass).
        env: the env's id ("" = the taskset's own, else ``SingleAgentEnv``).
        env_args: fields of the env's config.

    Raises:
        EnvError: verifiers missing, an id that does not load, arguments its configs refuse, more than one seat.
    """

    def __init__(self, taskset: str, taskset_args: Mapping[str, Any] | None = None, env: str = "",
                 env_args: Mapping[str, Any] | None = None):
        self.vf_env, self.seat = _load(_spec(taskset, taskset_args, env, env_args))
        self.metrics: dict[str, float] = {}
        self._asks: queue.Queue = queue.Queue()  # the episode's coroutines -> megarl: ("turn", messages) | ("done", r)
        self._replies: queue.Queue = queue.Queue()  # megarl -> the coroutines: (text, tool messages) | None (ended)
        self._thread: threading.Thread | None = None
        self._over = False

    def task(self, row: Mapping[str, Any], prompt: Sequence[Message]):
        """The verifiers task of a row: rebuilt from its ``vf_task`` (the taskset's data), else the taskset's
        data type from the row's fields, the prompt's last user message and its system message."""
        task_cls = type(self.vf_env.taskset).task_type()
        data_cls = task_cls.data_type()
        if row.get("vf_task"):
            return task_cls(data_cls.model_validate_json(row["vf_task"]), self.vf_env.taskset.config.task)
        system = next((m["content"] for m in prompt if m.get("role") == "system"), None)
        user = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), None)
        fields = {k: row[k] for k in data_cls.model_fields if k in row and k not in ("prompt", "system_prompt")}
        return task_cls(data_cls(**fields, prompt=user, system_prompt=system), self.vf_env.taskset.config.task)

    def reset(self, row: Mapping[str, Any], prompt: list[Message]) -> list[Message]:
        task = self.task(row, prompt)
        first = ([{"role": "system", "content": task.data.system_prompt}] if task.data.system_prompt else [])
        if isinstance(task.data.prompt, str):
            first.append({"role": "user", "content": task.data.prompt})
        elif task.data.prompt:
            first += [m.model_dump(exclude_none=True) for m in task.data.prompt]
        self._thread = threading.Thread(target=self._run, args=(task, first), daemon=True,
                                        name="verifiers-episode")
        self._thread.start()
        kind, value = self._asks.get()
        if kind != "turn":
            raise EnvError(f"verifiers env {type(self.vf_env).__name__} ended before the policy's first turn"
                           + (f": {value}" if kind == "error" else ""))
        return first + value

    def step(self, turn: AssistantTurn) -> StepResult:
        self._replies.put((turn.text, tool_messages(turn)))
        return self._answer()

    def close(self, end: str) -> float | None:
        if self._over or self._thread is None:
            return None
        self._replies.put(None)  # megarl's budget ended it: the exchange terminates, then it is scored
        return self._answer().reward

    def _answer(self) -> StepResult:
        kind, value = self._asks.get()
        if kind == "turn":
            return StepResult(value)
        self._over = True
        self._thread.join()
        if kind == "error":
            raise value
        return StepResult(reward=value, done=True)

    def _run(self, task, first: list[Message]) -> None:
        """The episode's verifiers coroutines on this thread's event loop; every outcome reaches ``_asks``."""
        try:
            reward = asyncio.run(self._episode(task, first))
            self._asks.put(("done", reward))
        except BaseException as e:  # noqa: BLE001 (the episode thread reports, megarl's raises)
            self._asks.put(("error", e))

    async def _episode(self, task, first: list[Message]) -> float:
        vf = _vf()
        from verifiers.v1.agent import Agents

        seat = _Seat(self, first)
        agents = Agents(self.vf_env.config, lambda name, spec: seat)
        episode = vf.Episode(env=vf.EnvInfo(id=self.vf_env.config.env_id),
                             task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                               hash=task.hash))
        await self.vf_env.setup(agents)
        await self.vf_env.run(task, agents)
        episode.traces.extend(seat.traces)
        if not episode.traces:
            raise EnvError(f"verifiers env {type(self.vf_env).__name__}.run() ran no interaction")
        await self.vf_env.finalize(task, episode)
        for trace in episode.traces:
            self.metrics.update({f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None})
            self.metrics.update({f"verifiers/{k}": float(v) for k, v in trace.metrics.items() if v is not None})
        return float(sum(t.reward for t in episode.traces))


class _Seat:
    """The policy in the env's one seat: what ``agents.<seat>`` is to ``Env.run`` (``interaction(task)``,
    ``run(task)``, ``trainable``), each turn sampled by megarl through the environment's queues."""

    trainable = True

    def __init__(self, owner: VerifiersEnvironment, first: list[Message]):
        self.owner, self.first, self.traces = owner, first, []

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        it = _Interaction(self.owner, task, self.first)
        self.traces.append(it.trace)
        try:
            yield it
        finally:
            await task.score(it.trace)  # the rubric, as a verifiers rollout scores at close

    async def run(self, task) -> None:
        """The chat harness's loop: one reply, again after each reply that called a tool."""
        async with self.interaction(task) as it:
            segment = await it.turn()
            while not segment.terminated and it.tool_results:
                segment = await it.turn(tool_results=it.tool_results)


class _Interaction:
    """One seat's exchange (``vf.Interaction``'s ``turn`` and ``trace``); its trace holds every message."""

    def __init__(self, owner: VerifiersEnvironment, task, first: list[Message]):
        vf = _vf()
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.session import call_hook

        self.owner, self.task, self._node, self._call_hook = owner, task, MessageNode, call_hook
        self.trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                hash=task.hash), agent=vf.AgentInfo(config=vf.AgentConfig()))
        self._vf, self.over, self.tool_results = vf, False, []
        for m in first:
            self._add({"system": vf.SystemMessage, "user": vf.UserMessage}[m["role"]](content=m["content"]))

    def _add(self, message, sampled: bool = False) -> None:
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(self._node(parent=parent, message=message, sampled=sampled))

    async def turn(self, message: str | None = None, *, tool_results: Sequence[Message] = ()):
        """Send ``message`` (a user turn; None: the policy speaks) and get the policy's reply as a ``Segment``;
        a terminated one once the exchange is over (a stop condition, megarl's budgets)."""
        vf = self._vf
        from verifiers.v1.agent import Segment

        if self.over:
            return Segment(messages=[], terminated=True)
        observations = [dict(m) for m in tool_results]
        if message is not None:
            observations.append({"role": "user", "content": message})
        for m in observations:
            self._add(vf.ToolMessage(content=m["content"], tool_call_id=f"call_{len(self.trace.nodes)}")
                      if m["role"] == "tool" else vf.UserMessage(content=m["content"]))
        self.owner._asks.put(("turn", observations))  # the first: after reset's first messages; then a step's
        reply = await asyncio.to_thread(self.owner._replies.get)
        if reply is None:
            self.over = True
            self.trace.stop("megarl_budget")
            return Segment(messages=[], terminated=True)
        text, self.tool_results = reply
        assistant = vf.AssistantMessage(content=text)
        self._add(assistant, sampled=True)
        for hook in self.task.hooks("stop"):
            if await self._call_hook(hook, {vf.Trace: self.trace}):
                self.over = True
                self.trace.stop(hook.__name__)
                break
        return Segment(messages=[assistant])


def verifiers_rows(kwargs: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The train and test rows of the taskset's own tasks (module docstring), from ``data.prepare_kwargs``:
    ``taskset``, ``taskset_args``, ``size`` (training rows; default all), ``test_size`` (default 0), the first
    ``test_size`` tasks for test.

    Raises:
        ConfigError: naming ``data.prepare_kwargs``: verifiers missing, a taskset that does not load, fewer tasks
            than asked for, other keys.
    """
    from megarl.config import ConfigError

    vf = _vf("data.prepare_kwargs", ConfigError)
    extra = sorted(set(kwargs) - {"taskset", "taskset_args", "size", "test_size"})
    if extra:
        raise ConfigError(f"data.prepare_kwargs: unknown keys {extra}; verifiers takes taskset, taskset_args, "
                          "size and test_size")
    try:
        taskset = vf.load_taskset(_taskset_config(kwargs))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"data.prepare_kwargs.taskset: verifiers cannot load {kwargs.get('taskset')!r}: "
                          f"{type(e).__name__}: {' '.join(str(e).split())[:400]}") from None
    size, test_size = kwargs.get("size"), int(kwargs.get("test_size", 0))
    view = taskset if size is None else taskset.take(test_size + int(size))
    if not view.bounded:
        raise ConfigError(f"data.prepare_kwargs.size: taskset {kwargs['taskset']!r} is infinite; give a size")
    rows = [{"question": t.data.prompt_text, "ground_truth": str(getattr(t.data, "answer", "") or ""),
             "vf_task": t.data.model_dump_json()} for t in view]
    if size is not None and len(rows) < test_size + int(size):
        raise ConfigError(f"data.prepare_kwargs.size: taskset {kwargs['taskset']!r} has {len(rows)} tasks, fewer "
                          f"than test_size + size = {test_size + int(size)}")
    return {"test": rows[:test_size], "train": rows[test_size:]}


def _taskset_config(kwargs: Mapping[str, Any]):
    from verifiers.v1.utils.loaders import taskset_config_type

    return taskset_config_type(kwargs["taskset"]).model_validate({"id": kwargs["taskset"],
                                                                  **dict(kwargs.get("taskset_args") or {})})


def prepare_verifiers(out_dir: str | os.PathLike, kwargs: Mapping[str, Any], *,
                      overwrite: bool = False) -> dict[str, Path]:
    """Write the taskset's train and test splits (:func:`verifiers_rows`) as parquet into ``out_dir``
    (``megarl_data_verifiers.json``; :func:`megarl.data.dataset.write_splits`)."""
    import pyarrow as pa

    from megarl.data.dataset import write_splits

    def tables():
        return {split: pa.table({"index": pa.array(range(len(rows)), pa.int64()),
                                 **{k: [r[k] for r in rows] for k in ("question", "ground_truth", "vf_task")}})
                for split, rows in verifiers_rows(kwargs).items()}
    return write_splits(("train", "test"), tables, out_dir, "data verifiers", overwrite=overwrite)
