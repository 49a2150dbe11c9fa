"""Gemma 3's decoder pieces that megatron-core 0.19.2 lacks, for the local layer spec.

Gemma 3 (Gemma Team, "Gemma 3 Technical Report", arXiv 2503.19786, section 2 "Model Architecture"; the
reference is transformers' ``models/gemma3/modeling_gemma3.py``) is a Llama-like decoder with:

- RMSNorm scaling by ``1 + weight`` (weights stored centred at 0): :class:`GemmaRMSNorm`; on every norm, the
  query and key norms (QK-norm, which replaces Gemma 2's attention soft-capping) and the final norm included;
- "sandwich" norms: besides the input and pre-MLP norms, a norm of the attention output and of the MLP output
  before each residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``):
  :class:`Gemma3SelfAttention` and :class:`Gemma3MLP`;
- local sliding-window layers (5 of every 6) with their own RoPE base (10k; 1M on the global layers): megatron's
  ``window_size`` + ``window_attn_skip_freq`` pick the layers and the mask, :class:`Gemma3SelfAttention` turns
  the global RoPE angles into the local ones;
- attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (megatron's ``softmax_scale``), a GeGLU MLP
  (GELU, tanh approximation), embeddings multiplied by ``sqrt(hidden)`` (:func:`scale_embeddings`).

What megatron-core has is used as it is: ``SelfAttention``, ``MLP``, ``TransformerLayer``, the window mask, the
softmax scale. The Transformer Engine spec is not described (its fused norms would need ``zero_centered_gamma``
and these post-norms): :func:`megarl.models.megatron.layer_spec` refuses it for Gemma 3.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.utils import is_layer_window_attention

from megarl.models.spec import ModelSpec, SpecError

gelu_tanh = functools.partial(F.gelu, approximate="tanh")  # transformers' "gelu_pytorch_tanh"


class GemmaRMSNorm(torch.nn.Module):
    """RMSNorm with the scale ``1 + weight`` (Gemma; transformers' ``Gemma3RMSNorm``): ``y = x / sqrt(mean(x^2) +
    eps) * (1 + w)``, computed in float32 and cast back to the input's dtype (transformers' order: the product,
    then the cast). Built as megatron builds its norms (``config``, ``hidden_size``, ``eps``); the weight starts
    at 0 (the identity scale) and, under sequence parallelism, is marked ``sequence_parallel`` so megatron sums
    its gradients over TP as it does for its own norms.

    Shapes:
        input and output: ``[..., hidden_size]``, any float dtype.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3SelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` followed by Gemma's post-attention norm (``post_layernorm``, HF's
    ``post_attention_layernorm``), with the local RoPE base on the sliding-window layers.

    The model's rotary embedding holds the global layers' angles ``p * f_g[i]`` (position ``p``, inverse frequency
    ``f_g``); a local layer multiplies them by ``local_rope_ratio[i] = f_l[i] / f_g[i]`` (float64), which gives
    ``p * f_l[i]`` for whatever positions megatron made them for (CP shares, packed sequences).

    Args:
        local_rope_ratio: ``[head_dim]`` float64, ``f_l / f_g`` as megatron lays the angles out (the half-dim ratio
            twice); None: every layer uses the global angles.
    """

    def __init__(self, config, *args, local_rope_ratio: torch.Tensor | None = None, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, config.layernorm_epsilon)
        local = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.register_buffer("local_rope_ratio", local_rope_ratio if local else None, persistent=False)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if self.local_rope_ratio is not None and rotary_pos_emb is not None:
            ratio = self.local_rope_ratio.to(rotary_pos_emb.device)
            rotary_pos_emb = (rotary_pos_emb.double() * ratio).to(rotary_pos_emb.dtype)
        out, bias = super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return self.post_layernorm(out), bias


class Gemma3MLP(MLP):
    """megatron-core's (GeGLU) ``MLP`` followed by Gemma's post-MLP norm (``post_layernorm``, HF's
    ``post_feedforward_layernorm``)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states, *args, **kwargs):
        out, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(out), bias


def config_kwargs(spec: ModelSpec) -> dict:
    """The ``TransformerConfig`` fields of a Gemma 3 spec: GeGLU, the softmax scale ``query_pre_attn_scalar **
    -0.5``, the window on the local layers only (``window_attn_skip_freq``: 1 = windowed, per layer) and
    ``layernorm_zero_centered_gamma`` (the ``1 + weight`` norms; megatron's own norms read it, ours always do it)."""
    kwargs = dict(activation_func=gelu_tanh, softmax_scale=(spec.query_pre_attn_scalar or spec.head_dim) ** -0.5,
                  layernorm_zero_centered_gamma=True)
    if spec.sliding_window_pattern is not None:
        kwargs.update(window_attn_skip_freq=list(spec.sliding_window_pattern))
    return kwargs


def rope_inv_freqs(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The global and local layers' RoPE inverse frequencies ``[head_dim / 2]`` float32, from transformers' own
    ``Gemma3RotaryEmbedding`` of the spec's config (so scaled global RoPE, e.g. Gemma 3 4B-27B's linear factor 8,
    is computed as transformers computes it).

    Raises:
        SpecError: a RoPE variant that also scales attention (megatron's RoPE would not apply the factor).
    """
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rope = Gemma3RotaryEmbedding(spec.to_hf_config())
    for kind in ("full_attention", "sliding_attention"):
        if getattr(rope, f"{kind}_attention_scaling") != 1.0:
            raise SpecError(f"Gemma 3's {kind} RoPE scales attention by {getattr(rope, f'{kind}_attention_scaling')}; "
                            "megarl supports only RoPE variants that change the frequencies alone")
    return (rope.full_attention_inv_freq.detach().clone().float(),  # plain tensors, not buffers
            rope.sliding_attention_inv_freq.detach().clone().float())


def adapt_layer_spec(layer, spec: ModelSpec) -> None:
    """Make megatron-core's local GPT layer spec (``get_gpt_layer_local_spec(normalization="RMSNorm",
    qk_layernorm=True)``) Gemma 3's, in place: :class:`GemmaRMSNorm` for the input, pre-MLP, query and key norms,
    :class:`Gemma3SelfAttention` (with the local RoPE ratio of :func:`rope_inv_freqs`) and :class:`Gemma3MLP`."""
    subs = layer.submodules
    subs.input_layernorm = subs.pre_mlp_layernorm = GemmaRMSNorm
    attn = subs.self_attention
    attn.submodules.q_layernorm = attn.submodules.k_layernorm = GemmaRMSNorm
    attn.module = Gemma3SelfAttention
    global_f, local_f = (f.double() for f in rope_inv_freqs(spec))
    attn.params = {**attn.params, "local_rope_ratio": torch.cat([local_f / global_f] * 2)}
    subs.mlp = functools.partial(Gemma3MLP.as_mlp_submodule, **subs.mlp.keywords)


def block_spec(layer, config, vp_stage: int | None):
    """The transformer block of this rank's stage (chunk ``vp_stage``): ``layer`` on each of its layers and a
    :class:`GemmaRMSNorm` as the final norm (megatron's default block takes its own norm class)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=GemmaRMSNorm)


def scale_embeddings(model, hidden_size: int) -> None:
    """Multiply the word embeddings' output by ``sqrt(hidden_size)`` in the weights' dtype (transformers'
    ``Gemma3TextScaledWordEmbedding``: in bf16 the factor rounds, e.g. sqrt(3072) = 55.4256 -> 55.5), with a
    forward hook on the first stage's ``model.embedding`` (megatron's embedding has no scale)."""
    if not getattr(model, "pre_process", False):
        return
    scale = torch.tensor(hidden_size ** 0.5, dtype=model.embedding.word_embeddings.weight.dtype)
    model.embedding.register_forward_hook(lambda module, args, out: out * scale.to(out.device))
