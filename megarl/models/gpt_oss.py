"""gpt-oss (``GptOssForCausalLM``, model_type ``gpt_oss``): its config, its checkpoint's experts and its megatron-core
configuration.

gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv 2508.10925, section 2.1; the reference is
transformers' ``models/gpt_oss/modeling_gpt_oss.py``) is a mixture-of-experts decoder with:

- attention sinks: a learned logit per query head joins each row's softmax and takes its share of the probability,
  then is dropped (``self_attn.sinks``; megatron-core's ``softmax_type="learnable"``, its ``softmax_offset``);
- biases on q/k/v/o (megatron's ``add_bias_linear`` and ``add_qkv_bias``), on the router and on the experts;
- alternating layers: even layers attend over a band of ``sliding_window`` tokens (128), odd layers over every
  earlier token (``layer_types``; megatron's ``window_size`` + ``window_attn_skip_freq``);
- YaRN RoPE (Peng et al., "YaRN", arXiv 2309.00071): transformers' frequencies, and its attention factor ``m``
  that multiplies cos and sin, so that every score ``q.k`` is scaled by ``m^2``: folded into megatron's
  ``softmax_scale = m^2 / sqrt(head_dim)`` (the sinks are not scaled, as in transformers);
- router: top-k of the logits ``x W^T + b``, softmax over those k (megatron's ``moe_router_pre_softmax=False``);
- experts: ``h = x W1^T + b1`` split into gate ``g`` and linear ``u``, ``g = min(g, 7)``, ``u = clamp(u, -7, 7)``,
  ``y = (g * sigmoid(1.702 g) * (u + 1)) W2^T + b2``, times the routing weight (the bias too): megatron's
  ``quick_gelu`` with ``activation_func_clamp_value=7`` and ``glu_linear_offset=1`` in ``SequentialMLP``'s experts
  (whose ``MLP`` scales the output bias by the routing weight).

The checkpoint holds each layer's experts fused and transposed (transformers' ``GptOssExperts``):
``mlp.experts.gate_up_proj`` ``[E, hidden, 2F]`` with gate and up *interleaved* on the last dim (gate ``j`` in
column ``2j``, up ``j`` in ``2j + 1``), ``gate_up_proj_bias`` ``[E, 2F]`` (interleaved the same way),
``down_proj`` ``[E, F, hidden]`` and ``down_proj_bias`` ``[E, hidden]``. megarl's canonical tensors are one 2-D
tensor per expert and projection in ``nn.Linear`` orientation (:func:`expert_tensors`): ``mlp.experts.{e}.
gate_up_proj.weight`` ``[2F, hidden]`` with gate and up rows still interleaved (as vLLM holds them: one box per
expert and rank; megatron's expert ``linear_fc1`` holds them so too and reorders its output,
:mod:`megarl.models.gpt_oss_layers`), ``down_proj.weight`` ``[hidden, F]``, each with its ``.bias``:
:func:`checkpoint_to_canonical`, :func:`canonical_to_checkpoint` and :func:`read_canonical` convert.

The release checkpoints (openai/gpt-oss-20b, -120b) store the experts in MXFP4 (``*_blocks`` / ``*_scales``);
megarl refuses them with the recipe for a bf16 copy (transformers' ``Mxfp4Config(dequantize=True)``).

The megatron-core configuration and layer spec are :mod:`megarl.models.gpt_oss_layers`'.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from megarl.models.errors import SpecError
from megarl.models.spec_protocol import SpecLike

SWIGLU_ALPHA = 1.702  # transformers' GptOssExperts.alpha: the sigmoid's slope (megatron's quick_gelu)
SWIGLU_LIMIT = 7.0  # transformers' GptOssExperts.limit (config.json's swiglu_limit)

DEQUANTIZE_RECIPE = ("python -c \"import torch, transformers as t; m = t.AutoModelForCausalLM.from_pretrained('IN', "
                     "quantization_config=t.Mxfp4Config(dequantize=True), dtype=torch.bfloat16); "
                     "m.save_pretrained('OUT'); t.AutoTokenizer.from_pretrained('IN').save_pretrained('OUT')\"")


# ---------------------------------------------------------------------------------------------- config
def spec_fields(cfg: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    """The sliding window and the ``sliding_window_pattern`` of a :class:`ModelSpec` from a ``gpt_oss`` config
    (``layer_types``; transformers' default: sliding on even layers, full on odd ones).

    Raises:
        SpecError: the MXFP4 release checkpoint (the recipe for a bf16 copy in the message), no attention bias,
            another ``swiglu_limit`` than 7 (transformers computes with 7 whatever the config says), a layer type
            other than sliding/full, or windowed layers without a ``sliding_window``.
    """
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant is not None:
        raise SpecError(f"model.path: a gpt-oss checkpoint quantised with {quant!r} (the MXFP4 release of "
                        "openai/gpt-oss-20b and -120b) is not supported: megarl trains bf16 weights. Write a bf16 copy "
                        f"with transformers ({DEQUANTIZE_RECIPE}) and set model.path to OUT")
    if not cfg.get("attention_bias", True):
        raise SpecError("attention_bias=false on a gpt_oss model is not supported (gpt-oss's q/k/v/o have biases)")
    if float(cfg.get("swiglu_limit", SWIGLU_LIMIT)) != SWIGLU_LIMIT:
        raise SpecError(f"swiglu_limit={cfg['swiglu_limit']} on a gpt_oss model is not supported: transformers' "
                        f"GptOssExperts clamps at {SWIGLU_LIMIT} whatever the config says")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != layers:
        raise SpecError(f"layer_types={types}: a gpt_oss model has one 'sliding_attention' or 'full_attention' per "
                        f"layer ({layers})")
    pattern = tuple(int(t == "sliding_attention") for t in types)
    window = cfg.get("sliding_window") if any(pattern) else None
    if any(pattern) and not window:
        raise SpecError(f"a gpt_oss config with sliding-window layers (layer_types {types}) needs a sliding_window")
    return window, {"sliding_window_pattern": pattern if any(pattern) else None}


def hf_config_kwargs(spec: SpecLike) -> dict[str, Any]:
    """The ``GptOssConfig`` arguments of a gpt-oss spec beyond the common ones."""
    pattern = spec.sliding_window_pattern or (0,) * spec.num_layers
    return dict(num_local_experts=spec.num_experts, intermediate_size=spec.moe_ffn_hidden_size, attention_bias=True,
                sliding_window=spec.sliding_window or 128, swiglu_limit=SWIGLU_LIMIT, output_router_logits=False,
                layer_types=["sliding_attention" if w else "full_attention" for w in pattern])


def rope_attention_factor(spec: SpecLike) -> float:
    """YaRN's attention factor ``m`` (transformers' ``_compute_yarn_parameters``), 1.0 without YaRN."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if (spec.rope_scaling or {}).get("rope_type") != "yarn":
        return 1.0
    return float(ROPE_INIT_FUNCTIONS["yarn"](spec.to_hf_config(), "cpu")[1])


# ---------------------------------------------------------------------------------------------- checkpoint
def expert_tensors(spec: SpecLike, layer: int, e: int) -> tuple[str, str]:
    """Canonical names of expert ``e``'s ``gate_up_proj.weight`` ``[2F, hidden]`` (gate row ``j`` at ``2j``, up row
    ``j`` at ``2j + 1``) and ``down_proj.weight`` ``[hidden, F]`` on ``layer``; their biases end in ``bias``."""
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_up_proj.weight", p + "down_proj.weight"


def checkpoint_shapes(spec: SpecLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a bf16 gpt-oss checkpoint: the canonical ones, each layer's experts fused
    (``mlp.experts.gate_up_proj`` ``[E, hidden, 2F]``, ``gate_up_proj_bias`` ``[E, 2F]``, ``down_proj`` ``[E, F,
    hidden]``, ``down_proj_bias`` ``[E, hidden]``) in place of the per-expert tensors."""
    e, h, f = spec.num_experts, spec.hidden_size, spec.moe_ffn_hidden_size
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in spec.hf_tensor_shapes().items():
        if ".mlp.experts." not in name:
            out[name] = shape
        elif name.endswith(".experts.0.gate_up_proj.weight"):
            p = name.removesuffix("0.gate_up_proj.weight")
            out.update({p + "gate_up_proj": (e, h, 2 * f), p + "gate_up_proj_bias": (e, 2 * f),
                        p + "down_proj": (e, f, h), p + "down_proj_bias": (e, h)})
    return out


def read_canonical(spec: SpecLike, read: Callable[[str, tuple[slice, ...]], torch.Tensor], name: str,
                   box: tuple[slice, ...] | None) -> torch.Tensor:
    """A box of canonical tensor ``name`` (``None``: all of it) read from a checkpoint through ``read(checkpoint
    name, box of it)``: an expert's weight as the transposed box of the fused tensor (``gate_up_proj.weight`` of
    expert ``e`` is ``gate_up_proj[e].T``, ``down_proj.weight`` ``down_proj[e].T``), its bias as a box of
    ``gate_up_proj_bias[e]`` / ``down_proj_bias[e]``; every other tensor as it is."""
    box = box or tuple(slice(0, n) for n in spec.hf_tensor_shapes()[name])
    if ".mlp.experts." not in name:
        return read(name, box)
    prefix, rest = name.split(".mlp.experts.")
    e, proj, suffix = rest.split(".")
    fused, expert = f"{prefix}.mlp.experts.{proj}", slice(int(e), int(e) + 1)
    if suffix == "bias":
        return read(fused + "_bias", (expert, box[0]))[0]
    return read(fused, (expert, box[1], box[0]))[0].t()


def checkpoint_to_canonical(spec: SpecLike, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical tensors of whole checkpoint (or transformers ``named_parameters()``) tensors ``tensors``
    (:func:`checkpoint_shapes`); copies, contiguous, in ``tensors``' dtypes."""
    return {n: read_canonical(spec, lambda fused, box: tensors[fused][box], n, None).contiguous().clone()
            for n in spec.hf_tensor_shapes()}


def canonical_to_checkpoint(spec: SpecLike, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (:func:`checkpoint_shapes`) of whole canonical tensors ``tensors``: each layer's
    experts stacked (weights transposed) as transformers' ``GptOssExperts`` holds them."""
    out = {}
    for name in checkpoint_shapes(spec):
        if ".mlp.experts." not in name:
            out[name] = tensors[name]
            continue
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        names = [expert_tensors(spec, layer, e)[kind.startswith("down")] for e in range(spec.num_experts)]
        if kind.endswith("_bias"):
            out[name] = torch.stack([tensors[n.removesuffix("weight") + "bias"] for n in names])
        else:
            out[name] = torch.stack([tensors[n].t() for n in names])
    return out
