"""The HTTP reward model against a real HTTP server on loopback, started by the test: batching, the score
of each text in order, retries through one injected timeout and one 503, and clear errors naming the URL
(server gone, malformed or short replies), so a step never proceeds with missing scores."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megarl.rewards import RewardError, load_reward_fn


class RewardServer:
    """A vLLM-pooling-shaped server: the score of a text is its length / 10. ``faults`` is a queue of
    behaviours for the next requests: "sleep" (answer after 2 s), "503", "drop" (leave out the last item),
    "garbage" (not JSON), "null" (the first text's score null, the second's NaN), "null=K" (the first K texts'
    scores null), "word" (every score a string). With ``die_after=k`` it shuts down (connections refused) once it
    answered k requests."""

    def __init__(self, die_after: int | None = None):
        self.faults: list[str] = []
        self.die_after = die_after
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                fault = server.faults.pop(0) if server.faults else None
                if fault == "503":
                    self.send_response(503)
                    self.end_headers()
                    self.wfile.write(b"overloaded")
                    return
                if fault == "sleep":
                    time.sleep(2.0)
                items = [{"index": i, "data": [len(t) / 10]} for i, t in enumerate(body["input"])]
                if fault == "null":
                    items[0]["data"], items[1]["data"] = [None], [float("nan")]
                if fault and fault.startswith("null="):
                    for item in items[:int(fault.partition("=")[2])]:
                        item["data"] = [None]
                if fault == "word":
                    items = [{**item, "data": ["high"]} for item in items]
                payload = b"not json" if fault == "garbage" else json.dumps(
                    {"data": items[:-1] if fault == "drop" else items}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload)
                if server.die_after is not None and len(server.requests) >= server.die_after:
                    threading.Thread(target=server.stop).start()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/pooling"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        if not self.stopped.is_set():
            self.stopped.set()
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture
def server():
    s = RewardServer()
    yield s
    s.stop()


PROMPTS = ["p1 ", "prompt2 ", "q "]
RESPONSES = ["a", "bb", "a longer response"]
WANT = [len(p + r) / 10 for p, r in zip(PROMPTS, RESPONSES)]


def reward(url, **kw):
    return load_reward_fn("http", {"url": url, "timeout_s": 0.5, "backoff_s": 0.01, "batch_size": 2, **kw})


def test_scores_in_order_batched(server):
    scores = reward(server.url, model="rm")(PROMPTS, RESPONSES, [None] * 3)
    assert scores.tolist() == pytest.approx(WANT)
    assert [len(r["input"]) for r in server.requests] == [2, 1]  # batch_size 2
    assert all(r["model"] == "rm" for r in server.requests)
    assert server.requests[0]["input"][0] == "p1 a"


def test_retries_through_a_timeout_and_a_503(server):
    server.faults = ["sleep", "503"]
    scores = reward(server.url, batch_size=8)(PROMPTS, RESPONSES)
    assert scores.tolist() == pytest.approx(WANT)
    assert len(server.requests) == 3  # timed out, 503, then answered


def test_gives_up_after_max_retries_naming_the_url(server):
    server.faults = ["503"] * 3
    with pytest.raises(RewardError, match=rf"reward server {server.url} failed 3 time\(s\), last: HTTP 503"):
        reward(server.url, max_retries=2)(PROMPTS, RESPONSES)


def test_server_gone(server):
    url = server.url
    server.stop()
    with pytest.raises(RewardError, match=rf"reward server {url} failed 2 time\(s\).*is it running"):
        reward(url, max_retries=1)(PROMPTS, RESPONSES)


def test_null_and_nan_scores_come_back_as_nan(server):
    """A text the server could not score (null, or NaN in the JSON) is NaN, for the trainer to drop
    (megarl.algos.nonfinite); the others keep their scores."""
    server.faults = ["null"]
    scores = reward(server.url)(PROMPTS, RESPONSES)
    assert torch.isnan(scores[:2]).all() and scores[2].item() == pytest.approx(WANT[2])


@pytest.mark.parametrize("fault, message", [("drop", "returned no score for 1 of 2 texts"),
                                            ("garbage", "reply that is not JSON"),
                                            ("word", "item 0 scores 'high', which is neither a number nor null")])
def test_incomplete_or_malformed_replies_fail(server, fault, message):
    server.faults = [fault]
    with pytest.raises(RewardError, match=message):
        reward(server.url)(PROMPTS, RESPONSES)


@pytest.mark.parametrize("kwargs, field", [({"url": "localhost:8000"}, "reward.kwargs.url"),
                                           ({"url": "http://h/p", "api": "chat"}, "reward.kwargs.api"),
                                           ({"url": "http://h/p", "batch_size": 0}, "reward.kwargs.batch_size"),
                                           ({"url": "http://h/p", "template": "{question}"},
                                            "reward.kwargs.template")])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(RewardError, match=field):
        load_reward_fn("http", kwargs)


def test_a_run_whose_reward_server_dies_records_no_step_without_scores(tmp_path):
    """The tiny task scored over HTTP: the server answers the first step's request and is then gone; the
    run stops with an error naming the URL, and metrics.jsonl holds only the complete first step."""
    from megarl.trainer.metrics import read_metrics
    from tests.distributed import run_world
    from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

    server = RewardServer(die_after=1)
    try:
        overrides = task_overrides(make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "p.jsonl", 16),
                                   tmp_path / "runs", "http") + [
            "reward.fn=http", f"reward.kwargs={{url: '{server.url}', timeout_s: 1, max_retries: 1, "
            "backoff_s: 0.01}", "trainer.steps=3", "trainer.save_every=1", "data.prompts_per_step=4",
            "rollout.n=2", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4"]
        with pytest.raises(RuntimeError, match=rf"reward server {server.url} failed 2 time"):
            run_world(train_on_rank, 1, overrides)
    finally:
        server.stop()
    history = read_metrics(tmp_path / "runs" / "http" / "metrics.jsonl")
    assert [h["step"] for h in history] == [1]
    assert history[0]["reward/mean"] > 0  # scored by the server (length / 10), not defaulted


def test_a_run_drops_the_samples_its_reward_server_cannot_score_and_stops_past_the_threshold(tmp_path):
    """The tiny task scored over HTTP, 8 samples a step: step 1's server leaves 2 of them unscored (null; 25% <=
    algorithm.nonfinite.max_fraction=0.3): they are dropped and counted, and the step trains with finite numbers;
    step 2's leaves 3 (37.5%): the run stops before that step's update, naming the first unscored sample."""
    from megarl.trainer.metrics import read_metrics
    from tests.distributed import run_world
    from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

    server = RewardServer()
    server.faults = ["null=2", "null=3"]
    try:
        overrides = task_overrides(make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "p.jsonl", 16),
                                   tmp_path / "runs", "http") + [
            "reward.fn=http", f"reward.kwargs={{url: '{server.url}', timeout_s: 5, max_retries: 0}}",
            "trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=2",
            "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "algorithm.nonfinite.max_fraction=0.3",
            "data.shuffle=false"]
        with pytest.raises(RuntimeError, match=r"NonFiniteError: 3 of 8 samples \(37.5%\) have non-finite rollout "
                                               r"log-probs or scores \(0 tokens, 3 scores\), more than "
                                               r"algorithm.nonfinite.max_fraction=0.3; the first, sample 0 of step 2 "
                                               r"\(prompt 0 of the step, dataset row 4\): its score is nan"):
            run_world(train_on_rank, 1, overrides)
    finally:
        server.stop()
    (step,) = read_metrics(tmp_path / "runs" / "http" / "metrics.jsonl")
    assert step["reward/nonfinite"] == 2 and step["nonfinite/sample_frac"] == 0.25
    assert all(math.isfinite(v) for k, v in step.items() if isinstance(v, float)), step
    assert step["reward/mean"] > 0  # over the 6 scored samples (length / 10)
