"""Core attention for megatron-core's layer spec on torch's ``scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the scores ``[b, heads, s, s]`` (and their softmax,
in fp32) and repeats the KV heads for GQA. :class:`SDPAttention` has the same interface and parameters and
hands the heads straight to ``torch.nn.functional.scaled_dot_product_attention``, which picks a fused
backend on the GPU (flash or cuDNN attention for causal masks, memory-efficient attention with an explicit
mask) and never holds the scores; GQA goes through its ``enable_gqa`` (no repeated KV heads).

Masks follow megatron: the layer's causal mask type, or a boolean ``attention_mask`` where True means
"masked out", or the config's sliding window ``(left, right)`` on layers where megatron applies it (a query at
``i`` sees keys ``i - left ... i + right``, and never a later one under a causal mask).

Packed sequences (megatron's ``PackedSeqParams`` with ``qkv_format="thd"``: one row of ``t`` tokens, several
sequences back to back, starting at ``cu_seqlens``): causal attention within each sequence only (a document
mask). On CUDA this runs torch's FlexAttention (``torch.nn.attention.flex_attention``, compiled) with a
document block mask, so blocks of keys that no query of a block may see are skipped, and the cost is that of
the sequences' own causal triangles, not of ``t x t``; the block mask is built once per packed row
(``cu_seqlens``) and reused by every layer. Elsewhere (CPU, no FlexAttention, or attention dropout, which
FlexAttention lacks) it is ``scaled_dot_product_attention`` with the boolean ``[t, t]`` block-diagonal causal
mask, which computes every score: exact, but quadratic in ``t``.
"""

from __future__ import annotations

from typing import Optional

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Drop-in for megatron-core's ``DotProductAttention`` (same constructor, state and checkpoint keys).

    Shapes (``np``/``ng``: query heads / query groups on this TP rank, ``hn``: head dim):
        query: ``[sq, b, np, hn]``; key, value: ``[sk, b, ng, hn]``; output: ``[sq, b, np * hn]``.

    Packed sequences (``packed_seq_params.qkv_format == "thd"``, as megatron's ``Attention`` hands them):
        query ``[t, np, hn]``; key, value ``[t, ng, hn]``; output ``[t, np * hn]``.

    Raises:
        ValueError: at construction for a softmax type other than "vanilla"; in forward for packed sequences
            in a format other than "thd", or an attention bias (not supported, as in the local spec).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        if config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.window_size = self.scale_mask_softmax.window_size

    def forward(self, query, key, value, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"SDPAttention supports packed sequences in qkv_format 'thd' only, got "
                                 f"{packed_seq_params.qkv_format!r}")
            return self._forward_thd(query, key, value, packed_seq_params.cu_seqlens_q)
        sq, b, heads, hn = query.shape
        sk = key.shape[0]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        mask = None
        if self.window_size is not None:
            mask = sliding_window_mask(sq, sk, self.window_size, query.device)
        elif attention_mask is not None:
            mask = ~attention_mask
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None and sq > 1,
            scale=self.softmax_scale, enable_gqa=heads != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _forward_thd(self, query, key, value, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Causal attention within each packed sequence: ``[t, n, hn]`` -> ``[t, np * hn]``."""
        t, heads, hn = query.shape
        # [t, n, d] -> [1, n, t, d]
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
        gqa = heads != k.shape[1]
        dropout = self.attention_dropout.p if self.training else 0.0
        flex = _compiled_flex_attention() if query.is_cuda and dropout == 0.0 else None
        if flex is not None:
            window = None if self.window_size is None else tuple(self.window_size)
            block_mask = _document_block_mask(cu_seqlens, t, window)
            out = flex(q, k, v, block_mask=block_mask, scale=self.softmax_scale, enable_gqa=gqa)
        else:
            mask = document_causal_mask(cu_seqlens, t)
            if self.window_size is not None:
                mask &= sliding_window_mask(t, t, self.window_size, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 scale=self.softmax_scale, enable_gqa=gqa)
        return out.squeeze(0).permute(1, 0, 2).reshape(t, heads * hn)


def document_ids(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """``[t]`` int64: the index of the packed sequence each of the ``t`` tokens belongs to (``cu_seqlens
    [n + 1]``: the sequences' starts, then ``t``)."""
    return torch.searchsorted(cu_seqlens[1:].long(), torch.arange(t, device=cu_seqlens.device), right=True)


def document_causal_mask(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """``[t, t]`` bool, True where query ``i`` may attend key ``j``: the same packed sequence and ``j <= i``."""
    doc = document_ids(cu_seqlens, t)
    i = torch.arange(t, device=cu_seqlens.device)
    return (doc.unsqueeze(1) == doc.unsqueeze(0)) & (i.unsqueeze(0) <= i.unsqueeze(1))


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    """torch's ``flex_attention``, compiled (its fused kernel); None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention)  # dynamic shapes after the first recompile: packed rows vary in length


@functools.lru_cache(maxsize=8)
def _document_block_mask(cu_seqlens: torch.Tensor, t: int, window: tuple[int, int] | None):
    """FlexAttention's block mask of :func:`document_causal_mask` (and the sliding window) for one packed row;
    cached by the ``cu_seqlens`` tensor itself (every layer of a forward receives the same one)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(cu_seqlens, t)

    def mask_mod(b, h, q, kv):
        keep = (doc[q] == doc[kv]) & (kv <= q)
        if window is not None:
            keep = keep & (kv >= q - window[0])
        return keep

    return create_block_mask(mask_mod, None, None, t, t, device=cu_seqlens.device)


def sliding_window_mask(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query ``i`` may attend key ``j`` under megatron's sliding window
    ``(left, right)`` (queries aligned to the last keys): ``i' - left <= j <= i' + right`` with
    ``i' = i + sk - sq``; the complement of megatron's ``get_sliding_window_causal_mask``."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    return (j >= i - window[0]) & (j <= i + window[1])
