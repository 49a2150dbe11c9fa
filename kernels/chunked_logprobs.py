"""The output layer, per-token log-probs and entropy in sequence chunks, on vocab-parallel logits.

The plain path (:func:`megarl.models.logprobs.vocab_parallel_logprobs` on the ``GPTModel``'s output) holds the
whole micro-batch's logits ``[b, s, vocab/tp]`` in bf16 and several fp32 copies of them, forward and backward:
10 GB per fp32 copy for Qwen2.5-0.5B at 8 x 2048 tokens. Here the logits of at most ``chunk_tokens`` tokens
exist at a time. The forward keeps four fp32 numbers per token (the log-prob and the softmax statistics
``M``, ``log S``, ``T / S`` below); the backward recomputes each chunk's logits from the saved hidden states and
weight, turns them into the logits' gradient in place and multiplies it into the hidden and weight
gradients. Nothing of size ``[b, s, vocab/tp]`` outlives one chunk.

The vocab-parallel math is the plain path's (Megatron's layout: TP rank ``r`` holds the contiguous vocab rows
``[r * v_local, (r + 1) * v_local)`` of the padded vocab; rows at or beyond ``vocab_size`` are padding and
take no part). With ``z = logits / temperature`` over the real vocab, each TP rank reduces its own slice to
per-token statistics (max ``m_r``, ``s_r = sum exp(z - m_r)``, ``t_r = sum exp(z - m_r)(z - m_r)``, and the
label's ``z`` where the rank owns the label); the TP group combines them with one max all-reduce of
``[tokens]`` and one sum all-reduce of ``[3, tokens]`` per chunk:

    M = max_r m_r,   S = sum_r e^(m_r - M) s_r,   T = sum_r e^(m_r - M) (t_r + (m_r - M) s_r),
    log-prob = (z_label - M) - log S,   entropy = log S - T / S.

Gradients (``p = softmax(z)``, ``E[z] = M + T / S``, ``g`` and ``h`` the upstream gradients of log-prob and
entropy): ``d/dz_j = g (1[j = label] - p_j) + h p_j (E[z] - z_j)``, divided by ``temperature`` for the logits.
The hidden states enter through megatron's ``copy_to_tensor_model_parallel_region`` (or the sequence-parallel
gather), as in megatron's ``ColumnParallelLinear``, so their gradient is summed over TP.

Per-chunk statistics and the logits' gradient run as Triton kernels on CUDA tensors
(:mod:`megarl.kernels.triton_logprobs`: one read of the bf16 logits for the statistics, one in-place pass for the
gradient) and as torch ops elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

from megarl.kernels.context_parallel import next_tokens

BACKENDS = ("auto", "torch", "triton")


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                     temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = 4096,
                     sequence_parallel: bool = False, tp_group=None, backend: str = "auto",
                     positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label and (optionally) the entropy of ``softmax((hidden @ weight.T) / temperature)``
    over the first ``vocab_size`` entries of the vocab, computed ``chunk_tokens`` tokens at a time.

    Equals ``vocab_parallel_logprobs(F.linear(hidden, weight).transpose(0, 1), labels, ...)`` (forward and
    gradients) without holding the logits of the whole batch.

    Args:
        hidden: ``[s, b, h]`` final hidden states (after the final norm), Megatron's sequence-first layout;
            ``[s / tp, b, h]`` when ``sequence_parallel``. Any float dtype (the model's).
        weight: ``[v_local, h]`` this TP rank's rows of the output layer (or the tied word embeddings), the
            same dtype as ``hidden``.
        labels: ``[b, s]`` int64 token ids in ``[0, vocab_size)``.
        vocab_size: the real (unpadded) vocab; rows of the padded vocab at or beyond it are left out.
        temperature: sampling temperature (> 0) the logits are divided by.
        with_entropy: also return the entropy (nats).
        chunk_tokens: tokens (over ``s * b``) whose logits exist at once; bounds the extra memory to about
            ``chunk_tokens * v_local`` elements of the model dtype plus fp32 temporaries of the same size on
            the torch backend.
        sequence_parallel: ``hidden`` is split over TP along ``s`` (gathered here).
        tp_group: the tensor-parallel group; default: megatron's ``parallel_state``.
        backend: "triton" (CUDA tensors, or ``TRITON_INTERPRET=1``), "torch", or "auto" (Triton on CUDA).
        positions: ``[b, s]`` bool, the positions whose log-prob (and entropy) the caller reads (the response
            tokens' labels); the output layer then runs on those tokens' hidden states only and every other
            position is 0, with no gradient. None: every position. The kept positions' values and the
            gradients equal those of None up to float summation order (the weight's gradient sums fewer
            zero rows).

    Returns:
        ``(logprobs [b, s] float32, entropy [b, s] float32 or None)``, differentiable w.r.t. ``hidden`` and
        ``weight``.

    Raises:
        ValueError: temperature <= 0, chunk_tokens < 1, an unknown backend, or mismatched shapes.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, group=tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[2] != weight.shape[1]:
        raise ValueError(f"hidden [s, b, h] and weight [v_local, h] do not fit: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if tuple(labels.shape) != (hidden.shape[1], hidden.shape[0]):
        raise ValueError(f"labels must be [b, s] = {(hidden.shape[1], hidden.shape[0])}, got {tuple(labels.shape)}")
    if backend == "auto":
        backend = "triton" if hidden.is_cuda and _have_triton() else "torch"
    if positions is None:
        logp, ent = _ChunkedLogprobs.apply(hidden, weight, labels, vocab_size, float(temperature), with_entropy,
                                           int(chunk_tokens), tp_group, backend)
        return logp, (ent if with_entropy else None)
    if positions.shape != labels.shape or positions.dtype != torch.bool:
        raise ValueError(f"positions must be a bool [b, s] = {tuple(labels.shape)}, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    # the kept tokens as one sequence [n, 1, h] (the same on every TP rank: after the TP mapping above)
    kept = hidden.transpose(0, 1)[positions].unsqueeze(1)
    logp, ent = _ChunkedLogprobs.apply(kept, weight, labels[positions].unsqueeze(0), vocab_size, float(temperature),
                                       with_entropy, int(chunk_tokens), tp_group, backend)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        full = values.new_zeros(labels.shape)
        full[positions] = values[0]
        return full

    return scatter(logp), (scatter(ent) if with_entropy else None)


class LogprobOutput:
    """A ``GPTModel`` ``output_processor``: the model returns ``(logprobs [b, s], entropy [b, s] | None)``
    (fp32) from :func:`chunked_logprobs` instead of its vocab-parallel logits.

    Pass it as ``model(input_ids, position_ids, None, output_processor=LogprobOutput(...))``; the labels are
    the next tokens, ``roll(input_ids, -1)`` (the last position's label is the first token, as in the
    trainer's plain path; callers mask it); under context parallelism the model's ``input_ids`` are this CP
    rank's ``[b, s / cp]`` and so are the outputs (:func:`megarl.kernels.context_parallel.next_tokens`). With tied embeddings megatron hands over the shared word-embedding
    weight, so its gradient collects both uses. Where the model call's ``output_processor_context`` (the
    micro-batch, :func:`megarl.models.pipeline.run_microbatches`) holds ``logit_positions`` ``[b, s]`` bool,
    only those positions are computed (:func:`chunked_logprobs`' ``positions``; the trainer sets them to the
    response tokens' labels, ``megarl.workers.engine``), the others are 0.

    Args:
        vocab_size / temperature / with_entropy / chunk_tokens / backend: as :func:`chunked_logprobs`.
    """

    def __init__(self, *, vocab_size: int, temperature: float = 1.0, with_entropy: bool = False,
                 chunk_tokens: int = 4096, backend: str = "auto"):
        self.vocab_size, self.temperature, self.with_entropy = vocab_size, temperature, with_entropy
        self.chunk_tokens, self.backend = chunk_tokens, backend

    def __call__(self, *, hidden_states, output_layer, output_weight, input_ids, context=None, **_: Any):
        weight = output_layer.weight if output_weight is None else output_weight
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        labels = next_tokens(input_ids, cp_group)
        return chunked_logprobs(hidden_states, weight, labels, vocab_size=self.vocab_size,
                                temperature=self.temperature, with_entropy=self.with_entropy,
                                chunk_tokens=self.chunk_tokens, sequence_parallel=output_layer.sequence_parallel,
                                tp_group=output_layer.tp_group, backend=self.backend,
                                positions=None if context is None else context.get("logit_positions"))


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _ChunkedLogprobs(torch.autograd.Function):
    """``(hidden [s, b, h], weight [v_local, h], labels [b, s]) -> (logprobs [b, s], entropy [b, s])``; the
    hidden gradient it returns is this rank's part (the caller's TP mapping sums it)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_size, temperature, with_entropy, chunk, group, backend):
        tp_rank, tp_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        s, b, h = hidden.shape
        x = hidden.reshape(s * b, h)
        lo = tp_rank * weight.shape[0]
        n_valid = max(0, min(weight.shape[0], vocab_size - lo))
        w = weight[:n_valid]
        local_labels = labels.t().reshape(s * b) - lo
        n = s * b
        # per token: log-prob, then M, log S and T / S (the backward's softmax statistics)
        out = torch.empty(4, n, dtype=torch.float32, device=x.device)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            logits = x[c0:c1] @ w.t()
            stats = _local_stats(logits, local_labels[c0:c1], temperature, backend)
            out[:, c0:c1] = _combine_over_tp(stats, group, tp_size)
            del logits
        logp, stats = out[0], out[1:]
        ctx.save_for_backward(hidden, weight, local_labels, stats)
        ctx.conf = (temperature, chunk, n_valid, backend, with_entropy)
        entropy = stats[1] - stats[2]
        return logp.view(s, b).t(), entropy.view(s, b).t()

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, local_labels, stats = ctx.saved_tensors
        temperature, chunk, n_valid, backend, with_entropy = ctx.conf
        s, b, h = hidden.shape
        n = s * b
        x = hidden.reshape(n, h)
        w = weight[:n_valid]
        g_lp = _tokens_major(grad_logp, n, x.device)
        g_ent = _tokens_major(grad_ent, n, x.device) if with_entropy else None
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            logits = x[c0:c1] @ w.t()
            g = _logits_grad_(logits, local_labels[c0:c1], stats[:, c0:c1], g_lp[c0:c1],
                              None if g_ent is None else g_ent[c0:c1], temperature, backend)
            if want_x:
                grad_x[c0:c1] = g @ w
            if want_w:
                grad_w[:n_valid] += (g.t() @ x[c0:c1]).float()
            del logits, g
        return (grad_x.view(s, b, h) if want_x else None, grad_w.to(weight.dtype) if want_w else None,
                None, None, None, None, None, None, None)


def _tokens_major(grad: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """``[b, s]`` upstream gradient -> ``[s * b]`` fp32 in the hidden states' token order (zeros if None)."""
    if grad is None:
        return torch.zeros(n, dtype=torch.float32, device=device)
    return grad.t().reshape(n).float()


def _local_stats(logits: torch.Tensor, local_labels: torch.Tensor, temperature: float, backend: str):
    """This rank's ``(m, s, t, z_label)`` per token of one chunk (see the module docstring); ``z_label`` is 0
    where another rank owns the label."""
    n, v = logits.shape
    owns = (local_labels >= 0) & (local_labels < v)
    idx = local_labels.clamp(0, max(v - 1, 0)).unsqueeze(-1)
    if v == 0:  # a rank that holds only padding rows
        zero = torch.zeros(n, dtype=torch.float32, device=logits.device)
        return torch.full_like(zero, float("-inf")), zero, zero, zero
    z_label = torch.gather(logits, 1, idx).squeeze(-1).float()
    if temperature != 1.0:
        z_label = z_label / temperature
    if backend == "triton":
        from megarl.kernels.triton_logprobs import softmax_stats

        m, s, t = softmax_stats(logits, temperature)
    else:
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        m = z.max(dim=-1).values
        shifted = z - m.unsqueeze(-1)
        del z
        e = shifted.exp()
        s = e.sum(dim=-1)
        t = (e * shifted).sum(dim=-1)
    return m, s, t, torch.where(owns, z_label, torch.zeros_like(z_label))


def _combine_over_tp(stats, group, tp_size: int):
    """Combine the TP ranks' statistics of one chunk into ``[4, n]``: log-prob, ``M``, ``log S``, ``T / S``."""
    m, s, t, z_label = stats
    big_m = m.clone()
    if tp_size > 1:
        torch.distributed.all_reduce(big_m, op=torch.distributed.ReduceOp.MAX, group=group)
    d = m - big_m
    scale = d.exp()
    parts = torch.stack([s * scale, torch.where(s > 0, (t + d * s) * scale, torch.zeros_like(s)), z_label])
    if tp_size > 1:
        torch.distributed.all_reduce(parts, group=group)
    sum_exp, sum_ez, label_z = parts
    log_sum = sum_exp.log()
    return torch.stack([(label_z - big_m) - log_sum, big_m, log_sum, sum_ez / sum_exp])


def _logits_grad_(logits, local_labels, stats, g_lp, g_ent, temperature: float, backend: str):
    """The gradient of ``sum(g_lp * logprob + g_ent * entropy)`` w.r.t. one chunk's logits ``[n, v]``, in the
    logits' dtype (written over ``logits`` on the Triton backend); ``stats`` is ``[3, n]``: ``M, log S, T / S``."""
    if logits.shape[1] == 0:
        return logits
    if backend == "triton":
        from megarl.kernels.triton_logprobs import logits_grad_

        return logits_grad_(logits, local_labels, stats, g_lp, g_ent, temperature)
    big_m, log_sum, mean_shifted = stats.unsqueeze(-1)
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    shifted = z - big_m
    del z
    p = (shifted - log_sum).exp()
    grad = p * (-g_lp).unsqueeze(-1)
    if g_ent is not None:
        grad += p * (mean_shifted - shifted) * g_ent.unsqueeze(-1)
    v = logits.shape[1]
    owns = (local_labels >= 0) & (local_labels < v)
    rows = torch.nonzero(owns).squeeze(-1)
    grad[rows, local_labels[rows]] += g_lp[rows]
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(logits.dtype)
