"""Layouts: which rectangular blocks of which canonical (Hugging Face) tensors every rank holds, and where.

Every weight has one canonical, unsharded form, the Hugging Face tensor (``model.layers.3.self_attn.q_proj.
weight``, shape ``[num_heads * head_dim, hidden]``). A :class:`Layout` lists, for each rank, its local tensors
(:class:`LocalTensor`: the engine's or Megatron's own parameter name and shape) and, for each, the
:class:`Block` s of canonical tensors it is made of. Three families of layouts are described here:

- :func:`megatron_layout`: megatron-core ``GPTModel`` on TP x PP x DP (QKV interleaved by query group,
  ``linear_fc1`` = ``[gate_r; up_r]``, row-parallel splits on the input dim, vocab padded and split, layers
  split across PP stages with local numbering, tied embeddings on the first and last stage);
- :func:`vllm_layout`: vLLM's Llama/Qwen2 modules at TP=t' (``qkv_proj`` = ``[q_r; k_r; v_r]`` with KV heads
  replicated when t' > num_kv_heads, ``gate_up_proj``, vocab padded to a multiple of 64 and split evenly,
  ``lm_head`` only when untied);
- :func:`hf_layout`: whole canonical tensors (the transformers engine, HF export).

Tensors are at most 2-D; a block is a box given by its start in the canonical tensor, its start in the local
tensor and its size (one entry per dim).

Layouts sit in ``models`` because loading Hugging Face weights into a Megatron model is itself a layout
change (:mod:`megarl.models.weights`); the reshard's planner and executor (:mod:`megarl.reshard`) build on
them, so ``reshard`` imports ``models`` and never the other way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from megarl.models.megatron import check_layout, padded_vocab_size
from megarl.models.spec import ModelSpec, SpecError
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
    """

    name: str
    shape: tuple[int, ...]
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class Layout:
    """Local tensors of every rank of one role (e.g. the actor's Megatron shards, vLLM's TP shards).

    Attributes:
        kind: "megatron", "vllm" or "hf".
        spec: the model.
        canonical: canonical name -> shape of every tensor the layout covers.
        ranks: global rank -> (local name -> :class:`LocalTensor`).
        key: hashable description (kind, sizes, ranks) used to cache plans.
    """

    kind: str
    spec: ModelSpec
    canonical: dict[str, tuple[int, ...]]
    ranks: dict[int, dict[str, LocalTensor]]
    key: tuple

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
            spec.num_kv_heads, spec.head_dim, spec.ffn_hidden_size, spec.tie_word_embeddings)


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
                          role: str = "actor", use_te: bool = False, padded_vocab: int | None = None
                          ) -> dict[str, LocalTensor]:
    """The local tensors of one Megatron rank (``GPTModel.named_parameters()`` names and shapes).

    Args:
        padded_vocab: Megatron's padded vocab (:func:`megarl.models.megatron.padded_vocab_size`).
    """
    check_layout(spec, mesh)
    t, r = mesh.tp, tp_rank
    h, hd = spec.hidden_size, spec.head_dim
    vp = padded_vocab or padded_vocab_size(spec.vocab_size, t)
    first, last = pp_rank == 0, pp_rank == mesh.pp - 1
    norms = megatron_names(use_te)
    out: list[LocalTensor] = []
    if first:
        out.append(_vocab_shard("model.embed_tokens.weight", "embedding.word_embeddings.weight",
                                spec.vocab_size, vp, t, r, h))
    groups = spec.num_kv_heads // t
    npg = spec.heads_per_group
    per_group = (npg + 2) * hd
    for local_i, i in enumerate(mesh.stage_layers(spec.num_layers, pp_rank)):
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
    return {lt.name: lt for lt in out}


def megatron_layout(spec: ModelSpec, mesh: ParallelLayout, *, ranks: Iterable[int] | None = None,
                    role: str = "actor", use_te: bool = False, padded_vocab: int | None = None) -> Layout:
    """The layout of a Megatron model on ``mesh``; ``ranks[i]`` is the global rank of mesh rank ``i``
    (default: ``0 .. world-1``).

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
        key = (c.tp, c.pp)
        if key not in per_stage:
            per_stage[key] = megatron_rank_tensors(spec, mesh, c.tp, c.pp, role=role, use_te=use_te,
                                                   padded_vocab=padded_vocab)
        out[g] = per_stage[key]
    return Layout("megatron", spec, canonical_shapes(spec, role), out,
                  ("megatron", _shape_key(spec), mesh.tp, mesh.pp, mesh.dp, tuple(ranks), role, use_te,
                   padded_vocab))


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
    if vllm_padded_vocab(spec.vocab_size) % tp:
        raise SpecError(f"vLLM tp={tp} does not divide the padded vocab {vllm_padded_vocab(spec.vocab_size)} "
                        "of embed_tokens")


def vllm_rank_tensors(spec: ModelSpec, tp: int, r: int) -> dict[str, LocalTensor]:
    """The local tensors of vLLM TP rank ``r`` (``model.named_parameters()`` names of vLLM's Llama/Qwen2)."""
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
        out.append(_gate_up(p, p + "mlp.gate_up_proj.weight", spec, tp, r))
        out.append(_row_parallel(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight",
                                 h, spec.ffn_hidden_size, tp, r))
        out.append(_whole(p + "input_layernorm.weight", (h,)))
        out.append(_whole(p + "post_attention_layernorm.weight", (h,)))
    out.append(_whole("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        out.append(_vocab_shard("lm_head.weight", "lm_head.weight", spec.vocab_size, vp, tp, r, h))
    return {lt.name: lt for lt in out}


def vllm_layout(spec: ModelSpec, tp: int, ranks: Iterable[int]) -> Layout:
    """vLLM engines of TP=``tp`` on ``ranks``: engine ``k`` is ``ranks[k*tp:(k+1)*tp]``, its TP rank ``i``
    is ``ranks[k*tp + i]`` (several engines = rollout data parallelism).

    Raises:
        SpecError: the TP does not fit the model (:func:`check_vllm_tp`) or does not divide ``len(ranks)``.
    """
    ranks = list(ranks)
    if len(ranks) % tp:
        raise SpecError(f"vLLM layout: tp={tp} does not divide the {len(ranks)} rollout ranks")
    per_tp = [vllm_rank_tensors(spec, tp, r) for r in range(tp)]
    return Layout("vllm", spec, canonical_shapes(spec), {g: per_tp[i % tp] for i, g in enumerate(ranks)},
                  ("vllm", _shape_key(spec), tp, tuple(ranks)))


# ----------------------------------------------------------------------------------------- HF
def hf_layout(spec: ModelSpec, ranks: Iterable[int], role: str = "actor") -> Layout:
    """Every rank in ``ranks`` holds every canonical tensor whole, under its HF name."""
    shapes = canonical_shapes(spec, role)
    tensors = {n: _whole(n, s) for n, s in shapes.items()}
    ranks = tuple(ranks)
    return Layout("hf", spec, shapes, {g: tensors for g in ranks}, ("hf", _shape_key(spec), ranks, role))
