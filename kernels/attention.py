"""Core attention for megatron-core's layer spec on torch's ``scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the scores ``[b, heads, s, s]`` (and their softmax,
in fp32) and repeats the KV heads for GQA. :class:`SDPAttention` has the same interface and parameters and
hands the heads straight to ``torch.nn.functional.scaled_dot_product_attention``, which picks a fused
backend on the GPU (flash or cuDNN attention for causal masks, memory-efficient attention with an explicit
mask) and never holds the scores; GQA goes through its ``enable_gqa`` (no repeated KV heads).

Masks follow megatron: the layer's causal mask type, or a boolean ``attention_mask`` where True means
"masked out", or the config's sliding window ``(left, right)`` on layers where megatron applies it (a query at
``i`` sees keys ``i - left ... i + right``, and never a later one under a causal mask).

With context parallelism (``context_parallel_size > 1``, which megatron's local attention refuses) the queries,
keys and values are this CP rank's tokens, and attention runs across the CP group
(:func:`kernels.context_parallel.context_parallel_attention`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from kernels.context_parallel import context_parallel_attention


class SDPAttention(DotProductAttention):
    """Drop-in for megatron-core's ``DotProductAttention`` (same constructor, state and checkpoint keys).

    Shapes (``np``/``ng``: query heads / query groups on this TP rank, ``hn``: head dim):
        query: ``[sq, b, np, hn]``; key, value: ``[sk, b, ng, hn]``; output: ``[sq, b, np * hn]``.

    Under context parallelism ``sq`` and ``sk`` are this CP rank's tokens (``s / cp``).

    Raises:
        ValueError: at construction for a softmax type other than "vanilla"; in forward for packed sequences
            or an attention bias (not supported, as in the local spec), or, with CP, a non-causal mask or an
            explicit attention mask.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        # megatron's DotProductAttention asserts context_parallel_size == 1 (CP there is TE's); its state does
        # not depend on CP, so it is built on a shallow copy of the config with CP off
        base_config = copy.copy(config)
        base_config.context_parallel_size = 1
        super().__init__(base_config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.window_size = self.scale_mask_softmax.window_size
        self.cp_group = None
        if config.context_parallel_size > 1:
            from megatron.core import parallel_state

            self.cp_group = (pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp")
                             else parallel_state.get_context_parallel_group())

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor an attention bias")
        sq, b, heads, hn = query.shape
        sk = key.shape[0]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        dropout = self.attention_dropout.p if self.training else 0.0
        if self.cp_group is not None and self.cp_group.size() > 1:
            if not causal or attention_mask is not None:
                raise ValueError("SDPAttention with context parallelism supports the causal mask only (no "
                                 "attention_mask)")
            out = context_parallel_attention(query, key, value, self.cp_group, scale=self.softmax_scale,
                                             window=self.window_size, dropout_p=dropout)
            return out.reshape(sq, b, heads * hn)
        mask = None
        if self.window_size is not None:
            mask = sliding_window_mask(sq, sk, self.window_size, query.device)
        elif attention_mask is not None:
            mask = ~attention_mask
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None and sq > 1,
            scale=self.softmax_scale, enable_gqa=heads != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def sliding_window_mask(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query ``i`` may attend key ``j`` under megatron's sliding window
    ``(left, right)`` (queries aligned to the last keys): ``i' - left <= j <= i' + right`` with
    ``i' = i + sk - sq``; the complement of megatron's ``get_sliding_window_causal_mask``."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return (j >= i - window[0]) & (j <= i + window[1])
