"""Qwen3.5's hybrid decoder (:mod:`megarl.models.qwen3_5_spec`) on megatron-core's modules: its ``GatedDeltaNet``
(``megatron/core/ssm/gated_delta_net``) on the linear-attention layers, its ``SelfAttention`` with the output gate
(``attention_output_gate``), QK-norm and partial RoPE (``rotary_percent``) on the full-attention layers, both in
megatron's ``TransformerLayer`` with the local spec's dense MLP.

megatron-core's ``GatedDeltaNet`` calls flash-linear-attention's (``fla``) Triton kernels, and refuses to build
without them; where ``fla`` does not import or there is no GPU, :func:`install_torch_kernels` hands it megarl's torch kernels
(:mod:`megarl.kernels.gated_delta_rule`, same signatures) instead, and :class:`HybridGatedDeltaNet` runs its fused
helpers uncompiled. The parameters are megatron's either way: ``in_proj`` (rows ``[q; k; v; z; beta; alpha]`` of this
TP rank's heads), ``conv1d`` (depthwise over ``[q; k; v]``), ``dt_bias``, ``A_log``, ``out_norm`` and ``out_proj``.

Norms: Qwen3.5's ``1 + weight`` RMSNorms are :class:`~megarl.models.gemma3.GemmaRMSNorm` (input, pre-MLP, query, key
and final norms); the DeltaNet's output norm is a plain RMSNorm (:class:`GatedOutputNorm`; megatron multiplies it by
``silu(z)``). Transformer Engine's spec is not described (refused by :func:`megarl.models.megatron.layer_spec`).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                           copy_to_tensor_model_parallel_region)
from megatron.core.transformer.spec_utils import ModuleSpec

from megarl.models.gemma3 import GemmaRMSNorm
from megarl.models.spec import ModelSpec


def install_torch_kernels() -> None:
    """Where ``fla`` is absent or there is no GPU (its kernels are Triton's), give megatron-core's gated DeltaNet
    megarl's torch kernels (its ``l2norm``, ``causal_conv1d`` and ``chunk_gated_delta_rule``); a no-op on a GPU
    where ``fla`` imports."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    from megarl.kernels import gated_delta_rule as torch_kernels

    if common.HAVE_FLA and torch.cuda.is_available() and not getattr(common, "megarl_torch_kernels", False):
        return
    common.HAVE_FLA, common.megarl_torch_kernels = True, True
    common.l2norm = torch_kernels.l2norm
    gdn.causal_conv1d = torch_kernels.causal_conv1d
    gdn.chunk_gated_delta_rule = torch_kernels.chunk_gated_delta_rule


def _uncompiled(fn):
    return getattr(fn, "_torchdynamo_orig_callable", fn)


class HybridGatedDeltaNet(GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` as a ``TransformerLayer``'s self-attention: it accepts (and ignores) the
    attention-only ``pp_layer_offset`` argument, keeps packed sequences apart (:meth:`forward`), and off the GPU
    runs its ``torch.compile``-d helpers as plain functions (no C++ compiler needed)."""

    def __init__(self, config, submodules, layer_number=None, pp_layer_offset=None, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)

    def forward(self, hidden_states, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        """megatron's forward; packed sequences given in megarl's ``sbhd`` form (one row, ``cu_seqlens`` for the
        attention's document mask: :func:`megarl.models.pipeline.packed_seq_params`) go to megatron's ``thd`` path,
        the one where the convolution and the state restart at each sequence's start."""
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd" and \
                packed_seq_params.cu_seqlens_q is not None:
            packed_seq_params = dataclasses.replace(packed_seq_params, qkv_format="thd")
        return super().forward(hidden_states, attention_mask, *args, packed_seq_params=packed_seq_params, **kwargs)

    if not torch.cuda.is_available():
        _apply_gated_norm = _uncompiled(GatedDeltaNet._apply_gated_norm)
        _prepare_input_for_gated_delta_rule = _uncompiled(GatedDeltaNet._prepare_input_for_gated_delta_rule)
        _compute_g_and_beta = _uncompiled(GatedDeltaNet._compute_g_and_beta)


class GatedOutputNorm(torch.nn.Module):
    """The DeltaNet's output RMSNorm (transformers' ``Qwen3_5RMSNormGated`` before its gate): ``y = w * (x /
    sqrt(mean(x^2) + eps))``, normalised in float32, the product in the input's dtype; the weight starts at 1 and its
    gradient is summed over TP in the backward (the ranks' heads share it).

    Shapes: input and output ``[..., value_head_dim]``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each TP rank normalises its own heads with the one weight: its gradient is the sum over TP (megatron's
        # copy_to_tensor_model_parallel_region: the identity forward, an all-reduce of the gradient backward)
        weight = copy_to_tensor_model_parallel_region(self.weight)
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def config_kwargs(spec: ModelSpec) -> dict:
    """The ``TransformerConfig`` fields of a Qwen3.5 spec: the attention's output gate and the DeltaNet's shape."""
    g = spec.gdn
    return dict(attention_output_gate=True, linear_conv_kernel_dim=g.conv_kernel, linear_key_head_dim=g.key_head_dim,
                linear_value_head_dim=g.value_head_dim, linear_num_key_heads=g.num_key_heads,
                linear_num_value_heads=g.num_value_heads, linear_attention_freq=list(g.linear_pattern),
                layernorm_zero_centered_gamma=True)


def adapt_layer_spec(layer) -> None:
    """Make megatron-core's local GPT layer spec (``qk_layernorm=True``) Qwen3.5's full-attention layer, in place:
    :class:`~megarl.models.gemma3.GemmaRMSNorm` for the input, pre-MLP, query and key norms."""
    subs = layer.submodules
    subs.input_layernorm = subs.pre_mlp_layernorm = GemmaRMSNorm
    attn = subs.self_attention.submodules
    attn.q_layernorm = attn.k_layernorm = GemmaRMSNorm


def block_spec(layer, config, vp_stage: int | None, spec: ModelSpec):
    """The transformer block of this rank's stage (chunk ``vp_stage``): ``layer`` (the full-attention layer of
    :func:`adapt_layer_spec`) where the pattern has a 0, the same layer with :class:`HybridGatedDeltaNet` as its
    mixer where it has a 1, and the ``1 + weight`` final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    install_torch_kernels()
    linear = copy.deepcopy(layer)
    linear.submodules.self_attention = ModuleSpec(module=HybridGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm, out_proj=RowParallelLinear))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    pattern = spec.gdn.linear_pattern[offset:offset + count]
    return TransformerBlockSubmodules(layer_specs=[linear if x else layer for x in pattern], layer_norm=GemmaRMSNorm)


def check_layout(spec: ModelSpec, layout) -> None:
    """Refuse the layouts a Qwen3.5 model cannot run on: TP not dividing the DeltaNet's key heads (megatron-core
    shards whole heads, and the convolution and ``in_proj`` with them), and context parallelism (megatron's gated
    DeltaNet has its own all-to-all CP, which megarl does not drive; the full-attention layers would need the
    ``sdpa`` attention, which has no output gate).

    Raises:
        SpecError: naming the size and the sizes that fit.
    """
    from megarl.models.errors import SpecError

    g = spec.gdn
    if g.num_key_heads % layout.tp or g.num_value_heads % layout.tp:
        raise SpecError(f"tp={layout.tp} does not divide the gated DeltaNet's linear_num_key_heads={g.num_key_heads} "
                        f"and linear_num_value_heads={g.num_value_heads}; TP sizes that fit: "
                        f"{[t for t in range(1, g.num_key_heads + 1) if g.num_key_heads % t == 0]}")
    if layout.cp > 1:
        raise SpecError(f"cp={layout.cp}: context parallelism with Qwen3.5's linear attention is not supported (the "
                        "DeltaNet's state runs through the whole sequence); set cp=1")
