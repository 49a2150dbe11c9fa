"""Core attention for megatron-core's layer spec on torch's ``scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the scores ``[b, heads, s, s]`` (and their softmax,
in fp32) and repeats the KV heads for GQA. :class:`SDPAttention` has the same interface and parameters and
hands the heads straight to ``torch.nn.functional.scaled_dot_product_attention``, which picks a fused
backend on the GPU (flash or cuDNN attention for causal masks, memory-efficient attention with an explicit
mask) and never holds the scores; GQA goes through its ``enable_gqa`` (no repeated KV heads).

Masks follow megatron: the layer's causal mask type, or a boolean ``attention_mask`` where True means
"masked out", or the config's sliding window ``(left, right)`` on layers where megatron applies it (a query at
``i`` sees keys ``i - left ... i + right``, and never a later one under a causal mask).

Packed sequences (a micro-batch of one row of ``t`` tokens, several sequences back to back starting at
``cu_seqlens``; megatron's ``PackedSeqParams``, see :func:`megarl.models.pipeline.packed_seq_params`): causal
attention within each sequence only (a document mask). On CUDA in bf16/fp16 this is FlashAttention's
variable-length kernel (``torch.nn.attention.varlen.varlen_attn``: the sequences' own causal triangles, GQA and
the sliding window native, no mask held); elsewhere (CPU, fp32, attention dropout) ``scaled_dot_product_attention``
with the boolean ``[t, t]`` block-diagonal causal mask: exact, but quadratic in ``t``.

With context parallelism (``context_parallel_size > 1``, which megatron's local attention refuses) the queries,
keys and values are this CP rank's tokens, and attention runs across the CP group
(:func:`megarl.kernels.context_parallel.context_parallel_attention`).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megarl.kernels.context_parallel import context_parallel_attention


class SDPAttention(DotProductAttention):
    """Drop-in for megatron-core's ``DotProductAttention`` (same constructor, state and checkpoint keys).

    Shapes (``np``/``ng``: query heads / query groups on this TP rank, ``hn``: head dim; ``hv``: a value head's,
    ``hn`` but for multi-latent attention, whose ``k_channels`` / ``v_channels`` the constructor takes):
        query: ``[sq, b, np, hn]``; key: ``[sk, b, ng, hn]``; value: ``[sk, b, ng, hv]``; output: ``[sq, b, np * hv]``.

    Packed sequences (``packed_seq_params`` with ``cu_seqlens_q``): ``b = 1`` and ``sq = sk = t``, in the
    ``sbhd`` layout above (``qkv_format="sbhd"``) or megatron's ``thd`` (query ``[t, np, hn]``, key and value
    ``[t, ng, hn]``, output ``[t, np * hn]``). Under context parallelism ``sq`` and ``sk`` are this CP rank's
    tokens (``s / cp``).

    Raises:
        ValueError: at construction for a softmax type other than "vanilla"; in forward for an attention bias
            (not supported, as in the local spec), packed sequences in a batch of more than one row, or, with
            CP, a non-causal mask or an explicit attention mask.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
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
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias")
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
            if packed_seq_params.qkv_format == "thd":
                return self._forward_packed(query, key, value, cu_seqlens)
            if query.shape[1] != 1:
                raise ValueError(f"packed sequences come in one row, got a batch of {query.shape[1]}")
            return self._forward_packed(query[:, 0], key[:, 0], value[:, 0], cu_seqlens).unsqueeze(1)
        sq, b, heads, _ = query.shape
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
            return out.reshape(sq, b, heads * value.shape[-1])
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
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * value.shape[-1])

    def _forward_packed(self, query, key, value, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Causal attention within each packed sequence: ``[t, n, hn]`` -> ``[t, np * hn]``."""
        t, heads, _ = query.shape
        dropout = self.attention_dropout.p if self.training else 0.0
        if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0:
            from torch.nn.attention.varlen import varlen_attn

            left = -1 if self.window_size is None else self.window_size[0]
            cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
            # t bounds every sequence's length: the kernel's grid covers it, blocks past a sequence's end exit
            out = varlen_attn(query, key, value, cu, cu, t, t, scale=self.softmax_scale, window_size=(left, 0))
            return out.reshape(t, heads * value.shape[-1])
        # [t, n, d] -> [1, n, t, d]
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
        mask = document_causal_mask(cu_seqlens.to(query.device), t)
        if self.window_size is not None:
            mask &= sliding_window_mask(t, t, self.window_size, query.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                             scale=self.softmax_scale, enable_gqa=heads != k.shape[1])
        return out.squeeze(0).permute(1, 0, 2).reshape(t, heads * value.shape[-1])


def document_ids(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """``[t]`` int64: the index of the packed sequence each of the ``t`` tokens belongs to (``cu_seqlens
    [n + 1]``: the sequences' starts, then ``t``)."""
    return torch.searchsorted(cu_seqlens[1:].long(), torch.arange(t, device=cu_seqlens.device), right=True)


def document_causal_mask(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """``[t, t]`` bool, True where query ``i`` may attend key ``j``: the same packed sequence and ``j <= i``."""
    doc = document_ids(cu_seqlens, t)
    i = torch.arange(t, device=cu_seqlens.device)
    return (doc.unsqueeze(1) == doc.unsqueeze(0)) & (i.unsqueeze(0) <= i.unsqueeze(1))


def sliding_window_mask(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query ``i`` may attend key ``j`` under megatron's sliding window
    ``(left, right)`` (queries aligned to the last keys): ``i' - left <= j <= i' + right`` with
    ``i' = i + sk - sq``; the complement of megatron's ``get_sliding_window_causal_mask``."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return (j >= i - window[0]) & (j <= i + window[1])
