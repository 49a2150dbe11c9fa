"""Per-token log-probs and entropy over vocab-parallel logits, without gathering the vocab.

Each TP rank holds logits for its slice of the (padded) vocab. The log-softmax normaliser, the label's
logit and the entropy are each one all-reduce over the TP group of a ``[b, s]`` tensor, so no rank ever
materialises the full ``[b, s, vocab]`` logits. Padded vocab entries (Megatron pads the vocab to a multiple of
128) are masked out. Gradients flow through megatron's ``reduce_from_tensor_model_parallel_region``
(all-reduce forward, identity backward), which is exact because everything after the reduction is
replicated over TP.
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                            temperature: float = 1.0, with_entropy: bool = False, tp_group=None,
                            tp_rank: int | None = None, tp_size: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and (optionally) the entropy of each position's distribution.

    The distribution is ``softmax(logits / temperature)`` over the first ``vocab_size`` entries of the full
    vocab (the same distribution the rollout engines sample from and report log-probs of).

    Args:
        logits: ``[b, s, v_local]`` float, this TP rank's contiguous vocab slice
            ``[tp_rank * v_local, (tp_rank + 1) * v_local)`` of the padded vocab.
        labels: ``[b, s]`` int64 token ids in ``[0, vocab_size)``.
        vocab_size: the real (unpadded) vocab; columns at or beyond it are masked out.
        temperature: sampling temperature (> 0) the logits are divided by.
        with_entropy: also return the entropy (nats).
        tp_group: the tensor-parallel process group; default: megatron's ``parallel_state``.
        tp_rank / tp_size: this rank's place in ``tp_group`` and its size; default: read from the group.

    Returns:
        ``(logprobs [b, s] float32, entropy [b, s] float32 or None)``, differentiable w.r.t. ``logits``.

    Raises:
        ValueError: ``temperature <= 0``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if tp_rank is None:
        tp_rank = torch.distributed.get_rank(tp_group)
    if tp_size is None:
        tp_size = torch.distributed.get_world_size(tp_group)
    v_local = logits.shape[-1]
    lo = tp_rank * v_local
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    if lo + v_local > vocab_size:  # this slice holds padding columns
        pad = torch.arange(lo, lo + v_local, device=z.device) >= vocab_size
        z = z.masked_fill(pad, float("-inf"))

    def allreduce_sum(x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=tp_group) if tp_size > 1 else x

    with torch.no_grad():
        zmax = z.max(dim=-1).values
        if tp_size > 1:
            torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = z - zmax.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = allreduce_sum(exp.sum(dim=-1))
    local_label = labels - lo
    in_slice = (local_label >= 0) & (local_label < v_local)
    picked = torch.gather(shifted, -1, local_label.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    label_shifted = allreduce_sum(torch.where(in_slice, picked, torch.zeros_like(picked)))
    log_norm = sum_exp.log()
    logprobs = label_shifted - log_norm
    entropy = None
    if with_entropy:
        # entropy = log Z - E_p[z] with E_p[z] = sum(exp * z) / Z; padded columns have exp = 0 and z = -inf: use
        # 0 there. Divide by Z after the all-reduce: dividing each rank's share first would leave the other
        # ranks' terms out of the gradient through Z (the all-reduce's backward is the identity).
        p_shifted = allreduce_sum((exp * torch.where(torch.isfinite(shifted), shifted,
                                                     torch.zeros_like(shifted))).sum(dim=-1)) / sum_exp
        entropy = log_norm - p_shifted
    return logprobs, entropy
