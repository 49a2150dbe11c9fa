"""Tokens, model FLOPs, tokens/s/GPU and MFU of each phase of one RL step (``perf/*`` and ``memory/*`` metrics).

What each phase counts, from the step's batch (``p_i`` prompt and ``r_i`` response tokens of sample ``i``,
real tokens only, padding excluded; FLOPs from :mod:`megarl.measure.flops`):

| phase | tokens | model FLOPs |
| --- | --- | --- |
| generate | generated (response) tokens ``sum r_i`` | forward over ``p_i + r_i`` (the model work behind the tokens) |
| reward | scored response tokens ``sum r_i`` | - |
| old_logprobs, reference | ``sum (p_i + r_i)`` | forward over ``p_i + r_i`` |
| values | ``sum (p_i + r_i)`` | forward with a 1-row value head |
| actor_update | ``ppo_epochs * sum (p_i + r_i)`` | ``ppo_epochs`` x forward + backward |
| critic_update | ``ppo_epochs * sum (p_i + r_i)`` | the same, value head |
| reshard, advantages | - | - |

Every rank holds the whole batch and the whole world works on every phase (the roles are colocated), so a
phase's rate per GPU is its tokens / seconds / world size, and its MFU is FLOPs / (seconds * world * peak).
"""

from __future__ import annotations

from typing import Mapping

import torch

from megarl.measure.flops import forward_flops, mfu, train_flops
from megarl.models.spec import ModelSpec

FORWARD_PHASES = ("old_logprobs", "reference")
UPDATE_PHASES = {"actor_update": None, "critic_update": 1}  # phase -> output rows (None = the vocab)


def phase_work(spec: ModelSpec, prompt_lens: torch.Tensor, response_lens: torch.Tensor,
               epochs: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Tokens and model FLOPs of every phase that has them (the table of the module docstring).

    Args:
        spec: the model shape (actor, reference and critic share it).
        prompt_lens / response_lens: ``[B]`` int64 tokens of each sample.
        epochs: ``ppo_epochs`` of "actor_update" and "critic_update".

    Returns:
        phase -> ``{"tokens": float, "flops": float}`` (``flops`` 0 for the reward).
    """
    seq = prompt_lens + response_lens
    generated, tokens = float(response_lens.sum()), float(seq.sum())
    work = {"generate": {"tokens": generated, "flops": forward_flops(spec, seq)},
            "reward": {"tokens": generated, "flops": 0.0},
            "values": {"tokens": tokens, "flops": forward_flops(spec, seq, output_rows=1)}}
    for phase in FORWARD_PHASES:
        work[phase] = {"tokens": tokens, "flops": forward_flops(spec, seq)}
    for phase, rows in UPDATE_PHASES.items():
        k = epochs.get(phase, 1)
        work[phase] = {"tokens": k * tokens, "flops": k * train_flops(spec, seq, output_rows=rows)}
    return work


def step_perf_metrics(spec: ModelSpec, prompt_lens: torch.Tensor, response_lens: torch.Tensor, *,
                      seconds: Mapping[str, float], peak_bytes: Mapping[str, int], step_s: float, world: int,
                      epochs: Mapping[str, int], peak_flops: float | None) -> dict[str, float]:
    """The step's throughput metrics (only for the phases in ``seconds``: those that ran).

    Args:
        seconds / peak_bytes: phase -> seconds and peak memory (bytes) from
            :class:`~megarl.measure.timers.PhaseTimer`.
        step_s: the whole step's seconds.
        world: GPUs (ranks) of the job.
        peak_flops: the device's peak FLOP/s (None: no MFU metrics).

    Returns:
        ``perf/tokens`` (prompt + response tokens of the batch), ``perf/tokens_per_s_per_gpu`` (those over
        the step), ``perf/mfu`` (all
        model FLOPs of the step over the step), and per phase ``perf/<phase>/tokens``,
        ``perf/<phase>/flops``, ``perf/<phase>/tokens_per_s_per_gpu``, ``perf/<phase>/mfu`` and
        ``memory/<phase>/peak_bytes``. MFU is a fraction; absent when ``peak_flops`` is None.
    """
    work = phase_work(spec, prompt_lens, response_lens, epochs)
    tokens = float((prompt_lens + response_lens).sum())
    out: dict[str, float] = {"perf/tokens": tokens, "perf/tokens_per_s_per_gpu": tokens / max(step_s, 1e-9) / world}
    total_flops = 0.0
    for phase, s in seconds.items():
        out[f"memory/{phase}/peak_bytes"] = int(peak_bytes.get(phase, 0))
        if phase not in work:
            continue
        w = work[phase]
        total_flops += w["flops"]
        out[f"perf/{phase}/tokens"] = w["tokens"]
        out[f"perf/{phase}/tokens_per_s_per_gpu"] = w["tokens"] / max(s, 1e-9) / world
        if w["flops"]:
            out[f"perf/{phase}/flops"] = w["flops"]
            value = mfu(w["flops"], s, world, peak_flops)
            if value is not None:
                out[f"perf/{phase}/mfu"] = value
    value = mfu(total_flops, step_s, world, peak_flops)
    if value is not None:
        out["perf/mfu"] = value
    return out
