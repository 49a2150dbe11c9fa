"""The generative judge against a fake OpenAI-compatible server on loopback, started by the test: each sample's
verdict is scripted (scores, choices, unreadable replies, timeouts), and the rewards and error metrics are what
the script says; requests run concurrently; the mix with a rule reward follows the weights; bad judge configs
end in one ``megarl: error:`` line naming the field."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megarl.config import JudgeConfig, RewardConfig, load_config
from megarl.rewards.judge import GenerativeJudge, parse_verdict
from megarl.rewards.mix import StepReward, merge_reward_metrics
from megarl.rewards.registry import RewardError

RUBRIC = "Q: {prompt} |A: {response} |REF: {reference} | Say 'Score: N'."


class JudgeServer:
    """A chat-completions server whose reply to a sample is ``script[response]`` (or ``script(response)``): a text,
    or ("sleep", s) (answer after s seconds), or "500" (HTTP 500), or ("barrier", text) (wait until ``barrier``
    requests are in flight at once, then answer text; an unmet barrier answers "no barrier"). Records each
    request's body."""

    def __init__(self, script: dict, barrier: int = 0):
        self.script, self.requests = script, []
        self.barrier = threading.Barrier(barrier) if barrier else None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                response = body["messages"][-1]["content"].split(" |A: ")[1].split(" |REF: ")[0]
                action = server.script(response) if callable(server.script) else server.script[response]
                if action == "500":
                    self.send_response(500)
                    self.end_headers()
                    return
                if isinstance(action, tuple) and action[0] == "sleep":
                    time.sleep(action[1])
                    action = "Score: 10"
                if isinstance(action, tuple) and action[0] == "barrier":
                    try:
                        server.barrier.wait(timeout=30)
                        action = action[1]
                    except threading.BrokenBarrierError:
                        action = "no barrier"
                payload = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                          "content": action}}]}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(script, **kw):
        servers.append(JudgeServer(script, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def judge_cfg(url, **kw) -> JudgeConfig:
    return JudgeConfig(**{"enabled": True, "url": url, "rubric": RUBRIC, "max_retries": 0, "backoff_s": 0.0, **kw})


def test_scripted_scores_unreadable_verdicts_and_timeouts_give_the_scripted_rewards_and_counts(serve):
    script = {"r0": "The answer is right. Score: 7", "r1": "**Rating**: [[10]]", "r2": "3",
              "r3": "I cannot decide.", "r4": "Score: 11", "r5": ("sleep", 3.0),
              "r6": "<think>Score: 1?</think> Final score: 4"}
    server = serve(script)
    judge = GenerativeJudge(judge_cfg(server.url, model="judge-m", timeout_s=0.5, error_score=-1.0, max_retries=1,
                                      system="You are a strict grader."))
    responses = list(script)
    scores = judge([f"p{i}" for i in range(7)], responses, ["ref0", None, *["r"] * 5])
    assert scores == [0.7, 1.0, 0.3, -1.0, -1.0, -1.0, 0.4]
    counts = judge.take_counts()
    assert (counts["requests"], counts["unreadable"], counts["timeouts"]) == (7, 2, 1)
    assert judge.take_counts()["requests"] == 0  # taken: zeroed
    # r5 was sent twice (one retry after its timeout); each request carries the model, system and rubric
    assert sum("|A: r5 |" in r["messages"][-1]["content"] for r in server.requests) == 2
    first = next(r for r in server.requests if "|A: r0 |" in r["messages"][-1]["content"])
    assert first["model"] == "judge-m" and first["messages"][0] == {"role": "system",
                                                                     "content": "You are a strict grader."}
    assert first["messages"][1]["content"] == "Q: p0 |A: r0 |REF: ref0 | Say 'Score: N'."
    second = next(r for r in server.requests if "|A: r1 |" in r["messages"][-1]["content"])
    assert "|REF:  |" in second["messages"][-1]["content"]  # no ground truth: empty reference


def test_choices_and_a_null_error_score_give_nan(serve):
    script = {"a": "Verdict: [[A]]", "b": "After comparing, my verdict is: B.", "y": "Yes.", "n": "no",
              "u": "Both are fine."}
    server = serve(script)
    judge = GenerativeJudge(judge_cfg(server.url, verdict="choice", choices={"A": 1.0, "B": 0.0, "yes": 1.0,
                                                                             "no": 0.25}, error_score=None))
    scores = judge(["p"] * 5, list(script), None)
    assert scores[:4] == [1.0, 0.0, 1.0, 0.25] and math.isnan(scores[4])
    assert judge.take_counts()["unreadable"] == 1
    # from the command line, quoted: a bare yes is YAML's True
    cfg = load_config(None, ["reward.judge.enabled=true", f"reward.judge.url={server.url}",
                             "reward.judge.verdict=choice", 'reward.judge.choices={"yes": 1, "no": 0.25}'])
    assert cfg.reward.judge.choices == {"yes": 1.0, "no": 0.25}


def test_requests_of_one_call_are_in_flight_together(serve):
    """Four samples, max_concurrency 4: the server answers only when all four requests are open at once."""
    server = serve({f"r{i}": ("barrier", f"Score: {i}") for i in range(4)}, barrier=4)
    judge = GenerativeJudge(judge_cfg(server.url, max_concurrency=4, timeout_s=60))
    assert judge(["p"] * 4, [f"r{i}" for i in range(4)]) == [0.0, 0.1, 0.2, 0.3]


def test_a_server_error_after_the_retries_fails_the_call_naming_the_url(serve):
    server = serve({"r": "500"})
    judge = GenerativeJudge(judge_cfg(server.url, max_retries=1))
    with pytest.raises(RewardError, match="127.0.0.1.*failed 2 time"):
        judge(["p"], ["r"])
    gone = GenerativeJudge(judge_cfg("http://127.0.0.1:9/v1"))
    with pytest.raises(RewardError, match="127.0.0.1:9/v1/chat/completions"):
        gone(["p"], ["r"])


def test_mixed_with_a_rule_reward_by_weights(serve):
    """``0.5 * judge + 2 * arithmetic``: the arithmetic reward is 1 for a right last number, else 0."""
    server = serve({"12": "Score: 10", "13": "Score: 5"})
    reward = StepReward(RewardConfig(fn="arithmetic", judge=judge_cfg(server.url, weight=0.5, rule_weight=2.0)))
    out = reward(["What is 5 + 7?", "What is 5 + 7?"], ["12", "13"], ["12", "12"])
    rule = reward.rule(["What is 5 + 7?"] * 2, ["12", "13"], ["12", "12"])
    assert torch.equal(out, 0.5 * torch.tensor([1.0, 0.5]) + 2.0 * rule)
    metrics = reward.take_metrics()
    assert metrics["reward/judge_requests"] == 2 and metrics["reward/judge_unreadable"] == 0
    assert metrics["reward/judge_s"] > 0 and metrics["reward/rule_s"] > 0
    merged = merge_reward_metrics([{"reward/judge_s": 2.0, "reward/judge_timeouts": 1},
                                   {"reward/judge_s": 3.0, "reward/judge_timeouts": 2}, None])
    assert merged == {"reward/judge_s": 3.0, "reward/judge_timeouts": 3}


def test_a_training_step_scores_with_the_judge_and_logs_its_metrics(serve, tmp_path):
    """Two CPU steps of the tiny task, the judge alone as the reward: each logged sample's score is the
    scripted verdict of its response (10 for one starting with the target, 0 else, unreadable for "y"), and
    the step's judge metrics count every sample and the unreadable ones."""
    from tests.distributed import run_world
    from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

    def verdict(response):
        words = response.split()
        return "???" if words[:1] == ["y"] else f"Score: {10 if words[:1] == ['x'] else 0}"

    server = serve(verdict)
    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 16)
    overrides = task_overrides(model, data, tmp_path / "runs", "judge") + [
        "trainer.steps=2", "trainer.save_every=0", "data.prompts_per_step=2", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "trainer.log_samples=8",
        "reward.judge.enabled=true", f"reward.judge.url={server.url}", f'reward.judge.rubric="{RUBRIC}"',
        "reward.judge.error_score=-1", "reward.judge.max_retries=0"]
    history = run_world(train_on_rank, 1, overrides)[0]
    samples = [json.loads(line) for line in (tmp_path / "runs" / "judge" / "samples.jsonl").open()]
    assert len(samples) == 16
    for s in samples:
        want = {"???": -1.0, "Score: 10": 1.0, "Score: 0": 0.0}[verdict(s["response"])]
        assert s["score"] == want, s
    for step, h in enumerate(history, 1):
        ours = [s for s in samples if s["step"] == step]
        assert h["reward/judge_requests"] == 8
        assert h["reward/judge_unreadable"] == sum(verdict(s["response"]) == "???" for s in ours)
        assert h["reward/judge_timeouts"] == 0 and h["reward/judge_s"] > 0 and "reward/rule_s" in h
        assert h["reward/mean"] == pytest.approx(sum(s["score"] for s in ours) / 8)


@pytest.mark.parametrize("text,kw,want", [
    ("Score: 7/10", {}, 0.7), ("score = 2.5", {}, 0.25), ("Score: -1", {}, None), ("seven", {}, None),
    ("Score: 3 ... on reflection, Score: 9", {}, 0.9), ("GRADE 4", {"normalize": False}, 4.0),
    ("The score is 6.", {}, 0.6),
    ("<<8>>", {"pattern": r"<<(\d+)>>"}, 0.8),
])
def test_parse_score_verdicts(text, kw, want):
    assert parse_verdict(text, verdict="score", **kw) == want


@pytest.mark.parametrize("overrides,field", [
    (["reward.judge.enabled=true"], "reward.judge.url"),
    (["reward.judge.enabled=true", "reward.judge.url=judge:8000"], "reward.judge.url"),
    (["reward.judge.enabled=true", "reward.judge.url=http://h/v1", "reward.judge.rubric='{prompt} {answer}'"],
     "reward.judge.rubric"),
    (["reward.judge.enabled=true", "reward.judge.url=http://h/v1", "reward.judge.rubric='{prompt} only'"],
     "reward.judge.rubric"),
    (["reward.judge.enabled=true", "reward.judge.url=http://h/v1", "reward.judge.verdict=choice"],
     "reward.judge.choices"),
    (["reward.judge.enabled=true", "reward.judge.url=http://h/v1", "reward.judge.pattern='(a)(b)'"],
     "reward.judge.pattern"),
    (["reward.judge.enabled=true", "reward.judge.url=http://h/v1", "reward.judge.backend=vllm"],
     "reward.judge.backend"),
])
def test_bad_judge_configs_are_one_error_line_naming_the_field(overrides, field, monkeypatch, capsys, tmp_path):
    import megarl.parallel.launch
    import megarl.trainer.trainer
    from megarl.cli import main

    def started(*a, **k):
        raise AssertionError("a process started")

    monkeypatch.setattr(megarl.parallel.launch, "run_world", started)
    monkeypatch.setattr(megarl.trainer.trainer, "train", started)
    monkeypatch.chdir(tmp_path)
    status = main(["train", *overrides])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"megarl: error: {field}:"), lines[0]
    load_config(None, overrides[:1] + ["reward.judge.enabled=false"])  # off: nothing checked

