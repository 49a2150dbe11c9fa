"""Agents written as ordinary code: an async function that talks to an OpenAI-compatible chat client served from
the rollout engine, every call's prompt and sampled token ids recorded, so what trains is exactly what was sampled.

The agent (``rollout.multi_turn.agent: "pkg.mod:my_agent"``, a registered name or a dotted path) is::

    async def my_agent(row, client, prompt):        # prompt: optional parameter
        r = await client.chat.completions.create(model="megarl", messages=prompt, tools=[...])
        ...                                         # run tools, append messages, call again
        return 1.0                                  # the episode's reward, or None: reward.fn on the last reply

- ``row``: the dataset row (every field); ``prompt`` (passed where the function has such a parameter): the row's
  ``data.prompt_key`` as chat messages (``data.system_prompt``, ``data.instruction``).
- ``client``: ``client.chat.completions.create(**kwargs)`` of ``openai.AsyncOpenAI``. In-process by default
  (:class:`ChatClient`: its answers read as openai's objects do, ``r.choices[0].message.content``, and are
  dicts too); with ``rollout.multi_turn.agent_server=true`` an ``openai.AsyncOpenAI`` pointed at a local HTTP
  endpoint (:class:`ChatServer`, ``POST /v1/chat/completions``) whose base URL names the episode (needs the
  ``openai`` package, which vLLM installs). Several episodes run at once on one event loop (up to
  ``max_parallel_episodes``): an agent must not block it (run blocking tools with ``asyncio.to_thread``).

Each call (:class:`EpisodeRecorder`): the messages are rendered by the model's chat template with the request's
``tools`` (or, for a template without tools, the parser's description of them in the system message, as
:class:`~megarl.agents.episode.ChatRenderer` does), the prompt's ids are found, the engine samples (through the
:class:`~megarl.agents.rollout.GenerationLoop`, beside the other episodes' calls), the call is recorded as
``(prompt ids, sampled ids, log-probs)``, and the reply is the sampled text with the tool calls the run's
``tool_parser`` reads in it (OpenAI's ``tool_calls``: ``{"id", "type": "function", "function": {"name",
"arguments": JSON text}}``; ``finish_reason`` "tool_calls"; the call texts removed from ``content``).

Token exactness. An assistant message the endpoint returned (the same content and calls, however the agent
rebuilt the dict) is rendered as the model wrote it, its sampled text as the content. A request whose rendering
begins with the text of an earlier call's prompt plus its sampled ids (or of an earlier prompt: a retry, n
samples of one prompt) reuses those ids and encodes only the rest (the template's turn end, the new messages
and the next assistant header); so the sampled ids are never decoded and encoded again. Otherwise (the agent
edited or dropped a reply, a template that drops earlier reasoning, another conversation) the rendering is
encoded whole. The episode's samples are :func:`~megarl.agents.episode.samples_from_calls` of its calls: a call
whose prompt extends the previous call's prompt and sampled ids extends its sample (the ids in between are
observation tokens, mask 0); any other starts a new sample (``agent/samples_split``), all sharing the episode's
reward.

The rules: one model (the request's ``model`` is not read); sampling is the run's (``rollout.temperature``,
``top_p``, ``top_k``: a request asking for others is refused; its ``seed`` is not read, every call is seeded
from the run's seed, the step, the episode and the call's index); ``n`` 1; no ``stop`` strings, no streaming;
``max_tokens`` (or ``max_completion_tokens``) may lower ``rollout.max_new_tokens``. The budgets: at most
``max_turns`` calls, ``max_episode_tokens`` and the context; a call past one is refused with
:class:`EpisodeLimit` (HTTP 400), and an episode whose agent then raises ends by that budget, scored by
``reward.fn``. Any other exception of the agent ends its episode with reward 0 (``agent/ended/env_error``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Sequence

from megarl.agents.episode import ChatRenderer, samples_from_calls
from megarl.agents.rollout import (EpisodeBatch, EpisodeResult, EpisodeSettings, GenerationLoop, WeightUpdate,
                                   gather_episodes)
from megarl.agents.tools import Tool, ToolCall
from megarl.algos.registry import Registry
from megarl.rollout.base import Completion, RequestEngine, RolloutStats, SamplingConfig, turn_seed
from megarl.rollout.data_parallel import shard_bounds

log = logging.getLogger(__name__)

AGENTS: Registry[Callable[..., Any]] = Registry("agent", "register_agent")
register_agent = AGENTS.register

# request fields read, and those accepted but not read (the openai client's and vLLM's usual ones)
_READ = {"messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
         "n", "stop", "stream", "logprobs", "extra_body"}
_NOT_READ = {"model", "seed", "user", "metadata", "parallel_tool_calls", "top_logprobs", "timeout", "extra_headers",
             "extra_query", "frequency_penalty", "presence_penalty", "store", "stream_options"}


class AgentError(ValueError):
    """An agent function that cannot be loaded, or that returned something other than a reward."""


class ChatRequestError(ValueError):
    """A request the endpoint refuses (HTTP 400); the message names the field.

    Attributes:
        param: the request field at fault.
    """

    def __init__(self, message: str, param: str = ""):
        super().__init__(message)
        self.param = param


class EpisodeLimit(ChatRequestError):
    """A call past the episode's budget.

    Attributes:
        reason: "max_turns", "episode_budget" or "context" (``agent/ended/<reason>``).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message, reason)
        self.reason = reason


@dataclass(frozen=True)
class AgentFunction:
    """The loaded agent.

    Attributes:
        name: the config's name or path.
        fn: ``async def fn(row, client[, prompt])``.
        takes_prompt: whether ``fn`` has a ``prompt`` parameter.
    """

    name: str
    fn: Callable[..., Any]
    takes_prompt: bool

    def __call__(self, row: Mapping[str, Any], client: Any, prompt: list[dict[str, Any]]):
        return self.fn(row, client, prompt=prompt) if self.takes_prompt else self.fn(row, client)


def load_agent(spec: str) -> AgentFunction:
    """The agent function ``spec`` names (a registered name or ``"pkg.mod:fn"``).

    Raises:
        AgentError: not found, or not an ``async def`` of ``(row, client[, prompt])``.
    """
    try:
        fn = AGENTS.find(spec, AgentError)
    except AgentError as e:
        raise AgentError(f"rollout.multi_turn.agent: {e}") from e
    if not inspect.iscoroutinefunction(fn):
        raise AgentError(f"rollout.multi_turn.agent: {spec!r} is not an async function; write it as "
                         "`async def agent(row, client)` (it awaits client.chat.completions.create)")
    params = inspect.signature(fn).parameters
    required = [p for name, p in params.items() if p.default is p.empty and name != "prompt"
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if len(required) > 2:
        raise AgentError(f"rollout.multi_turn.agent: {spec!r} takes {list(params)}; it is called as "
                         "agent(row, client) (and prompt=messages where it has a `prompt` parameter)")
    return AgentFunction(spec, fn, "prompt" in params)


class Record(dict):
    """A JSON object that reads as attributes too, as openai's response objects do
    (``r.choices[0].message.tool_calls[0].function.arguments``); ``model_dump()`` gives plain dicts."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def model_dump(self, exclude_none: bool = False, **_: Any) -> dict[str, Any]:
        return _plain(self, exclude_none)


def _record(value: Any) -> Any:
    if isinstance(value, Mapping):
        return Record({k: _record(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_record(v) for v in value]
    return value


def _plain(value: Any, exclude_none: bool = False) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v, exclude_none) for k, v in value.items() if not (exclude_none and v is None)}
    if isinstance(value, (list, tuple)):
        return [_plain(v, exclude_none) for v in value]
    dump = getattr(value, "model_dump", None)  # an openai (pydantic) message passed back as it came
    if callable(dump):
        return _plain(dump(exclude_none=True), exclude_none)
    return value


def _message_key(message: Mapping[str, Any]) -> str:
    """What identifies an assistant message: its content and its calls (name, arguments as JSON), not the
    calls' ids nor how the agent wrote the dict."""
    calls = []
    for c in message.get("tool_calls") or []:
        f = (c or {}).get("function") or {}
        args = f.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append([f.get("name"), args])
    return json.dumps([message.get("content") or "", calls], sort_keys=True, default=str)


def _tool_from_schema(schema: Any, k: int) -> Tool:
    """A :class:`~megarl.agents.tools.Tool` (without a function: the agent runs its tools) of an OpenAI tool
    schema ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    f = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise ChatRequestError(f"tools[{k}]: must be {{'type': 'function', 'function': {{'name': ..., "
                               f"'parameters': {{...}}}}}}, got {schema!r}", "tools")
    return Tool(f["name"], _no_function, f.get("description") or "",
                dict(f.get("parameters") or {"type": "object", "properties": {}}))


def _no_function(**_: Any) -> Any:
    raise RuntimeError("the agent runs its own tools")


@dataclass
class RecordedCall:
    """One call of an episode.

    Attributes:
        prompt_ids: the prompt the engine got.
        token_ids / logprobs: what it sampled, with the rollout log-prob of each token.
        finish_reason: "stop" or "length".
        reused: the prompt began with the ids of an earlier call (its prompt, or prompt and sampled ids).
        policy_version / routes: the completion's (:class:`~megarl.rollout.base.Completion`).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reused: bool
    policy_version: int | None = None
    routes: Any = None


@dataclass
class _Pending:
    index: int
    prompt_ids: list[int]
    prompt_text: str
    messages: list[dict[str, Any]]
    tools: dict[str, Tool]
    parse: bool
    sampling: SamplingConfig
    seed: int
    delta: int
    reused: bool
    logprobs: bool


class EpisodeRecorder:
    """One episode's side of the endpoint (module docstring): renders each request, finds its prompt ids,
    submits it to the generation loop, records it and answers as OpenAI's chat completions do. Thread-safe
    (the HTTP server calls it from its handler threads).

    Args:
        loop: the generation loop over the engine.
        renderer: the chat template, tokenizer and tool-call parser (its tools are not used: each request
            names its own).
        sampling: the run's sampling (temperature, top_p, top_k, stop ids, seed).
        settings: the budgets (``max_turns`` calls, ``max_turn_tokens``, ``max_episode_tokens``).
        stop: the ids that end a turn (the engine's EOS ids and ``sampling.stop_token_ids``).
        context: the model's context, tokens.
        seed_of: the seed of the episode's k-th call.
    """

    def __init__(self, loop: GenerationLoop, renderer: ChatRenderer, sampling: SamplingConfig,
                 settings: EpisodeSettings, stop: Sequence[int], context: int, seed_of: Callable[[int], int]):
        self.loop, self.renderer, self.sampling, self.settings = loop, renderer, sampling, settings
        self.stop, self.context, self.seed_of = set(int(t) for t in stop), context, seed_of
        self.calls: list[RecordedCall] = []
        self.limit: str | None = None  # the budget a refused call hit
        self.used = 0  # sampled tokens and appended prompt tokens after the first prompt (max_episode_tokens)
        self.tool_calls = self.malformed = self.cut = 0
        self.wait_s = 0.0
        self.last_text, self.last_cut = "", False
        self.messages: list[dict[str, Any]] = []
        self._started = 0
        self._held: list[tuple[str, list[int]]] = []  # texts whose ids are known: prompts, prompts + samples
        self._raw: dict[str, str] = {}  # returned assistant message -> its sampled text
        self._lock = threading.Lock()

    # -- a request
    def prepare(self, request: Mapping[str, Any]) -> _Pending:
        """Check and render ``request`` (the keyword arguments of ``create``) and find its prompt ids.

        Raises:
            ChatRequestError: a field the endpoint does not serve; EpisodeLimit: a budget spent.
        """
        request = dict(request)
        request.update(request.pop("extra_body", None) or {})
        unknown = sorted(set(request) - _READ - _NOT_READ)
        if unknown:
            raise ChatRequestError(f"{unknown[0]}: not served by megarl's endpoint (fields read: {sorted(_READ)})",
                                   unknown[0])
        for key in ("temperature", "top_p", "top_k"):
            value, run = request.get(key), getattr(self.sampling, key)
            if value is not None and float(value) != float(run):
                raise ChatRequestError(f"{key}: {value} asked, but the run samples with rollout.{key}={run} (the "
                                       f"trainer's log-probs are of that); leave it out or set rollout.{key}", key)
        if request.get("n") not in (None, 1):
            raise ChatRequestError(f"n: must be 1, got {request['n']} (call again for another sample)", "n")
        if request.get("stop"):
            raise ChatRequestError("stop: stop strings are not served (a turn ends at the model's end-of-turn "
                                   "token; rollout.stop_token_ids adds others)", "stop")
        if request.get("stream"):
            raise ChatRequestError("stream: streaming is not served; leave stream unset", "stream")
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ChatRequestError(f"max_tokens: must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        messages = request.get("messages")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatRequestError("messages: a non-empty list of {'role', 'content'} messages is needed", "messages")
        messages = [_plain(m) for m in messages]
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatRequestError(f"messages[{k}]: must be a dict with a 'role', got {m!r}", "messages")
        tools = [_tool_from_schema(s, k) for k, s in enumerate(request.get("tools") or [])]
        renderer = self.renderer.with_tools(tools)
        with self._lock:
            shown = [{"role": "assistant", "content": self._raw[key]} if m["role"] == "assistant" and
                     (key := _message_key(m)) in self._raw else m for m in messages]
            text = renderer.render(renderer.first_messages(shown))
            known = max((h for h in self._held if text.startswith(h[0])), key=lambda h: len(h[0]), default=None)
            if known is None:
                prompt, delta = renderer.encode(text), 0
            else:
                rest = renderer.encode(text[len(known[0]):]) if len(text) > len(known[0]) else []
                prompt, delta = known[1] + rest, len(rest)
            if self._started >= self.settings.max_turns:
                self._refuse("max_turns", f"the episode has made its {self.settings.max_turns} calls "
                                          "(rollout.multi_turn.max_turns)")
            budget = self.settings.max_episode_tokens
            limits = {"turn": min(self.settings.max_turn_tokens, max_tokens or self.settings.max_turn_tokens),
                      "episode_budget": budget - self.used - delta if budget else self.settings.max_turn_tokens,
                      "context": self.context - len(prompt)}
            binding = min(limits, key=lambda name: limits[name])
            if limits[binding] < 1:
                self._refuse(binding, f"the prompt of {len(prompt)} tokens leaves no token to sample: "
                             + ("rollout.multi_turn.max_episode_tokens is spent" if binding == "episode_budget"
                                else f"the context is {self.context} tokens"))
            index = self._started
            self._started += 1
            self.used += delta
            self._held.append((text, prompt))
        return _Pending(index, prompt, text, messages, {t.name: t for t in tools},
                        bool(tools) and request.get("tool_choice") != "none",
                        dataclasses.replace(self.sampling, n=1, max_new_tokens=limits[binding]),
                        self.seed_of(index), delta, known is not None, bool(request.get("logprobs")))

    def _refuse(self, reason: str, message: str) -> None:
        self.limit = reason
        raise EpisodeLimit(reason, f"{reason}: {message}")

    def submit(self, pending: _Pending) -> Future:
        """The future of the engine's :class:`~megarl.rollout.base.Completion` of ``pending``."""
        return self.loop.submit(pending.prompt_ids, pending.sampling, pending.seed)

    def complete(self, pending: _Pending, done: Completion) -> Record:
        """Record the call and answer it (an OpenAI ``chat.completion`` object)."""
        ids, logprobs = [int(t) for t in done.token_ids], [float(x) for x in done.logprobs.tolist()]
        content_ids = ids[:-1] if ids and ids[-1] in self.stop else ids
        r = self.renderer
        text = r.decode(content_ids)
        calls, malformed = r.parser.parse(text, pending.tools) if pending.parse else ([], [])
        content: str | None = text
        for c in calls:
            content = content.replace(c.text, "", 1) if c.text else content
        content = content.strip() if calls else content
        message = {"role": "assistant", "content": content or (None if calls else ""),
                   "tool_calls": [_openai_call(c, f"call_{uuid.uuid4().hex[:12]}") for c in calls] or None}
        with self._lock:
            self.calls.append(RecordedCall(pending.prompt_ids, ids, logprobs, done.finish_reason, pending.reused,
                                           done.policy_version, done.routed_experts))
            self._held.append((pending.prompt_text + r.decode(ids), pending.prompt_ids + ids))
            self._raw[_message_key(message)] = text
            self.used += len(ids)
            self.tool_calls += len(calls)
            self.malformed += len(malformed)
            self.last_cut = done.finish_reason == "length"
            self.cut += self.last_cut
            self.last_text = text
            self.messages = pending.messages + [message]
        choice = {"index": 0, "message": message,
                  "finish_reason": "tool_calls" if calls else done.finish_reason,
                  "logprobs": {"content": [{"token": r.decode([t]), "logprob": lp}
                                           for t, lp in zip(ids, logprobs)]} if pending.logprobs else None,
                  "token_ids": ids}
        return _record({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                        "created": int(time.time()), "model": "megarl", "choices": [choice],
                        "prompt_token_ids": pending.prompt_ids,
                        "usage": {"prompt_tokens": len(pending.prompt_ids), "completion_tokens": len(ids),
                                  "total_tokens": len(pending.prompt_ids) + len(ids)}})

    async def acreate(self, **request: Any) -> Record:
        """``chat.completions.create`` for an agent on the event loop."""
        pending = self.prepare(request)
        t0 = time.perf_counter()
        done = await asyncio.wrap_future(self.submit(pending))
        self.wait_s += time.perf_counter() - t0
        return self.complete(pending, done)

    def create(self, request: Mapping[str, Any]) -> Record:
        """``chat.completions.create`` blocking the calling thread (the HTTP server's handlers)."""
        pending = self.prepare(request)
        t0 = time.perf_counter()
        done = self.submit(pending).result()
        with self._lock:
            self.wait_s += time.perf_counter() - t0
        return self.complete(pending, done)


def _openai_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments), ensure_ascii=False)}}


class ChatClient:
    """The in-process client of one episode: ``client.chat.completions.create(**kwargs)`` as on
    ``openai.AsyncOpenAI`` (a coroutine; the answer reads as openai's objects and is a dict)."""

    def __init__(self, recorder: EpisodeRecorder):
        self.recorder = recorder
        self.chat = _Namespace(completions=_Namespace(create=recorder.acreate))


class _Namespace:
    def __init__(self, **fields: Any):
        self.__dict__.update(fields)


class ChatServer:
    """The local HTTP endpoint (``rollout.multi_turn.agent_server``): ``POST <base>/chat/completions`` and
    ``GET <base>/models`` on ``127.0.0.1`` (a free port), ``<base>`` = ``/episodes/<key>/v1`` naming the
    episode's recorder. Requests are served on threads of their own; a refused request is a 400 with an
    OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` body, an unknown episode or path a 404."""

    def __init__(self):
        self.recorders: dict[str, EpisodeRecorder] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # no line per request
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _recorder(self, suffix: str) -> EpisodeRecorder | None:
                parts = self.path.split("?")[0].strip("/").split("/")
                if len(parts) < 3 or parts[0] != "episodes" or "/" + "/".join(parts[2:]) != suffix:
                    return None
                return server.recorders.get(parts[1])

            def do_GET(self):
                if self._recorder("/v1/models") is None:
                    return self._send(404, _error(f"no such endpoint {self.path}", "not_found"))
                self._send(200, {"object": "list", "data": [{"id": "megarl", "object": "model"}]})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                recorder = self._recorder("/v1/chat/completions")
                if recorder is None:
                    return self._send(404, _error(f"no such endpoint {self.path}", "not_found"))
                try:
                    request = json.loads(body or b"{}")
                    if not isinstance(request, dict):
                        raise ChatRequestError("the body must be a JSON object")
                    self._send(200, recorder.create(request))
                except json.JSONDecodeError as e:
                    self._send(400, _error(f"the body is not JSON: {e}", "invalid_request_error"))
                except ChatRequestError as e:
                    self._send(400, _error(str(e), "invalid_request_error", e.param))
                except Exception as e:  # noqa: BLE001 (the engine's refusal: the agent sees it, the run goes on)
                    self._send(500, _error(f"{type(e).__name__}: {e}", "server_error"))

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="chat-server", daemon=True)
        self._thread.start()

    def base_url(self, recorder: EpisodeRecorder) -> str:
        """Register ``recorder``; the base URL (``.../v1``) of its episode."""
        key = uuid.uuid4().hex
        self.recorders[key] = recorder
        return f"http://127.0.0.1:{self.port}/episodes/{key}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # every episode connects at once (the default 5 resets connections past it)


def _error(message: str, kind: str, param: str = "") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param or None, "code": None}}


def require_openai() -> Any:
    """The ``openai`` module.

    Raises:
        AgentError: it is not installed (the message says how to do without).
    """
    try:
        import openai
    except ImportError as e:
        raise AgentError("rollout.multi_turn.agent_server=true gives the agent an openai.AsyncOpenAI client, and "
                         "the openai package is not installed (pip install openai; vLLM installs it); or set "
                         "rollout.multi_turn.agent_server=false for the in-process client") from e
    return openai


def openai_client(base_url: str) -> Any:
    """``openai.AsyncOpenAI`` at ``base_url`` (no retries: a refused call is the agent's to handle).

    Raises:
        AgentError: the ``openai`` package is not installed.
    """
    return require_openai().AsyncOpenAI(base_url=base_url, api_key="megarl", max_retries=0)


def run_agent_episodes(engine: RequestEngine, renderer: ChatRenderer, agent: AgentFunction,
                       rows: Sequence[Mapping[str, Any]], prompts: Sequence[list[dict[str, Any]]],
                       sampling: SamplingConfig, settings: EpisodeSettings, *, call: int = 0, prompt_offset: int = 0,
                       server: bool = False, client_factory: Callable[[str], Any] | None = None,
                       pause: WeightUpdate | None = None) -> EpisodeBatch:
    """Run ``sampling.n`` episodes of ``agent`` per row on one event loop (a thread of its own) while this
    thread steps the engine (:class:`~megarl.agents.rollout.GenerationLoop`; ``pause``: new weights taken
    between calls once due, as there).

    Args:
        engine / renderer / sampling / call / prompt_offset: as :func:`~megarl.agents.rollout.run_episodes`.
        agent: the agent function.
        rows / prompts: each prompt's dataset row and its chat messages.
        settings: budgets (``max_turns`` calls per episode) and ``max_parallel_episodes`` at a time.
        server: serve each episode over HTTP (:class:`ChatServer`), the agent's client made by
            ``client_factory(base_url)`` (default :func:`openai_client`); False: the in-process
            :class:`ChatClient`.

    Returns:
        The episodes, prompt-major (``end`` "done" when the agent returned, a budget's name when it raised
        after a refused call, "env_error" for any other exception).

    Raises:
        AgentError: the agent returned something other than a number or None (every episode would).
        RolloutError: from the engine.
    """
    start = time.perf_counter()
    loop = GenerationLoop(engine)
    stop = tuple(engine.spec.eos_token_ids) + tuple(sampling.stop_token_ids)
    context = engine.spec.max_position_embeddings
    jobs = [(k, j) for k in range(len(rows)) for j in range(sampling.n)]
    results: list[EpisodeResult | None] = [None] * len(jobs)
    http = ChatServer() if server else None
    make_client = client_factory or openai_client
    finished = threading.Event()
    failure: list[BaseException] = []

    async def episode(index: int, gate: asyncio.Semaphore) -> None:
        k, j = jobs[index]
        p = prompt_offset + k
        recorder = EpisodeRecorder(loop, renderer, sampling, settings, stop, context,
                                   lambda t: turn_seed(sampling.seed, call, p, j, t))
        async with gate:
            client = make_client(http.base_url(recorder)) if http else ChatClient(recorder)
            results[index] = await _agent_episode(agent, recorder, client, rows[k], prompts[k], p, j)

    async def main() -> None:
        gate = asyncio.Semaphore(max(1, settings.max_parallel_episodes))
        await asyncio.gather(*(episode(i, gate) for i in range(len(jobs))))

    def run_loop() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 (raised on the engine's thread below)
            failure.append(e)
        finally:
            finished.set()

    thread = threading.Thread(target=run_loop, name="agents", daemon=True)
    thread.start()
    try:
        loop.run(finished.is_set, pause=pause)
    finally:
        thread.join()
        if http:
            http.close()
    if failure:
        raise failure[0]
    stats = RolloutStats(prompt_tokens=loop.prompt_tokens, generated_tokens=loop.generated_tokens,
                         seconds=time.perf_counter() - start)
    return EpisodeBatch(results, sampling.n, stats, loop.cached_tokens)


async def _agent_episode(agent: AgentFunction, recorder: EpisodeRecorder, client: Any, row: Mapping[str, Any],
                         prompt: list[dict[str, Any]], prompt_index: int, sample_index: int) -> EpisodeResult:
    t0 = time.perf_counter()
    reward: float | None
    try:
        value = await agent(dict(row), client, [dict(m) for m in prompt])
    except Exception as e:  # noqa: BLE001 (a failing agent ends its episode, not the run)
        if recorder.limit is not None:
            end, reward = recorder.limit, None
        else:
            log.warning("agent %s failed (prompt %d): %s: %s", agent.name, prompt_index, type(e).__name__, e)
            end, reward = "env_error", 0.0
    else:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise AgentError(f"rollout.multi_turn.agent: {agent.name!r} returned {type(value).__name__} "
                             f"{value!r}; it must return the episode's reward (a number) or None (reward.fn scores "
                             "its last reply)")
        end, reward = "done", None if value is None else float(value)
    finally:
        close = getattr(client, "close", None)  # an openai.AsyncOpenAI's connections
        if inspect.iscoroutinefunction(close):
            await close()
    samples = samples_from_calls([(c.prompt_ids, c.token_ids, c.logprobs, c.policy_version, c.routes)
                                  for c in recorder.calls])
    return EpisodeResult(prompt_index, sample_index, samples, reward, end, recorder.last_text,
                         recorder.messages or [dict(m) for m in prompt], len(recorder.calls), recorder.tool_calls,
                         {"malformed": recorder.malformed} if recorder.malformed else {},
                         max(0.0, time.perf_counter() - t0 - recorder.wait_s), max(0, len(samples) - 1),
                         recorder.cut, recorder.last_cut)


def run_agent_episodes_data_parallel(engine: RequestEngine | None, renderer: ChatRenderer, agent: AgentFunction,
                                     rows: Sequence[Mapping[str, Any]], prompts: Sequence[list[dict[str, Any]]],
                                     sampling: SamplingConfig, settings: EpisodeSettings, *, call: int = 0,
                                     group=None, server: bool = False, pause: WeightUpdate | None = None,
                                     gather: bool = True) -> EpisodeBatch:
    """:func:`run_agent_episodes` on this rank's share of the prompts, gathered on every rank of ``group`` (as
    :func:`~megarl.agents.rollout.run_episodes_data_parallel`, with its ``pause`` and ``gather``)."""
    import torch.distributed as dist

    lo, hi = shard_bounds(len(rows), dist.get_rank(group), dist.get_world_size(group))
    local = run_agent_episodes(engine, renderer, agent, rows[lo:hi], prompts[lo:hi], sampling, settings, call=call,
                               prompt_offset=lo, server=server, pause=pause)
    return gather_episodes(local, sampling.n, group) if gather else local
