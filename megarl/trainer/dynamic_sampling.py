"""DAPO's dynamic sampling (``algorithm.dynamic_sampling``; Yu et al. 2025, arXiv:2503.14476, sec. 3.2): a step
trains only on groups whose rewards are not all equal (a group of equal rewards has zero advantage under GRPO
and adds no gradient), generating more prompts until it has enough of them.

The rule, given ``want = data.prompts_per_step`` and ``unit`` (:func:`group_unit`, the fewest groups that fill
whole mini-batches): score each round's responses with the reward function (before overlong shaping), keep
the groups whose scores are not all equal (among the samples with a finite score: :mod:`megarl.algos.nonfinite`
drops the others from the group), and generate ``want`` more prompts until ``want`` groups have
signal or ``max_extra_rounds`` extra rounds ran. The kept groups are cut to the first ``want``, or, short of
that, to a whole number of units; with not one unit's worth, the step trains on one unit of them filled with
tied groups (advantage 0: they add only to the KL and entropy terms and the normalisers).

The selection lives here rather than in :mod:`megarl.algos` because it drives generation and scoring (algos
are pure tensor functions below the rollout and data packages).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import torch

from megarl.config import MEGATRON_ROLES, Config
from megarl.data.loader import PromptBatch
from megarl.rollout.base import RolloutOutput, RolloutStats

log = logging.getLogger(__name__)


def group_unit(cfg: Config, layouts: dict, with_critic: bool) -> int:
    """The fewest groups that make whole mini-batches of every trained role, divisible by every Megatron role's
    DP (``layouts``: the roles' layouts; the batch sizes :func:`~megarl.parallel.placement.validate_for_world`
    checks for a full step)."""
    sizes = [cfg.actor.ppo_mini_batch_size] + [lay.dp for role, lay in layouts.items() if role in MEGATRON_ROLES]
    if with_critic:
        sizes.append(cfg.critic.ppo_mini_batch_size)
    return math.lcm(cfg.rollout.n, *sizes) // cfg.rollout.n


def dynamic_sampling(prompts: PromptBatch, out: RolloutOutput, *,
                     generate: Callable[[PromptBatch, int], RolloutOutput],
                     score: Callable[[PromptBatch, RolloutOutput], torch.Tensor],
                     more_prompts: Callable[[], PromptBatch], want: int, unit: int, max_extra_rounds: int,
                     step: int, verbose: bool = False
                     ) -> tuple[PromptBatch, RolloutOutput, torch.Tensor, dict[str, float]]:
    """The groups a step trains on, by the rule of the module docstring.

    Args:
        prompts, out: the step's first round (its prompts and their ``n`` responses each): a
            :class:`~megarl.rollout.base.RolloutOutput`, or with multi-turn episodes an
            :class:`~megarl.agents.rollout.EpisodeBatch` (a group is a prompt's ``n`` episodes, each scored once).
        generate: ``generate(prompts, round)``: the responses of an extra round (its own sampling seed).
        score: ``score(prompts, out)``: ``[P * n]`` float32 rewards of a round's responses (episodes).
        more_prompts: the next batch of ``want`` prompts.
        want: ``data.prompts_per_step``. unit: :func:`group_unit`. max_extra_rounds: the rounds after the first.
        step: the (1-based) step, for the log line. verbose: log when the step is short of groups (rank 0).

    Returns:
        ``(prompts, out, scores [B] float32, metrics)`` of the kept groups; ``out``'s stats are every round's
        (the generation throughput counts every token generated). Metrics: ``dynamic_sampling/rounds``
        (generation rounds), ``.../groups_generated``, ``.../groups_with_signal`` (all rounds),
        ``.../groups_kept`` (with signal, in the step), ``.../groups_tied_kept`` and ``.../groups_short``
        (``want`` minus groups with signal kept).
    """
    n = out.n
    kept: list[tuple[PromptBatch, int, list, torch.Tensor]] = []  # (prompts, prompt k, samples, scores)
    tied: list[tuple[PromptBatch, int, list, torch.Tensor]] = []
    generated = signal = rounds = prompt_tokens = new_tokens = 0
    seconds = 0.0
    while True:
        rounds += 1
        generated += out.num_prompts
        seconds += out.stats.seconds
        prompt_tokens += out.stats.prompt_tokens
        new_tokens += out.stats.generated_tokens
        scores = score(prompts, out).float()
        for k in range(out.num_prompts):
            group = scores[k * n:(k + 1) * n]
            scored = group[torch.isfinite(group)]  # a sample without a score leaves its group (algos.nonfinite)
            spread = bool((scored != scored[:1]).any())
            signal += spread
            (kept if spread else tied).append((prompts, k, out.group(k), group))
        if len(kept) >= want or rounds > max_extra_rounds:
            break
        prompts = more_prompts()
        out = generate(prompts, rounds)
    signalled, kept = kept, kept[:want] if len(kept) >= want else kept[:len(kept) // unit * unit]
    if not kept:  # not one mini-batch with signal: one mini-batch of them, filled with tied groups
        kept = (signalled + tied)[:unit]
    with_signal = min(len(kept), len(signalled))
    merged = PromptBatch(input_ids=[p.input_ids[k] for p, k, _, _ in kept], index=[p.index[k] for p, k, _, _ in kept],
                         ground_truth=[p.ground_truth[k] for p, k, _, _ in kept],
                         raw_prompt=[p.raw_prompt[k] for p, k, _, _ in kept],
                         rows=[p.rows[k] for p, k, _, _ in kept] if all(p.rows for p, _, _, _ in kept) else None)
    samples = [dataclasses.replace(s, prompt_index=i) for i, (_, _, group, _) in enumerate(kept) for s in group]
    stats = RolloutStats(prompt_tokens=prompt_tokens, generated_tokens=new_tokens, seconds=seconds)  # every round's
    # a RolloutOutput of samples, or an EpisodeBatch of episodes (multi-turn): the first round's kind, re-grouped
    merged_out = (RolloutOutput(samples, n, stats) if isinstance(out, RolloutOutput)
                  else dataclasses.replace(out, episodes=samples, stats=stats))
    metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/groups_generated": generated,
               "dynamic_sampling/groups_with_signal": signal, "dynamic_sampling/groups_kept": with_signal,
               "dynamic_sampling/groups_tied_kept": len(kept) - with_signal,
               "dynamic_sampling/groups_short": want - with_signal}
    if verbose and with_signal < want:
        log.info("dynamic sampling: %d of %d groups with signal after %d rounds "
                 "(algorithm.dynamic_sampling.max_extra_rounds=%d); step %d trains on %d of them%s",
                 signal, want, rounds, max_extra_rounds, step, with_signal,
                 f" and {len(kept) - with_signal} tied groups" if len(kept) > with_signal else "")
    return merged, merged_out, torch.cat([g for _, _, _, g in kept]), metrics
