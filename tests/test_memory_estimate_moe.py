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
