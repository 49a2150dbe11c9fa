"""The OpenEnv client environment (megarl/environments/openenv.py): a server started by the test on 127.0.0.1
speaking OpenEnv 0.10.0's session protocol (``/health``; ``/ws``: reset, step, close, as
``openenv.core.env_server.http_server`` answers them) answers a whole episode; a server that does not answer is
an error naming the URL before the run. (OpenEnv's own server package cannot be installed beside verifiers 0.4.0:
``mcp`` pins conflict; the protocol server here follows its wire format.)"""

from __future__ import annotations

import json
import socket
import threading
from http import HTTPStatus

import pytest

from megarl.agents.env import EnvError, load_environment
from megarl.agents.episode import ChatRenderer
from megarl.agents.parsers import load_parser
from megarl.agents.rollout import EpisodeSettings, run_episodes
from megarl.rollout.base import SamplingConfig
from tests.agent_fixtures import ScriptedEngine, bpe_tokenizer

websockets = pytest.importorskip("websockets.sync.server")


class CountServer:
    """An OpenEnv environment server: count to three. reset -> {"prompt": "say 1"}; each step's action
    {"message": text} scores 1 when the text is the next number; done after three steps. Records every message."""

    def __init__(self):
        self.received: list[dict] = []
        self.server = websockets.serve(self._session, "127.0.0.1", 0, process_request=self._http)
        self.url = "http://127.0.0.1:%d" % self.server.socket.getsockname()[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _http(self, connection, request):
        if request.path == "/health":
            return connection.respond(HTTPStatus.OK, '{"status": "healthy"}\n')
        return None if request.path == "/ws" else connection.respond(HTTPStatus.NOT_FOUND, "no\n")

    def _session(self, ws):
        count = 0
        for raw in ws:
            message = json.loads(raw)
            self.received.append(message)
            if message["type"] == "close":
                break
            if message["type"] == "reset":
                count, reward, done = 0, None, False
            elif message["type"] == "step":
                count += 1
                reward, done = float(message["data"].get("message", "").strip() == str(count)), count == 3
            else:
                ws.send(json.dumps({"type": "error", "data": {"message": "unknown type", "code": "BAD"}}))
                continue
            ws.send(json.dumps({"type": "observation", "data": {
                "observation": {"prompt": f"say {count + 1}", "metadata": {}}, "reward": reward, "done": done}}))


@pytest.fixture(scope="module")
def server():
    s = CountServer()
    yield s
    s.server.shutdown()


def test_an_openenv_server_answers_a_whole_episode(server):
    tok = bpe_tokenizer()
    said = ["1", "2", "5"]
    engine = ScriptedEngine(lambda p: tok(said[tok.decode(p).count("<|im_start|>assistant") - 1],
                                          add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                            [tok.eos_token_id])
    renderer = ChatRenderer(tok, [], load_parser("auto", tok.chat_template))
    factory = load_environment("openenv", {"url": server.url, "observation_key": "prompt",
                                           "action": {"metadata": {}}})
    out = run_episodes(engine, renderer, factory, [{}], [[{"role": "user", "content": "count"}]],
                       SamplingConfig(n=1, seed=1), EpisodeSettings(max_turns=5, max_turn_tokens=8))
    (e,) = out.episodes
    assert e.end == "done" and e.turns == 3 and e.reward == 2.0  # the server's rewards, summed
    assert [m["content"] for m in e.messages if m["role"] == "user"] == ["say 1", "say 2", "say 3"]
    types = [m["type"] for m in server.received]
    assert types == ["reset", "step", "step", "step", "close"]
    assert [m["data"] for m in server.received[1:4]] == [{"metadata": {}, "message": t} for t in said]
    assert isinstance(server.received[0]["data"]["seed"], int)


def test_a_server_that_does_not_answer_is_an_error_before_the_run():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(EnvError, match=rf"rollout.multi_turn.env_kwargs.url: no OpenEnv server answers at "
                                       rf"http://127.0.0.1:{port}/health"):
        load_environment("openenv", {"url": f"http://127.0.0.1:{port}", "timeout_s": 5})


def test_a_misspelt_keyword_is_named_with_the_ones_it_takes():
    with pytest.raises(EnvError, match=r"rollout.multi_turn.env_kwargs: cannot build environment 'openenv' with "
                                       r"\['acton_key', 'url'\]: .*'acton_key'; 'openenv' takes \['url', "
                                       r"'action_key', 'action', 'observation_key'"):
        load_environment("openenv", {"url": "http://127.0.0.1:1", "acton_key": "message"})
