"""Environments: what an episode talks to between the model's turns, by name or dotted path.

An environment is a class (or a function returning an instance) named by ``rollout.multi_turn.env`` (a
registered name, or ``"pkg.mod:MyEnv"``) and built once per episode with ``rollout.multi_turn.env_kwargs``.
It lives as long as its episode, so it keeps the episode's state on ``self``::

    from megarl.agents.env import Environment, StepResult, register_env

    @register_env("countdown")
    class Countdown(Environment):
        def reset(self, row, prompt):          # the dataset row, and its prompt as chat messages
            self.target = int(row["ground_truth"])
            return prompt                      # the first messages (system, user)
        def step(self, turn):                  # the assistant's turn: text, tool calls and their results
            said = turn.text.strip()
            if said == str(self.target):
                return StepResult([], reward=1.0, done=True)
            return StepResult([{"role": "user", "content": "no, try again"}])

- :meth:`Environment.reset` gets the dataset row (every field of it) and ``prompt``, the chat messages that
  ``data.prompt_key`` gives through ``data.system_prompt`` and ``data.instruction``, and returns the first
  messages (``{"role", "content"}`` dicts); the chat template renders them with the tools.
- :meth:`Environment.step` gets the :class:`AssistantTurn` (its text, the tool calls the parser read and what
  each returned: the tools have already run, with their timeouts, :mod:`megarl.agents.tools`) and returns a
  :class:`StepResult`: the observation messages (rendered by the chat template after the assistant's turn:
  role ``"tool"`` for tool results, ``"user"`` for anything else), an optional reward and whether the episode
  is done. Calls run on a worker thread, at the same time as other episodes' turns and generation.
- ``self.rng``: a ``random.Random`` seeded for the episode (from the run's seed, the step and the episode's
  prompt and sample index), set before ``reset``, for environments that draw (a secret, a maze).
- :meth:`Environment.close` is called once when the episode ends, however it ended (done, a turn or token
  budget, the context; not after an exception): an environment that scores the whole episode (a rubric, a game's
  outcome) returns its reward there; ``self.metrics`` (name -> float, set any time) are averaged over the step's
  episodes that set them (``reward/<name>``, ``game/win``, ...).
- The episode's reward is the sum of the rewards the environment returned, or, where it returned none, the
  run's ``reward.fn`` on the episode's last assistant message (the prompt and ground truth as for one-turn
  responses). An exception in ``reset`` or ``step`` ends that episode with reward 0 and is counted
  (``agent/ended/env_error``), and so does a call that runs past ``rollout.multi_turn.env_timeout_s``
  (``agent/env_timeouts``; the call is left running in a daemon thread); the run goes on.

Built-in: ``tools`` (:class:`ToolEnvironment`: tool calls get their results, a turn without a call ends the
episode; the default), ``guess_number`` (:class:`GuessNumber`: no tools, "higher/lower" feedback).
"""

from __future__ import annotations

import inspect
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megarl.agents.tools import ToolCall, ToolResult
from megarl.algos.registry import Registry

Message = dict[str, Any]


class EnvError(ValueError):
    """An environment that cannot be found or built (bad config)."""


@dataclass(frozen=True)
class AssistantTurn:
    """One turn of the model, as the environment sees it.

    Attributes:
        text: the sampled tokens decoded (special tokens and the end-of-turn token dropped).
        tool_calls: the calls the parser read, in order.
        tool_results: what each call returned (and one result per malformed call, ``call`` None), in order.
        turn: 0 for the first turn.
        finish_reason: "stop" (the model ended its turn) or "length" (cut at the turn's token budget).
    """

    text: str
    tool_calls: Sequence[ToolCall] = ()
    tool_results: Sequence[ToolResult] = ()
    turn: int = 0
    finish_reason: str = "stop"


@dataclass(frozen=True)
class StepResult:
    """What the environment answers a turn with.

    Attributes:
        messages: observation messages, appended to the history (none: the next turn follows at once).
        reward: a reward for this turn (summed over the episode), or None.
        done: the episode ends here.
    """

    messages: Sequence[Message] = ()
    reward: float | None = None
    done: bool = False


class Environment:
    """The base class: :meth:`reset` returns the prompt as is, :meth:`step` answers tool calls with their
    results and ends the episode at a turn without a call (the ``tools`` environment)."""

    def reset(self, row: Mapping[str, Any], prompt: list[Message]) -> list[Message]:
        """The episode's first messages (module docstring); default: ``prompt``."""
        return prompt

    metrics: dict[str, float] = {}  # the episode's figures (module docstring); an instance sets its own dict

    def step(self, turn: AssistantTurn) -> StepResult:
        """The observations after ``turn`` (module docstring); default: :func:`tool_messages`, done when the turn
        called no tool (and wrote no malformed call)."""
        if not turn.tool_results:
            return StepResult(done=True)
        return StepResult(tool_messages(turn))

    def close(self, end: str) -> float | None:
        """The episode has ended (``end``: one of :data:`megarl.agents.rollout.ENDS` but "env_error"); returns a
        reward added to the episode's, or None (the default)."""
        return None


def tool_messages(turn: AssistantTurn) -> list[Message]:
    """One ``{"role": "tool", "content": result}`` message per tool result of ``turn``, in call order."""
    return [{"role": "tool", "content": r.content} for r in turn.tool_results]


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment", "register_env")
register_env = ENVIRONMENTS.register
# environments of other libraries (megarl/environments/), imported when a config names them
ENVIRONMENTS.declare("verifiers", "megarl.environments.verifiers:VerifiersEnvironment")
ENVIRONMENTS.declare("textarena", "megarl.environments.textarena:TextArenaEnvironment")
ENVIRONMENTS.declare("openenv", "megarl.environments.openenv:OpenEnvEnvironment")


@register_env("tools")
class ToolEnvironment(Environment):
    """Tool calls get their results; a turn without a call is the answer and ends the episode (its reward:
    the run's ``reward.fn``).

    Args:
        few_shot: messages put before the prompt's user message (after its system message): a worked example
            of a call, its result and the answer, which small models copy far more readily than an instruction.
    """

    def __init__(self, few_shot: Sequence[Message] = ()):
        self.few_shot = [dict(m) for m in few_shot]

    def reset(self, row: Mapping[str, Any], prompt: list[Message]) -> list[Message]:
        system = [m for m in prompt[:1] if m.get("role") == "system"]
        return system + self.few_shot + prompt[len(system):]


@register_env("guess_number")
class GuessNumber(Environment):
    """Guess a secret integer in ``[low, high]`` from "higher" / "lower" feedback (no tools).

    The row's ground truth is the number (or, without one, a number drawn from the row's index). The first
    message says the range; each turn the environment reads the turn's last integer and answers "higher",
    "lower" (a user message) or ends the episode with reward 1 when it is the number; a turn without a
    number is told so. Reward 0 when the turns run out.

    Args:
        low / high: the range (inclusive).
    """

    def __init__(self, low: int = 1, high: int = 100):
        self.low, self.high = low, high

    def reset(self, row: Mapping[str, Any], prompt: list[Message]) -> list[Message]:
        truth = row.get("ground_truth")
        span = self.high - self.low + 1
        self.secret = int(truth) if truth is not None else self.low + zlib.crc32(repr(sorted(row.items())).encode()) % span
        return [{"role": "user", "content": f"I am thinking of a whole number from {self.low} to {self.high}. "
                                            "Guess it: reply with one number. I will say higher or lower."}]

    def step(self, turn: AssistantTurn) -> StepResult:
        numbers = re.findall(r"-?\d+", turn.text)
        if not numbers:
            return StepResult([{"role": "user", "content": "Reply with one number."}])
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])


@dataclass
class EnvironmentFactory:
    """Builds one environment per episode: ``target(**kwargs)``.

    Attributes:
        name: the name or path it was loaded from.
        target: the class or function.
        kwargs: ``rollout.multi_turn.env_kwargs``.
    """

    name: str
    target: Callable[..., Environment]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Environment:
        return self.target(**self.kwargs)


def load_environment(spec: str, kwargs: Mapping[str, Any] | None = None) -> EnvironmentFactory:
    """The environment ``spec`` names (registered name or dotted path), checked by building one.

    Raises:
        EnvError: unknown name, an import that fails, or a build that fails with ``kwargs`` (the
            message names ``rollout.multi_turn.env`` / ``env_kwargs``).
    """
    target = ENVIRONMENTS.find(spec, EnvError)
    factory = EnvironmentFactory(spec, target, dict(kwargs or {}))
    try:
        env = factory()
    except TypeError as e:
        try:
            takes = [n for n, p in inspect.signature(target).parameters.items()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):  # a builtin without a signature
            takes = None
        fix = f"; {spec!r} takes {takes}" if takes is not None else ""
        raise EnvError(f"rollout.multi_turn.env_kwargs: cannot build environment {spec!r} with "
                       f"{sorted(factory.kwargs)}: {e}{fix}") from e
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise EnvError(f"rollout.multi_turn.env: {spec!r} built a {type(env).__name__}, which has no "
                                "reset(row, prompt) and step(turn); subclass megarl.agents.env.Environment")
    return factory
