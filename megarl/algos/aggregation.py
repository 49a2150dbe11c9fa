"""Masked reductions and loss aggregation over ``[B, T]`` token matrices.

Mask semantics (every function here and in :mod:`megarl.algos`): ``mask`` is ``[B, T]`` bool, int or float,
nonzero on the tokens that count (response tokens including EOS) and zero on padding (and any other excluded
token). Values at masked-out positions never reach a result, even if they are inf or NaN (they are selected
away with ``torch.where``, not multiplied by zero), and the losses of :mod:`megarl.algos.losses` give them a
zero gradient (they select before computing); what the caller computed them from is the caller's affair.
A "sequence" is a row of the matrix; a row with no valid token is not counted as a sequence.

Split invariance (the contract with the distributed trainer)
-----------------------------------------------------------
The trainer splits a global mini-batch of ``B`` rows over data-parallel ranks and micro-batches, runs
``backward`` on each micro-batch's loss and sums the gradients. Pass every micro-batch the normalisers of the
whole mini-batch (``count_tokens_and_seqs`` of its mask summed over micro-batches, then all-reduced with SUM
over the DP group)::

    tokens, seqs = count_tokens_and_seqs(mini_batch_mask)          # summed over all DP ranks
    loss_k = agg_loss(loss_mat_k, mask_k, mode, global_tokens=tokens, global_seqs=seqs)

Then ``sum_k loss_k`` over all micro-batches of all ranks equals ``agg_loss(loss_mat, mask, mode)`` of the
whole mini-batch (up to float rounding), for every mode, however the rows are split. The framework must
therefore SUM micro-batch losses and gradients, not average them. Megatron-core 0.19 averages by default:
``forward_backward_func`` divides the loss of a loss function returning ``(loss, stats)`` by the number of
micro-batches, and DDP scales gradients by ``1 / dp_size``. With ``calculate_per_token_loss=True`` and a loss
function returning ``(loss, num_tokens, stats)`` neither happens; otherwise multiply the loss by
``num_microbatches * dp_size``.
Without the ``global_*`` arguments, the normalisers are this call's own (a plain mean over this batch).
"""

from __future__ import annotations

import torch

from megarl.algos.registry import AGG_MODES


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the valid positions of ``mask`` (same shape), float32; over ``dim`` or everything."""
    x = torch.where(mask.bool(), x.float(), 0.0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the valid positions of ``mask``, float32; 0 where there is no valid position."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def group_sum(x: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: the sum of ``x`` over its group and the group's size.

    Args:
        x: ``[N]`` float.
        group_index: ``[N]`` integer; equal ids form a group (any values, in any order).

    Returns:
        ``(sums [N], sizes [N] float32)``: the sums float64 for a float64 ``x``, else float32. They accumulate
        in float64 (``index_add_`` adds one element after the other: in float32 the sum of a group of 1M
        elements was off by 4e-5 relative, which shifted every whitened advantage by that much).
    """
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel(), dtype=torch.float64, device=x.device).index_add_(0, inverse, x.double())
    sums = sums[inverse]
    return (sums if x.dtype == torch.float64 else sums.float()), counts[inverse].float()


def group_deviations(x: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element minus the mean of its group, exactly 0 for every element of a group of equal values.

    ``x - mean`` with the mean computed as ``sum / n`` is not 0 in float arithmetic when the values are all
    equal (eight fp32 copies of 0.7 sum to 5.5999994, so the deviations are ~6e-8 and a later division by a
    standard deviation of the same size turns them into O(0.1)). Here each group is first shifted by its own
    minimum, which is exact and 0 for equal values, and the mean is taken of the shifted values:
    ``d = (x - min) - mean(x - min)``; a tied group gives exact zeros, any other group the same deviations up
    to rounding. Statistics built from ``d`` (variance, standard deviation) are then exactly 0 for a tied
    group: such a group has no spread and carries no signal. The arithmetic is float64.

    Args:
        x: ``[N]`` float.
        group_index: ``[N]`` integer group ids (see :func:`group_sum`).

    Returns:
        ``(deviations [N], group sizes [N] float32)``; the deviations float64 for a float64 ``x``, else
        float32; a group of one has deviation 0.
    """
    wide = x.double()
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    lowest = wide.new_full((counts.numel(),), float("inf")).scatter_reduce_(0, inverse, wide, "amin")
    shifted = wide - lowest[inverse]
    sums, sizes = group_sum(shifted, group_index)
    deviations = shifted - sums / sizes
    return (deviations if x.dtype == torch.float64 else deviations.float()), sizes


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel-corrected) variance of ``x`` over the valid positions of ``mask``, float32 scalar,
    from exact deviations (:func:`group_deviations`, float64): exactly 0 when the valid values are all equal,
    and 0 with fewer than two valid positions."""
    centred = _masked_deviations(x, mask.bool())
    return (centred.square().sum() / (mask.bool().sum() - 1).clamp(min=1)).float()


def _masked_deviations(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float64: ``x`` minus its mean over the valid positions (exact), 0 elsewhere."""
    valid = x.double()[m]
    deviations, _ = group_deviations(valid, torch.zeros_like(valid, dtype=torch.int64))
    return torch.zeros(m.shape, dtype=torch.float64, device=x.device).masked_scatter_(m, deviations)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over all valid positions of the batch.

    ``(x - mean) / sqrt(var + eps)`` with the mean and the unbiased (Bessel-corrected) variance over the
    valid positions; with ``shift_mean=False`` the mean is added back (scale only). Used for advantage
    whitening (PPO; Hu 2025, REINFORCE++, global batch normalisation). The deviations from the mean are exact
    (:func:`group_deviations`), so a batch whose valid values are all equal whitens to exactly 0. The whole
    computation is float64, rounded to float32 at the end: within 1e-6 of a float64 whitening at 1M tokens
    (a float32 running sum had shifted every value by 4e-5 there).

    Args:
        x: ``[B, T]`` float.
        mask: ``[B, T]`` valid positions.
        shift_mean: subtract the mean (True) or only divide by the standard deviation (False).
        eps: added to the variance.

    Returns:
        ``[B, T]`` float32, 0 at masked-out positions. With fewer than two valid positions the variance is
        taken as 0, so a single valid value becomes 0 (stays itself with ``shift_mean=False``).
    """
    m = mask.bool()
    centred = _masked_deviations(x, m)
    out = centred * torch.rsqrt(centred.square().sum() / (m.sum() - 1).clamp(min=1) + eps)
    if not shift_mean:
        out = torch.where(m, out + x.double()[m].mean(), 0.0)
    return out.float()


def count_tokens_and_seqs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two normalisers of :func:`agg_loss` for a batch: valid tokens and sequences with a valid token.

    Args:
        mask: ``[B, T]`` valid tokens.

    Returns:
        ``(tokens, seqs)``, float32 scalars (sum them over micro-batches and DP ranks for ``global_*``).
    """
    m = mask.bool()
    return m.sum().float(), m.any(-1).sum().float()


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", *,
             global_tokens: torch.Tensor | float | None = None,
             global_seqs: torch.Tensor | float | None = None, norm_tokens: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar (this batch's share of the mini-batch loss).

    Modes (``N`` = valid tokens, ``S`` = sequences with a valid token, ``m`` the mask, ``l`` the loss):

    - ``"token-mean"``: ``sum_{i,t} m l / N``; every token weighs the same (Yu et al. 2025, DAPO,
      arXiv:2503.14476, "token-level policy gradient loss").
    - ``"seq-mean-token-sum"``: ``sum_i (sum_t m l) / S``; a sequence weighs its length (Liu et al. 2025,
      Dr. GRPO, arXiv:2503.20783, up to its constant length normaliser).
    - ``"seq-mean-token-mean"``: ``sum_i (sum_t m l / sum_t m) / S``; every sequence weighs the same
      (Shao et al. 2024, GRPO, arXiv:2402.03300, eq. 3).
    - ``"seq-mean-token-sum-norm"``: ``sum_i (sum_t m l / L) / S`` with a constant ``L`` (``norm_tokens``, the
      response length limit): Dr. GRPO's unbiased normalisation (Liu et al. 2025, "Understanding R1-Zero-Like
      Training: A Critical Perspective", arXiv:2503.20783, eq. 3 and its listing: ``masked_mean`` divides by
      ``MAX_TOKENS``, not by the response's length), so a token's weight depends on neither its response's
      length nor the batch's token count.

    Args:
        loss_mat: ``[B, T]`` float per-token loss.
        mask: ``[B, T]`` valid tokens.
        mode: one of :data:`AGG_MODES`.
        global_tokens: ``N`` of the whole mini-batch (all micro-batches, all DP ranks), for "token-mean";
            default: this batch's own.
        global_seqs: ``S`` of the whole mini-batch, for the "seq-mean-*" modes; default: this batch's own.
            See the module docstring for the split-invariance contract.
        norm_tokens: ``L`` (> 0) of "seq-mean-token-sum-norm" (required there, ignored otherwise).

    Returns:
        float32 scalar, differentiable w.r.t. ``loss_mat``; 0 when the normaliser is 0.

    Raises:
        ValueError: unknown ``mode``, mismatched shapes, "seq-mean-token-sum-norm" without ``norm_tokens > 0``.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat and mask must both be [B, T], got {tuple(loss_mat.shape)} and "
                         f"{tuple(mask.shape)}")
    tokens, seqs = count_tokens_and_seqs(mask)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "token-mean":
        total, denom = seq_sum.sum(), tokens if global_tokens is None else global_tokens
    elif mode == "seq-mean-token-sum":
        total, denom = seq_sum.sum(), seqs if global_seqs is None else global_seqs
    elif mode == "seq-mean-token-sum-norm":
        if norm_tokens is None or norm_tokens <= 0:
            raise ValueError(f"loss aggregation {mode!r} needs norm_tokens > 0 (the constant L of Dr. GRPO, "
                             f"e.g. the response length limit), got {norm_tokens}")
        total = seq_sum.sum() / norm_tokens
        denom = seqs if global_seqs is None else global_seqs
    elif mode == "seq-mean-token-mean":
        total = (seq_sum / mask.bool().sum(-1).clamp(min=1)).sum()
        denom = seqs if global_seqs is None else global_seqs
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {list(AGG_MODES)}")
    return total / torch.as_tensor(denom, dtype=torch.float32, device=total.device).clamp(min=1)
