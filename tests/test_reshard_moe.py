"""The reshard of mixture-of-experts models: Megatron EP shards -> vLLM's fused-MoE parameters and -> the
transformers model's fused experts, on one world of 4 gloo ranks.

Sources are real Megatron models at EP=2 (TP=1 x DP=4, TP=2 x DP=2, and PP=2 x DP=2; grouped experts, and one
with megatron's ``SequentialMLP``) filled from random HF weights (their logits equal transformers',
tests/test_models_moe.py). Every destination tensor must equal, bitwise, the tensor cut directly from the HF
weights by the reference slicer below, written from scratch with plain torch (stack and cat, not
megarl.models.layout) from what vLLM 0.24.0's loaders do (layout_vllm.py's notes): per engine rank r of TP t,
``w13_weight[e] = [gate_e[r]; up_e[r]]`` (rows r * I/t ...), ``w2_weight[e] = down_e[:, r]``.
Every rank receives exactly the destination elements its own shards do not hold (the planner's lower bound).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.distributed import run_world
from tests.test_models_moe import SPECS, hf_moe_model
from tests.test_reshard_exact import missing_elements

DESTINATIONS = [("vllm", 1), ("vllm", 2), ("transformers", None)]
# Megatron (tp, pp, ep, moe_experts) on 4 ranks: all three for Qwen3-MoE, one with SequentialMLP's experts too;
# Qwen2-MoE's shared expert split over TP; Mixtral's names across pipeline stages
SOURCES = {"qwen3_moe": [(1, 1, 2, "grouped"), (2, 1, 2, "grouped"), (1, 2, 2, "grouped"), (1, 1, 2, "sequential")],
           "qwen2_moe": [(2, 1, 2, "grouped")], "mixtral": [(1, 2, 2, "grouped")]}
CASES = sum(len(s) for s in SOURCES.values()) * len(DESTINATIONS)


def ref_vllm(spec, w: dict[str, torch.Tensor], tp: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM 0.24's parameters of TP rank ``r`` (MoE families, KV heads divisible by ``tp``), as 3-D fused
    experts, cut from the HF checkpoint tensors ``w``."""
    def rows(t, n):
        per = t.shape[0] // n
        return t[r * per:(r + 1) * per]

    def cols(t, n):
        per = t.shape[1] // n
        return t[:, r * per:(r + 1) * per]

    vocab = -(-spec.vocab_size // 64) * 64
    block = "block_sparse_moe" if spec.family == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if spec.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    def vocab_shard(t):
        padded = torch.zeros(vocab, t.shape[1])
        padded[:t.shape[0]] = t
        return rows(padded, tp)

    out = {"model.embed_tokens.weight": vocab_shard(w["model.embed_tokens.weight"]),
           "model.norm.weight": w["model.norm.weight"]}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = vocab_shard(w["lm_head.weight"])
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias") if spec.family == "qwen2_moe" else ("weight",):
            out[p + f"self_attn.qkv_proj.{suffix}"] = torch.cat([rows(w[p + f"self_attn.{x}_proj.{suffix}"], tp)
                                                                 for x in "qkv"])
        out[p + "self_attn.o_proj.weight"] = cols(w[p + "self_attn.o_proj.weight"], tp)
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = w[p + n]
        if spec.family == "qwen3_moe":
            out[p + "self_attn.q_norm.weight"] = w[p + "self_attn.q_norm.weight"]
            out[p + "self_attn.k_norm.weight"] = w[p + "self_attn.k_norm.weight"]
        b = p + block + "."
        out[b + "gate.weight"] = w[b + "gate.weight"]
        experts = range(spec.num_experts)
        out[b + "experts.routed_experts.w13_weight"] = torch.stack([
            torch.cat([rows(w[b + f"experts.{e}.{names[0]}.weight"], tp),
                       rows(w[b + f"experts.{e}.{names[1]}.weight"], tp)]) for e in experts])
        out[b + "experts.routed_experts.w2_weight"] = torch.stack([cols(w[b + f"experts.{e}.{names[2]}.weight"], tp)
                                                                   for e in experts])
        if spec.shared_expert_ffn_hidden_size:
            s = p + "mlp.shared_expert."
            out[s + "gate_up_proj.weight"] = torch.cat([rows(w[s + "gate_proj.weight"], tp),
                                                        rows(w[s + "up_proj.weight"], tp)])
            out[s + "down_proj.weight"] = cols(w[s + "down_proj.weight"], tp)
            out[p + "mlp.shared_expert_gate.weight"] = w[p + "mlp.shared_expert_gate.weight"]
    return out


def _world(rank, world):
    from megatron.core import parallel_state as ps

    from megarl.models.layout import hf_layout, local_views
    from megarl.models.layout_megatron import megatron_layout, megatron_rank_tensors
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard

    results = {}
    for seed, spec in enumerate(SPECS.values()):
        hf, w = hf_moe_model(spec, seed)
        fused = {n: p.detach().clone() for n, p in hf.named_parameters()}
        for (tp, pp, ep, experts), (kind, dst_tp) in itertools.product(SOURCES[spec.family], DESTINATIONS):
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
            initialize_model_parallel(mesh)
            model = build_model(spec, mesh, init_weights=False, moe_experts=experts)
            fill_local_tensors(megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(),
                                                     ps.get_pipeline_model_parallel_rank(),
                                                     ep_rank=ps.get_expert_model_parallel_rank(), moe_experts=experts),
                               dict(model.named_parameters()), state_dict_reader(w, spec.hf_tensor_shapes()))
            src = megatron_layout(spec, mesh, moe_experts=experts)
            if kind == "vllm":
                dst = vllm_layout(spec, dst_tp, range(world))
                want = ref_vllm(spec, w, dst_tp, rank % dst_tp)
            else:
                dst = hf_layout(spec, range(world), fused_experts=True)
                want = fused
            got = {n: torch.zeros_like(t) for n, t in want.items()}
            label = f"{spec.family} megatron tp{tp} pp{pp} ep{ep} {experts} -> {kind}{dst_tp or ''}"
            if set(got) != set(dst.tensors(rank)):
                results[label] = f"names differ: {sorted(set(got) ^ set(dst.tensors(rank)))[:6]}"
                continue
            stats = execute_plan(plan_reshard(src, dst), dict(model.named_parameters()),
                                 local_views(got, dst.tensors(rank)), bucket_bytes=8192, direct_min_bytes=None)
            bad = [n for n in want if not torch.equal(got[n], want[n])]
            results[label] = dict(bad=bad, received=stats.bytes_received,
                                  lower_bound=4 * missing_elements(src, dst, rank))
    ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def world_results():
    return run_world(_world, 4)


def test_every_moe_destination_tensor_equals_the_reference(world_results):
    for rank, results in enumerate(world_results):
        assert len(results) == CASES
        for label, r in results.items():
            assert isinstance(r, dict), (rank, label, r)
            assert not r["bad"], (rank, label, r["bad"])


def test_moe_reshard_receives_exactly_the_planners_lower_bound(world_results):
    for results in world_results:
        for label, r in results.items():
            assert r["received"] == r["lower_bound"], label
    # EP=2 -> vLLM TP=1: every engine rank holds all experts, and half of them come from the other EP rank
    assert any(r["received"] > 0 for results in world_results for label, r in results.items()
               if "ep2 grouped -> vllm1" in label)
