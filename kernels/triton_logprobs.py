"""Triton kernels of :mod:`megarl.kernels.chunked_logprobs`: one chunk's softmax statistics and logits gradient.

Each program walks one token's row of logits ``[V]`` (the model dtype) in blocks, in fp32 (``V``, this rank's
real vocab rows, is a compile-time constant: one compilation per model):

- :func:`softmax_stats` reads the row once (online softmax, Milakov & Gimelshein 2018, "Online normalizer
  calculation for softmax") and writes ``m = max z``, ``s = sum exp(z - m)``, ``t = sum exp(z - m)(z - m)``
  with ``z = logits / temperature``;
- :func:`logits_grad_` overwrites the row with ``d/dlogits`` of ``g * logprob + h * entropy`` (see
  :mod:`megarl.kernels.chunked_logprobs` for the formula), so the backward needs no buffer beside the logits.

Both run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the CPU tests check them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _stats_kernel(logits_ptr, m_ptr, s_ptr, t_ptr, stride, inv_temp, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    m = tl.full((), -1e30, tl.float32)  # finite, so that (m_old - m_new) * s is 0 before the first block
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        shifted = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(shifted), 0.0)
        t = alpha * (t + (m - m_new) * s) + tl.sum(e * shifted, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(t_ptr + row, t)


@triton.jit
def _grad_kernel(logits_ptr, label_ptr, big_m_ptr, log_sum_ptr, mean_ptr, g_ptr, h_ptr, stride, inv_temp,
                 V: tl.constexpr, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    label = tl.load(label_ptr + row)
    big_m = tl.load(big_m_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    g = tl.load(g_ptr + row)
    if HAS_ENTROPY:
        mean_shifted = tl.load(mean_ptr + row)
        h = tl.load(h_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        shifted = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp - big_m
        p = tl.exp(shifted - log_sum)
        grad = tl.where(cols == label, g, 0.0) - g * p
        if HAS_ENTROPY:
            grad += h * p * (mean_shifted - shifted)
        grad = grad * inv_temp
        tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def softmax_stats(logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(m, s, t)`` of ``z = logits / temperature``, each ``[n]`` fp32.

    Args:
        logits: ``[n, v]`` with unit stride along ``v``, ``v >= 1``; any float dtype.
    """
    n, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocab")
    m, s, t = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
    if n:
        _stats_kernel[(n,)](logits, m, s, t, logits.stride(0), 1.0 / temperature, V=v, BLOCK=min(BLOCK, _pow2(v)))
    return m, s, t


def logits_grad_(logits: torch.Tensor, local_labels: torch.Tensor, stats: torch.Tensor, g_lp: torch.Tensor,
                 g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Overwrite ``logits`` ``[n, v]`` with the gradient of ``sum(g_lp * logprob + g_ent * entropy)`` w.r.t.
    them and return it.

    Args:
        local_labels: ``[n]`` int64 label index within this slice (outside ``[0, v)``: another rank's).
        stats: ``[3, n]`` fp32 ``M, log S, T / S`` of the whole (all-TP) distribution.
        g_lp / g_ent: ``[n]`` fp32 upstream gradients of log-prob and entropy (``g_ent`` None: no entropy).
    """
    n, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocab")
    if n:
        stats = stats.contiguous()
        _grad_kernel[(n,)](logits, local_labels.contiguous(), stats[0], stats[1], stats[2], g_lp.contiguous(),
                           g_lp if g_ent is None else g_ent.contiguous(), logits.stride(0), 1.0 / temperature,
                           V=v, HAS_ENTROPY=g_ent is not None, BLOCK=min(BLOCK, _pow2(v)))
    return logits


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())
