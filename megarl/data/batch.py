"""The batch that flows through one RL step: a dict of tensors plus per-sample metadata.

Sequences are stored as prompt + response, right-padded to one length ``S`` (``input_ids [B, S]``); every
per-token RL quantity (log-probs, values, advantages, masks) lives in the *response frame* ``[B, R]``, where
column ``j`` is the ``j``-th response token and ``R`` is the longest response. The model's outputs come in the
*label frame* (position ``t`` predicts token ``t + 1``); :func:`response_index` maps one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from megarl.models.router_replay import ROUTES, routes_of_samples


def response_index(prompt_lens: torch.Tensor, response_width: int, seq_len: int) -> torch.Tensor:
    """Label-frame positions of each response token: ``[B, R]`` int64, ``prompt_len - 1 + j`` (clamped to
    ``seq_len - 1`` past the end of short responses, where the response mask is 0)."""
    j = torch.arange(response_width, device=prompt_lens.device)
    return (prompt_lens.unsqueeze(1) - 1 + j).clamp(max=seq_len - 1)


def response_positions(prompt_lens: torch.Tensor, response_width: int, seq_len: int) -> torch.Tensor:
    """``[B, seq_len]`` bool: the label-frame positions that :func:`response_index` reads (each position once;
    those past the end of the sequence are left out)."""
    start = prompt_lens.unsqueeze(1) - 1
    t = torch.arange(seq_len, device=prompt_lens.device)
    return (t >= start) & (t < start + response_width)


def to_response_frame(x: torch.Tensor, prompt_lens: torch.Tensor, response_width: int,
                      seq_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Gather a label-frame tensor ``[B, S]`` (or ``[B, S, 1]``) into the response frame ``[B, R]``.

    With ``seq_offsets [B]`` int64, ``x`` is one packed (THD) row ``[1, T]`` (or ``[1, T, 1]``) holding the
    ``B`` sequences back to back, sequence ``i`` from position ``seq_offsets[i]``
    (:func:`megarl.workers.packing.pack_rows`); its labels are the next token within the sequence (the last
    token of a sequence has none and is not in the response frame).
    """
    if x.dim() == 3:
        x = x.squeeze(-1)
    if seq_offsets is not None:
        return x.reshape(-1)[response_index(prompt_lens + seq_offsets, response_width, x.shape[1])]
    idx = response_index(prompt_lens, response_width, x.shape[1])
    return torch.gather(x, 1, idx)


@dataclass
class RolloutBatch:
    """Tensors ``[B, ...]`` keyed by name, and per-sample metadata lists of length ``B``.

    Tensors set by :func:`build_batch`:
        input_ids ``[B, S]`` int64 (prompt + response, right-padded), prompt_lens / response_lens ``[B]``
        int64, response_mask ``[B, R]`` float32 (1 on sampled response tokens, EOS included; 0 on padding and on a
        multi-turn episode's observation tokens), rollout_logprobs
        ``[B, R]`` float32 (from the rollout engine), group ``[B]`` int64 (prompt index: GRPO/RLOO groups);
        with an MoE model's routes, routed_experts ``[B, S, layers, top_k]`` int16 (input frame,
        :mod:`megarl.models.router_replay`).
    Added by the step: scores ``[B]``, old_logprobs, ref_logprobs, values, token_rewards, advantages,
    returns (``[B, R]`` float32).
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if value.shape[0] != len(self):
            raise ValueError(f"batch tensor {name!r} has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def select(self, index: torch.Tensor | slice) -> "RolloutBatch":
        """Rows ``index`` of every tensor and metadata list."""
        if isinstance(index, slice):
            idx = list(range(len(self)))[index]
        else:
            idx = index.tolist()
        t = {k: v[index] for k, v in self.tensors.items()}
        return RolloutBatch(t, {k: [v[i] for i in idx] for k, v in self.meta.items()})

    def micro_batches(self, size: int, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """Consecutive micro-batches of ``size`` rows holding the tensors ``names``."""
        for lo in range(0, len(self), size):
            yield {k: self.tensors[k][lo:lo + size] for k in names}


def build_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                rollout_logprobs: Sequence[torch.Tensor], groups: Sequence[int], *, pad_token_id: int,
                seq_multiple: int = 8, meta: dict[str, list[Any]] | None = None,
                response_masks: Sequence[Sequence[int]] | None = None,
                routed_experts: Sequence[torch.Tensor | None] | None = None) -> RolloutBatch:
    """Pack prompt/response token lists into a :class:`RolloutBatch`.

    Args:
        prompts / responses: token ids per sample (a prompt repeated for each of its samples).
        rollout_logprobs: ``[len(response)]`` float32 per sample, from the rollout engine (0 where not sampled).
        groups: prompt index per sample.
        seq_multiple: ``S`` is rounded up to a multiple of this (tensor-parallel sequence sharding, kernels).
        response_masks: per sample, ``len(response)`` 0/1: 1 on the tokens the engine sampled (trained), 0 on
            tokens in the context only (a multi-turn episode's observations, :mod:`megarl.agents.episode`);
            None: every response token is sampled. ``response_mask`` is 1 where both this and the length say so,
            so the losses, the KL and the advantages see sampled tokens only; ``response_lens`` counts every
            response token (what the sequences' lengths and packing need).
        routed_experts: per sample, the engine's ``[tokens, layers, top_k]`` routes
            (:attr:`~megarl.rollout.base.Sample.routed_experts`), into ``routed_experts`` (None: no routes).
    """
    b = len(prompts)
    if not (len(responses) == len(rollout_logprobs) == len(groups) == b):
        raise ValueError("prompts, responses, rollout_logprobs and groups must have the same length")
    p_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    r_lens = torch.tensor([len(r) for r in responses], dtype=torch.int64)
    if (r_lens < 1).any():
        raise ValueError("every response needs at least one token")
    width = int(r_lens.max())
    seq = int((p_lens + r_lens).max()) + 1  # one spare column: the label of the last token
    seq = -(-seq // seq_multiple) * seq_multiple
    input_ids = torch.full((b, seq), pad_token_id, dtype=torch.int64)
    logprobs = torch.zeros(b, width, dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, rollout_logprobs)):
        input_ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        input_ids[i, len(p):len(p) + len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
        logprobs[i, :len(r)] = lp
    mask = (torch.arange(width).unsqueeze(0) < r_lens.unsqueeze(1)).float()
    if response_masks is not None:
        for i, m in enumerate(response_masks):
            if len(m) != len(responses[i]):
                raise ValueError(f"response_masks[{i}] has {len(m)} entries for a response of {len(responses[i])}")
            mask[i, :len(m)] *= torch.as_tensor(list(m), dtype=torch.float32)
    tensors = {"input_ids": input_ids, "prompt_lens": p_lens, "response_lens": r_lens, "response_mask": mask,
               "rollout_logprobs": logprobs, "group": torch.as_tensor(list(groups), dtype=torch.int64)}
    routes = routes_of_samples(routed_experts or [None], seq)
    if routes is not None:
        tensors[ROUTES] = routes
    return RolloutBatch(tensors, dict(meta or {}))
