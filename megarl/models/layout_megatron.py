"""The layout of a megatron-core ``GPTModel`` on TP x PP x DP (:func:`megatron_layout`,
:func:`megatron_rank_tensors`), in the algebra of :mod:`megarl.models.layout`.

QKV interleaved by query group, ``linear_fc1`` = ``[gate_r; up_r]``, row-parallel splits on the input dim, vocab
padded and split, layers split across PP stages (and VPP chunks) with local numbering, tied embeddings on the
first and last stage; Gemma 3's post-attention and post-MLP norms as ``self_attention.post_layernorm`` and
``mlp.post_layernorm`` (:mod:`megarl.models.gemma3`). Mixture-of-experts layers hold the router (replicated), the
``num_experts / ep`` experts of EP rank ``e`` (whole: expert TP = 1) and Qwen2-MoE's shared expert split over TP
like a dense MLP. A LoRA actor's adapters sit beside the weights they adapt
(:func:`megarl.models.layout_lora.adapter_tensors`).
"""

from __future__ import annotations

from typing import Iterable

from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.layout import (VALUE_HEAD, Block, Layout, LocalTensor, canonical_shapes, experts_down,
                                  experts_gate_up, gate_up, row_parallel, rows, shape_key, shared_expert, vocab_shard,
                                  whole)
from megarl.models.layout_lora import adapter_tensors, lora_canonical_shapes, lora_targets
from megarl.models.lora import LoRASpec
from megarl.models.qwen3_5_spec import QWEN3_NEXT
from megarl.models import gpt_oss
from megarl.models.megatron import check_layout, padded_vocab_size
from megarl.models.spec import FAMILIES, ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout


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
            (:func:`~megarl.models.layout_lora.adapter_tensors`).
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
        out.append(vocab_shard("model.embed_tokens.weight", "embedding.word_embeddings.weight",
                                spec.vocab_size, vp, t, r, h))
    groups = spec.num_kv_heads // t
    npg = spec.heads_per_group
    per_group = (npg + 2) * hd
    for local_i, i in enumerate(layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local_i}."
        if spec.gdn is not None:
            out.extend(_qwen3_5_mixer(spec, i, hf, mg, t, r))
        for suffix, cols in (("weight", h), ("bias", None)):
            if spec.mla is not None:
                out.extend(_megatron_mla(spec, hf + "self_attn.", mg + "self_attention.", t, r))
                break
            if spec.gdn is not None:
                break
            if suffix == "bias" and not spec.qkv_bias:
                continue
            blocks = []
            (q, q0), (k, k0), (v, v0) = spec.qkv_sources(i, suffix)
            for j in range(groups):
                g = r * groups + j
                base = j * per_group
                blocks.append(rows(q, q0 + g * npg * hd, base, npg * hd, cols))
                blocks.append(rows(k, k0 + g * hd, base + npg * hd, hd, cols))
                blocks.append(rows(v, v0 + g * hd, base + (npg + 1) * hd, hd, cols))
            shape = (groups * per_group, h) if cols else (groups * per_group,)
            out.append(LocalTensor(mg + f"self_attention.linear_qkv.{suffix}", shape, tuple(blocks)))
        o_cols = spec.num_attention_heads * spec.mla.v_head_dim if spec.mla is not None else spec.q_size
        if spec.gdn is None:
            out.append(row_parallel(hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight",
                                    h, o_cols, t, r))
        if FAMILIES[spec.family].gpt_oss:  # o_proj's bias (whole: added after the reduce), the heads' sinks
            heads = spec.num_attention_heads // t
            out += [whole(hf + "self_attn.o_proj.bias", (h,), mg + "self_attention.linear_proj.bias"),
                    LocalTensor(mg + "self_attention.core_attention.softmax_offset", (heads,),
                                (rows(hf + "self_attn.sinks", r * heads, 0, heads, None),))]
        out.append(whole(hf + "input_layernorm.weight", (h,), mg + norms["input_layernorm"]))
        if spec.qk_norm and spec.gdn is None:
            out.append(whole(hf + "self_attn.q_norm.weight", (hd,), mg + "self_attention.q_layernorm.weight"))
            out.append(whole(hf + "self_attn.k_norm.weight", (hd,), mg + "self_attention.k_layernorm.weight"))
        if is_moe_layer(spec, i):
            out.append(whole(hf + "post_attention_layernorm.weight", (h,), mg + "pre_mlp_layernorm.weight"))
            out.extend(_megatron_moe(spec, mesh, i, mg + "mlp.", r, ep_rank, use_te, moe_experts))
            continue
        out.append(whole(hf + "post_attention_layernorm.weight", (h,), mg + norms["pre_mlp_layernorm"]))
        out.append(gate_up(spec, i, mg + "mlp.linear_fc1.weight", t, r))
        out.append(row_parallel(hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight",
                                 h, spec.ffn_hidden_size, t, r))
    if FAMILIES[spec.family].gemma:
        out = _gemma3_norms(out, h)
    if last:
        out.append(whole("model.norm.weight", (h,), "decoder.final_layernorm.weight"))
        if role == "critic":
            out.append(whole(VALUE_HEAD, (1, h), "output_layer.weight"))
        elif not spec.tie_word_embeddings:
            out.append(vocab_shard("lm_head.weight", "output_layer.weight", spec.vocab_size, vp, t, r, h))
        elif not first:  # tied, PP > 1: the last stage keeps its own copy of the word embeddings
            out.append(vocab_shard("model.embed_tokens.weight", "output_layer.weight",
                                    spec.vocab_size, vp, t, r, h))
    return out


def _qwen3_5_mixer(spec: ModelSpec, i: int, hf: str, mg: str, t: int, r: int) -> list[LocalTensor]:
    """Qwen3.5 layer ``i``'s token mixer on TP rank ``r`` of ``t`` (:mod:`megarl.models.qwen3_5`). A gated DeltaNet:
    ``in_proj`` ``[q_r; k_r; v_r; z_r; beta_r; alpha_r]`` (this rank's heads of ``in_proj_qkv``'s three parts, then of
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``conv1d`` ``[q_r; k_r; v_r]`` channels, ``dt_bias`` / ``A_log``
    its value heads, the output norm whole, ``out_proj`` split on its input. A gated attention: ``linear_qkv`` per
    query group ``[q heads; gate heads; k; v]`` (HF's ``q_proj`` holds ``[q_h; gate_h]`` per head), QK-norms whole."""
    g, h, hd = spec.gdn, spec.hidden_size, spec.head_dim
    if not g.linear_pattern[i]:
        p, a = hf + "self_attn.", mg + "self_attention."
        groups, npg = spec.num_kv_heads // t, spec.heads_per_group
        per_group, blocks = (2 * npg + 2) * hd, []
        for j in range(groups):
            base, grp = j * per_group, r * groups + j
            for n in range(npg):
                head = grp * npg + n
                blocks += [rows(p + "q_proj.weight", 2 * head * hd, base + n * hd, hd, h),
                           rows(p + "q_proj.weight", (2 * head + 1) * hd, base + (npg + n) * hd, hd, h)]
            blocks += [rows(p + "k_proj.weight", grp * hd, base + 2 * npg * hd, hd, h),
                       rows(p + "v_proj.weight", grp * hd, base + (2 * npg + 1) * hd, hd, h)]
        return [LocalTensor(a + "linear_qkv.weight", (groups * per_group, h), tuple(blocks)),
                row_parallel(p + "o_proj.weight", a + "linear_proj.weight", h, spec.q_size, t, r),
                whole(p + "q_norm.weight", (hd,), a + "q_layernorm.weight"),
                whole(p + "k_norm.weight", (hd,), a + "k_layernorm.weight")]
    p, a = hf + "linear_attn.", mg + "self_attention."
    kd, vd, hv = g.key_dim // t, g.value_dim // t, g.num_value_heads // t
    parts = ((p + "in_proj_qkv.weight", r * kd, kd), (p + "in_proj_qkv.weight", g.key_dim + r * kd, kd),
             (p + "in_proj_qkv.weight", 2 * g.key_dim + r * vd, vd))
    in_proj, conv, dst = [], [], 0
    for name, start, n in parts + ((p + "in_proj_z.weight", r * vd, vd), (p + "in_proj_b.weight", r * hv, hv),
                                   (p + "in_proj_a.weight", r * hv, hv)):
        in_proj.append(rows(name, start, dst, n, h))
        if name.endswith("qkv.weight"):
            conv.append(Block(p + "conv1d.weight", (start, 0, 0), (dst, 0, 0), (n, 1, g.conv_kernel)))
        dst += n
    if spec.family == QWEN3_NEXT:
        in_proj = _qwen3_next_in_proj(spec, p, t, r)
    return [LocalTensor(a + "in_proj.weight", (dst, h), tuple(in_proj)),
            LocalTensor(a + "conv1d.weight", (2 * kd + vd, 1, g.conv_kernel), tuple(conv)),
            LocalTensor(a + "dt_bias", (hv,), (rows(p + "dt_bias", r * hv, 0, hv, None),)),
            LocalTensor(a + "A_log", (hv,), (rows(p + "A_log", r * hv, 0, hv, None),)),
            whole(p + "norm.weight", (g.value_head_dim,), a + "out_norm.weight"),
            row_parallel(p + "out_proj.weight", a + "out_proj.weight", h, g.value_dim, t, r)]


def _qwen3_next_in_proj(spec: ModelSpec, p: str, t: int, r: int) -> list[Block]:
    """Megatron's ``in_proj`` rows ``[q_r; k_r; v_r; z_r; beta_r; alpha_r]`` of TP rank ``r`` cut from Qwen3-Next's
    checkpoint, which fuses them by key-head group (:mod:`megarl.models.qwen3_5_spec`): key head ``g``'s ``[q_g; k_g;
    v_g; z_g]`` in ``in_proj_qkvz`` and ``[b_g; a_g]`` in ``in_proj_ba``, its value heads the ``hv / hk`` after
    ``g * hv / hk``."""
    g, h = spec.gdn, spec.hidden_size
    groups, dk, vg = g.num_key_heads // t, g.key_head_dim, g.num_value_heads // g.num_key_heads * g.value_head_dim
    heads = g.num_value_heads // g.num_key_heads
    kd, vd, hv = groups * dk, groups * vg, groups * heads
    out = []
    for j in range(groups):
        grp = r * groups + j
        base, ba = grp * (2 * dk + 2 * vg), grp * 2 * heads
        out += [rows(p + "in_proj_qkvz.weight", base, j * dk, dk, h),
                rows(p + "in_proj_qkvz.weight", base + dk, kd + j * dk, dk, h),
                rows(p + "in_proj_qkvz.weight", base + 2 * dk, 2 * kd + j * vg, vg, h),
                rows(p + "in_proj_qkvz.weight", base + 2 * dk + vg, 2 * kd + vd + j * vg, vg, h),
                rows(p + "in_proj_ba.weight", ba, 2 * kd + 2 * vd + j * heads, heads, h),
                rows(p + "in_proj_ba.weight", ba + heads, 2 * kd + 2 * vd + hv + j * heads, heads, h)]
    return out


def _megatron_mla(spec: ModelSpec, hf: str, mg: str, t: int, r: int) -> list[LocalTensor]:
    """One layer's multi-latent attention tensors (DeepSeek-V3; megatron's ``MLASelfAttention``, local spec) on TP
    rank ``r`` of ``t``, but its output projection: the down projections' output rows split over TP (megatron's
    column-parallel, gathered), the a-projection norms whole, the up projections' rows split by heads (HF's rows are
    head-major: ``[q_nope; q_rope]`` / ``[k_nope; v]`` per head, as megatron's)."""
    m, h, heads = spec.mla, spec.hidden_size, spec.num_attention_heads // t

    def split(name: str, local: str, n_rows: int, cols: int) -> LocalTensor:
        per = n_rows // t
        return LocalTensor(mg + local, (per, cols), (rows(hf + name, r * per, 0, per, cols),))

    out = []
    if m.q_lora_rank is None:
        out.append(split("q_proj.weight", "linear_q_proj.weight", t * heads * m.qk_head_dim, h))
    else:
        out += [split("q_a_proj.weight", "linear_q_down_proj.weight", m.q_lora_rank, h),
                whole(hf + "q_a_layernorm.weight", (m.q_lora_rank,), mg + "q_layernorm.weight"),
                split("q_b_proj.weight", "linear_q_up_proj.weight", t * heads * m.qk_head_dim, m.q_lora_rank)]
    return out + [split("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight", m.kv_lora_rank + m.qk_rope_head_dim,
                        h),
                  whole(hf + "kv_a_layernorm.weight", (m.kv_lora_rank,), mg + "kv_layernorm.weight"),
                  split("kv_b_proj.weight", "linear_kv_up_proj.weight", t * heads * (m.qk_nope_head_dim + m.v_head_dim),
                        m.kv_lora_rank)]


def _gemma3_norms(out: list[LocalTensor], h: int) -> list[LocalTensor]:
    """Gemma 3's layer norms (:mod:`megarl.models.gemma3`, local spec) in a chunk's tensors ``out`` laid out as
    Llama's: HF's ``post_attention_layernorm`` (Llama's pre-MLP norm, Gemma's attention post-norm) goes to
    ``self_attention.post_layernorm``, ``pre_feedforward_layernorm`` to ``pre_mlp_layernorm``,
    ``post_feedforward_layernorm`` to ``mlp.post_layernorm``."""
    gemma = []
    for lt in out:
        if not lt.name.endswith(".pre_mlp_layernorm.weight"):
            gemma.append(lt)
            continue
        mg, hf = lt.name.removesuffix("pre_mlp_layernorm.weight"), lt.blocks[0].name.removesuffix(
            "post_attention_layernorm.weight")
        gemma += [whole(hf + "post_attention_layernorm.weight", (h,), mg + "self_attention.post_layernorm.weight"),
                  whole(hf + "pre_feedforward_layernorm.weight", (h,), mg + "pre_mlp_layernorm.weight"),
                  whole(hf + "post_feedforward_layernorm.weight", (h,), mg + "mlp.post_layernorm.weight")]
    return gemma


def _megatron_moe(spec: ModelSpec, mesh: ParallelLayout, layer: int, mg: str, tp_rank: int, ep_rank: int,
                  use_te: bool = False, moe_experts: str = "grouped") -> list[LocalTensor]:
    """One MoE layer's tensors on a Megatron rank: the router, the rank's local experts (whole: expert TP = 1;
    the local spec's :class:`~megarl.kernels.grouped_experts.GroupedExperts` stacks them in ``linear_fc1.weight`` and
    ``linear_fc2.weight``, its ``SequentialMLP`` names them ``local_experts.{j}.linear_fc1.weight``, TE's
    ``TEGroupedMLP`` ``linear_fc1.weight{j}``) and the shared expert (split over TP)."""
    per_rank = spec.num_experts // mesh.ep
    out = [whole(spec.router_name(layer), (spec.num_experts, spec.hidden_size), mg + "router.weight")]
    if FAMILIES[spec.family].gpt_oss:
        return out + _gpt_oss_experts(spec, layer, mg, range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
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
        out.append(experts_gate_up(spec, layer, mg + fc1, experts, 1, 0))
        out.append(experts_down(spec, layer, mg + fc2, experts, 1, 0))
    if spec.deepseek_moe is not None:  # DeepSeek-V3, GLM-4.5: the router's score-correction bias, shared experts
        out.append(whole(f"model.layers.{layer}.mlp.gate.e_score_correction_bias", (spec.num_experts,),
                         mg + "router.expert_bias"))
        if spec.shared_expert_ffn_hidden_size:
            out.extend(shared_expert(f"model.layers.{layer}.", mg + "shared_experts.", spec, mesh.tp, tp_rank,
                                     ("linear_fc1.weight", "linear_fc2.weight"), "mlp.shared_experts."))
    elif spec.shared_expert_ffn_hidden_size:
        out.extend(shared_expert(f"model.layers.{layer}.", mg + "shared_experts.", spec, mesh.tp, tp_rank,
                                  ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")))
    return out


def _gpt_oss_experts(spec: ModelSpec, layer: int, mg: str, experts: range) -> list[LocalTensor]:
    """gpt-oss's router bias and this EP rank's ``experts`` in ``SequentialMLP``, whole (expert TP = 1): local
    expert ``j``'s ``linear_fc1`` weight and bias are the canonical ``gate_up_proj`` (gate and up rows interleaved:
    :mod:`megarl.models.gpt_oss_layers` reorders the output), ``linear_fc2`` ``down_proj``."""
    f, h = spec.moe_ffn_hidden_size, spec.hidden_size
    out = [whole(spec.router_name(layer).removesuffix("weight") + "bias", (spec.num_experts,), mg + "router.bias")]
    for j, e in enumerate(experts):
        p = f"{mg}experts.local_experts.{j}."
        for (name, shape), local in zip(zip(gpt_oss.expert_tensors(spec, layer, e), ((2 * f, h), (h, f))),
                                        ("linear_fc1.", "linear_fc2.")):
            out += [whole(name, shape, p + local + "weight"),
                    whole(name.removesuffix("weight") + "bias", shape[:1], p + local + "bias")]
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
                  ("megatron", shape_key(spec), mesh.tp, mesh.pp, mesh.dp, mesh.ep, tuple(ranks), role, use_te,
                   padded_vocab, mesh.cp, mesh.vpp, lora, moe_experts))
