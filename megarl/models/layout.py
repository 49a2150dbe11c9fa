"""Layouts: which rectangular blocks of which canonical (Hugging Face) tensors every rank holds, and where.

Every weight has one canonical, unsharded form, the Hugging Face tensor (``model.layers.3.self_attn.q_proj.
weight``, shape ``[num_heads * head_dim, hidden]``). A :class:`Layout` lists, for each rank, its local tensors
(:class:`LocalTensor`: the engine's or Megatron's own parameter name and shape) and, for each, the
:class:`Block` s of canonical tensors it is made of. This module holds that algebra, the block builders the
layouts are written with (:func:`whole`, :func:`rows`, :func:`vocab_shard`, :func:`row_parallel`,
:func:`gate_up`, the experts' :func:`experts_gate_up` / :func:`experts_down`, :func:`shared_expert`) and the
canonical layout itself; the families of layouts:

- :func:`~megarl.models.layout_megatron.megatron_layout`: megatron-core ``GPTModel`` on TP x PP x DP
  (:mod:`megarl.models.layout_megatron`);
- :func:`~megarl.models.layout_vllm.vllm_layout`: vLLM's Llama/Qwen2 modules at TP=t', bf16 or block-FP8
  (:mod:`megarl.models.layout_vllm`);
- :func:`hf_layout` (here): whole canonical tensors (HF export), or the transformers model in memory (the
  transformers engine; ``fused_experts=True``);
- LoRA adapters as canonical tensors, and engine layouts that merge them (:mod:`megarl.models.layout_lora`).

Mixture-of-experts models (:attr:`~megarl.models.spec.ModelSpec.is_moe`) add, per layer: Megatron's router
(replicated) and the ``num_experts / ep`` experts of EP rank ``e`` (``SequentialMLP``: expert ``j`` of the rank is
global expert ``e * num_experts / ep + j``, ``linear_fc1 = [gate; up]``, whole: expert TP = 1), Qwen2-MoE's
shared expert split over TP like a dense MLP; vLLM's fused experts of all ``num_experts`` split over its TP on the
intermediate dim (:func:`~megarl.models.layout_vllm.vllm_rank_tensors`). Fused 3-D expert tensors are described as
their 2-D views (``[experts * rows, cols]``): an engine hands them to the reshard viewed so (:func:`local_views`).

Tensors are at most 2-D; a block is a box given by its start in the canonical tensor, its start in the local
tensor and its size (one entry per dim).

Layouts sit in ``models`` because loading Hugging Face weights into a Megatron model is itself a layout
change (:mod:`megarl.models.weights`); the reshard's planner and executor (:mod:`megarl.reshard`) build on
them, so ``reshard`` imports ``models`` and never the other way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

import torch

from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.lora import Merge
from megarl.models.spec import FAMILIES, ModelSpec, SpecError

VALUE_HEAD = "score.weight"  # the critic's value head, named as in HF *ForSequenceClassification


class Block(NamedTuple):
    """A box of canonical tensor ``name`` placed into a local tensor.

    Attributes:
        name: canonical (HF) tensor name.
        src: start of the box in the canonical tensor, one int per dim.
        dst: start of the box in the local tensor, one int per dim.
        size: extent of the box, one int per dim.
    """

    name: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    @property
    def src_box(self) -> tuple[slice, ...]:
        """The box in the canonical tensor, as slices."""
        return tuple(slice(s, s + n) for s, n in zip(self.src, self.size))

    @property
    def dst_box(self) -> tuple[slice, ...]:
        """The box in the local tensor, as slices."""
        return tuple(slice(s, s + n) for s, n in zip(self.dst, self.size))


@dataclass(frozen=True)
class LocalTensor:
    """One tensor a rank holds: its local name, its shape and the canonical blocks it is made of.

    Elements of the local tensor covered by no block (vocab padding) are not part of the model.

    Attributes:
        scale: for a block-FP8 weight (vLLM's ``quantization: fp8``, :mod:`megarl.models.fp8`): the local name
            of its float32 scale tensor; the tensor itself holds E4M3 values of its blocks' elements, quantised
            per 128 x 128 tile of *this local tensor* (tile ``(i, j)`` covers rows ``[128 i, 128 i + 128)`` and
            columns ``[128 j, 128 j + 128)``, cut at the edges). The scale tensor is a :class:`LocalTensor` of
            its own, of shape :func:`megarl.models.fp8.scale_shape` and without blocks (it is derived from the
            weight, not part of the canonical model). None: the tensor holds the values themselves.
    """

    name: str
    shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    scale: str | None = None


@dataclass(frozen=True)
class Layout:
    """Local tensors of every rank of one role (e.g. the actor's Megatron shards, vLLM's TP shards).

    Attributes:
        kind: "megatron", "vllm" or "hf".
        spec: the model.
        canonical: canonical name -> shape of every tensor the layout covers.
        ranks: global rank -> (local name -> :class:`LocalTensor`).
        key: hashable description (kind, sizes, ranks) used to cache plans.
        merges: global rank -> the LoRA merges its tensors need after the transfers
            (:func:`~megarl.models.layout_lora.with_lora_merge`; their auxiliary tensors are among the rank's local
            tensors, allocated by the executor).
    """

    kind: str
    spec: ModelSpec
    canonical: dict[str, tuple[int, ...]]
    ranks: dict[int, dict[str, LocalTensor]]
    key: tuple
    merges: dict[int, tuple[Merge, ...]] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.key == other.key

    def tensors(self, rank: int) -> dict[str, LocalTensor]:
        """The local tensors of ``rank`` (empty for a rank outside this layout)."""
        return self.ranks.get(rank, {})

    def local_bytes(self, rank: int, element_size: int) -> int:
        """Bytes of all local tensors of ``rank`` at ``element_size`` bytes per element."""
        return sum(math.prod(t.shape) for t in self.tensors(rank).values()) * element_size


def canonical_shapes(spec: ModelSpec, role: str = "actor") -> dict[str, tuple[int, ...]]:
    """Canonical tensors of a role: the HF causal-LM tensors for the actor; for the critic, the trunk plus the
    value head :data:`VALUE_HEAD` ``[1, hidden]`` and no LM head (HF ``*ForSequenceClassification`` names)."""
    shapes = spec.hf_tensor_shapes()
    if role == "critic":
        shapes.pop("lm_head.weight", None)
        shapes[VALUE_HEAD] = (1, spec.hidden_size)
    elif role != "actor":
        raise SpecError(f"role must be 'actor' or 'critic', got {role!r}")
    return shapes


# ----------------------------------------------------------------------------------------- block builders
def shape_key(spec: ModelSpec) -> tuple:
    """The fields of ``spec`` that decide tensor names and shapes: the part of a layout's key that describes
    the model (hashable even where ``spec.rope_scaling`` is a dict, which makes ``hash(spec)`` fail)."""
    return (spec.family, spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_attention_heads,
            spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size, spec.tie_word_embeddings, spec.num_experts,
            spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size, spec.mla, spec.deepseek_moe, spec.glm)


def local_views(params: Mapping[str, torch.Tensor], tensors: Mapping[str, LocalTensor]) -> dict[str, torch.Tensor]:
    """``params`` with each tensor viewed in the shape its layout entry gives (fused 3-D experts
    ``[experts, rows, cols]`` as ``[experts * rows, cols]``; others as they are). The views share storage, so
    writing them writes the parameters.

    Raises:
        SpecError: a tensor whose element count differs from its layout entry's, or one that cannot be viewed.
    """
    out = dict(params)
    for name, lt in tensors.items():
        p = params.get(name)
        if p is not None and tuple(p.shape) != lt.shape:
            if p.numel() != math.prod(lt.shape) or not p.is_contiguous():
                raise SpecError(f"parameter {name!r} of shape {tuple(p.shape)} cannot be viewed as its layout's "
                                f"{lt.shape}")
            out[name] = p.view(lt.shape)
    return out


def experts_gate_up(spec: ModelSpec, layer: int, local: str, experts: range, tp: int, r: int) -> LocalTensor:
    """Experts ``experts`` of ``layer`` fused as ``[gate_r; up_r]`` each (rows of TP rank ``r`` of ``tp``), in
    one tensor of ``len(experts) * 2 * moe_ffn / tp`` rows (vLLM's ``w13_weight`` viewed 2-D, transformers'
    ``gate_up_proj``)."""
    per, h = spec.moe_ffn_hidden_size // tp, spec.hidden_size
    blocks = []
    for j, e in enumerate(experts):
        gate, up, _ = spec.expert_names(layer, e)
        blocks += [rows(gate, r * per, 2 * per * j, per, h), rows(up, r * per, 2 * per * j + per, per, h)]
    return LocalTensor(local, (len(experts) * 2 * per, h), tuple(blocks))


def experts_down(spec: ModelSpec, layer: int, local: str, experts: range, tp: int, r: int) -> LocalTensor:
    """Experts ``experts``' down projections ``[hidden, moe_ffn / tp]`` (input columns of TP rank ``r``) stacked
    in one tensor of ``len(experts) * hidden`` rows (vLLM's ``w2_weight`` viewed 2-D, transformers'
    ``down_proj``)."""
    per, h = spec.moe_ffn_hidden_size // tp, spec.hidden_size
    blocks = tuple(Block(spec.expert_names(layer, e)[2], (0, r * per), (h * j, 0), (h, per))
                   for j, e in enumerate(experts))
    return LocalTensor(local, (len(experts) * h, per), blocks)


def shared_expert(prefix: str, local_prefix: str, spec: ModelSpec, tp: int, r: int, names: tuple[str, ...],
                  block: str = "mlp.shared_expert.") -> list[LocalTensor]:
    """Qwen2-MoE's shared expert (DeepSeek-V3's: ``block="mlp.shared_experts."``) split over TP like a dense MLP
    (``gate_up`` rows, ``down`` columns), and Qwen2-MoE's gate ``[1, hidden]`` whole; ``names`` = the local names of
    (gate_up, down[, gate])."""
    s, h = spec.shared_expert_ffn_hidden_size, spec.hidden_size
    per = s // tp
    src = prefix + block
    out = [LocalTensor(local_prefix + names[0], (2 * per, h), (rows(src + "gate_proj.weight", r * per, 0, per, h),
                                                               rows(src + "up_proj.weight", r * per, per, per, h))),
           row_parallel(src + "down_proj.weight", local_prefix + names[1], h, s, tp, r)]
    return out + [whole(prefix + "mlp.shared_expert_gate.weight", (1, h), local_prefix + n) for n in names[2:]]


def whole(name: str, shape: tuple[int, ...], local: str | None = None) -> LocalTensor:
    """Canonical tensor ``name`` of ``shape`` held whole, under ``local`` (default: its own name)."""
    zeros = (0,) * len(shape)
    return LocalTensor(local or name, shape, (Block(name, zeros, zeros, shape),))


def rows(name: str, start: int, dst: int, n: int, cols: int | None) -> Block:
    """Rows ``[start, start + n)`` of a canonical tensor (all columns when 2-D) at local row ``dst``."""
    if cols is None:
        return Block(name, (start,), (dst,), (n,))
    return Block(name, (start, 0), (dst, 0), (n, cols))


def vocab_shard(name: str, local: str, vocab: int, padded: int, tp: int, r: int, hidden: int) -> LocalTensor:
    """TP rank ``r``'s ``[padded / tp, hidden]`` rows of an embedding padded to ``padded`` rows: the canonical
    rows of ``vocab`` it covers, the padding rows in no block."""
    per = padded // tp
    lo, hi = r * per, min((r + 1) * per, vocab)
    blocks = (Block(name, (lo, 0), (0, 0), (hi - lo, hidden)),) if hi > lo else ()
    return LocalTensor(local, (per, hidden), blocks)


def row_parallel(name: str, local: str, rows: int, cols: int, tp: int, r: int) -> LocalTensor:
    """TP rank ``r``'s input columns ``[r * cols / tp, (r + 1) * cols / tp)`` of a ``[rows, cols]`` weight."""
    per = cols // tp
    return LocalTensor(local, (rows, per), (Block(name, (0, r * per), (0, 0), (rows, per)),))


def gate_up(spec: ModelSpec, layer: int, local: str, tp: int, r: int) -> LocalTensor:
    """Dense layer ``layer``'s gate and up projections fused as ``[gate_r; up_r]`` (rows of TP rank ``r`` of
    ``tp``), cut from their own canonical tensors or from Phi-3's fused ``gate_up_proj``
    (:meth:`~megarl.models.spec.ModelSpec.gate_up_sources`)."""
    per, h = spec.ffn_hidden_size // tp, spec.hidden_size
    (gate, g0), (up, u0) = spec.gate_up_sources(layer)
    return LocalTensor(local, (2 * per, h), (rows(gate, g0 + r * per, 0, per, h), rows(up, u0 + r * per, per, per, h)))


# ----------------------------------------------------------------------------------------- HF
def hf_layout(spec: ModelSpec, ranks: Iterable[int], role: str = "actor", *, fused_experts: bool = False) -> Layout:
    """Every rank in ``ranks`` holds every canonical tensor whole, under its HF name.

    Args:
        fused_experts: describe the transformers model in memory instead of the checkpoint (MoE models):
            transformers 5 holds each layer's experts as ``mlp.experts.gate_up_proj`` ``[experts, 2 * ffn,
            hidden]`` (gate then up) and ``mlp.experts.down_proj`` ``[experts, hidden, ffn]`` (2-D views here) and
            Mixtral's ``block_sparse_moe`` as ``mlp``. The same as the checkpoint for dense models.
    """
    shapes = canonical_shapes(spec, role)
    tensors = {n: whole(n, s) for n, s in shapes.items()}
    if fused_experts and FAMILIES[spec.family].gpt_oss:
        raise SpecError("gpt-oss's transformers model holds its experts transposed and interleaved, which no box of "
                        "its canonical tensors describes: the transformers engine (rollout.engine=hf) cannot take its "
                        "weights from the reshard; use rollout.engine=vllm")
    if fused_experts and spec.is_moe:
        for i in (i for i in range(spec.num_layers) if is_moe_layer(spec, i)):  # DeepSeek-V3: dense first layers
            moe = {n for n in shapes if n.startswith(f"model.layers.{i}.{FAMILIES[spec.family].moe.block}.")
                   and ".experts." in n or n == spec.router_name(i)}
            for n in moe:
                del tensors[n]
            p, experts = f"model.layers.{i}.mlp.", range(spec.num_experts)
            for lt in (whole(spec.router_name(i), (spec.num_experts, spec.hidden_size), p + "gate.weight"),
                       experts_gate_up(spec, i, p + "experts.gate_up_proj", experts, 1, 0),
                       experts_down(spec, i, p + "experts.down_proj", experts, 1, 0)):
                tensors[lt.name] = lt
    ranks = tuple(ranks)
    return Layout("hf", spec, shapes, {g: tensors for g in ranks},
                  ("hf", shape_key(spec), ranks, role, fused_experts and spec.is_moe))
