"""A client environment for OpenEnv's environment servers (``rollout.multi_turn.env: openenv``): any server that
speaks OpenEnv 0.10.0's session protocol trains, one session per episode::

    rollout:
      multi_turn:
        enabled: true
        env: openenv
        env_kwargs: {url: "http://127.0.0.1:8000", action_key: message, observation_key: prompt}

The protocol (``openenv.core.env_client.EnvClient`` and ``env_server.http_server``'s ``/ws`` endpoint): a
WebSocket to ``<url>/ws``; ``{"type": "reset", "data": reset_kwargs}`` and ``{"type": "step", "data": action}``
are each answered by ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`` (or
``{"type": "error", "data": {"message", "code"}}``), and ``{"type": "close"}`` ends the session. (OpenEnv's HTTP
``/reset`` and ``/step`` build a fresh environment per request, so a multi-step episode needs the session.)

An episode: ``reset`` (with ``reset_kwargs``, and ``seed`` drawn from the episode's ``self.rng`` where
``seed_reset``); the observation's ``observation_key`` field (the whole observation as JSON where the key is
"" or absent) is the user message after the prompt's system message; each turn's text is sent as the action
``{**action, action_key: text}``; the step's observation is the next user message, its reward adds to the
episode's, and ``done`` ends it. The session closes when the episode ends, however it ended.

The server is checked before the run (``GET <url>/health`` within ``timeout_s``): one that does not answer is
an error naming the URL. The client needs only the ``websockets`` package (installed with textarena and
verifiers); OpenEnv itself (``openenv==0.10.0``, the servers' side) cannot be installed beside
``verifiers==0.4.0``: its ``fastmcp`` 3 needs ``mcp`` < 2, verifiers pins ``mcp==2.0.0``.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any, Mapping

from megarl.agents.env import AssistantTurn, EnvError, Environment, Message, StepResult
from megarl.environments import import_package

FIELD = "rollout.multi_turn.env_kwargs"


class OpenEnvEnvironment(Environment):
    """One OpenEnv session per episode (module docstring).

    Args:
        url: the server's base URL (``http://host:port``).
        action_key: the action field the turn's text fills.
        action: the action's other fields, the same every step.
        observation_key: the observation field shown to the policy ("" = the whole observation, JSON).
        reset_kwargs: the reset message's data.
        seed_reset: add ``seed`` (from the episode's rng) to the reset's data.
        timeout_s: seconds to wait for the server's health check and for each answer.

    Raises:
        EnvError: ``websockets`` missing, or no server answers ``<url>/health`` (the message names the URL).
    """

    def __init__(self, url: str, action_key: str = "message", action: Mapping[str, Any] | None = None,
                 observation_key: str = "", reset_kwargs: Mapping[str, Any] | None = None, seed_reset: bool = True,
                 timeout_s: float = 30.0):
        import_package("websockets.sync.client", "websockets==17.4", "rollout.multi_turn.env", EnvError)
        self.url, self.action_key, self.action = url.rstrip("/"), action_key, dict(action or {})
        self.observation_key, self.reset_kwargs = observation_key, dict(reset_kwargs or {})
        self.seed_reset, self.timeout_s = seed_reset, float(timeout_s)
        self.metrics: dict[str, float] = {}
        self._ws, self._session = None, contextlib.ExitStack()
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=self.timeout_s) as r:
                r.read()
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise EnvError(f"{FIELD}.url: no OpenEnv server answers at {self.url}/health ({e}); start the server "
                           "or fix the URL") from None

    def reset(self, row: Mapping[str, Any], prompt: list[Message]) -> list[Message]:
        from websockets.sync.client import connect

        ws_url = "ws" + self.url[len("http"):] if self.url.startswith("http") else self.url
        self._ws = self._session.enter_context(connect(f"{ws_url}/ws", open_timeout=self.timeout_s))
        data = {**self.reset_kwargs, **({"seed": self.rng.randrange(2**31)} if self.seed_reset else {})}
        answer = self._call("reset", data)
        system = [m for m in prompt[:1] if m.get("role") == "system"]
        return system + [{"role": "user", "content": self._text(answer)}]

    def step(self, turn: AssistantTurn) -> StepResult:
        answer = self._call("step", {**self.action, self.action_key: turn.text})
        reward = answer.get("reward")
        done = bool(answer.get("done"))
        return StepResult([] if done else [{"role": "user", "content": self._text(answer)}],
                          reward=None if reward is None else float(reward), done=done)

    def close(self, end: str) -> float | None:
        if self._ws is not None:
            try:
                self._ws.send(json.dumps({"type": "close"}))
            finally:
                self._ws = None
                self._session.close()
        return None

    def _call(self, kind: str, data: Mapping[str, Any]) -> dict[str, Any]:
        self._ws.send(json.dumps({"type": kind, "data": dict(data)}))
        message = json.loads(self._ws.recv(timeout=self.timeout_s))
        if message.get("type") == "error":
            error = message.get("data", {})
            self._ws = None  # the episode ends on the error: close() is not called after an exception
            self._session.close()
            raise EnvError(f"OpenEnv server {self.url}: {kind} failed: {error.get('message')} "
                           f"({error.get('code')})")
        return message.get("data", {})

    def _text(self, answer: Mapping[str, Any]) -> str:
        observation = answer.get("observation", {})
        if self.observation_key and self.observation_key in observation:
            return str(observation[self.observation_key])
        return json.dumps(observation)
