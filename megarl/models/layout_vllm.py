"""vLLM's layout: the local tensors of vLLM's Llama/Qwen2/Qwen3/Phi-3 (and MoE) modules at TP=t' (:func:`vllm_layout`,
:func:`vllm_rank_tensors`), in the algebra of :mod:`megarl.models.layout`, and the checks that a model splits.

``qkv_proj`` = ``[q_r; k_r; v_r]`` with KV heads replicated when t' > num_kv_heads, ``gate_up_proj``, vocab padded
to a multiple of 64 and split evenly, ``lm_head`` only when untied; MoE layers hold the fused experts of all
``num_experts`` split over TP on the intermediate dim. With ``quantization="fp8"`` the linear weights are
block-FP8 (:attr:`~megarl.models.layout.LocalTensor.scale`, :func:`check_vllm_fp8`). The notes above each
function say which vLLM source each rule was read from.
"""

from __future__ import annotations

from typing import Iterable

from megarl.config import QUANTIZATIONS
from megarl.models import fp8, gpt_oss
from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.layout import (Block, Layout, LocalTensor, canonical_shapes, experts_down, experts_gate_up, gate_up,
                                  row_parallel, rows, shape_key, shared_expert, vocab_shard, whole)
from megarl.models.qwen3_5_spec import QWEN3_NEXT
from megarl.models.spec import FAMILIES, ModelSpec, SpecError

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


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
# - models/gemma3.py: Gemma3ForCausalLM has the same linear layers, q_norm/k_norm and two more norms a layer
#   (pre_feedforward_layernorm, post_feedforward_layernorm), ties lm_head to embed_tokens; its norms are
#   layers/layernorm.py GemmaRMSNorm, which stores the checkpoint's weight as it is (default_weight_loader, no
#   post-processing) and adds 1 in forward; the sqrt(hidden) embedding scale is a buffer, not a parameter.
# - models/llama.py and models/qwen2.py: the attention asserts heads % tp == 0 and kv % tp == 0 or tp % kv == 0;
#   with tie_word_embeddings, LlamaForCausalLM ties lm_head to embed_tokens' Parameter (ParallelLMHead.
#   tie_weights) and Qwen2ForCausalLM sets lm_head = model.embed_tokens, so named_parameters() lists only
#   model.embed_tokens.weight; load_weights maps q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj.
# - models/qwen3.py (read 2026-12-06): Qwen3ForCausalLM is Qwen2's model with Qwen3Attention, which adds q_norm and
#   k_norm (RMSNorm [head_dim], whole on every rank) after qkv_proj, head_dim from the config; lm_head =
#   model.embed_tokens when tied. models/phi3.py: Phi3ForCausalLM is LlamaForCausalLM (same parameters) whose
#   checkpoint holds qkv_proj and gate_up_proj already fused; layers/linear.py QKVParallelLinear.weight_loader and
#   MergedColumnParallelLinear.weight_loader with loaded_shard_id=None split such a tensor at q_size, q_size +
#   kv_size (at ffn) and load each part as q/k/v (gate/up) would be: the same local tensors as Llama's.
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
    if FAMILIES[spec.family].gpt_oss:
        _check_vllm_gpt_oss(spec, tp)
    if vllm_padded_vocab(spec.vocab_size) % tp:
        raise SpecError(f"vLLM tp={tp} does not divide the padded vocab {vllm_padded_vocab(spec.vocab_size)} "
                        "of embed_tokens")


def _check_vllm_gpt_oss(spec: ModelSpec, tp: int) -> None:
    """What vLLM 0.24's gpt_oss.py needs beyond the common checks (:func:`_vllm_gpt_oss`'s notes)."""
    if spec.num_kv_heads % tp:
        raise SpecError(f"vLLM tp={tp} must divide gpt-oss's num_kv_heads={spec.num_kv_heads} (its attention splits "
                        "the KV heads without replicating them)")
    alternating = tuple(int(i % 2 == 0) for i in range(spec.num_layers))
    if spec.sliding_window_pattern not in (None, alternating) or (spec.sliding_window_pattern is None) != (
            spec.sliding_window is None):
        raise SpecError(f"sliding_window_pattern={spec.sliding_window_pattern}: vLLM's gpt-oss puts the window on the "
                        "even layers, whatever layer_types say; the model's pattern differs")


# vLLM 0.24's gpt_oss.py OAIAttention builds its rotary embedding as YaRN whatever the config says, reading
# rope_parameters["factor"], ["original_max_position_embeddings"], ["beta_fast"] and ["beta_slow"] (a KeyError
# while vLLM loads the model when one is missing).
GPT_OSS_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def check_vllm_rope(spec: ModelSpec) -> None:
    """Check that vLLM 0.24 builds ``spec``'s rotary embedding as the trainer does (whatever the TP).

    Raises:
        SpecError: a gpt-oss model without YaRN ``rope_scaling`` (or without one of :data:`GPT_OSS_YARN_KEYS`).
    """
    rope = spec.rope_scaling or {}
    if FAMILIES[spec.family].gpt_oss and (rope.get("rope_type") != "yarn"
                                          or any(k not in rope for k in GPT_OSS_YARN_KEYS)):
        raise SpecError(f"rope_scaling={spec.rope_scaling}: vLLM's gpt-oss always applies YaRN and reads its "
                        f"{', '.join(GPT_OSS_YARN_KEYS)}; give the model gpt-oss's YaRN rope_scaling (the released "
                        "configs have it: rope_type yarn, factor 32, beta_fast 32, beta_slow 1, "
                        "original_max_position_embeddings 4096)")


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
    """The local tensors of vLLM TP rank ``r`` (``model.named_parameters()`` names of vLLM's Llama/Qwen2/Qwen3/Phi3).

    Args:
        quantization: None (the model dtype) or "fp8": the four linear weights of every layer block-FP8
            (:attr:`~megarl.models.layout.LocalTensor.scale`), each with its ``weight_scale_inv``
            (:func:`check_vllm_fp8`).

    Raises:
        SpecError: the TP (or FP8 at this TP) does not fit the model, or an unknown quantization.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise SpecError(f"quantization must be null or one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "fp8":
        check_vllm_fp8(spec, tp)
    check_vllm_tp(spec, tp)
    if FAMILIES[spec.family].gpt_oss:
        return {lt.name: lt for lt in _vllm_gpt_oss(spec, tp, r)}
    h, hd = spec.hidden_size, spec.head_dim
    vp = vllm_padded_vocab(spec.vocab_size)
    q_heads = spec.num_attention_heads // tp
    if tp >= spec.num_kv_heads:
        kv_heads, kv_first = 1, r // (tp // spec.num_kv_heads)
    else:
        kv_heads = spec.num_kv_heads // tp
        kv_first = r * kv_heads
    out = [vocab_shard("model.embed_tokens.weight", "model.embed_tokens.weight", spec.vocab_size, vp, tp, r, h)]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if spec.gdn is not None:
            out.extend(_vllm_qwen3_5_mixer(spec, i, tp, r, kv_first * hd, kv_heads * hd))
        for suffix, cols in (("weight", h), ("bias", None)):
            if spec.mla is not None:
                out.extend(_vllm_mla(spec, p + "self_attn.", tp, r))
                break
            if spec.gdn is not None:
                break
            if suffix == "bias" and not spec.qkv_bias:
                continue
            q, kv = q_heads * hd, kv_heads * hd
            (qn, q0), (kn, k0), (vn, v0) = spec.qkv_sources(i, suffix)
            blocks = (rows(qn, q0 + r * q, 0, q, cols), rows(kn, k0 + kv_first * hd, q, kv, cols),
                      rows(vn, v0 + kv_first * hd, q + kv, kv, cols))
            shape = (q + 2 * kv, h) if cols else (q + 2 * kv,)
            out.append(LocalTensor(p + f"self_attn.qkv_proj.{suffix}", shape, blocks))
        o_cols = spec.num_attention_heads * spec.mla.v_head_dim if spec.mla is not None else spec.q_size
        if spec.gdn is None:
            out.append(row_parallel(p + "self_attn.o_proj.weight", p + "self_attn.o_proj.weight", h, o_cols, tp, r))
        if spec.qk_norm and spec.gdn is None:
            out += [whole(p + "self_attn.q_norm.weight", (hd,)), whole(p + "self_attn.k_norm.weight", (hd,))]
        if is_moe_layer(spec, i):
            out.extend(_vllm_moe(spec, i, tp, r))
        else:
            out.append(gate_up(spec, i, p + "mlp.gate_up_proj.weight", tp, r))
            out.append(row_parallel(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight",
                                     h, spec.ffn_hidden_size, tp, r))
        out.append(whole(p + "input_layernorm.weight", (h,)))
        out.append(whole(p + "post_attention_layernorm.weight", (h,)))
        if FAMILIES[spec.family].gemma:
            out += [whole(p + "pre_feedforward_layernorm.weight", (h,)),
                    whole(p + "post_feedforward_layernorm.weight", (h,))]
    out.append(whole("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        out.append(vocab_shard("lm_head.weight", "lm_head.weight", spec.vocab_size, vp, tp, r, h))
    if quantization == "fp8":
        out = _block_fp8(out)
    return {lt.name: lt for lt in out}


def _vllm_qwen3_5_mixer(spec: ModelSpec, i: int, tp: int, r: int, kv0: int, kv: int) -> list[LocalTensor]:
    """Qwen3.5 layer ``i``'s token mixer on vLLM TP rank ``r`` (vLLM 0.24.0's models/qwen3_5.py, qwen3_next.py and
    layers/mamba/gdn/qwen_gdn_linear_attn.py, read from the wheel). ``QwenGatedDeltaNetAttention`` (Qwen3.5's
    ``gqa_interleaved_layout=False``): ``in_proj_qkvz`` a ``MergedColumnParallelLinear`` of output sizes ``[key_dim,
    key_dim, value_dim, value_dim]`` loaded from ``in_proj_qkv`` (shards 0, 1, 2) and ``in_proj_z`` (shard 3):
    ``[q_r; k_r; v_r; z_r]``; ``in_proj_ba`` ``[b_r; a_r]``; ``conv1d`` (a ``ColumnParallelLinear`` of the
    ``[q; k; v]`` channels, weight unsqueezed to ``[channels / tp, 1, w]``, loaded per part by
    ``mamba_v2_sharded_weight_loader``): ``[q_r; k_r; v_r]``; ``dt_bias`` and ``A_log`` split over the value heads;
    ``norm`` whole; ``out_proj`` split on its input. ``Qwen3NextAttention``: ``qkv_proj`` a ``QKVParallelLinear`` of
    ``2 * heads`` query heads (HF's ``q_proj`` rows ``[q_h; gate_h]`` per head, kept) and the KV heads (``kv`` rows of
    each from row ``kv0``), ``o_proj`` split on its input, ``q_norm`` / ``k_norm`` whole (vLLM's ``GemmaRMSNorm``
    adds the 1 in its forward: raw weights). Qwen3-Next (``gqa_interleaved_layout=True``): ``in_proj_qkvz`` and
    ``in_proj_ba`` one output shard each, loaded from the checkpoint's fused tensors: rank ``r``'s contiguous rows
    (whole key-head groups)."""
    g, h, hd = spec.gdn, spec.hidden_size, spec.head_dim
    if g.num_key_heads % tp or g.num_value_heads % tp:
        raise SpecError(f"vLLM TP={tp} does not divide the gated DeltaNet's linear_num_key_heads={g.num_key_heads} "
                        f"and linear_num_value_heads={g.num_value_heads}")
    if not g.linear_pattern[i]:
        p, q = f"model.layers.{i}.self_attn.", 2 * spec.q_size // tp
        blocks = (rows(p + "q_proj.weight", r * q, 0, q, h), rows(p + "k_proj.weight", kv0, q, kv, h),
                  rows(p + "v_proj.weight", kv0, q + kv, kv, h))
        return [LocalTensor(p + "qkv_proj.weight", (q + 2 * kv, h), blocks),
                row_parallel(p + "o_proj.weight", p + "o_proj.weight", h, spec.q_size, tp, r),
                whole(p + "q_norm.weight", (hd,)), whole(p + "k_norm.weight", (hd,))]
    p = f"model.layers.{i}.linear_attn."
    kd, vd, hv = g.key_dim // tp, g.value_dim // tp, g.num_value_heads // tp
    qkv = ((r * kd, kd), (g.key_dim + r * kd, kd), (2 * g.key_dim + r * vd, vd))
    in_proj = tuple(rows(p + "in_proj_qkv.weight", s, d, n, h) for (s, n), d in zip(qkv, (0, kd, 2 * kd)))
    conv = tuple(Block(p + "conv1d.weight", (s, 0, 0), (d, 0, 0), (n, 1, g.conv_kernel))
                 for (s, n), d in zip(qkv, (0, kd, 2 * kd)))
    if spec.family == QWEN3_NEXT:  # the checkpoint's fused tensors, grouped by key head: a rank's rows are contiguous
        qkvz = (rows(p + "in_proj_qkvz.weight", r * (2 * kd + 2 * vd), 0, 2 * kd + 2 * vd, h),)
        ba = (rows(p + "in_proj_ba.weight", r * 2 * hv, 0, 2 * hv, h),)
    else:
        qkvz = in_proj + (rows(p + "in_proj_z.weight", r * vd, 2 * kd + vd, vd, h),)
        ba = (rows(p + "in_proj_b.weight", r * hv, 0, hv, h), rows(p + "in_proj_a.weight", r * hv, hv, hv, h))
    return [LocalTensor(p + "in_proj_qkvz.weight", (2 * kd + 2 * vd, h), qkvz),
            LocalTensor(p + "in_proj_ba.weight", (2 * hv, h), ba),
            LocalTensor(p + "conv1d.weight", (2 * kd + vd, 1, g.conv_kernel), conv),
            LocalTensor(p + "dt_bias", (hv,), (rows(p + "dt_bias", r * hv, 0, hv, None),)),
            LocalTensor(p + "A_log", (hv,), (rows(p + "A_log", r * hv, 0, hv, None),)),
            whole(p + "norm.weight", (g.value_head_dim,)),
            row_parallel(p + "out_proj.weight", p + "out_proj.weight", h, g.value_dim, tp, r)]


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
# - models/glm4_moe.py (read 2026-12-06): Glm4MoeForCausalLM is Llama's layout (qkv_proj with bias when
#   attention_bias, q_norm/k_norm [head_dim] when use_qk_norm, an untied lm_head) whose MoE layers hold Glm4MoE:
#   `gate` (an nn.Linear [experts, hidden] kept in float32) with `gate.e_score_correction_bias` (float32),
#   `shared_experts` (gate_up_proj, down_proj), `experts` (FusedMoE, as DeepSeek-V2's); the first
#   first_k_dense_replace layers' `mlp` is a dense Glm4MoeMLP; MTP layers' names are skipped by load_weights.
# vLLM's expert parallelism (enable_expert_parallel) is not described here: every engine rank holds all experts.
def _vllm_moe(spec: ModelSpec, layer: int, tp: int, r: int) -> list[LocalTensor]:
    block = f"model.layers.{layer}.{FAMILIES[spec.family].moe.block}."
    experts = range(spec.num_experts)
    out = [whole(spec.router_name(layer), (spec.num_experts, spec.hidden_size), block + "gate.weight"),
           experts_gate_up(spec, layer, block + "experts.routed_experts.w13_weight", experts, tp, r),
           experts_down(spec, layer, block + "experts.routed_experts.w2_weight", experts, tp, r)]
    if spec.deepseek_moe is not None:  # DeepSeek-V3, GLM-4.5: the router's bias (float32), gateless shared experts
        out.append(whole(block + "gate.e_score_correction_bias", (spec.num_experts,)))
        if spec.shared_expert_ffn_hidden_size:
            out.extend(shared_expert(f"model.layers.{layer}.", block + "shared_experts.", spec, tp, r,
                                     ("gate_up_proj.weight", "down_proj.weight"), "mlp.shared_experts."))
    elif spec.shared_expert_ffn_hidden_size:
        out.extend(shared_expert(f"model.layers.{layer}.", block, spec, tp, r,
                                  ("shared_expert.gate_up_proj.weight", "shared_expert.down_proj.weight",
                                   "shared_expert_gate.weight")))
    return out


# gpt-oss, read in vLLM 0.24.0's models/gpt_oss.py (2026-12-06): GptOssForCausalLM holds model.embedding
# (VocabParallelEmbedding) and an untied lm_head; TransformerBlock holds `attn` (OAIAttention: QKVParallelLinear
# `qkv_proj` and RowParallelLinear `o_proj`, both with bias, and `sinks` [heads / tp], loaded as
# weight.narrow(0, tp_rank * heads / tp, heads / tp); the Attention layer gets the same Parameter, listed once,
# and v1/attention/backends/flash_attn.py keeps a reference to it as the kernel's s_aux, so writes in place reach it;
# num_local_key_value_heads = kv // tp: no KV replication; the window on layer_idx % 2 == 0 whatever layer_types
# say), `mlp` (MLPBlock: ReplicatedLinear `router` with bias, FusedMoE `experts` with has_bias, activation
# "swigluoai"), input_layernorm, post_attention_layernorm. RowParallelLinear's bias is whole on every rank (added on
# rank 0 only). _load_weights_other (bf16 checkpoints) copies, with I = intermediate_size and rank r's columns
# [r I/tp, (r+1) I/tp): w13_weight[e] = gate_up_proj[e, :, 2 r I/tp : 2 (r+1) I/tp].T (gate and up still
# interleaved: row 2j is gate j, row 2j + 1 up j, as swigluoai reads them), w13_bias[e] = gate_up_proj_bias[e] over
# the same columns, w2_weight[e] = down_proj[e, r I/tp : (r+1) I/tp, :].T, and w2_bias = down_proj_bias on rank 0
# and zeros elsewhere (the bias added once after the all-reduce). FusedMoE's parameters sit under its
# `routed_experts` (model_loader/weight_utils.py maybe_remap_moe_expert_param_name). After loading,
# unquantized_fused_moe_method.py's process_weights_after_loading keeps this layout on CUDA (padding only on ROCm).
# The reshard writes no block into w2_bias on ranks r > 0: vLLM's own load left them zero.
def _vllm_gpt_oss(spec: ModelSpec, tp: int, r: int) -> list[LocalTensor]:
    """vLLM's ``GptOssForCausalLM`` TP rank ``r`` of ``tp`` (the notes above)."""
    h, f = spec.hidden_size, spec.moe_ffn_hidden_size // tp
    vp, q, kv = vllm_padded_vocab(spec.vocab_size), spec.q_size // tp, spec.kv_size // tp
    heads = spec.num_attention_heads // tp
    out = [vocab_shard("model.embed_tokens.weight", "model.embedding.weight", spec.vocab_size, vp, tp, r, h)]
    for i in range(spec.num_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.attn.", f"model.layers.{i}.mlp."
        for suffix, cols in (("weight", h), ("bias", None)):
            (qn, _), (kn, _), (vn, _) = spec.qkv_sources(i, suffix)
            out.append(LocalTensor(a + f"qkv_proj.{suffix}", (q + 2 * kv, h) if cols else (q + 2 * kv,),
                                   (rows(qn, r * q, 0, q, cols), rows(kn, r * kv, q, kv, cols),
                                    rows(vn, r * kv, q + kv, kv, cols))))
        out += [row_parallel(p + "self_attn.o_proj.weight", a + "o_proj.weight", h, spec.q_size, tp, r),
                whole(p + "self_attn.o_proj.bias", (h,), a + "o_proj.bias"),
                LocalTensor(a + "sinks", (heads,), (rows(p + "self_attn.sinks", r * heads, 0, heads, None),)),
                whole(spec.router_name(i), (spec.num_experts, h), m + "router.weight"),
                whole(spec.router_name(i).removesuffix("weight") + "bias", (spec.num_experts,), m + "router.bias")]
        w13, b13, w2, b2 = [], [], [], []
        for e in range(spec.num_experts):  # gate_up_proj: gate and up rows interleaved, as w13 holds them
            gate_up, down = gpt_oss.expert_tensors(spec, i, e)
            w13.append(rows(gate_up, 2 * r * f, 2 * f * e, 2 * f, h))
            b13.append(rows(gate_up.removesuffix("weight") + "bias", 2 * r * f, 2 * f * e, 2 * f, None))
            w2.append(Block(down, (0, r * f), (h * e, 0), (h, f)))
            if r == 0:
                b2.append(rows(down.removesuffix("weight") + "bias", 0, h * e, h, None))
        x = m + "experts.routed_experts."
        out += [LocalTensor(x + "w13_weight", (spec.num_experts * 2 * f, h), tuple(w13)),
                LocalTensor(x + "w13_bias", (spec.num_experts * 2 * f,), tuple(b13)),
                LocalTensor(x + "w2_weight", (spec.num_experts * h, f), tuple(w2)),
                LocalTensor(x + "w2_bias", (spec.num_experts * h,), tuple(b2)),
                whole(p + "input_layernorm.weight", (h,)), whole(p + "post_attention_layernorm.weight", (h,))]
    return out + [whole("model.norm.weight", (h,)),
                  vocab_shard("lm_head.weight", "lm_head.weight", spec.vocab_size, vp, tp, r, h)]


# DeepSeek-V3's multi-latent attention, read in vLLM 0.24.0's source (2026-12-06):
# - models/deepseek_v2.py DeepseekV2MLAAttention.__init__ registers, in this order: with a query latent
#   `fused_qkv_a_proj` (DeepSeekV2FusedQkvAProjLinear: a MergedColumnParallelLinear with disable_tp, output_sizes
#   [q_lora_rank, kv_lora_rank + qk_rope_head_dim], whole on every rank; load_weights' mla_params_mapping loads
#   q_a_proj as shard 0 and kv_a_proj_with_mqa as shard 1), else `kv_a_proj_with_mqa` (ReplicatedLinear); then
#   `q_a_layernorm` and `q_b_proj` (ColumnParallelLinear: heads split over TP), or `q_proj` (ColumnParallelLinear);
#   `kv_a_layernorm`, `kv_b_proj` (ColumnParallelLinear [heads/tp * (qk_nope + v), kv_lora_rank]), `o_proj`
#   (RowParallelLinear). The MLA wrapper and layer hold the same modules (named_parameters lists them once).
# - DeepseekV2MoE: `gate` (GateLinear [experts, hidden]) with `gate.e_score_correction_bias` (float32 [experts];
#   created only when config.topk_method == "noaux_tc", and the routing is sigmoid only with config.scoring_func
#   == "sigmoid": megarl's exported config.json sets both), `shared_experts` (DeepseekV2MLP: gate_up_proj,
#   down_proj, split as a dense MLP), `experts` (FusedMoE: routed_experts.w13_weight / w2_weight as Qwen's); the
#   first first_k_dense_replace layers' `mlp` is a DeepseekV2MLP. MTP layers (num_nextn_predict_layers) are built
#   only for speculative decoding (load_weights skips their names otherwise).
# - layers/attention/mla_attention.py MLAAttention.process_weights_after_loading (after load) sets W_UV [heads,
#   kv_lora_rank, v] and W_UK_T [heads, qk_nope, kv_lora_rank] from kv_b_proj's weight, through
#   quantization/utils/quant_utils.py get_and_maybe_dequant_weights, which for an unquantized layer returns
#   weight.to(act_dtype): the same tensor when the weights are in the activation dtype (bf16), so both are views
#   of kv_b_proj.weight, transposed and split (no copy), and the reshard's in-place write of kv_b_proj.weight is
#   what vLLM's own load then post-processing would hold. A quantized kv_b_proj (FP8: dequantised copies) would
#   need process_weights_after_loading again after each write; megarl refuses FP8 rollouts of MoE models.
def _vllm_mla(spec: ModelSpec, p: str, tp: int, r: int) -> list[LocalTensor]:
    """One layer's multi-latent attention tensors on vLLM TP rank ``r`` of ``tp`` (``p``: ``model.layers.{i}.
    self_attn.``), its ``o_proj`` aside: the fused or lone a-projection and its norms whole, the b-projections'
    rows (head-major) split over TP."""
    m, h, heads = spec.mla, spec.hidden_size, spec.num_attention_heads // tp
    kv_a = m.kv_lora_rank + m.qk_rope_head_dim
    q_rows, kv_rows = heads * m.qk_head_dim, heads * (m.qk_nope_head_dim + m.v_head_dim)
    if m.q_lora_rank is None:
        out = [whole(p + "kv_a_proj_with_mqa.weight", (kv_a, h)),
               LocalTensor(p + "q_proj.weight", (q_rows, h), (rows(p + "q_proj.weight", r * q_rows, 0, q_rows, h),))]
    else:
        ql = m.q_lora_rank
        out = [LocalTensor(p + "fused_qkv_a_proj.weight", (ql + kv_a, h), (
                   rows(p + "q_a_proj.weight", 0, 0, ql, h), rows(p + "kv_a_proj_with_mqa.weight", 0, ql, kv_a, h))),
               whole(p + "q_a_layernorm.weight", (ql,)),
               LocalTensor(p + "q_b_proj.weight", (q_rows, ql), (rows(p + "q_b_proj.weight", r * q_rows, 0, q_rows,
                                                                     ql),))]
    return out + [whole(p + "kv_a_layernorm.weight", (m.kv_lora_rank,)),
                  LocalTensor(p + "kv_b_proj.weight", (kv_rows, m.kv_lora_rank),
                              (rows(p + "kv_b_proj.weight", r * kv_rows, 0, kv_rows, m.kv_lora_rank),))]


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
                  ("vllm", shape_key(spec), tp, tuple(ranks), quantization))
