"""A generative judge (LLM-as-judge) as a reward: a judge model reads each sample through a rubric and answers a
verdict, a score or a choice, that becomes the sample's reward (Zheng et al. 2023, "Judging LLM-as-a-Judge with
MT-Bench and Chatbot Arena", arXiv:2306.05685: the rubric prompt and the "[[A]]" / "Rating: [[7]]" verdicts).

The judge is served by any OpenAI-compatible chat-completions server (``vllm serve JUDGE``, SGLang, a hosted
API). Every sample of the call is one request, up to ``max_concurrency`` in flight at once (a thread pool over
the stdlib's ``urllib``), so a step's samples are judged together and the server batches them::

    POST {url}/chat/completions  {"model": MODEL, "messages": [{"role": "system", ...}, {"role": "user",
                                  "content": rubric.format(prompt=..., response=..., reference=...)}],
                                  "max_tokens": N, "temperature": T}
    200                          {"choices": [{"message": {"content": "... Score: 7"}}]}

The verdict is read from the reply's text (:func:`parse_verdict`, after dropping a ``<think>...</think>``
block): the last match of the pattern's group, or the whole reply where it is the verdict alone. A reply
without a readable verdict (no match, a score outside the range, an unknown label) and a request that timed out
on every attempt score ``error_score`` and are counted (:attr:`GenerativeJudge.counts`); a server that cannot be
reached or answers HTTP errors after the retries fails the call (a :class:`~megarl.rewards.registry.RewardError`
naming the URL), so no step proceeds on a judge that is down.
"""

from __future__ import annotations

import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

from megarl.config import JudgeConfig
from megarl.rewards.http_reward import NoReply, Retryable, post_json
from megarl.rewards.registry import RewardError

log = logging.getLogger(__name__)

NUMBER = r"(-?\d+(?:\.\d+)?)"
# the verdict after its keyword ("Score: 7", "Rating: [[7]]", "**Score**: 7/10", "the score is 7"); choices:
# "Verdict: [[A]]", "my answer is yes"
SCORE_PATTERN = r"(?i)\b(?:score|rating|grade)\b(?:\s+is)?[^\w-]{0,6}" + NUMBER
CHOICE_PATTERN = r"(?i)\b(?:verdict|answer|choice|decision)\b(?:\s+is)?\W{0,6}(\w+)"
THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_verdict(text: str, *, verdict: str, score_range: Sequence[float] = (0.0, 10.0), normalize: bool = True,
                  choices: Mapping[str, float] | None = None, pattern: str | None = None) -> float | None:
    """The reward that a judge's reply ``text`` gives, or None where it holds no readable verdict.

    Args:
        verdict: "score": a number in ``score_range`` (inclusive), mapped linearly to [0, 1] when
            ``normalize``; "choice": a label of ``choices`` (case-insensitive), whose value is the reward.
        pattern: a regular expression with one group, the verdict; its last match counts. None: the built-in
            one (:data:`SCORE_PATTERN`, :data:`CHOICE_PATTERN`). Where nothing matches, a reply that is the
            verdict alone ("7", "Yes.", "[[B]]") is read.

    Returns:
        The reward, or None (no match, a score outside the range, a label not in ``choices``).
    """
    text = THINK.sub("", text)
    regex = re.compile(pattern or (SCORE_PATTERN if verdict == "score" else CHOICE_PATTERN))
    found = [m.group(1) for m in regex.finditer(text) if m.group(1) is not None]
    bare = text.strip().strip("*[]().:!\"' \n\t")
    candidate = found[-1] if found else bare
    if verdict == "choice":
        labels = {str(k).casefold(): float(v) for k, v in (choices or {}).items()}
        return labels.get(candidate.strip().casefold())
    try:
        score = float(candidate)
    except ValueError:
        return None
    low, high = score_range
    if not (math.isfinite(score) and low <= score <= high):
        return None
    return (score - low) / (high - low) if normalize else score


class GenerativeJudge:
    """Scores a batch of samples with a judge model served over HTTP (module docstring).

    Args:
        cfg: the ``reward.judge`` section (validated by the config: URL, rubric placeholders, pattern).

    Attributes:
        counts: what the calls since the last :meth:`take_counts` met: ``requests``, ``unreadable``,
            ``timeouts`` (requests that timed out on every attempt), ``seconds`` (wall seconds in calls).
    """

    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        base = cfg.url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.counts = self._zero()

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"requests": 0, "unreadable": 0, "timeouts": 0, "seconds": 0.0}

    def take_counts(self) -> dict[str, float]:
        """:attr:`counts`, then zeroed."""
        counts, self.counts = self.counts, self._zero()
        return counts

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 ground_truths: Sequence[str | None] | None = None) -> list[float]:
        """Judge ``B`` samples, up to ``max_concurrency`` requests at once.

        Returns:
            ``B`` rewards in input order: :func:`parse_verdict`'s, or ``error_score`` (NaN where it is null)
            for an unreadable verdict or a timeout.

        Raises:
            RewardError: naming the URL, where the server cannot be reached, answers an HTTP error other than
                a retried one, or a reply that is not a chat completion.
        """
        start = time.perf_counter()
        truths = [None] * len(responses) if ground_truths is None else list(ground_truths)
        jobs = list(zip(prompts, responses, truths))
        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, len(jobs))) as pool:
            replies = list(pool.map(lambda job: self._judge(*job), jobs))
        error = math.nan if self.cfg.error_score is None else float(self.cfg.error_score)
        scores = []
        for reply in replies:
            if reply is None:
                self.counts["timeouts"] += 1
                scores.append(error)
                continue
            score = parse_verdict(reply, verdict=self.cfg.verdict, score_range=self.cfg.score_range,
                                  normalize=self.cfg.normalize, choices=self.cfg.choices, pattern=self.cfg.pattern)
            if score is None:
                self.counts["unreadable"] += 1
                log.debug("judge %s: no verdict in %r", self.url, reply[:300])
            scores.append(error if score is None else score)
        self.counts["requests"] += len(jobs)
        self.counts["seconds"] += time.perf_counter() - start
        return scores

    def messages(self, prompt: str, response: str, reference: str | None) -> list[dict[str, str]]:
        """The chat messages of one sample: the system message, if any, and the filled rubric."""
        user = self.cfg.rubric.format(prompt=prompt, response=response, reference=reference or "")
        system = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return [*system, {"role": "user", "content": user}]

    def _judge(self, prompt: str, response: str, reference: str | None) -> str | None:
        """The judge's reply text to one sample, or None where every attempt timed out."""
        cfg = self.cfg
        body = {"messages": self.messages(prompt, response, reference), "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, **({"model": cfg.model} if cfg.model is not None else {})}
        for attempt in range(cfg.max_retries + 1):
            try:
                return self._content(post_json(self.url, body, timeout_s=cfg.timeout_s, server="judge server"))
            except Retryable as e:
                if attempt == cfg.max_retries:
                    if isinstance(e, NoReply):
                        return None
                    raise RewardError(f"judge server {self.url} failed {attempt + 1} time(s), last: {e}; is it "
                                      "running and reachable? (reward.judge.url, timeout_s, max_retries)") from None
                time.sleep(cfg.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _content(self, reply: dict) -> str:
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"judge server {self.url}: the reply is not a chat completion "
                              f"(choices[0].message.content): {str(reply)[:200]}") from None
        return content or ""
