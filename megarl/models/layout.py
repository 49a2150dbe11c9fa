"""Layouts: which rectangular blocks of which canonical (Hugging Face) tensors every rank holds, and where.

Every weight has one canonical, unsharded form, the Hugging Face tensor (``model.layers.3.self_attn.q_proj.
weight``, shape ``[num_heads * head_dim, hidden]``). A :class:`Layout` lists, for each rank, its local tensors
(:class:`LocalTensor`: the engine's or Megatron's own parameter name and shape) and, for each, the
:class:`Block` s of canonical tensors it is made of. Three families of layouts are described here:

- :func:`megatron_layout`: megatron-core ``GPTModel`` on TP x PP x DP (QKV interleaved by query group,
  ``linear_fc1`` = ``[gate_r; up_r]``, row-parallel splits on the input dim, vocab padded and split, layers
  split across PP stages (and VPP chunks) with local numbering, tied embeddings on the first and last stage);
- :func:`vllm_layout`: vLLM's Llama/Qwen2 modules at TP=t' (``qkv_proj`` = ``[q_r; k_r; v_r]`` with KV heads
  replicated when t' > num_kv_heads, ``gate_up_proj``, vocab padded to a multiple of 64 and split evenly,
  ``lm_head`` only when untied);
- :func:`hf_layout`: whole canonical tensors (HF export), or the transformers model in memory (the transformers
  engine; ``fused_experts=True``).

Mixture-of-experts models (:attr:`~megarl.models.spec.ModelSpec.is_moe`) add, per layer: Megatron's router
(replicated) and the ``num_experts / ep`` experts of EP rank ``e`` (``SequentialMLP``: expert ``j`` of the rank is
global expert ``e * num_experts / ep + j``, ``linear_fc1 = [gate; up]``, whole: expert TP = 1), Qwen2-MoE's
shared expert split over TP like a dense MLP; vLLM's fused experts of all ``num_experts`` split over its TP on the
intermediate dim (:func:`vllm_rank_tensors`). Fused 3-D expert tensors are described as their 2-D views
(``[experts * rows, cols]``): an engine hands them to the reshard viewed so (:func:`local_views`).

Tensors are at most 2-D; a block is a box given by its start in the canonical tensor, its start in the local
tensor and its size (one entry per dim).

LoRA adapters (:mod:`megarl.models.lora`) are canonical tensors too (:func:`lora_targets`): each adapted weight ``W``
(``[rows, cols]``) has ``B`` ``[rows, r]`` named ``<W>.lora_B.weight`` and ``A`` ``[r, cols]``, shared by the
projections that megatron fuses into one layer (``self_attn.qkv_proj.lora_A.weight`` for q, k and v,
``mlp.gate_up_proj.lora_A.weight`` for gate and up; ``<W>.lora_A.weight`` otherwise). A local tensor's adapter
factors follow its blocks: the ``B`` side holds, for each block of ``W`` rows, those rows of ``B``; the ``A`` side,
for each block's columns, those columns of ``A`` (:func:`adapter_tensors`). That describes megatron's adapters
(``lora_b`` split like a column-parallel weight's rows, ``lora_a`` like a row-parallel weight's columns) and, in a
merged destination (:func:`with_lora_merge`), the factors each engine tensor needs to compute its own
``W + (alpha / r) B A`` in place.

Layouts sit in ``models`` because loading Hugging Face weights into a Megatron model is itself a layout
change (:mod:`megarl.models.weights`); the reshard's planner and executor (:mod:`megarl.reshard`) build on
them, so ``reshard`` imports ``models`` and never the other way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

import torch

from megarl.config import QUANTIZATIONS
from megarl.models import fp8
from megarl.models.lora import LoRASpec, Merge
from megarl.models.megatron import check_layout, padded_vocab_size
from megarl.models.spec import FAMILIES, ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
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
        merges: global rank -> the LoRA merges its tensors need after the transfers (:func:`with_lora_merge`;
            their auxiliary tensors are among the rank's local tensors, allocated by the executor).
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


# ----------------------------------------------------------------------------------------- helpers
def _shape_key(spec: ModelSpec) -> tuple:
    """The fields of ``spec`` that decide tensor names and shapes: the part of a layout's key that describes
    the model (hashable even where ``spec.rope_scaling`` is a dict, which makes ``hash(spec)`` fail)."""
    return (spec.family, spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_attention_heads,
            spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size, spec.tie_word_embeddings, spec.num_experts,
            spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size)


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


def _experts_gate_up(spec: ModelSpec, layer: int, local: str, experts: range, tp: int, r: int) -> LocalTensor:
    """Experts ``experts`` of ``layer`` fused as ``[gate_r; up_r]`` each (rows of TP rank ``r`` of ``tp``), in
    one tensor of ``len(experts) * 2 * moe_ffn / tp`` rows (vLLM's ``w13_weight`` viewed 2-D, transformers'
    ``gate_up_proj``)."""
    per, h = spec.moe_ffn_hidden_size // tp, spec.hidden_size
    blocks = []
    for j, e in enumerate(experts):
        gate, up, _ = spec.expert_names(layer, e)
        blocks += [_rows(gate, r * per, 2 * per * j, per, h), _rows(up, r * per, 2 * per * j + per, per, h)]
    return LocalTensor(local, (len(experts) * 2 * per, h), tuple(blocks))


def _experts_down(spec: ModelSpec, layer: int, local: str, experts: range, tp: int, r: int) -> LocalTensor:
    """Experts ``experts``' down projections ``[hidden, moe_ffn / tp]`` (input columns of TP rank ``r``) stacked
    in one tensor of ``len(experts) * hidden`` rows (vLLM's ``w2_weight`` viewed 2-D, transformers'
    ``down_proj``)."""
    per, h = spec.moe_ffn_hidden_size // tp, spec.hidden_size
    blocks = tuple(Block(spec.expert_names(layer, e)[2], (0, r * per), (h * j, 0), (h, per))
                   for j, e in enumerate(experts))
    return LocalTensor(local, (len(experts) * h, per), blocks)


def _shared_expert(prefix: str, local_prefix: str, spec: ModelSpec, tp: int, r: int, names: tuple[str, str, str]
                   ) -> list[LocalTensor]:
    """Qwen2-MoE's shared expert split over TP like a dense MLP (``gate_up`` rows, ``down`` columns), and its
    gate ``[1, hidden]`` whole; ``names`` = the local names of (gate_up, down, gate)."""
    s, h = spec.shared_expert_ffn_hidden_size, spec.hidden_size
    per = s // tp
    src = prefix + "mlp.shared_expert."
    return [LocalTensor(local_prefix + names[0], (2 * per, h), (_rows(src + "gate_proj.weight", r * per, 0, per, h),
                                                                _rows(src + "up_proj.weight", r * per, per, per, h))),
            _row_parallel(src + "down_proj.weight", local_prefix + names[1], h, s, tp, r),
            _whole(prefix + "mlp.shared_expert_gate.weight", (1, h), local_prefix + names[2])]


def _whole(name: str, shape: tuple[int, ...], local: str | None = None) -> LocalTensor:
    zeros = (0,) * len(shape)
    return LocalTensor(local or name, shape, (Block(name, zeros, zeros, shape),))


def _rows(name: str, start: int, dst: int, n: int, cols: int | None) -> Block:
    """Rows ``[start, start + n)`` of a canonical tensor (all columns when 2-D) at local row ``dst``."""
    if cols is None:
        return Block(name, (start,), (dst,), (n,))
    return Block(name, (start, 0), (dst, 0), (n, cols))


def _vocab_shard(name: str, local: str, vocab: int, padded: int, tp: int, r: int, hidden: int) -> LocalTensor:
    per = padded // tp
    lo, hi = r * per, min((r + 1) * per, vocab)
    blocks = (Block(name, (lo, 0), (0, 0), (hi - lo, hidden)),) if hi > lo else ()
    return LocalTensor(local, (per, hidden), blocks)


def _row_parallel(name: str, local: str, rows: int, cols: int, tp: int, r: int) -> LocalTensor:
    per = cols // tp
    return LocalTensor(local, (rows, per), (Block(name, (0, r * per), (0, 0), (rows, per)),))


def _gate_up(prefix: str, local: str, spec: ModelSpec, tp: int, r: int) -> LocalTensor:
    per, h = spec.ffn_hidden_size // tp, spec.hidden_size
    return LocalTensor(local, (2 * per, h), (_rows(prefix + "mlp.gate_proj.weight", r * per, 0, per, h),
                                             _rows(prefix + "mlp.up_proj.weight", r * per, per, per, h)))


# ----------------------------------------------------------------------------------------- Megatron
def megatron_names(use_te: bool = False) -> dict[str, str]:
    """Per-layer Megatron parameter names (local numbering) of the layer norms for the local or TE spec."""
    if use_te:
        return {"input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_weight"}
    return {"input_layernorm": "input_layernorm.weight", "pre_mlp_layernorm": "pre_mlp_layernorm.weight"}


def megatron_rank_tensors(spec: ModelSpec, mesh: ParallelLayout, tp_rank: int, pp_rank: int, *,
                          role: str = "actor", use_te: bool = False, padded_vocab: int | None = None,
                          ep_rank: int = 0, lora: LoRASpec | None = None, moe_experts: str = "grouped"
                          ) -> dict[str, LocalTensor]:
    """The local tensors of one Megatron rank (``GPTModel.named_parameters()`` names and shapes).

    With VPP (``mesh.vpp > 1``) the rank holds ``vpp`` model chunks, chunk ``c`` the layers of virtual stage
    ``c * pp + pp_rank`` (:meth:`~megarl.parallel.mesh.ParallelLayout.chunk_layers`) numbered from 0 within the
    chunk; its names carry the prefix ``"{c}."`` (:func:`megarl.models.checkpoint.chunk_parameters`). The word
    embeddings sit on chunk 0 of the first pipeline rank, the final norm and output layer on the last chunk of
    the last.

    Args:
        padded_vocab: Megatron's padded vocab (:func:`megarl.models.megatron.padded_vocab_size`).
        ep_rank: the rank's expert-parallel rank (:meth:`ParallelLayout.ep_rank`; MoE models): it holds experts
            ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` of every layer.
        lora: the adapters of a LoRA actor: each adapted layer's ``lora_a`` and ``lora_b`` beside its weight
            (:func:`adapter_tensors`).
        moe_experts: the local spec's routed experts, "grouped" or "sequential" (the model's
            ``megarl_moe_experts``: :func:`~megarl.models.megatron.layer_spec`), which name them.

    Raises:
        SpecError: the mesh does not fit the model (:func:`~megarl.models.megatron.check_layout`).
    """
    check_layout(spec, mesh)
    targets = lora_targets(spec, lora) if lora is not None else {}
    out: list[LocalTensor] = []
    for c, layers in enumerate(mesh.chunk_layers(spec.num_layers, pp_rank)):
        prefix = f"{c}." if mesh.vpp > 1 else ""
        first = pp_rank == 0 and c == 0
        last = pp_rank == mesh.pp - 1 and c == mesh.vpp - 1
        for lt in _megatron_chunk_tensors(spec, mesh, tp_rank, layers, first, last, role=role, use_te=use_te,
                                          padded_vocab=padded_vocab, ep_rank=ep_rank, moe_experts=moe_experts):
            out.append(LocalTensor(prefix + lt.name, lt.shape, lt.blocks))
            if any(b.name in targets for b in lt.blocks):
                base = out[-1].name.removesuffix("weight")
                a, b, _ = adapter_tensors(out[-1], targets, lora.rank, base + "lora_a", base + "lora_b")
                out += [a, b]
    return {lt.name: lt for lt in out}


def _megatron_chunk_tensors(spec: ModelSpec, mesh: ParallelLayout, tp_rank: int, layers: range, first: bool,
                            last: bool, *, role: str, use_te: bool, padded_vocab: int | None, ep_rank: int,
                            moe_experts: str) -> list[LocalTensor]:
    """The tensors of one model chunk (a rank's stage without VPP) holding decoder ``layers``, named as its
    ``GPTModel`` names them; ``first`` / ``last``: it is the first / last (virtual) pipeline stage."""
    t, r = mesh.tp, tp_rank
    h, hd = spec.hidden_size, spec.head_dim
    vp = padded_vocab or padded_vocab_size(spec.vocab_size, t)
    norms = megatron_names(use_te)
    out: list[LocalTensor] = []
    if first:
        out.append(_vocab_shard("model.embed_tokens.weight", "embedding.word_embeddings.weight",
                                spec.vocab_size, vp, t, r, h))
    groups = spec.num_kv_heads // t
    npg = spec.heads_per_group
    per_group = (npg + 2) * hd
    for local_i, i in enumerate(layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local_i}."
        for suffix, cols in (("weight", h), ("bias", None)):
            if suffix == "bias" and not spec.qkv_bias:
                continue
            blocks = []
            for j in range(groups):
                g = r * groups + j
                base = j * per_group
                blocks.append(_rows(hf + f"self_attn.q_proj.{suffix}", g * npg * hd, base, npg * hd, cols))
                blocks.append(_rows(hf + f"self_attn.k_proj.{suffix}", g * hd, base + npg * hd, hd, cols))
                blocks.append(_rows(hf + f"self_attn.v_proj.{suffix}", g * hd, base + (npg + 1) * hd, hd, cols))
            shape = (groups * per_group, h) if cols else (groups * per_group,)
            out.append(LocalTensor(mg + f"self_attention.linear_qkv.{suffix}", shape, tuple(blocks)))
        out.append(_row_parallel(hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight",
                                 h, spec.q_size, t, r))
        out.append(_whole(hf + "input_layernorm.weight", (h,), mg + norms["input_layernorm"]))
        if spec.qk_norm:
            out.append(_whole(hf + "self_attn.q_norm.weight", (hd,), mg + "self_attention.q_layernorm.weight"))
            out.append(_whole(hf + "self_attn.k_norm.weight", (hd,), mg + "self_attention.k_layernorm.weight"))
        if spec.is_moe:
            out.append(_whole(hf + "post_attention_layernorm.weight", (h,), mg + "pre_mlp_layernorm.weight"))
            out.extend(_megatron_moe(spec, mesh, i, mg + "mlp.", r, ep_rank, use_te, moe_experts))
            continue
        out.append(_whole(hf + "post_attention_layernorm.weight", (h,), mg + norms["pre_mlp_layernorm"]))
        out.append(_gate_up(hf, mg + "mlp.linear_fc1.weight", spec, t, r))
        out.append(_row_parallel(hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight",
                                 h, spec.ffn_hidden_size, t, r))
    if last:
        out.append(_whole("model.norm.weight", (h,), "decoder.final_layernorm.weight"))
        if role == "critic":
            out.append(_whole(VALUE_HEAD, (1, h), "output_layer.weight"))
        elif not spec.tie_word_embeddings:
            out.append(_vocab_shard("lm_head.weight", "output_layer.weight", spec.vocab_size, vp, t, r, h))
        elif not first:  # tied, PP > 1: the last stage keeps its own copy of the word embeddings
            out.append(_vocab_shard("model.embed_tokens.weight", "output_layer.weight",
                                    spec.vocab_size, vp, t, r, h))
    return out


def _megatron_moe(spec: ModelSpec, mesh: ParallelLayout, layer: int, mg: str, tp_rank: int, ep_rank: int,
                  use_te: bool = False, moe_experts: str = "grouped") -> list[LocalTensor]:
    """One MoE layer's tensors on a Megatron rank: the router, the rank's local experts (whole: expert TP = 1;
    the local spec's :class:`~megarl.kernels.grouped_experts.GroupedExperts` stacks them in ``linear_fc1.weight`` and
    ``linear_fc2.weight``, its ``SequentialMLP`` names them ``local_experts.{j}.linear_fc1.weight``, TE's
    ``TEGroupedMLP`` ``linear_fc1.weight{j}``) and the shared expert (split over TP)."""
    per_rank = spec.num_experts // mesh.ep
    out = [_whole(spec.router_name(layer), (spec.num_experts, spec.hidden_size), mg + "router.weight")]
    first = ep_rank * per_rank
    if use_te:
        stacks = [(f"experts.linear_fc1.weight{j}", f"experts.linear_fc2.weight{j}", range(first + j, first + j + 1))
                  for j in range(per_rank)]
    elif moe_experts == "grouped":
        stacks = [("experts.linear_fc1.weight", "experts.linear_fc2.weight", range(first, first + per_rank))]
    else:
        stacks = [(f"experts.local_experts.{j}.linear_fc1.weight", f"experts.local_experts.{j}.linear_fc2.weight",
                   range(first + j, first + j + 1)) for j in range(per_rank)]
    for fc1, fc2, experts in stacks:
        out.append(_experts_gate_up(spec, layer, mg + fc1, experts, 1, 0))
        out.append(_experts_down(spec, layer, mg + fc2, experts, 1, 0))
    if spec.shared_expert_ffn_hidden_size:
        out.extend(_shared_expert(f"model.layers.{layer}.", mg + "shared_experts.", spec, mesh.tp, tp_rank,
                                  ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")))
    return out


def megatron_layout(spec: ModelSpec, mesh: ParallelLayout, *, ranks: Iterable[int] | None = None,
                    role: str = "actor", use_te: bool = False, padded_vocab: int | None = None,
                    lora: LoRASpec | None = None, moe_experts: str = "grouped") -> Layout:
    """The layout of a Megatron model on ``mesh``; ``ranks[i]`` is the global rank of mesh rank ``i``
    (default: ``0 .. world-1``). Weights are replicated over DP and CP: the DP and CP peers of a rank hold the
    same blocks (the reshard planner may read either). ``lora``: a LoRA actor's adapters too; ``moe_experts``: the
    local spec's routed experts (:func:`megatron_rank_tensors`).

    Raises:
        SpecError: the mesh does not fit the model, or ``ranks`` has the wrong length.
    """
    ranks = list(range(mesh.world_size)) if ranks is None else list(ranks)
    if len(ranks) != mesh.world_size:
        raise SpecError(f"megatron layout: {len(ranks)} ranks given for a mesh of {mesh.world_size}")
    per_stage = {}
    out = {}
    for i, g in enumerate(ranks):
        c = mesh.coords(i)
        key = (c.tp, c.pp, mesh.ep_rank(i))
        if key not in per_stage:
            per_stage[key] = megatron_rank_tensors(spec, mesh, c.tp, c.pp, role=role, use_te=use_te,
                                                   padded_vocab=padded_vocab, ep_rank=key[2], lora=lora,
                                                   moe_experts=moe_experts)
        out[g] = per_stage[key]
    canonical = {**canonical_shapes(spec, role), **(lora_canonical_shapes(spec, lora) if lora else {})}
    return Layout("megatron", spec, canonical, out,
                  ("megatron", _shape_key(spec), mesh.tp, mesh.pp, mesh.dp, mesh.ep, tuple(ranks), role, use_te,
                   padded_vocab, mesh.cp, mesh.vpp, lora, moe_experts))


# ----------------------------------------------------------------------------------------- vLLM
# Checked against vLLM 0.24.0's source (vllm/model_executor/...; read 2026-11-29, the version GPU.md pins):
# - layers/vocab_parallel_embedding.py: VocabParallelEmbedding.__init__ pads the vocab with pad_vocab_size(
#   vocab, DEFAULT_VOCAB_PADDING_SIZE=64) (no added LoRA vocab for Llama/Qwen2: org_vocab_size == vocab) and gives
#   every TP rank divide(padded, tp) rows; _get_indices puts rank r on rows [r * padded/tp, (r+1) * padded/tp)
#   clipped to org_vocab_size; weight_loader copies those canonical rows to the shard's first rows and zero-fills
#   the rest. The reshard leaves padding rows untouched: layers/logits_processor.py cuts logits to
#   org_vocab_size, so they are never read. ParallelLMHead shards the same way.
# - layers/linear.py: QKVParallelLinear.__init__ has num_heads = divide(total_heads, tp) and, when
#   tp >= total_kv_heads, one KV head per rank with num_kv_head_replicas = divide(tp, total_kv_heads), else
#   divide(total_kv_heads, tp) heads; weight_loader places q, k, v at offsets 0, q, q + kv and takes KV heads
#   from shard_rank = tp_rank // num_kv_head_replicas. MergedColumnParallelLinear (gate_up_proj, output_sizes
#   [ffn, ffn]) places each half's rank-r slice at sum(output_sizes[:i]) // tp. RowParallelLinear (o_proj,
#   down_proj) splits the input dim.
# - models/llama.py and models/qwen2.py: the attention asserts heads % tp == 0 and kv % tp == 0 or tp % kv == 0;
#   with tie_word_embeddings, LlamaForCausalLM ties lm_head to embed_tokens' Parameter (ParallelLMHead.
#   tie_weights) and Qwen2ForCausalLM sets lm_head = model.embed_tokens, so named_parameters() lists only
#   model.embed_tokens.weight; load_weights maps q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj.
def vllm_padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocab: a multiple of 64 (``pad_vocab_size(vocab, DEFAULT_VOCAB_PADDING_SIZE)``)."""
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def check_vllm_tp(spec: ModelSpec, tp: int) -> None:
    """Check that vLLM can shard ``spec`` at TP=``tp``.

    Raises:
        SpecError: naming the tensor and the sizes that do not divide.
    """
    if spec.num_attention_heads % tp:
        raise SpecError(f"vLLM tp={tp} does not divide the query heads of qkv_proj: "
                        f"num_attention_heads={spec.num_attention_heads}")
    if tp >= spec.num_kv_heads and tp % spec.num_kv_heads:
        raise SpecError(f"vLLM tp={tp} is neither a divisor nor a multiple of num_kv_heads={spec.num_kv_heads} "
                        "(k/v heads of qkv_proj cannot be split or replicated evenly)")
    if tp < spec.num_kv_heads and spec.num_kv_heads % tp:
        raise SpecError(f"vLLM tp={tp} does not divide num_kv_heads={spec.num_kv_heads} (qkv_proj)")
    if spec.ffn_hidden_size % tp:
        raise SpecError(f"vLLM tp={tp} does not divide gate_up_proj: ffn_hidden_size={spec.ffn_hidden_size}")
    if spec.is_moe and (tp > spec.num_experts or spec.moe_ffn_hidden_size % tp):
        raise SpecError(f"vLLM tp={tp} must be <= num_experts={spec.num_experts} and divide the experts' "
                        f"moe_intermediate_size={spec.moe_ffn_hidden_size} (w13_weight, w2_weight)")
    if spec.shared_expert_ffn_hidden_size % tp:
        raise SpecError(f"vLLM tp={tp} does not divide the shared expert's shared_expert_intermediate_size="
                        f"{spec.shared_expert_ffn_hidden_size}")
    if vllm_padded_vocab(spec.vocab_size) % tp:
        raise SpecError(f"vLLM tp={tp} does not divide the padded vocab {vllm_padded_vocab(spec.vocab_size)} "
                        "of embed_tokens")


FP8_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# vLLM 0.24.0's block-FP8 linear layers (model_executor/layers/quantization/fp8.py, Fp8LinearMethod with
# weight_block_size [128, 128], read 2026-12-02): create_weights registers `weight` (float8_e4m3fn
# [out_per_partition, in_per_partition]) and `weight_scale_inv` (float32 [ceil(out / 128), ceil(in / 128)]) and
# calls utils/fp8_utils.py validate_fp8_block_shape, which raises unless (a) a row-parallel layer split over TP
# (input_size // input_per_partition == tp > 1) has input_per_partition % 128 == 0, and (b) a layer split over TP
# on its output (output_size // sum(partitions) == tp > 1) has every output partition % 128 == 0, a merged layer
# (QKV, gate/up) that is not such a split every partition but the last. Embeddings, the LM head and norms stay
# in the model dtype (VocabParallelEmbedding is no LinearBase); MoE experts take another method (Fp8MoEMethod).
def check_vllm_fp8(spec: ModelSpec, tp: int) -> None:
    """Check that vLLM 0.24 can serve ``spec`` at TP=``tp`` with block-FP8 weights (vLLM's rules above).

    Raises:
        SpecError: naming the layer and the size that 128 does not divide, or an MoE model.
    """
    check_vllm_tp(spec, tp)
    if spec.is_moe:
        raise SpecError("block-FP8 rollouts are described for dense models only (vLLM's Fp8MoEMethod lays the "
                        "experts out otherwise); use rollout.quantization=null for an MoE model")
    hd, b = spec.head_dim, fp8.BLOCK
    kv_local = 1 if tp >= spec.num_kv_heads else spec.num_kv_heads // tp
    merged = {"qkv_proj": ([spec.q_size // tp, kv_local * hd, kv_local * hd], spec.q_size + 2 * spec.num_kv_heads * hd),
              "gate_up_proj": ([spec.ffn_hidden_size // tp] * 2, 2 * spec.ffn_hidden_size)}
    for layer, (parts, total) in merged.items():
        checked = parts if tp > 1 and total // sum(parts) == tp else parts[:-1]
        for size in checked:
            if size % b:
                raise SpecError(f"vLLM tp={tp} with block-FP8 weights: an output partition of {layer} has {size} "
                                f"rows, not a multiple of the {b}-row quantisation block (partitions {parts})")
    if tp > 1:
        for layer, cols in (("o_proj", spec.q_size), ("down_proj", spec.ffn_hidden_size)):
            if (cols // tp) % b:
                raise SpecError(f"vLLM tp={tp} with block-FP8 weights: {layer} holds {cols // tp} input columns "
                                f"a rank, not a multiple of the {b}-column quantisation block")


def _block_fp8(out: list[LocalTensor]) -> list[LocalTensor]:
    """``out`` with the weights of :data:`FP8_LINEARS` marked block-FP8 and their scale tensors added."""
    quantised = []
    for lt in out:
        if lt.name.endswith(".weight") and lt.name.removesuffix(".weight").endswith(FP8_LINEARS):
            scale = lt.name.removesuffix("weight") + "weight_scale_inv"
            quantised += [LocalTensor(lt.name, lt.shape, lt.blocks, scale),
                          LocalTensor(scale, fp8.scale_shape(lt.shape), ())]
        else:
            quantised.append(lt)
    return quantised


def vllm_rank_tensors(spec: ModelSpec, tp: int, r: int, quantization: str | None = None) -> dict[str, LocalTensor]:
    """The local tensors of vLLM TP rank ``r`` (``model.named_parameters()`` names of vLLM's Llama/Qwen2).

    Args:
        quantization: None (the model dtype) or "fp8": the four linear weights of every layer block-FP8
            (:attr:`LocalTensor.scale`), each with its ``weight_scale_inv`` (:func:`check_vllm_fp8`).

    Raises:
        SpecError: the TP (or FP8 at this TP) does not fit the model, or an unknown quantization.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise SpecError(f"quantization must be null or one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "fp8":
        check_vllm_fp8(spec, tp)
    check_vllm_tp(spec, tp)
    h, hd = spec.hidden_size, spec.head_dim
    vp = vllm_padded_vocab(spec.vocab_size)
    q_heads = spec.num_attention_heads // tp
    if tp >= spec.num_kv_heads:
        kv_heads, kv_first = 1, r // (tp // spec.num_kv_heads)
    else:
        kv_heads = spec.num_kv_heads // tp
        kv_first = r * kv_heads
    out = [_vocab_shard("model.embed_tokens.weight", "model.embed_tokens.weight", spec.vocab_size, vp, tp, r, h)]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for suffix, cols in (("weight", h), ("bias", None)):
            if suffix == "bias" and not spec.qkv_bias:
                continue
            q, kv = q_heads * hd, kv_heads * hd
            blocks = (_rows(p + f"self_attn.q_proj.{suffix}", r * q, 0, q, cols),
                      _rows(p + f"self_attn.k_proj.{suffix}", kv_first * hd, q, kv, cols),
                      _rows(p + f"self_attn.v_proj.{suffix}", kv_first * hd, q + kv, kv, cols))
            shape = (q + 2 * kv, h) if cols else (q + 2 * kv,)
            out.append(LocalTensor(p + f"self_attn.qkv_proj.{suffix}", shape, blocks))
        out.append(_row_parallel(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight",
                                 h, spec.q_size, tp, r))
        if spec.qk_norm:
            out += [_whole(p + "self_attn.q_norm.weight", (hd,)), _whole(p + "self_attn.k_norm.weight", (hd,))]
        if spec.is_moe:
            out.extend(_vllm_moe(spec, i, tp, r))
        else:
            out.append(_gate_up(p, p + "mlp.gate_up_proj.weight", spec, tp, r))
            out.append(_row_parallel(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight",
                                     h, spec.ffn_hidden_size, tp, r))
        out.append(_whole(p + "input_layernorm.weight", (h,)))
        out.append(_whole(p + "post_attention_layernorm.weight", (h,)))
    out.append(_whole("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        out.append(_vocab_shard("lm_head.weight", "lm_head.weight", spec.vocab_size, vp, tp, r, h))
    if quantization == "fp8":
        out = _block_fp8(out)
    return {lt.name: lt for lt in out}


# MoE, read in vLLM 0.24.0's source (the wheel of GPU.md's list, 2026-12-01):
# - models/qwen3_moe.py, qwen2_moe.py: Qwen{3,2}MoeSparseMoeBlock registers, in this order, `gate`
#   (ReplicatedLinear [num_experts, hidden]), for Qwen2-MoE `shared_expert_gate` (ReplicatedLinear [1, hidden]) and
#   `shared_expert` (Qwen2MoeMLP: MergedColumnParallelLinear `gate_up_proj` [2 * shared / tp, hidden],
#   RowParallelLinear `down_proj` [hidden, shared / tp]), then `experts = FusedMoE(...)`. models/mixtral.py:
#   MixtralMoE is the layer's `block_sparse_moe` with `gate` and `experts` the same way (checkpoint names w1/w3/w2).
#   Qwen3MoeAttention has `q_norm`/`k_norm` (RMSNorm [head_dim]).
# - layers/fused_moe/layer.py: FusedMoE(...) returns a MoERunner holding `routed_experts` (RoutedExperts, after
#   `gate` and `shared_expert_gate`, which the block registered first, so named_parameters() lists them under the
#   block's names); fused_moe_make_expert_params_mapping maps checkpoint experts to
#   `experts.routed_experts.w13_weight` / `w2_weight` (routed_experts_prefix="routed_experts").
# - layers/fused_moe/unquantized_fused_moe_method.py create_weights: w13_weight [num_experts, 2 *
#   intermediate_size_per_partition, hidden], w2_weight [num_experts, hidden, intermediate_size_per_partition].
# - layers/fused_moe/routed_experts.py weight_loader: without expert parallelism every rank holds all experts
#   (local id = global id); w1 (gate) and w3 (up) are narrowed on dim 0 to rows [r * I/tp, (r+1) * I/tp) and go to
#   rows [0, I/tp) and [I/tp, 2 I/tp) of w13_weight[e]; w2 (down) is narrowed on its input dim (dim 1).
# - layers/fused_moe/oracle/unquantized.py: on SM90 (H200) the Triton backend comes first and keeps that layout;
#   FlashInfer CUTLASS would swap to [w3; w1] after loading (convert_to_unquantized_kernel_format), so the GPU
#   check (perf/gpu_moe.sh) compares vLLM's own load_weights result with the reshard's.
# vLLM's expert parallelism (enable_expert_parallel) is not described here: every engine rank holds all experts.
def _vllm_moe(spec: ModelSpec, layer: int, tp: int, r: int) -> list[LocalTensor]:
    block = f"model.layers.{layer}.{FAMILIES[spec.family].moe.block}."
    experts = range(spec.num_experts)
    out = [_whole(spec.router_name(layer), (spec.num_experts, spec.hidden_size), block + "gate.weight"),
           _experts_gate_up(spec, layer, block + "experts.routed_experts.w13_weight", experts, tp, r),
           _experts_down(spec, layer, block + "experts.routed_experts.w2_weight", experts, tp, r)]
    if spec.shared_expert_ffn_hidden_size:
        out.extend(_shared_expert(f"model.layers.{layer}.", block, spec, tp, r,
                                  ("shared_expert.gate_up_proj.weight", "shared_expert.down_proj.weight",
                                   "shared_expert_gate.weight")))
    return out


def vllm_layout(spec: ModelSpec, tp: int, ranks: Iterable[int], quantization: str | None = None) -> Layout:
    """vLLM engines of TP=``tp`` on ``ranks``: engine ``k`` is ``ranks[k*tp:(k+1)*tp]``, its TP rank ``i``
    is ``ranks[k*tp + i]`` (several engines = rollout data parallelism); ``quantization`` as in
    :func:`vllm_rank_tensors`.

    Raises:
        SpecError: the TP (or FP8 at this TP) does not fit the model (:func:`check_vllm_tp`,
            :func:`check_vllm_fp8`) or does not divide ``len(ranks)``.
    """
    ranks = list(ranks)
    if len(ranks) % tp:
        raise SpecError(f"vLLM layout: tp={tp} does not divide the {len(ranks)} rollout ranks")
    per_tp = [vllm_rank_tensors(spec, tp, r, quantization) for r in range(tp)]
    return Layout("vllm", spec, canonical_shapes(spec), {g: per_tp[i % tp] for i, g in enumerate(ranks)},
                  ("vllm", _shape_key(spec), tp, tuple(ranks), quantization))


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
    tensors = {n: _whole(n, s) for n, s in shapes.items()}
    if fused_experts and spec.is_moe:
        for i in range(spec.num_layers):
            moe = {n for n in shapes if n.startswith(f"model.layers.{i}.{FAMILIES[spec.family].moe.block}.")
                   and ".experts." in n or n == spec.router_name(i)}
            for n in moe:
                del tensors[n]
            p, experts = f"model.layers.{i}.mlp.", range(spec.num_experts)
            for lt in (_whole(spec.router_name(i), (spec.num_experts, spec.hidden_size), p + "gate.weight"),
                       _experts_gate_up(spec, i, p + "experts.gate_up_proj", experts, 1, 0),
                       _experts_down(spec, i, p + "experts.down_proj", experts, 1, 0)):
                tensors[lt.name] = lt
    ranks = tuple(ranks)
    return Layout("hf", spec, shapes, {g: tensors for g in ranks},
                  ("hf", _shape_key(spec), ranks, role, fused_experts and spec.is_moe))


# ----------------------------------------------------------------------------------------- LoRA
def lora_targets(spec: ModelSpec, lora: LoRASpec) -> dict[str, tuple[str, str]]:
    """Every weight that ``lora`` adapts, by canonical name, with its adapter's canonical ``(A, B)`` names (module
    docstring): q/k/v share ``self_attn.qkv_proj.lora_A.weight``, gate/up ``<mlp>.gate_up_proj.lora_A.weight``
    (one per expert, and the shared expert's), ``o_proj`` / ``down_proj`` have their own.

    Raises:
        SpecError: ``lora.experts`` on a dense model.
    """
    if lora.experts and not spec.is_moe:
        raise SpecError(f"LoRA on the experts (experts=true) needs a mixture-of-experts model; a {spec.family} "
                        "model has none")
    out: dict[str, tuple[str, str]] = {}
    want = set(lora.target_modules)

    def own(w: str) -> None:
        out[w] = (w.removesuffix("weight") + "lora_A.weight", w.removesuffix("weight") + "lora_B.weight")

    def shared(ws: tuple[str, ...], a_name: str) -> None:
        for w in ws:
            out[w] = (a_name, w.removesuffix("weight") + "lora_B.weight")

    def mlp(prefix: str, gate: str, up: str, down: str) -> None:
        if "linear_fc1" in want:
            shared((gate, up), prefix + "gate_up_proj.lora_A.weight")
        if "linear_fc2" in want:
            own(down)

    for i in range(spec.num_layers):
        p = f"model.layers.{i}.self_attn."
        if "linear_qkv" in want:
            shared(tuple(p + f"{x}_proj.weight" for x in "qkv"), p + "qkv_proj.lora_A.weight")
        if "linear_proj" in want:
            own(p + "o_proj.weight")
        m = f"model.layers.{i}.mlp."
        if not spec.is_moe:
            mlp(m, m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight")
            continue
        if spec.shared_expert_ffn_hidden_size:
            s = m + "shared_expert."
            mlp(s, s + "gate_proj.weight", s + "up_proj.weight", s + "down_proj.weight")
        if lora.experts:
            for e in range(spec.num_experts):
                gate, up, down = spec.expert_names(i, e)
                mlp(gate.rsplit(".", 2)[0] + ".", gate, up, down)
    return out


def lora_canonical_shapes(spec: ModelSpec, lora: LoRASpec) -> dict[str, tuple[int, int]]:
    """Canonical name -> shape of every adapter factor: ``A`` ``[r, cols]`` and ``B`` ``[rows, r]`` of each
    adapted weight ``[rows, cols]`` (:func:`lora_targets`)."""
    shapes = spec.hf_tensor_shapes()
    out: dict[str, tuple[int, int]] = {}
    for w, (a, b) in lora_targets(spec, lora).items():
        rows, cols = shapes[w]
        out[a] = (lora.rank, cols)
        out[b] = (rows, lora.rank)
    return out


def parameter_counts(spec: ModelSpec, lora: LoRASpec | None) -> dict[str, int]:
    """``{"model", "adapters", "trainable"}``: the base model's parameters, the LoRA adapters' (0 without), and
    those an update trains (the adapters with LoRA, else every weight), counted once over any layout."""
    adapters = sum(math.prod(s) for s in lora_canonical_shapes(spec, lora).values()) if lora else 0
    return {"model": spec.num_params(), "adapters": adapters, "trainable": adapters if lora else spec.num_params()}


def adapter_tensors(lt: LocalTensor, targets: Mapping[str, tuple[str, str]], rank: int, a_name: str, b_name: str
                    ) -> tuple[LocalTensor, LocalTensor, list[Merge]]:
    """The adapter factors that a local tensor made of adapted weights' blocks holds (module docstring).

    Returns:
        ``(A side, B side, merges)``: ``a_name`` ``[slots * rank, cols]`` holding each block's columns of its
        weight's ``A`` (one slot of ``rank`` rows per distinct ``A``), ``b_name`` ``[rows, rank]`` holding each
        block's rows of its ``B``, and one :class:`Merge` per block (scale 1: :func:`with_lora_merge` sets it).
        Identical blocks (q, k and v's shared ``A``) are listed once.

    Raises:
        SpecError: ``lt`` is not 2-D, or two blocks of different adapted weights share rows.
    """
    if len(lt.shape) != 2:
        raise SpecError(f"LoRA: local tensor {lt.name!r} {lt.shape} is not a 2-D weight")
    slots: dict[str, int] = {}
    a_blocks: dict[tuple, Block] = {}
    b_blocks: dict[tuple, Block] = {}
    merges: list[Merge] = []
    for blk in lt.blocks:
        if blk.name not in targets:
            continue
        a, b = targets[blk.name]
        slot = slots.setdefault(a, len(slots))
        (r0, c0), (d0, d1), (n0, n1) = blk.src, blk.dst, blk.size
        ab = Block(a, (0, c0), (slot * rank, d1), (rank, n1))
        bb = Block(b, (r0, 0), (d0, 0), (n0, rank))
        a_blocks.setdefault((ab.src, ab.dst, ab.name), ab)
        if any(o.dst[0] < d0 + n0 and d0 < o.dst[0] + o.size[0] for o in b_blocks.values()):
            raise SpecError(f"LoRA: blocks of {lt.name!r} share rows; its B rows cannot be laid out")
        b_blocks[(bb.src, bb.dst, bb.name)] = bb
        merges.append(Merge(lt.name, b_name, a_name, (d0, n0), (d1, n1), slot * rank, rank, 1.0))
    return (LocalTensor(a_name, (len(slots) * rank, lt.shape[1]), tuple(a_blocks.values())),
            LocalTensor(b_name, (lt.shape[0], rank), tuple(b_blocks.values())), merges)


def with_lora_merge(dst: Layout, lora: LoRASpec) -> Layout:
    """``dst`` (an engine's layout) receiving merged weights ``W + (alpha / r) B A``: each local tensor made of
    adapted weights gets two auxiliary tensors (``<name>:lora_a``, ``<name>:lora_b``, :func:`adapter_tensors`)
    that the reshard fills with the rows of ``B`` and the columns of ``A`` its blocks need, besides its own
    ``W`` blocks, and the merges that then write it (:attr:`Layout.merges`, run by the executor). No rank
    receives more of the adapters than its own tensors' rows and columns (and a whole factor where its tensor
    is whole along it).

    Raises:
        SpecError: from :func:`lora_targets` / :func:`adapter_tensors`.
    """
    targets = lora_targets(dst.spec, lora)
    per_dict: dict[int, tuple[dict[str, LocalTensor], tuple[Merge, ...]]] = {}
    ranks, merges = {}, {}
    for g, tensors in dst.ranks.items():
        if id(tensors) not in per_dict:
            out, ops = dict(tensors), []
            for lt in tensors.values():
                if len(lt.shape) == 2 and any(b.name in targets for b in lt.blocks):
                    a, b, m = adapter_tensors(lt, targets, lora.rank, f"{lt.name}:lora_a", f"{lt.name}:lora_b")
                    out.update({a.name: a, b.name: b})
                    ops += [op._replace(scale=lora.scale) for op in m]
            per_dict[id(tensors)] = (out, tuple(ops))
        ranks[g], merges[g] = per_dict[id(tensors)]
    return Layout(dst.kind, dst.spec, {**dst.canonical, **lora_canonical_shapes(dst.spec, lora)}, ranks,
                  dst.key + ("lora-merged", lora), merges)


def adapter_layout(spec: ModelSpec, lora: LoRASpec, ranks: Iterable[int]) -> Layout:
    """Every rank in ``ranks`` holds every adapter factor whole under its canonical name (the adapter-only
    weight sync to vLLM, whose LoRA layers cut their own TP shards; the PEFT export)."""
    shapes = lora_canonical_shapes(spec, lora)
    tensors = {n: _whole(n, s) for n, s in shapes.items()}
    ranks = tuple(ranks)
    return Layout("hf", spec, shapes, {g: tensors for g in ranks}, ("lora-adapters", _shape_key(spec), ranks, lora))
