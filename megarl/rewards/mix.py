"""The run's reward from its config section: ``reward.fn`` alone, or mixed with a generative judge by weights
(``reward.judge``), with the judge's figures as metrics.

With the judge on, a sample's reward is ``judge.weight * judge + judge.rule_weight * fn`` (``fn`` is not called
when its weight is 0); each part's wall seconds are measured, so a step reports the judge's seconds next to the
rule reward's (:func:`merge_reward_metrics` over the reward pool's ranks).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from megarl.config import RewardConfig
from megarl.rewards.judge import GenerativeJudge
from megarl.rewards.registry import load_reward_fn


class StepReward:
    """``reward.fn`` bound to its kwargs, mixed with the judge where ``reward.judge.enabled``.

    Args:
        cfg: the ``reward`` section.

    Raises:
        RewardError: from :func:`~megarl.rewards.registry.load_reward_fn`.
    """

    def __init__(self, cfg: RewardConfig):
        self.judge_cfg = cfg.judge
        self.rule = load_reward_fn(cfg.fn, cfg.kwargs)
        self.judge = GenerativeJudge(cfg.judge) if cfg.judge.enabled else None
        self.rule_s = 0.0

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 ground_truths: Sequence[str | None] | None = None) -> torch.Tensor:
        """``[B]`` float32 rewards of ``B`` samples (the reward-function signature of
        :mod:`megarl.rewards.registry`; NaN: no score)."""
        if self.judge is None:
            return self.rule(prompts, responses, ground_truths)
        judged = torch.as_tensor(self.judge(prompts, responses, ground_truths), dtype=torch.float32)
        reward = self.judge_cfg.weight * judged
        if self.judge_cfg.rule_weight:
            start = time.perf_counter()
            reward = reward + self.judge_cfg.rule_weight * self.rule(prompts, responses, ground_truths)
            self.rule_s += time.perf_counter() - start
        return reward

    def take_metrics(self) -> dict[str, float]:
        """This rank's judge figures since the last call (empty without a judge), then zeroed:
        ``reward/judge_s`` and ``reward/rule_s`` (wall seconds), ``reward/judge_requests``,
        ``reward/judge_unreadable``, ``reward/judge_timeouts``."""
        if self.judge is None:
            return {}
        counts = self.judge.take_counts()
        rule_s, self.rule_s = self.rule_s, 0.0
        return {"reward/judge_s": counts["seconds"], "reward/rule_s": rule_s,
                "reward/judge_requests": counts["requests"], "reward/judge_unreadable": counts["unreadable"],
                "reward/judge_timeouts": counts["timeouts"]}


def merge_reward_metrics(parts: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The step's judge metrics from the reward ranks' :meth:`StepReward.take_metrics`: the counts summed, the
    seconds (``..._s``, ranks judging at once) the largest."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in (part or {}).items():
            out[key] = max(out.get(key, 0.0), value) if key.endswith("_s") else out.get(key, 0.0) + value
    return out
