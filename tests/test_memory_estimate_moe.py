"""The memory estimate of an MoE update (issue 32): beside its experts' SwiGLU activations (a dense MLP of
``top_k`` experts' width), each MoE layer keeps the ``top_k`` dispatched copies of every token's hidden state,
the ``top_k`` probability-scaled inputs of the second grouped GEMM and the router's fp32 logits and
probabilities; on one H200 the 8-layer Qwen3-30B-A3B update's activations were measured well above the dense
count (perf/RESULTS.md)."""

from __future__ import annotations

import dataclasses

from megarl.config import load_config
from megarl.launch.memory import activation_bytes
from megarl.models.spec import preset


def test_an_moe_layer_adds_its_dispatched_tokens_and_router_to_a_dense_layer_of_its_width():
    moe = preset("qwen3-30b-a3b?layers=8")
    k, h, f, n = moe.moe_top_k, moe.hidden_size, moe.moe_ffn_hidden_size, moe.num_experts
    dense = dataclasses.replace(moe, family="llama", num_experts=0, moe_top_k=0, moe_ffn_hidden_size=0,
                                ffn_hidden_size=k * f)
    cfg = load_config(None, ["model.dtype=bfloat16", "data.max_prompt_length=8", "rollout.max_new_tokens=128",
                             "actor.micro_batch_size=32", "actor.ppo_mini_batch_size=32"])
    tokens, layers, e = 32 * (8 + 128), moe.num_layers, 2
    routed = k * h + k * f + 2 * n * 4 / e  # elements of e bytes per token and layer
    extra = activation_bytes(cfg, moe, 1, 1, 1) - activation_bytes(cfg, dense, 1, 1, 1)
    assert abs(extra - tokens * layers * e * routed) <= 1, (extra, tokens * layers * e * routed)


def _deepseek_v3_layers() -> tuple[int, int, int, int]:
    """DeepSeek-V3's sizes by hand from its config.json (deepseek-ai/DeepSeek-V3; the MTP layer left out): (one MLA
    attention block with its norms, one dense MLP, one MoE block, one routed expert), in parameters."""
    h, heads, q_lora, kv_lora, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    attention = (q_lora * h + q_lora + heads * (nope + rope) * q_lora + (kv_lora + rope) * h + kv_lora
                 + heads * (nope + v) * kv_lora + h * heads * v + 2 * h)  # + input and post-attention norms
    expert = 3 * h * 2048
    moe = 256 * h + 256 + 256 * expert + expert  # router, score-correction bias, 256 routed, 1 shared
    return attention, 3 * h * 18432, moe, expert


def test_deepseek_v3_parameters_by_hand_and_its_dense_first_layers_in_the_stage_count():
    """671B parameters, ~37B active (the DeepSeek-V3 report's figures), and the estimate's stage count is the same
    sum: its first 3 layers have a dense MLP, not 256 experts (they were counted as MoE layers: 32.8B too many)."""
    from megarl.launch.memory import stage_params

    spec = preset("deepseek-v3")
    attention, dense, moe, expert = _deepseek_v3_layers()
    h, vocab = 7168, 129280  # 129280 = 1010 x 128: no vocab padding at TP = 1
    total = 2 * vocab * h + 61 * attention + 3 * dense + 58 * moe + h
    active = total - 58 * (256 - 8) * expert
    assert spec.num_params() == total and round(total / 1e9) == 671
    assert spec.num_active_params() == active and 37e9 < active < 38e9
    assert stage_params(spec, 1, 1) == total

    from megarl.launch.memory import stage_split  # the stage's routed experts (their optimizer state's sharding)
    assert stage_split(spec, 1, 1) == (total, 58 * 256 * expert)
    experts_ep8 = 58 * 32 * expert
    assert stage_split(spec, 1, 1, ep=8) == (total - 58 * 224 * expert, experts_ep8)


def test_moonlight_pipeline_stages_hold_their_own_layers():
    """Moonlight-16B-A3B (27 layers, the first dense) at PP = 3, EP = 2: the busiest stage is the last (9 MoE
    layers, the final norm and the output layer), not the first (its dense layer is the lighter); its experts, the
    part sharded over the experts' own DP group, are 9 layers x 32 local experts."""
    from megarl.launch.memory import stage_split

    spec = preset("moonlight-16b-a3b")
    h, heads, kv_lora, nope, rope, v, vocab, m = 2048, 16, 512, 128, 64, 128, 163840, 1408
    attention = (heads * (nope + rope) * h + (kv_lora + rope) * h + kv_lora + heads * (nope + v) * kv_lora
                 + h * heads * v + 2 * h)
    expert = 3 * h * m
    moe = attention + 64 * h + 64 + 32 * expert + 3 * h * 2 * m  # router, bias, 32 local experts, 2 shared
    dense = attention + 3 * h * 11264
    first, last = dense + 8 * moe + vocab * h, 9 * moe + h + vocab * h
    assert last > first
    assert stage_split(spec, 1, 3, ep=2) == (last, 9 * 32 * expert)
    assert stage_split(spec, 1, 1, ep=2)[0] == dense + 26 * moe + 2 * vocab * h + h
