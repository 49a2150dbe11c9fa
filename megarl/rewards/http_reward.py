"""Reward from a model served over HTTP: a vLLM server (``vllm serve RM --runner pooling``) or any server that
speaks its pooling/classify API, so that the reward model runs on its own GPUs beside the training job.

Each (prompt, response) pair becomes one text, ``template.format(prompt=..., response=...)`` (default: the
prompt followed by the response, as :class:`~megarl.rewards.reward_model.RewardModel` scores it without a chat
template). Texts are sent ``batch_size`` at a time as one request::

    POST {url}            {"model": MODEL, "input": [text, ...]}            (api "pooling": vLLM's /pooling;
                                                                             api "classify": vLLM's /classify)
    200                   {"data": [{"index": i, "data": [score, ...]}, ...]}      (pooling)
                          {"data": [{"index": i, "probs": [p0, p1, ...]}, ...]}   (classify)

The score of text ``i`` is element ``label_index`` of its vector; where the server returns one vector per
token (a token-level reward head), the last token's. Every text of a batch must come back exactly once: a
reply that drops, repeats or mis-indexes a sample is an error, never a silent 0. A score of ``null`` (or
``NaN``, ``Infinity``) is a text the server could not score: it comes back as NaN, and the trainer drops that
sample from its group (:mod:`megarl.algos.nonfinite`); any other value that is no number is an error.

Failures that a retry can cure (no connection, a timeout, HTTP 429 or 5xx) are retried ``max_retries`` times
with exponential backoff (``backoff_s * 2**k`` seconds); other HTTP errors and malformed replies fail at once.
Every error is a :class:`~megarl.rewards.registry.RewardError` naming the URL, so a step never proceeds with
missing scores.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from typing import Sequence

from megarl.rewards.registry import RewardError, register_reward

log = logging.getLogger(__name__)

APIS = {"pooling": "data", "classify": "probs"}  # api -> the reply field holding each text's vector
RETRYABLE_HTTP = (429, 500, 502, 503, 504)


class Retryable(Exception):
    """A failure that a later attempt may not meet (no connection, HTTP 429/5xx, no reply in time)."""


class NoReply(Retryable):
    """A request that got no reply within its timeout."""


def post_json(url: str, body: dict, *, timeout_s: float, server: str) -> dict:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON reply.

    Args:
        url: the endpoint.
        body: the request, JSON-serialisable.
        timeout_s: seconds to wait for the reply.
        server: what the server is, for messages ("reward server", "judge server").

    Raises:
        NoReply: no reply within ``timeout_s``.
        Retryable: no connection, or HTTP 429/500/502/503/504.
        RewardError: another HTTP status, or a reply that is not JSON.
    """
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode(errors="replace")
        if e.code in RETRYABLE_HTTP:
            raise Retryable(f"HTTP {e.code} {detail}") from None
        raise RewardError(f"{server} {url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
            raise NoReply(f"no reply in {timeout_s} s") from None
        raise Retryable(f"{type(reason).__name__}: {reason}") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise RewardError(f"{server} {url} sent a reply that is not JSON: {raw[:200]!r}") from None


@register_reward("http")
class HTTPRewardModel:
    """Batched scoring through a reward-model server over HTTP.

    Args:
        url: the endpoint, e.g. ``http://rm-host:8000/pooling`` (vLLM) or ``.../classify``.
        model: the served model's name (the request's ``model`` field); None leaves the field out.
        api: "pooling" or "classify" (the reply's shape, module docstring).
        batch_size: texts per request.
        timeout_s: seconds to wait for one reply.
        max_retries: retries of a request after a retryable failure (0: one attempt).
        backoff_s: the first retry's delay, seconds; each further retry doubles it.
        label_index: which element of a text's vector is the score.
        template: the text scored for a pair, with ``{prompt}`` and ``{response}`` fields.

    Raises:
        RewardError: invalid arguments (naming the parameter), or, when called, a server that stays down or
            answers with an error or a malformed reply (naming the URL).
    """

    def __init__(self, url: str, *, model: str | None = None, api: str = "pooling", batch_size: int = 64,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 1.0, label_index: int = 0,
                 template: str = "{prompt}{response}"):
        if not url.startswith(("http://", "https://")):
            raise RewardError(f"reward.kwargs.url: {url!r} is not an http:// or https:// URL")
        if api not in APIS:
            raise RewardError(f"reward.kwargs.api: {api!r} is not one of {sorted(APIS)}")
        for name, value, low in (("batch_size", batch_size, 1), ("max_retries", max_retries, 0),
                                 ("label_index", label_index, 0)):
            if value < low:
                raise RewardError(f"reward.kwargs.{name}: must be >= {low}, got {value}")
        if not timeout_s > 0 or backoff_s < 0:
            raise RewardError(f"reward.kwargs.timeout_s must be > 0 and backoff_s >= 0, got {timeout_s} and "
                              f"{backoff_s}")
        try:
            template.format(prompt="", response="")
        except (KeyError, IndexError, ValueError) as e:
            raise RewardError(f"reward.kwargs.template: {template!r} may use only {{prompt}} and {{response}} "
                              f"({type(e).__name__}: {e})") from None
        self.url, self.model, self.field = url, model, APIS[api]
        self.batch_size, self.timeout_s = batch_size, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.label_index, self.template = label_index, template

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 ground_truths: Sequence[str | None] | None = None) -> list[float]:
        """Score ``B`` responses (the reward-function signature; ``ground_truths`` is unused).

        Returns:
            ``B`` floats, in the order of the inputs (NaN where the server's score was null).

        Raises:
            RewardError: naming the URL, when a batch cannot be scored (module docstring).
        """
        texts = [self.template.format(prompt=p, response=r) for p, r in zip(prompts, responses)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            scores.extend(self._score_batch(texts[start:start + self.batch_size]))
        return scores

    def _score_batch(self, texts: list[str]) -> list[float]:
        body = {"input": texts, **({"model": self.model} if self.model is not None else {})}
        for attempt in range(self.max_retries + 1):
            try:
                return self._parse(post_json(self.url, body, timeout_s=self.timeout_s, server="reward server"),
                                   len(texts))
            except Retryable as e:
                if attempt == self.max_retries:
                    raise RewardError(f"reward server {self.url} failed {attempt + 1} time(s), last: {e}; is it "
                                      "running and reachable? (reward.kwargs.url, timeout_s, max_retries)") from None
                delay = self.backoff_s * 2 ** attempt
                log.warning("reward server %s: %s; retry %d/%d in %.1f s", self.url, e, attempt + 1,
                            self.max_retries, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _parse(self, reply: dict, n: int) -> list[float]:
        items = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(items, list):
            raise RewardError(f"reward server {self.url}: the reply has no 'data' list: {str(reply)[:200]}")
        scores: list[float | None] = [None] * n
        for pos, item in enumerate(items):
            i = item.get("index", pos) if isinstance(item, dict) else None
            vector = item.get(self.field) if isinstance(item, dict) else None
            if not isinstance(i, int) or not 0 <= i < n or scores[i] is not None or vector is None:
                raise RewardError(f"reward server {self.url}: reply item {pos} is not a new index in [0, {n}) "
                                  f"with a '{self.field}' field: {str(item)[:200]}")
            if vector and isinstance(vector[0], list):  # one vector per token: the last token's
                vector = vector[-1]
            if not isinstance(vector, list) or len(vector) <= self.label_index:
                raise RewardError(f"reward server {self.url}: item {i} has no element {self.label_index} "
                                  f"(reward.kwargs.label_index) in {str(vector)[:200]}")
            value = vector[self.label_index]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise RewardError(f"reward server {self.url}: item {i} scores {str(value)[:100]!r}, which is "
                                  "neither a number nor null")
            scores[i] = math.nan if value is None else float(value)  # null: no score (module docstring)
        missing = [i for i, s in enumerate(scores) if s is None]
        if missing:
            raise RewardError(f"reward server {self.url} returned no score for {len(missing)} of {n} texts "
                              f"(first: {missing[:5]})")
        return scores  # type: ignore[return-value]
