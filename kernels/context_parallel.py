"""Context parallelism (CP) without Transformer Engine: causal attention over a sequence split on ``cp`` ranks.

megatron-core runs CP only in Transformer Engine's attention (its local ``DotProductAttention`` asserts
``context_parallel_size == 1``). This module gives the local spec's :class:`megarl.kernels.attention.SDPAttention` the
same sequence layout, so that megatron's own CP pieces (``parallel_state``'s CP groups, ``RotaryEmbedding``'s
per-rank positions ``get_pos_emb_on_this_cp_rank``, DDP's gradient reduction over DP x CP) apply unchanged.

Layout (Megatron-LM's ``get_batch_on_this_cp_rank``, the load-balanced causal split): a sequence of ``s`` tokens
is cut into ``2 * cp`` chunks of ``s / (2 * cp)``; CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so
every rank has the same share of the causal attention's work.

Attention (all-gather KV, as TE's ``cp_comm_type="all_gather"``): each rank all-gathers the keys and values of
the CP group (forward: all-gather; backward: reduce-scatter of their gradients, megatron's
``gather_from_sequence_parallel_region`` on the CP group) and its queries attend the gathered keys under the
causal mask of their global positions. The scores ``[b, heads, s / cp, s]`` of a rank are never held at once on
the GPU (SDPA's memory-efficient backend takes the explicit mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_len / cp]`` (int64) of the tokens CP rank ``cp_rank`` holds: chunks ``cp_rank``
    and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp_size``.
    """
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2 * cp = {2 * cp_size} for context "
                         "parallelism (the load-balanced split into 2 * cp chunks)")
    chunk = seq_len // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def split_for_cp_rank(t: torch.Tensor, dim: int, cp_group) -> torch.Tensor:
    """This CP rank's tokens of ``t`` along ``dim`` (Megatron-LM's ``get_batch_on_this_cp_rank``).

    Args:
        t: any tensor whose ``dim`` is the full sequence (``s``, a multiple of ``2 * cp``).
        cp_group: the CP process group (``parallel_state.get_context_parallel_group()``).

    Returns:
        ``t`` with ``dim`` of size ``s / cp``: chunks ``r`` and ``2 * cp - 1 - r`` of the CP rank ``r``.
    """
    cp = cp_group.size()
    if cp == 1:
        return t
    idx = cp_positions(t.shape[dim], cp_group.rank(), cp, t.device)
    return t.index_select(dim, idx)


def gather_from_cp_ranks(t: torch.Tensor, dim: int, cp_group, *, reduce_grad: bool) -> torch.Tensor:
    """Inverse of :func:`split_for_cp_rank`: the full sequence along ``dim``, in global token order, on every CP
    rank (autograd-aware).

    Args:
        t: this rank's ``s / cp`` tokens along ``dim``.
        reduce_grad: backward sums the gradients of the CP ranks and returns this rank's slice
            (reduce-scatter: every rank's use of the gathered tensor contributes, as for keys and values);
            False returns this rank's slice of its own gradient (every rank computes the same function of the
            gathered tensor, as for per-token log-probs in a loss computed identically on every CP rank).

    Returns:
        ``t`` with ``dim`` of size ``s``.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    cp = cp_group.size()
    if cp == 1:
        return t
    first = t.movedim(dim, 0)
    full = gather_from_sequence_parallel_region(first, tensor_parallel_output_grad=reduce_grad, group=cp_group)
    s = full.shape[0]
    # gathered in rank order: rank r's chunks (r, 2cp-1-r); position p of the gathered tensor holds token order[p]
    order = torch.cat([cp_positions(s, r, cp, t.device) for r in range(cp)])
    return full.index_select(0, torch.argsort(order)).movedim(0, dim)


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_group, *,
                               scale: float | None = None, window: tuple[int, int] | None = None,
                               dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys and values.

    Args:
        query: ``[s/cp, b, np, hn]`` this rank's queries (chunks ``r`` and ``2cp-1-r``), rotary already applied.
        key, value: ``[s/cp, b, ng, hn]`` this rank's keys and values (same tokens); ``ng`` divides ``np`` (GQA).
        cp_group: the CP process group.
        scale: softmax scale (None: ``1 / sqrt(hn)``).
        window: megatron's sliding window ``(left, right)`` on top of the causal mask, or None.
        dropout_p: attention dropout.

    Returns:
        ``[s/cp, b, np, hn]`` attention output of this rank's queries, the dtype of ``query``; equal to this
        rank's rows of causal attention over the full sequence.
    """
    cp = cp_group.size()
    sq = query.shape[0]
    s = sq * cp
    kv = gather_from_cp_ranks(torch.stack([key, value]), 1, cp_group, reduce_grad=True)
    q_pos = cp_positions(s, cp_group.rank(), cp, query.device).unsqueeze(1)
    k_pos = torch.arange(s, device=query.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (k_pos >= q_pos - window[0]) & (k_pos <= q_pos + window[1])
    # [s, b, n, d] -> [b, n, s, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, kv[0], kv[1]))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.permute(2, 0, 1, 3)


def next_tokens(input_ids: torch.Tensor, cp_group=None) -> torch.Tensor:
    """The label of each token: the next token of its sequence, ``roll(input_ids, -1)`` along the sequence (the
    last position's label is the first token; callers mask it).

    Args:
        input_ids: ``[b, s]`` int64, or with ``cp_group`` of more than one rank this CP rank's ``[b, s / cp]``
            (:func:`split_for_cp_rank`).
        cp_group: the CP process group, or None.

    Returns:
        ``[b, s]`` (``[b, s / cp]``: this rank's tokens' labels) int64.
    """
    if cp_group is None or cp_group.size() == 1:
        return torch.roll(input_ids, shifts=-1, dims=1)
    full = gather_from_cp_ranks(input_ids, 1, cp_group, reduce_grad=False)
    return split_for_cp_rank(torch.roll(full, shifts=-1, dims=1), 1, cp_group)
