"""Micro-batches by token count (dynamic batch size) for the log-prob, value and update passes.

With a token budget ``T`` (``actor.max_tokens_per_micro_batch``), a data-parallel share's rows are sorted by
length, longest first, and cut greedily into micro-batches whose padded size ``rows * padded_len(longest)``
stays within ``T``; each micro-batch is then cut to its own longest sequence (:func:`trim_to_longest`)
instead of the batch's. Rows of similar length end up together, so the padding left is small; a row longer
than ``T`` gets a micro-batch of its own. Same idea as verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``:
rows stay right-padded, so the plain causal attention of the local layer spec serves.

With ``actor.sequence_packing`` a micro-batch holds no padding between rows: :func:`pack_sequences` packs rows
(first-fit decreasing) into micro-batches of at most ``T`` real tokens, and :func:`pack_rows` lays them back to
back in one row ``[1, T']`` with ``cu_seqlens`` for megatron's ``PackedSeqParams``, so that attention
(:class:`megarl.kernels.attention.SDPAttention`) stays within each sequence (and RoPE sees each sequence's own
distances: :func:`megarl.models.pipeline.packed_seq_params`). The per-row tensors (response frame ``[n, R]``) stay per row and
:func:`megarl.data.batch.to_response_frame` reads the packed outputs back into them.

megatron-core's constraints, and what follows from them:

- the pipeline schedule (PP > 1) sends activations of one ``[s, b, h]`` shape for every micro-batch of a
  ``forward_backward_func`` call, so padded micro-batches of different shapes need PP = 1 (checked by
  :func:`megarl.parallel.placement.validate_for_world`); without pipelining each micro-batch runs on its own.
  Packed micro-batches are all ``b = 1``; at PP > 1 each is padded at its tail to the longest of the batch
  (rounded up to TP under sequence parallelism), the padding a segment of its own that nobody reads.
- megatron divides each micro-batch's loss by the number of micro-batches and DDP averages over DP ranks; the
  trainer undoes both with one factor ``num_microbatches * dp`` (:mod:`megarl.algos.aggregation`), which needs
  the same number of micro-batches on every DP rank. :func:`pack_shares` deals the rows to the ranks balanced
  by tokens (:func:`balanced_shares`) and gives every rank the largest count of any rank, splitting its
  micro-batches with the most rows where it has fewer. The loss normalisers stay those of the whole
  mini-batch, so the gradient equals the fixed-size path's.
"""

from __future__ import annotations

import torch


def padded_length(length: int, multiple: int) -> int:
    """Columns a sequence of ``length`` tokens takes: one spare label column, rounded up to ``multiple``
    (as :func:`~megarl.data.batch.build_batch` pads)."""
    return -(-(length + 1) // multiple) * multiple


def pack_by_tokens(lengths: torch.Tensor, budget: int, *, multiple: int = 1, min_count: int = 1
                   ) -> list[torch.Tensor]:
    """Cut rows into micro-batches of at most ``budget`` padded tokens, rows of similar length together.

    Args:
        lengths: ``[n]`` int, real tokens of each row (prompt + response).
        budget: padded tokens per micro-batch (rows x padded length of its longest row), >= 1.
        multiple: sequence lengths are padded to a multiple of this (8 x TP for sequence parallelism).
        min_count: split the micro-batches with the most rows until there are at least this many (at most
            ``n``).

    Returns:
        Row indices (int64) of each micro-batch, longest rows first; every row in exactly one.

    Raises:
        ValueError: ``budget < 1``, or ``min_count`` above the number of rows.
    """
    groups: list[list[int]] = []
    width = 0
    for i in _longest_first(lengths, budget, min_count):
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = padded_length(int(lengths[i]), multiple)
    return _split_to(groups, min_count)


def pack_sequences(lengths: torch.Tensor, budget: int, *, min_count: int = 1) -> list[torch.Tensor]:
    """Pack rows back to back into micro-batches (THD) of at most ``budget`` real tokens each.

    First-fit decreasing (Johnson 1973): rows longest first, each into the first micro-batch it still fits in,
    or a new one; a row longer than ``budget`` gets a micro-batch of its own. No padding between rows.

    Args:
        lengths: ``[n]`` int, real tokens of each row (prompt + response).
        budget: tokens per micro-batch, >= 1.
        min_count: split the micro-batches with the most rows until there are at least this many (at most
            ``n``).

    Returns and raises as :func:`pack_by_tokens`.
    """
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in _longest_first(lengths, budget, min_count):
        size = int(lengths[i])
        k = next((k for k, load in enumerate(loads) if load + size <= budget), None)
        if k is None:
            groups.append([i])
            loads.append(size)
        else:
            groups[k].append(i)
            loads[k] += size
    return _split_to(groups, min_count)


def _longest_first(lengths: torch.Tensor, budget: int, min_count: int) -> list[int]:
    """Row indices, longest row first (ties in row order), once ``budget`` and ``min_count`` are checked."""
    if budget < 1:
        raise ValueError(f"the token budget per micro-batch must be >= 1, got {budget}")
    if min_count > len(lengths):
        raise ValueError(f"cannot cut {len(lengths)} rows into {min_count} micro-batches")
    return torch.argsort(torch.as_tensor(lengths), descending=True, stable=True).tolist()


def _split_to(groups: list[list[int]], min_count: int) -> list[torch.Tensor]:
    """Split the groups with the most rows in halves until there are ``min_count``; as int64 tensors."""
    while len(groups) < min_count:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups.pop(k)
        groups[k:k] = [g[:len(g) // 2], g[len(g) // 2:]]
    return [torch.tensor(g, dtype=torch.int64) for g in groups]


def balanced_shares(lengths: torch.Tensor, dp_size: int) -> list[torch.Tensor]:
    """Deal rows to ``dp_size`` data-parallel ranks, longest first, in snake order (ranks 0..d-1, then d-1..0,
    ...): every rank gets the same number of rows (``len(lengths) / dp_size``; the trainer's batch sizes are
    multiples of DP) and nearly the same number of tokens, so no rank waits long for the others.

    Returns:
        Per DP rank, its rows' indices in ascending order (int64).
    """
    order = torch.argsort(torch.as_tensor(lengths), descending=True, stable=True).tolist()
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i, row in enumerate(order):
        lap, k = divmod(i, dp_size)
        shares[k if lap % 2 == 0 else dp_size - 1 - k].append(row)
    return [torch.tensor(sorted(s), dtype=torch.int64) for s in shares]


def pack_shares(lengths: torch.Tensor, dp_size: int, budget: int, *, multiple: int = 1, packed: bool = False,
                count_multiple: int = 1) -> list[list[torch.Tensor]]:
    """Rows of a batch split over DP ranks (:func:`balanced_shares`) and each rank's rows cut into micro-batches
    by tokens, with the same number of micro-batches on every rank: padded rows of similar length
    (:func:`pack_by_tokens`), or with ``packed`` rows back to back (:func:`pack_sequences`; ``multiple`` unused).
    The count is rounded up to a multiple of ``count_multiple`` (``pp`` for megatron's interleaved schedule
    with VPP) by splitting micro-batches, as for the DP balance.

    Returns:
        Per DP rank, the batch rows of its micro-batches (int64 index tensors), in micro-batch order.

    Raises:
        ValueError: a share with fewer rows than that count (the config check asks for rows per DP rank in
            multiples of ``pp`` with VPP).
    """
    def cut(share, min_count=1):
        if packed:
            return pack_sequences(lengths[share], budget, min_count=min_count)
        return pack_by_tokens(lengths[share], budget, multiple=multiple, min_count=min_count)

    shares = balanced_shares(lengths, dp_size)
    count = -(-max(len(cut(s)) for s in shares) // count_multiple) * count_multiple
    return [[s[g] for g in cut(s, count)] for s in shares]


def trim_to_longest(micro: dict[str, torch.Tensor], lengths: torch.Tensor, multiple: int) -> dict[str, torch.Tensor]:
    """Cut ``input_ids [b, S]`` of a micro-batch to ``padded_length`` of its longest row (never above ``S``);
    other tensors stay as they are (the response frame keeps the batch's width)."""
    width = min(padded_length(int(lengths.max()), multiple), micro["input_ids"].shape[1])
    return {**micro, "input_ids": micro["input_ids"][:, :width]}


def pack_rows(micro: dict[str, torch.Tensor], lengths: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
    """One packed (THD) micro-batch from rows of the batch: their tokens back to back in one row.

    Args:
        micro: the rows' tensors ``[n, ...]``; ``input_ids [n, S]`` int64 right-padded.
        lengths: ``[n]`` int, real tokens of each row (prompt + response).
        width: tokens of the packed row ``T`` (>= ``lengths.sum()``); the tail after the last row is padding
            (token 0), a segment of its own in ``cu_seqlens`` so that attention and RoPE see it as one more
            sequence, whose outputs nobody reads.

    Returns:
        ``micro`` with ``input_ids [1, T]`` int64, and ``position_ids [1, T]`` int64 (restarting at 0 on every
        sequence), ``cu_seqlens [segments + 1]`` int32 (megatron's ``PackedSeqParams``: start of every segment,
        then ``T``) and ``seq_offsets [n]`` int64 (where each row starts in the packed row) added; the other
        tensors stay per row (the response frame ``[n, R]``).

    Raises:
        ValueError: ``width`` shorter than the rows' tokens.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    total = int(lengths.sum())
    if width < total:
        raise ValueError(f"a packed row of {width} tokens cannot hold {total} tokens")
    segments = torch.cat([lengths, lengths.new_tensor([width - total])]) if width > total else lengths
    cu_seqlens = torch.cat([lengths.new_zeros(1), segments.cumsum(0)])
    ids = micro["input_ids"]
    input_ids = torch.cat([ids[i, :int(n)] for i, n in enumerate(lengths)] + [ids.new_zeros(width - total)])
    starts = torch.repeat_interleave(cu_seqlens[:-1], segments)
    return {**micro, "input_ids": input_ids.unsqueeze(0),
            "position_ids": (torch.arange(width) - starts).unsqueeze(0),
            "cu_seqlens": cu_seqlens.to(torch.int32), "seq_offsets": cu_seqlens[:len(lengths)].clone()}
