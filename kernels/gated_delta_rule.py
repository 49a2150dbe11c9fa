"""The gated delta rule (Gated DeltaNet's linear attention) and its short causal convolution in torch, with
flash-linear-attention's (``fla``) call signatures: the kernels megatron-core's ``GatedDeltaNet`` calls, for where
``fla``'s Triton kernels are absent (the CPU; :func:`megarl.models.qwen3_next.install_torch_kernels`).

The rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv 2412.06464,
eq. 10), per value head, with a state ``S`` of ``[k_dim, v_dim]`` starting at zero, for each token ``t``:

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - (exp(g_t) * S_{t-1})^T k_t))^T,    o_t = S_t^T (q_t / sqrt(d_k))

:func:`recurrent_gated_delta_rule` runs it token by token; :func:`chunk_gated_delta_rule` in chunks of ``C`` tokens
(the paper's section 3.3, "hardware-efficient chunkwise algorithm"): within a chunk the ``C`` delta updates are the
WY / UT representation, a unit lower-triangular system solved once per chunk, and only the chunk's last state is
carried to the next. Both work in float32 and return the inputs' dtype. Packed documents (``cu_seqlens``) each start
from a zero (or their own initial) state: a state never crosses a document boundary.

Shapes (fla's layout): ``q, k`` ``[b, t, h, d_k]``, ``v`` ``[b, t, h, d_v]``, ``g, beta`` ``[b, t, h]`` (``g`` the
log decay, <= 0), initial and final states ``[n, h, d_k, d_v]`` with ``n`` the batch or, packed, the documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along ``dim`` (fla's ``l2norm``), in float32, returned in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _segments(length: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """The ``[start, end)`` token ranges of the packed documents (one range without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return [(0, length)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != length or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the {length} packed tokens")
    return list(zip(bounds, bounds[1:]))


def _chunked(q, k, v, g, beta, state, chunk_size: int):
    """One batch of sequences, float32, heads first (``q, k`` ``[b, h, t, d_k]``, ``v`` ``[b, h, t, d_v]``, ``g,
    beta`` ``[b, h, t]``, ``state`` ``[b, h, d_k, d_v]``): the outputs ``[b, h, t, d_v]`` and the last state."""
    t = q.shape[2]
    if t == 0:  # an empty packed document: no output, the state unchanged
        return v, state
    pad = (-t) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # padded tokens: no decay, no update, read nothing back
    b, h, n = q.shape[0], q.shape[1], (t + pad) // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, chunk_size) for x in (g, beta))
    gc = g.cumsum(-1)  # log decay from the chunk's start through token i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gc_i - gc_j) for j <= i (what token j's write has decayed to when token i reads)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    # UT transform: (I + tril(diag(beta) K K^T * decay, -1)) W = [diag(beta) V, diag(beta) exp(gc) K]
    system = (kb @ k.transpose(-1, -2)) * decay
    system = system.tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp().unsqueeze(-1)
    k_to_end = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    outs = []
    for c in range(n):
        new = u[:, :, c] - w[:, :, c] @ state  # the part of the values the carried state does not predict
        outs.append(q_decayed[:, :, c] @ state + scores[:, :, c] @ new)
        state = state * gc[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ new
    return torch.stack(outs, 2).reshape(b, h, n * chunk_size, -1)[:, :, :t], state


def _recurrent(q, k, v, g, beta, state):
    """:func:`_chunked`'s inputs and outputs, token by token (the rule as written in the module docstring)."""
    outs = []
    for i in range(q.shape[2]):
        state = state * g[:, :, i, None, None].exp()
        delta = (v[:, :, i] - (state * k[:, :, i].unsqueeze(-1)).sum(-2)) * beta[:, :, i, None]
        state = state + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, :, i].unsqueeze(-1)).sum(-2))
    return (torch.stack(outs, 2) if outs else v), state


def _run(step, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    dtype = v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    if q.shape[2] != v.shape[2]:  # fewer key heads than value heads: each serves a group of consecutive value heads
        q, k = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q * scale, k, v, g, beta))
    b, h, t, dk = k.shape
    segments = _segments(t, cu_seqlens)
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"packed sequences (cu_seqlens) come as one row, got a batch of {b}")
    count = len(segments) if cu_seqlens is not None else b
    state0 = (torch.zeros(count, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
              if initial_state is None else initial_state.float())
    if cu_seqlens is None:
        out, final = step(q, k, v, g, beta, state0)
    else:
        parts = [step(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e], beta[:, :, s:e], state0[i:i + 1])
                 for i, (s, e) in enumerate(segments)]
        out, final = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 0)
    return out.transpose(1, 2).contiguous().to(dtype), (final if output_final_state else None)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64, **_):
    """The gated delta rule in chunks of ``chunk_size`` tokens (fla's ``chunk_gated_delta_rule``).

    Args:
        q, k, v, g, beta: see the module docstring; ``q``/``k`` may have fewer heads than ``v`` (each key head
            serves ``h_v / h_k`` consecutive value heads).
        scale: the queries' factor (default ``d_k ** -0.5``).
        initial_state: ``[n, h, d_k, d_v]`` or None (zeros).
        use_qk_l2norm_in_kernel: L2-normalise queries and keys first (:func:`l2norm`).
        cu_seqlens: ``[n + 1]`` int, the packed documents' boundaries in a batch of one row (None: none).

    Returns:
        ``(o [b, t, h, d_v] in v's dtype, final state [n, h, d_k, d_v] float32 or None)``.

    Raises:
        ValueError: ``cu_seqlens`` not rising from 0 to ``t``, or with a batch of more than one row.
    """
    step = lambda *a: _chunked(*a, chunk_size=chunk_size)  # noqa: E731
    return _run(step, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None, **_):
    """:func:`chunk_gated_delta_rule`'s arguments and results, token by token (fla's
    ``fused_recurrent_gated_delta_rule``): the definition the chunked form is tested against."""
    return _run(_recurrent, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None, **_):
    """A depthwise causal convolution over the tokens (fla's ``causal_conv1d``): ``y[t, c] = act(bias[c] +
    sum_j weight[c, j] * x[t - (w - 1) + j, c])``, tokens before the sequence's (or packed document's) start
    counted as zero.

    Args:
        x: ``[b, t, channels]``; weight: ``[channels, w]``; bias: ``[channels]`` or None.
        activation: "silu" / "swish" or None.
        initial_state / output_final_state: not supported (training runs whole sequences).

    Returns:
        ``(y [b, t, channels] in x's dtype, None)``.

    Raises:
        ValueError: a state asked for, an unknown activation, or bad ``cu_seqlens`` (:func:`chunk_gated_delta_rule`).
    """
    if initial_state is not None or output_final_state:
        raise ValueError("causal_conv1d: the torch kernel runs whole sequences (no initial or final state)")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: activation {activation!r} is not 'silu', 'swish' or None")
    width = weight.shape[-1]

    def conv(seq):  # [b, s, c] -> [b, s, c]
        if seq.shape[1] == 0:
            return seq
        out = F.conv1d(F.pad(seq.transpose(1, 2), (width - 1, 0)), weight.unsqueeze(1), bias, groups=seq.shape[-1])
        return out.transpose(1, 2)

    segments = _segments(x.shape[1], cu_seqlens)
    y = conv(x) if cu_seqlens is None else torch.cat([conv(x[:, s:e]) for s, e in segments], 1)
    if activation is not None:
        y = F.silu(y)
    return y.to(x.dtype), None
