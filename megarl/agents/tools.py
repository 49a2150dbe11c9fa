"""Tools: Python callables with JSON schemas, found by name or dotted path, run with a timeout each.

A tool is a :class:`Tool`: its name, a description and the JSON schema of its parameters (an ``"object"``
schema, what OpenAI's ``tools=[{"type": "function", "function": {...}}]`` and every chat template's ``tools``
argument take: :meth:`Tool.schema`), and the Python function that runs it with the parsed arguments as keyword
arguments. Its return value becomes the observation text (``str()`` of it; a dict or list as JSON).

Writing one::

    from megarl.agents.tools import register_tool

    @register_tool("calculator", description="Evaluate an arithmetic expression, e.g. 2 * (3 + 4).",
                   parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]})
    def calculator(expression: str) -> str:
        ...

and name it in the config, ``rollout.multi_turn.tools=[calculator]`` (or by path, ``[mypkg.mytools:calculator]``,
for a function decorated with :func:`tool` or registered as above; a plain function is wrapped with a schema
made from its signature: every parameter a string unless annotated int, float or bool).

Running (:func:`run_tool_calls`): every call of a turn in a daemon thread of its own, all at once, each given
``timeout_s`` seconds; the episode's generation and the other episodes go on meanwhile
(:mod:`megarl.agents.rollout`). Nothing a tool does stops the run; each failure is an observation the model
reads and a counted kind (``agent/tool_errors/<kind>``):

- ``unknown_tool``: the call names no tool of the episode;
- ``bad_arguments``: the arguments do not fit the function's signature;
- ``exception``: the tool raised (the observation is ``error: <Type>: <message>``);
- ``timeout``: it ran past ``timeout_s`` (its thread is left to finish on its own: Python cannot stop a
  thread, which is why tools run in daemon threads that do not hold the process open: :class:`TimedCall`);
- ``malformed`` (from the parser, :mod:`megarl.agents.parsers`) and ``truncated`` (an observation cut to
  ``rollout.multi_turn.max_observation_tokens``, :mod:`megarl.agents.episode`).
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megarl.algos.registry import Registry

ERROR_KINDS = ("unknown_tool", "bad_arguments", "exception", "timeout", "malformed", "truncated")
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


class ToolError(ValueError):
    """A tool that cannot be found or described (bad config), never a tool that fails while it runs."""


@dataclass(frozen=True)
class Tool:
    """A callable the model may call.

    Attributes:
        name: what the model writes in a call.
        fn: runs the call: ``fn(**arguments)``; its return value is the observation (``str()``, JSON for a dict
            or list).
        description: one sentence for the prompt.
        parameters: the JSON schema of the arguments (``{"type": "object", "properties": {...}, "required":
            [...]}``).
    """

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __call__(self, **arguments: Any) -> Any:
        """``fn(**arguments)``."""
        return self.fn(**arguments)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style tool schema that chat templates render (``tools=[...]``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote, as the parser read it.

    Attributes:
        name: the tool it names.
        arguments: its arguments (a JSON object).
        text: the call as written (for logs and the error observation).
    """

    name: str
    arguments: Mapping[str, Any]
    text: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What one call returned.

    Attributes:
        call: the call (None for a malformed call the parser could not read).
        content: the observation text.
        error: None, or one of :data:`ERROR_KINDS`.
        seconds: the call's wall time (seconds; the timeout for a call that timed out).
    """

    call: ToolCall | None
    content: str
    error: str | None = None
    seconds: float = 0.0


TOOLS: Registry[Tool] = Registry("tool", "register_tool")


def tool(name: str | None = None, *, description: str | None = None,
         parameters: Mapping[str, Any] | None = None) -> Callable[[Callable], Tool]:
    """Decorator: the function as a :class:`Tool` (not registered; name it by path). ``name`` defaults to the
    function's name, ``description`` to its docstring's first line, ``parameters`` to a schema made from its
    signature (:func:`signature_schema`)."""
    def make(fn: Callable) -> Tool:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        return Tool(name or fn.__name__, fn, description if description is not None else (doc[0] if doc else ""),
                    dict(parameters) if parameters is not None else signature_schema(fn))
    return make


def register_tool(name: str, *, description: str | None = None,
                  parameters: Mapping[str, Any] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: register the function as the tool ``name`` (see :func:`tool`); returns it unchanged."""
    def decorate(fn: Callable) -> Callable:
        fn.megarl_tool = tool(name, description=description, parameters=parameters)(fn)
        return TOOLS.register(name)(fn)
    return decorate


def signature_schema(fn: Callable) -> dict[str, Any]:
    """A JSON schema of ``fn``'s keyword parameters: each a string unless annotated int, float or bool; those
    without a default required."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = p.annotation if not isinstance(p.annotation, str) else {
            "int": int, "float": float, "bool": bool}.get(p.annotation, str)
        props[p.name] = {"type": _JSON_TYPES.get(annotation, "string")}
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


def load_tool(spec: str) -> Tool:
    """The tool that ``spec`` names: a registered name, or a dotted path to a :class:`Tool` (from :func:`tool`),
    a function registered with :func:`register_tool`, or a plain function (wrapped by :func:`tool`).

    Raises:
        ToolError: unknown name, an import that fails, or something that is not a tool or function.
    """
    obj = TOOLS.find(spec, ToolError)
    if isinstance(obj, Tool):
        return obj
    return getattr(obj, "megarl_tool", None) or tool()(obj)


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """:func:`load_tool` of each spec.

    Raises:
        ToolError: as :func:`load_tool`, or two tools of one name.
    """
    tools = [load_tool(s) for s in specs]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError(f"rollout.multi_turn.tools: two tools share a name: {names}")
    return tools


def observation_text(value: Any) -> str:
    """A tool's return value as observation text: strings as they are, dicts and lists as JSON, else ``str()``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def run_tool_calls(calls: Sequence[ToolCall], tools: Mapping[str, Tool], timeout_s: float) -> list[ToolResult]:
    """Run every call at once, each in a daemon thread with ``timeout_s`` seconds (module docstring).

    Returns:
        One :class:`ToolResult` per call, in call order; failures are results with ``error`` set, never raised.
    """
    results: list[ToolResult | None] = [None] * len(calls)
    threads = []
    start = time.perf_counter()
    for k, call in enumerate(calls):
        found = tools.get(call.name)
        if found is None:
            results[k] = ToolResult(call, f"error: unknown tool {call.name!r}; the tools are {sorted(tools)}",
                                    "unknown_tool")
            continue
        try:
            inspect.signature(found.fn).bind(**call.arguments)
        except TypeError as e:
            results[k] = ToolResult(call, f"error: bad arguments for {call.name}: {e}", "bad_arguments")
            continue
        threads.append((k, call, TimedCall(found.fn, dict(call.arguments), name=f"tool-{call.name}")))
    for k, call, timed in threads:
        if not timed.wait(start + timeout_s):
            results[k] = ToolResult(call, f"error: {call.name} timed out after {timeout_s:g} s", "timeout", timeout_s)
        elif timed.error is not None:
            e = timed.error
            results[k] = ToolResult(call, f"error: {type(e).__name__}: {e}", "exception", timed.seconds)
        else:
            results[k] = ToolResult(call, observation_text(timed.value), None, timed.seconds)
    return results


class TimedCall:
    """``fn(**arguments)`` started at once in a daemon thread of its own, waited for until a deadline: a call that
    runs past it is left to finish on its own (Python cannot stop a thread; a daemon thread does not hold the
    process open). Tools (:func:`run_tool_calls`) and environments (``rollout.multi_turn.env_timeout_s``,
    :mod:`megarl.agents.rollout`) run this way.

    Attributes (once :meth:`wait` returned True):
        value: what ``fn`` returned. error: what it raised (any ``BaseException``), or None.
        seconds: its wall time (seconds).
    """

    def __init__(self, fn: Callable[..., Any], arguments: Mapping[str, Any], *, name: str):
        self.value: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, dict(arguments)), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], arguments: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            self.value = fn(**arguments)
        except BaseException as e:  # noqa: BLE001 (whatever the call raises is the caller's to report)
            self.error = e
        self.seconds = time.perf_counter() - t0
        self._done.set()

    def wait(self, deadline: float) -> bool:
        """Wait until the call ends or ``time.perf_counter()`` reaches ``deadline``; whether it ended."""
        return self._done.wait(max(0.0, deadline - time.perf_counter()))
