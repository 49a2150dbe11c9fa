"""Model FLOPs of the RL step's model passes, and the peak rates that MFU divides them by.

Counting (model FLOPs, the numerator of MFU: what the model needs, not what the hardware did; no activation
recomputation, no padding). A decoder-only transformer with ``L`` layers, width ``h``, query width
``q = heads * head_dim``, key/value width ``k = kv_heads * head_dim``, SwiGLU width ``f`` and vocab ``V``
(unpadded) runs one sequence of ``s`` tokens. One multiply-add is 2 FLOPs.

- Weights: ``2 * N_mm * s`` FLOPs forward, with ``N_mm = L * (2*h*q + 2*h*k + 3*h*f) + V_out*h`` the matmul
  weights (Q, K, V, O; gate, up, down; the output layer, ``V_out = V`` for a policy, 1 for a value head). The
  embedding lookup is a gather and biases and norms are elementwise: none is counted. This is the ``2N`` per
  token of Kaplan et al. 2020 (arXiv:2001.08361, table 1) and of PaLM (Chowdhery et al. 2022,
  arXiv:2204.02311, appendix B), with N the matmul parameters. A mixture-of-experts layer counts the weights
  one token computes with (the *active* parameters, as Mixtral's and Qwen3-MoE's "A3B" name them): the router
  ``E*h``, ``top_k`` experts ``3*h*m`` each (expert width ``m``) and the shared expert ``3*h*f_s`` with its gate
  ``h``, in place of ``3*h*f``.
- Causal attention: token ``t`` (0-based) attends to ``t + 1`` positions, and ``Q K^T`` and ``A V`` each cost
  ``q * (t + 1)`` multiply-adds per layer, so a sequence costs ``2 * 2 * L * q * sum_t (t + 1)
  = 2 * L * q * s * (s + 1)`` FLOPs forward. PaLM's appendix B counts ``6 * L * H * Q * T`` FLOPs per token
  (``12 L H Q T`` for training), ``H * Q = q``, over the full ``T x T`` score matrix; a causal mask needs half
  of it, which is what this counts (``12 * L * q * s^2 / 2`` per sequence for training, plus the diagonal).
  With a sliding window of ``w`` tokens on every layer (Mistral, Phi-3-mini) token ``t`` attends to
  ``min(t + 1, w)`` positions: ``sum_t min(t + 1, w) = m (m + 1) / 2 + (s - m) w`` with ``m = min(s, w)``.
  Gemma 3 has the window on its local layers only (``sliding_window_pattern``); its global layers count in full.
- Multi-latent attention (DeepSeek-V3, :mod:`megarl.models.deepseek_spec`): the attention weights are its down,
  up and output projections (``q_proj`` or ``q_a_proj`` + ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``,
  ``o_proj``; the latent is expanded per token as megatron's training path does, not absorbed), and ``Q K^T`` costs
  ``heads * (qk_nope + qk_rope)``, ``A V`` ``heads * v_head_dim`` multiply-adds per position: ``q`` above is their
  mean. Its first ``first_k_dense`` layers count a dense SwiGLU of width ``f``, the others the MoE block (the
  shared experts without a gate).
- Qwen3.5 (:mod:`megarl.models.qwen3_5_spec`): the weights are each layer's projections (the full-attention
  layers' ``q_proj`` yields query and gate, ``2 q`` rows; the DeltaNet's ``in_proj_qkv``, ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``, ``out_proj``; its depthwise ``conv1d`` is not a matmul: not counted); causal
  attention on the full-attention layers only; a DeltaNet layer's recurrence costs, per token and value head,
  ``S^T k``, the rank-1 update of ``S`` and ``S^T q``: ``3 * d_k * d_v`` multiply-adds (the recurrent form,
  Yang et al. 2024, arXiv:2412.06464, eq. 10; the chunked kernel does more, which MFU does not count).
- Training = 3 x forward: the backward pass costs twice the forward (gradients of the inputs and of the
  weights); Narayanan et al. 2021 (Megatron-LM, arXiv:2104.04473, section 5.1: ``72 B s l h^2 (1 + s/(6h) +
  V/(12 l h))``, which is this count for ``f = 4h``, ``k = q = h``, full attention and no recomputation).

MFU = model FLOPs / (seconds * GPUs * peak FLOP/s). The peak is the dense bf16 tensor-core rate of the
device's datasheet (:data:`PEAK_BF16_TFLOPS`); :data:`MEASURED_BF16_TFLOPS` holds what a bf16 matmul on random
data reached on our machines (GPU.md), the ceiling that issue targets are stated against.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.mixer import attention_shapes
from megarl.models.spec import ModelSpec

# Dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets, without sparsity), matched as substrings of
# torch.cuda.get_device_name() in this order (the first match wins).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0), ("GH200", 989.4), ("H200", 989.4), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
    ("H100", 989.4), ("H800", 989.4), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
)
# bf16 matmul on random data, TFLOP/s, measured on our machines (../shared/docs/GPU.md, 2026-11-29).
MEASURED_BF16_TFLOPS: tuple[tuple[str, float], ...] = (("H200", 794.0),)


def matmul_params(spec: ModelSpec, output_rows: int | None = None) -> int:
    """``N_mm``: the matmul weights of the model (see the module docstring), output layer included.

    Args:
        output_rows: rows of the output layer (None = the vocab: a policy; 1 = a value head).
    """
    h = spec.hidden_size
    out = spec.vocab_size if output_rows is None else output_rows

    def attention(i: int) -> int:  # the projections' matrices (MLA's, Qwen3.5's norms 1-D, the conv1d 3-D)
        return sum(math.prod(s) for s in attention_shapes(spec, i).values() if len(s) == 2)

    return sum(attention(i) + ffn_matmul_params(spec, not is_moe_layer(spec, i))
               for i in range(spec.num_layers)) + out * h


def attention_width(spec: ModelSpec) -> float:
    """``q`` of the attention term: the multiply-adds per layer, query and key position of ``Q K^T`` and ``A V``,
    halved (``heads * head_dim``; multi-latent attention: ``heads * (qk_head_dim + v_head_dim) / 2``)."""
    if spec.mla is None:
        return spec.q_size
    return spec.num_attention_heads * (spec.mla.qk_head_dim + spec.mla.v_head_dim) / 2


def ffn_matmul_params(spec: ModelSpec, dense: bool = False) -> int:
    """The FFN weights one token computes with in one layer: ``3*h*f`` (SwiGLU; ``dense``: DeepSeek-V3's first
    layers), or for an MoE layer its active weights ``E*h + top_k*3*h*m + 3*h*f_s + h`` (router, routed experts,
    shared expert and Qwen2-MoE's gate)."""
    h = spec.hidden_size
    if not spec.is_moe or dense:
        return 3 * h * spec.ffn_hidden_size
    gate = h if spec.deepseek_moe is None else 0
    shared = 3 * h * spec.shared_expert_ffn_hidden_size + gate if spec.shared_expert_ffn_hidden_size else 0
    return spec.num_experts * h + spec.moe_top_k * 3 * h * spec.moe_ffn_hidden_size + shared


def forward_flops(spec: ModelSpec, seq_lens: Iterable[int] | torch.Tensor, output_rows: int | None = None
                  ) -> float:
    """Model FLOPs of one forward pass over sequences of the given lengths (causal attention).

    Args:
        spec: the model shape.
        seq_lens: real tokens of each sequence (prompt + response; padding excluded).
        output_rows: rows of the output layer (None = the vocab; 1 for the critic's value head).

    Returns:
        ``sum_i 2 * N_mm * s_i + 2 * L * q * s_i * (s_i + 1)`` FLOPs (float); with a sliding window ``w``,
        ``m_i (m_i + 1) + 2 (s_i - m_i) w`` in place of ``s_i (s_i + 1)``, ``m_i = min(s_i, w)``.

    Raises:
        ValueError: a negative length.
    """
    lens = torch.as_tensor(list(seq_lens) if not isinstance(seq_lens, torch.Tensor) else seq_lens,
                           dtype=torch.float64)
    if (lens < 0).any():
        raise ValueError(f"sequence lengths must be >= 0, got {lens.min().item()}")
    dense = 2.0 * matmul_params(spec, output_rows) * lens.sum()
    seen = lens.clamp(max=spec.sliding_window) if spec.sliding_window is not None else lens
    pairs = seen * (seen + 1) + 2 * (lens - seen) * (spec.sliding_window or 0)  # 2 x sum_t min(t + 1, w)
    attention = 2.0 * spec.num_layers * attention_width(spec) * pairs.sum()
    if spec.sliding_window_pattern is not None:  # Gemma 3: the window on the local layers only
        local = sum(spec.sliding_window_pattern)
        full = (lens * (lens + 1)).sum()
        attention = 2.0 * spec.q_size * (local * pairs.sum() + (spec.num_layers - local) * full)
    if spec.gdn is not None:  # Qwen3.5: causal attention on the full layers, the delta rule's state on the others
        g, linear = spec.gdn, sum(spec.gdn.linear_pattern)
        attention = (2.0 * (spec.num_layers - linear) * spec.q_size * (lens * (lens + 1)).sum()
                     + 6.0 * linear * g.num_value_heads * g.key_head_dim * g.value_head_dim * lens.sum())
    return float(dense + attention)


def train_flops(spec: ModelSpec, seq_lens: Iterable[int] | torch.Tensor, output_rows: int | None = None
                ) -> float:
    """Model FLOPs of one forward + backward pass: 3 x :func:`forward_flops` (no recomputation counted)."""
    return 3.0 * forward_flops(spec, seq_lens, output_rows)


def _lookup(table: tuple[tuple[str, float], ...], device_name: str) -> float | None:
    for key, tflops in table:
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


def device_name() -> str:
    """``torch.cuda.get_device_name()`` of this rank's GPU, or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def peak_bf16_flops(name: str | None = None) -> float | None:
    """The datasheet's dense bf16 peak of device ``name`` (default: this rank's), FLOP/s; None when unknown
    (the CPU, or a GPU missing from :data:`PEAK_BF16_TFLOPS`)."""
    return _lookup(PEAK_BF16_TFLOPS, device_name() if name is None else name)


def measured_bf16_flops(name: str | None = None) -> float | None:
    """The bf16 matmul rate measured on device ``name`` (:data:`MEASURED_BF16_TFLOPS`), FLOP/s, or None."""
    return _lookup(MEASURED_BF16_TFLOPS, device_name() if name is None else name)


def mfu(flops: float, seconds: float, gpus: int, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops / (seconds * gpus * peak_flops)``, a fraction in [0, 1] (None when the
    peak is unknown or no time passed)."""
    if not peak_flops or seconds <= 0:
        return None
    return flops / (seconds * gpus * peak_flops)
