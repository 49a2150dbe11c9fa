"""Validation: the policy's responses to a fixed set of held-out prompts, scored by the run's reward function.

A run validates before its first step (logged as step 0), after every ``validation.every``-th step and after
the last step (config ``validation``); ``megarl eval`` (:mod:`megarl.offline.evaluate`) runs the same
evaluation on a model outside a run. The prompts go through the rollout engine already in use (vLLM on the
GPU, transformers on the CPU), split over the rollout data-parallel ranks
(:func:`~megarl.rollout.data_parallel.generate_data_parallel`), and the reward function scores each rank's
share of the responses (the run's reward pool, :meth:`~megarl.trainer.trainer.Trainer._rewards`).

Figures (``val/`` in the run's metrics), over the ``P`` prompts and ``n`` responses per prompt:

- ``val/accuracy``: the share of responses that are correct (score >= 1, the convention of the built-in
  rewards: GSM8K scores 1 for a correct answer, 0.1 for a wrong one in the ``#### N`` format); greedy with
  ``n = 1`` this is pass@1, sampled it is mean@n (an unbiased estimate of pass@1);
- ``val/pass@n`` (``n > 1``): the share of prompts with at least one correct response;
- ``val/reward_mean``, ``val/response_length_mean`` (tokens), ``val/clip_ratio`` (the share of responses cut
  at ``max_new_tokens``), ``val/num_prompts``, ``val/seconds``;
- ``val/reward_nonfinite``: responses the reward gave no finite score (NaN, inf, None: :mod:`megarl.algos.
  nonfinite`); they count as not correct, stay out of ``val/reward_mean`` and have ``score: null`` in their
  records.

The prompts are fixed for the whole run (the first ``num_prompts`` of the files, or a sample drawn with the
run's seed), and never enter training: :meth:`Validation.hold_out` removes the training prompts with the same
text (the check that matters when ``validation.files`` and ``data.train_files`` overlap).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from megarl.algos.aggregation import masked_mean
from megarl.config import ValidationConfig
from megarl.data.dataset import PromptDataset
from megarl.data.loader import PromptBatch
from megarl.jsonl import append_records
from megarl.rollout.base import RolloutEngine, SamplingConfig
from megarl.rollout.data_parallel import generate_data_parallel, map_data_parallel

log = logging.getLogger(__name__)

CORRECT_SCORE = 1.0  # a response scoring at least this is correct (the built-in rewards' full score)
ScoreFn = Callable[[list[str], list[str], list[Any]], torch.Tensor]  # (prompts, responses, truths) -> [B] scores


def select_prompts(dataset: PromptDataset, num_prompts: int, *, shuffle: bool = False, seed: int = 0) -> PromptBatch:
    """The validation prompts: the first ``num_prompts`` of ``dataset`` (all when 0, -1 or more than it holds),
    or, with ``shuffle``, ``num_prompts`` drawn without replacement by ``numpy.random.default_rng(seed)``, kept
    in dataset order. The same arguments always give the same prompts."""
    k = len(dataset) if num_prompts <= 0 else min(num_prompts, len(dataset))
    chosen = (sorted(np.random.default_rng(seed).choice(len(dataset), k, replace=False).tolist()) if shuffle
              else list(range(k)))
    return PromptBatch(input_ids=[dataset.input_ids[i] for i in chosen], index=[dataset.index[i] for i in chosen],
                       ground_truth=[dataset.ground_truths[i] for i in chosen],
                       raw_prompt=[dataset.raw_prompts[i] for i in chosen], rows=[dataset.rows[i] for i in chosen])


def evaluate(engine: RolloutEngine, prompts: PromptBatch, sampling: SamplingConfig, score: ScoreFn,
             tokenizer: Any, group=None) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate ``sampling.n`` responses per prompt (split over the ranks of ``group``), score them and sum up.

    Every rank of ``group`` must call this with the same arguments; every rank gets the same results.
    ``score(prompts, responses, ground_truths)`` returns the ``[B]`` float32 scores of all ``B`` responses on
    every rank (e.g. the reward function, each rank scoring a share: :func:`score_data_parallel`).

    Returns:
        ``(metrics, samples)``: the figures of the module docstring (keys without the ``val/`` prefix), and one
        record per response, prompt-major: ``index`` (the prompt's row in its file), ``sample``, ``prompt``,
        ``response``, ``ground_truth``, ``score``, ``correct``, ``length`` (tokens), ``finish_reason``.

    Raises:
        RolloutError: from the engine (a prompt too long for its context, no weights, asleep).
        RewardError: from the reward function.
    """
    start = time.perf_counter()
    out = generate_data_parallel(engine, prompts.input_ids, sampling, group=group)
    samples = out.samples
    raw, texts, truths = prompts.reward_inputs(samples, tokenizer)
    scores = score(raw, texts, truths)
    correct = (scores >= CORRECT_SCORE).reshape(len(prompts), sampling.n)
    scored = torch.isfinite(scores)
    lengths = [len(s.token_ids) for s in samples]
    cut = [s.finish_reason == "length" for s in samples]
    metrics = {"accuracy": correct.float().mean().item(), "reward_mean": masked_mean(scores, scored).item(),
               "reward_nonfinite": float((~scored).sum()),
               "response_length_mean": float(np.mean(lengths)), "clip_ratio": float(np.mean(cut)),
               "num_prompts": len(prompts), "seconds": time.perf_counter() - start}
    if sampling.n > 1:
        metrics[f"pass@{sampling.n}"] = correct.any(dim=1).float().mean().item()
    records = [{"index": prompts.index[s.prompt_index], "sample": s.sample_index, "prompt": raw[i],
                "response": texts[i], "ground_truth": truths[i],
                "score": float(scores[i]) if scored[i] else None,
                "correct": bool(scores[i] >= CORRECT_SCORE), "length": lengths[i], "finish_reason": s.finish_reason}
               for i, s in enumerate(samples)]
    return metrics, records


def score_data_parallel(reward_fn: Callable[..., Any]) -> ScoreFn:
    """A :data:`ScoreFn` for which every rank of the world scores a share of the responses with ``reward_fn``."""
    return lambda *columns: torch.cat(map_data_parallel(reward_fn, *columns))


def append_samples(path: Path, records: list[dict[str, Any]], **fields: Any) -> None:
    """Append ``records`` to a JSONL file, one line each, with ``fields`` (e.g. ``step``) first
    (:func:`megarl.jsonl.append_records`)."""
    append_records(path, [{**fields, **r} for r in records])


class Validation:
    """A run's held-out evaluation (config ``validation``): which prompts, how they are decoded, and when.

    Args:
        cfg: the ``validation`` section.
        dataset: the prompts of ``cfg.files``, templated and length-filtered like the training prompts.
        score: the run's scoring (:func:`evaluate`). tokenizer: decodes the responses.
        seed: the run's seed (the prompt sample with ``shuffle``, and the sampling seed).
        max_new_tokens: the limit when ``cfg.max_new_tokens`` is null (the rollout's).
        stop_token_ids: tokens that end a response (the model's EOS tokens).

    Attributes:
        prompts: the validation prompts (:func:`select_prompts`).
        sampling: how they are decoded.
    """

    def __init__(self, cfg: ValidationConfig, dataset: PromptDataset, *, score: ScoreFn, tokenizer: Any,
                 seed: int, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()):
        self.cfg, self.score, self.tokenizer = cfg, score, tokenizer
        self.source = dataset.source
        self.prompts = select_prompts(dataset, cfg.num_prompts, shuffle=cfg.shuffle, seed=seed)
        self.sampling = SamplingConfig(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                                       max_new_tokens=cfg.max_new_tokens or max_new_tokens,
                                       stop_token_ids=stop_token_ids, seed=seed)

    def describe(self) -> str:
        """``64 prompts of data/gsm8k/test.parquet, greedy, <= 128 new tokens`` (for logs and the summary)."""
        how = "greedy" if self.sampling.greedy else f"n={self.sampling.n} at temperature {self.sampling.temperature}"
        return (f"{len(self.prompts)} prompts of {self.source}, {how}, "
                f"<= {self.sampling.max_new_tokens} new tokens")

    def hold_out(self, train: PromptDataset) -> list[int]:
        """Remove from ``train`` the prompts whose text is a validation prompt's; returns their row numbers
        (logged: empty unless the training and validation files overlap)."""
        removed = train.remove(set(self.prompts.raw_prompt))
        if removed:
            log.warning("validation: %d training prompts of %s are validation prompts (same text) and were removed "
                        "from training (rows %s%s)", len(removed), train.source, removed[:10],
                        " ..." if len(removed) > 10 else "")
        return removed

    def due(self, step: int, last_step: int) -> bool:
        """Whether to validate after step ``step`` (0: before the first step) of a run of ``last_step`` steps."""
        if step == 0:
            return self.cfg.before_train
        return (self.cfg.every > 0 and step % self.cfg.every == 0) or (step == last_step and self.cfg.at_end)

    def run(self, engine: RolloutEngine, group=None, evaluate_fn: Callable | None = None
            ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:func:`evaluate` (or ``evaluate_fn`` with its arguments: multi-turn episodes,
        :func:`megarl.trainer.episodes.evaluate_episodes`) on the validation prompts; metrics keyed ``val/...``."""
        metrics, records = (evaluate_fn or evaluate)(engine, self.prompts, self.sampling, self.score, self.tokenizer,
                                                     group)
        return {f"val/{k}": v for k, v in metrics.items()}, records
