"""megatron_layout against real megatron-core models, on one world of 4 gloo ranks.

For TP=2 x PP=2 (and TP=2 x DP=2), tied and untied embeddings, with and without Q/K/V bias: the layout's local
names and shapes equal ``GPTModel.named_parameters()`` on every rank; HF weights loaded into the model with
``fill_local_tensors`` equal the independent reference slicer's shards; resharding the model's own parameters
back to whole HF tensors (and to vLLM TP=4) reproduces the weights bitwise.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.test_reshard_exact import MODELS, hf_weights, megatron_coords, ref_megatron, ref_vllm

CASES = [("gqa_tied", 2, 2, 1), ("gqa_untied_bias", 2, 2, 1), ("gqa_untied_bias", 2, 1, 2)]


def _world(rank: int, world: int) -> dict:
    from megarl.models.layout import hf_layout
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.megatron import build_model
    from megarl.models.spec import ModelSpec
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard

    out = {}
    for model, tp, pp, dp in CASES:
        label = f"{model} tp{tp} pp{pp} dp{dp}"
        fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
        spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
        mesh = ParallelLayout(tp, pp, dp)
        initialize_model_parallel(mesh)
        params = dict(build_model(spec, mesh).named_parameters())
        layout = megatron_layout(spec, mesh)
        local = layout.tensors(rank)
        out[label + " names"] = ({n: tuple(p.shape) for n, p in params.items()},
                                 {n: lt.shape for n, lt in local.items()})
        w = hf_weights(model, seed=1)
        fill_local_tensors(local, params, state_dict_reader(w, spec.hf_tensor_shapes()))
        r, stage = megatron_coords(rank, tp, dp)
        ref = ref_megatron(model, w, tp, pp, r, stage)
        out[label + " loaded"] = [n for n in ref if not torch.equal(params[n].detach(), ref[n])]
        back = {n: torch.zeros(t.shape) for n, t in w.items()}
        execute_plan(plan_reshard(layout, hf_layout(spec, range(world))), params, back, bucket_bytes=2048)
        out[label + " to hf"] = [n for n in w if not torch.equal(back[n], w[n])]
        want = ref_vllm(model, w, 4, rank)
        got = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in want.items()}
        execute_plan(plan_reshard(layout, vllm_layout(spec, 4, range(world))), params, got)
        out[label + " to vllm4"] = [n for n in want if not torch.equal(got[n], want[n].bfloat16())]
    return out


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(_world, 4, timeout_s=600)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}pp{c[2]}dp{c[3]}")
def test_layout_names_and_shapes_are_megatrons(world_results, case):
    label = f"{case[0]} tp{case[1]} pp{case[2]} dp{case[3]}"
    for rank, res in enumerate(world_results):
        model_params, layout = res[label + " names"]
        assert model_params == layout, (rank, set(model_params.items()) ^ set(layout.items()))
        if case[2] > 1 and not MODELS[case[0]][-1] and rank >= 2:
            assert "output_layer.weight" in layout
        if MODELS[case[0]][0] == "qwen2":
            assert any(n.endswith("linear_qkv.bias") for n in layout)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}pp{c[2]}dp{c[3]}")
def test_loaded_weights_match_the_reference_and_reshard_back_exactly(world_results, case):
    label = f"{case[0]} tp{case[1]} pp{case[2]} dp{case[3]}"
    for rank, res in enumerate(world_results):
        assert res[label + " loaded"] == [], rank
        assert res[label + " to hf"] == [], rank
        assert res[label + " to vllm4"] == [], rank
