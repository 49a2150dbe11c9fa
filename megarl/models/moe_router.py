"""The MoE load-balancing loss and z-loss over a whole mini-batch's real tokens.

megatron-core's ``TopKRouter`` forms the load-balancing (aux) loss of each micro-batch from that micro-batch's
own token counts, averaged over micro-batches and DP ranks: its gradient changes with the micro-batch size, the
padding, packing and the DP split (Megatron-LM #1984). :class:`GlobalBatchRouter` (put in through the layer spec,
:func:`megarl.models.megatron.layer_spec`) forms the switch-transformer loss of the whole mini-batch instead
(Fedus et al. 2021, eq. 4; megatron's ``switch_load_balancing_loss_func``)::

    L_aux = coeff * E / (k * T**2) * sum_e N_e * sum_t p_te

over the mini-batch's ``T`` real tokens (every micro-batch, DP rank and, under sequence parallelism, TP rank;
padding and packing gaps excluded through megatron's ``padding_mask``), ``N_e`` the tokens whose top-k holds
expert ``e`` and ``p_te`` the router's softmax. ``N_e`` and ``T`` come from a forward pass without gradients
over the mini-batch before its update (:func:`count_routing`): the old-log-prob pass where it ran over the same
tokens and weights (:class:`PassRouting`), else one of the update's own; in the update each micro-batch adds its share
``coeff * E / (k * T**2) * sum_e N_e * sum_{t in micro-batch} p_te`` (times the ``micro-batches x DP`` that
megatron's schedule and DDP average away), so the shares' gradients sum to that of ``L_aux`` whatever the
layout. The z-loss (ST-MoE, Zoph et al. 2022, eq. 5) likewise: ``coeff_z / T * sum_t logsumexp(logits_t)**2``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    compute_routing_scores_for_aux_loss,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter


class GlobalBatchRouter(TopKRouter):
    """megatron-core's ``TopKRouter`` whose aux loss and z-loss are normalised over the whole mini-batch.

    Outside an update prepared by :func:`global_batch_loss` it is megatron's router unchanged (its per-micro-batch
    losses). While :func:`count_routing` runs it accumulates, per real token, the top-k counts per expert, the
    router probabilities and ``logsumexp(logits)**2``; routing itself is never changed.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats: torch.Tensor | None = None  # [2E + 2] float64 while counting: N_e, sum p_te, T, sum z_t
        self.batch: tuple[torch.Tensor, float, float] | None = None  # N_e [E], T, gradient scale

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron's top-k routing of ``logits [s, b, E]`` (``padding_mask [s, b]`` bool, True on padding),
        counted into :attr:`stats` while :func:`count_routing` runs."""
        if self.stats is not None:
            self._count(logits, padding_mask)
        return super().routing(logits, padding_mask)

    def _count(self, logits: torch.Tensor, padding_mask: torch.Tensor | None) -> None:
        """Add a micro-batch's real tokens to :attr:`stats` (``padding_mask`` True on padding)."""
        flat = logits.detach().reshape(-1, self.config.num_moe_experts).float()
        pad = padding_mask.reshape(-1) if padding_mask is not None else None
        routing_map, scores = compute_routing_scores_for_aux_loss(flat, self.topk, self.score_function,
                                                                  padding_mask=pad)
        real = (~pad).double() if pad is not None else torch.ones(flat.shape[0], dtype=torch.float64,
                                                                   device=flat.device)
        z = (torch.logsumexp(flat, dim=-1).double().square() * real).sum()
        self.stats += torch.cat([routing_map.sum(0).double(), scores.sum(0).double(), real.sum()[None], z[None]])

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """Attach this micro-batch's share of the mini-batch's switch loss to ``probs`` (``scores_for_aux_loss
        [N, E]``: the softmax, zero on padding), or megatron's own loss outside :func:`global_batch_loss`."""
        coeff = self.get_aux_loss_coeff("aux_loss")
        if self.batch is None or coeff == 0:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        counts, tokens, scale = self.batch
        aux = switch_load_balancing_loss_func(scores_for_aux_loss, counts, tokens, self.topk,
                                              self.config.num_moe_experts, coeff * scale)
        return MoEAuxLossAutoScaler.apply(probs, aux)

    def apply_z_loss(self, logits, padding_mask=None):
        """Attach this micro-batch's share of the mini-batch's z-loss to ``logits [N, E]`` (``padding_mask [N]``
        True on padding) in a training pass inside :func:`global_batch_loss`; megatron's own otherwise."""
        coeff = self.config.moe_z_loss_coeff
        if self.batch is None or not coeff or not (self.training and torch.is_grad_enabled()):
            return super().apply_z_loss(logits, padding_mask)
        _, tokens, scale = self.batch
        z = torch.logsumexp(logits.float(), dim=-1).square()
        if padding_mask is not None:
            z = z * ~padding_mask
        return MoEAuxLossAutoScaler.apply(logits, z.sum() * (coeff * scale / tokens))


def routers(model) -> list[GlobalBatchRouter]:
    """The :class:`GlobalBatchRouter` s of a rank's model (a chunk, DDP-wrapped or not, or a list of chunks), in
    chunk and layer order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, GlobalBatchRouter)]


def needs_batch_stats(found: list[GlobalBatchRouter]) -> bool:
    """True when the routers have an aux loss or a z-loss (what :func:`count_routing` is for)."""
    return bool(found) and (found[0].get_aux_loss_coeff("aux_loss") > 0
                            or bool(found[0].config.moe_z_loss_coeff))


def count_routing(found: list[GlobalBatchRouter], forward: Callable[[], Any], dp_group
                  ) -> tuple[torch.Tensor, Any]:
    """The mini-batch's routing statistics: ``forward()`` (a pass without gradients over this rank's
    micro-batches of the mini-batch) with the routers counting, summed over ``dp_group`` and, under sequence
    parallelism (each TP rank routes its share of the tokens), over the routers' TP group.

    Returns:
        ``(stats, forward())``: ``stats [routers, 2E + 2]`` float64 on every rank of the groups: per router the
        tokens whose top-k holds each expert ``N_e`` (E), the sums of its router probabilities ``sum_t p_te``
        (E), the real tokens ``T`` and ``sum_t logsumexp(logits_t)**2``, all over real tokens.
    """
    width = 2 * found[0].config.num_moe_experts + 2
    device = found[0].weight.device
    for r in found:
        r.stats = torch.zeros(width, dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            result = forward()
        stats = torch.stack([r.stats for r in found])
    finally:
        for r in found:
            r.stats = None
    dist.all_reduce(stats, group=dp_group)
    if found[0].config.sequence_parallel:
        dist.all_reduce(stats, group=found[0].tp_group)
    return stats, result


@dataclasses.dataclass
class PassRouting:
    """The routing statistics (:func:`count_routing`) that a forward pass without gradients (the old-log-prob
    pass) counted over a batch, with what identifies that batch's tokens: an update of the same tokens under the
    same weights takes them instead of a counting pass of its own (the same ``N_e``, ``sum_t p_te`` and ``T``:
    sums over real tokens, whatever the micro-batches).

    Attributes:
        input_ids: ``[B, S]`` int64, the batch's token ids (CPU). lengths: ``[B]`` its rows' real tokens.
        stats: ``[routers, 2E + 2]`` float64, :func:`count_routing`'s.
    """
    input_ids: torch.Tensor
    lengths: torch.Tensor
    stats: torch.Tensor

    @classmethod
    def of(cls, batch: Mapping[str, torch.Tensor], stats: torch.Tensor) -> PassRouting:
        """The statistics ``stats`` of ``batch`` (``input_ids``, ``prompt_lens``, ``response_lens``)."""
        return cls(batch["input_ids"], batch["prompt_lens"] + batch["response_lens"], stats)

    def holds(self, batch: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``batch`` holds the pass's rows, in the same order (then these are its statistics)."""
        return (tuple(batch["input_ids"].shape) == tuple(self.input_ids.shape)
                and torch.equal(batch["prompt_lens"] + batch["response_lens"], self.lengths)
                and torch.equal(batch["input_ids"], self.input_ids))


@contextlib.contextmanager
def global_batch_loss(found: list[GlobalBatchRouter], stats: torch.Tensor, scale: float):
    """Inside the block, the routers' aux loss and z-loss are the mini-batch's (:func:`count_routing`'s
    ``stats``), each micro-batch's share multiplied by ``scale`` (its micro-batches x DP ranks, which megatron's
    schedule and DDP divide by)."""
    e = found[0].config.num_moe_experts
    for r, s in zip(found, stats):
        r.batch = (s[:e].to(r.weight.device, torch.float32), max(float(s[2 * e]), 1.0), float(scale))
    try:
        yield
    finally:
        for r in found:
            r.batch = None


def routing_metrics(found: list[GlobalBatchRouter], stats: torch.Tensor, pp_group) -> dict[str, float]:
    """The mini-batch's ``moe_aux_loss`` (the switch loss without its coefficient, mean over MoE layers: 1 when
    balanced), ``moe_expert_load_max`` / ``_min`` (the largest / smallest share ``N_e / (k T)`` of routed
    tokens that one expert of any layer received: ``1 / E`` when balanced) and, with a z-loss, ``moe_z_loss``
    (mean over layers of ``sum_t logsumexp**2 / T``), combined over the pipeline stages ``pp_group``."""
    e, k = found[0].config.num_moe_experts, found[0].topk
    tokens = stats[:, 2 * e].clamp(min=1.0)
    aux = e / (k * tokens ** 2) * (stats[:, :e] * stats[:, e:2 * e]).sum(-1)
    share = stats[:, :e] / (k * tokens[:, None])
    sums = torch.stack([aux.sum(), (stats[:, 2 * e + 1] / tokens).sum(), tokens.new_tensor(float(len(found)))])
    extremes = torch.stack([share.max(), -share.min()])
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sums, group=pp_group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=pp_group)
    out = {"moe_aux_loss": float(sums[0] / sums[2]), "moe_expert_load_max": float(extremes[0]),
           "moe_expert_load_min": float(-extremes[1])}
    if found[0].config.moe_z_loss_coeff:
        out["moe_z_loss"] = float(sums[1] / sums[2])
    return out


def padding_mask(mb: dict[str, torch.Tensor], width: int) -> torch.Tensor:
    """megatron's MoE ``padding_mask`` of a micro-batch: ``[b, width]`` bool, True where no real token is.

    A padded micro-batch (``input_ids [b, width]``) holds row ``i``'s ``prompt_lens[i] + response_lens[i]``
    tokens first; a packed one (``b = 1``, with ``seq_offsets``: :func:`megarl.workers.packing.pack_rows`) holds
    each row's tokens from its offset, the gaps and tail being padding.
    """
    lengths = mb["prompt_lens"] + mb["response_lens"]
    pos = torch.arange(width, device=lengths.device)
    if "seq_offsets" in mb:
        starts = mb["seq_offsets"]
        inside = (pos[None, :] >= starts[:, None]) & (pos[None, :] < (starts + lengths)[:, None])
        return ~inside.any(0, keepdim=True)
    return pos[None, :] >= lengths[:, None]
