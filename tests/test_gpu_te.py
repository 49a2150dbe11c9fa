"""Transformer Engine's layer spec against transformers and against megarl's local spec (marked ``gpu``; skipped
without CUDA or without TE: ``perf/gpu_te.sh`` builds it on the H200).

In fp32 on one GPU, for a dense Qwen2 and a Qwen3-MoE (whose experts TE runs as grouped GEMMs, ``TEGroupedMLP``):

1. megarl's layout names every parameter of the TE-spec model (fused ``linear_qkv.layer_norm_weight``, grouped
   ``experts.linear_fc1.weight{j}``) with its shape: ``load_hf_weights`` fills the model and misses none;
2. its logits equal transformers' on the same weights;
3. a checkpoint written from TE's spec exports bit for bit (the MoE through TE's spec again, the dense model
   through the local spec, which reads TE's keys), and the local spec refuses the MoE one with the fix.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.megatron import have_transformer_engine
from tests.distributed import run_world
from tests.test_models_megatron import QWEN2, hf_model, megatron_logits
from tests.test_models_moe import QWEN3_MOE, hf_moe_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not have_transformer_engine(), reason="needs Transformer Engine")]


def _check(rank, world, tmp):
    from megarl.models import checkpoint as ck
    from megarl.models.convert import load_canonical
    from megarl.models.hf_io import open_hf_checkpoint, save_hf_checkpoint
    from megarl.models.megatron import build_model
    from megarl.models.spec import SpecError
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout())
    tokens = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(3)).cuda()
    out = {}
    dense = hf_model(QWEN2, 0)
    for name, spec, (ref, sd) in (("qwen2", QWEN2, (dense, {n: t.clone() for n, t in dense.state_dict().items()})),
                                  ("qwen3_moe", QWEN3_MOE, hf_moe_model(QWEN3_MOE, 0))):
        with torch.no_grad():
            ref_logits = ref.cuda()(tokens).logits
        save_hf_checkpoint(f"{tmp}/{name}", spec, sd)
        te = build_model(spec, ParallelLayout(), use_te=True, init_weights=False).cuda().eval()
        ck.load_hf_weights(te, open_hf_checkpoint(f"{tmp}/{name}"))
        logits = megatron_logits(te, tokens)[..., :spec.vocab_size]
        out[f"{name}_logits_diff"] = (logits - ref_logits).abs().max().item()
        out[f"{name}_experts"] = type(te.decoder.layers[0].mlp).__name__ + "/" + type(
            getattr(te.decoder.layers[0].mlp, "experts", te.decoder.layers[0].mlp)).__name__
        ck.save_model(f"{tmp}/{name}-ckpt", te)
        exported = load_canonical(f"{tmp}/{name}-ckpt")
        out[f"{name}_export_mismatch"] = [n for n, t in sd.items() if not torch.equal(exported[n].cpu(), t)]
        if spec.is_moe:
            local = build_model(spec, ParallelLayout(), init_weights=False).cuda()
            try:
                ck.load_model(f"{tmp}/{name}-ckpt", local)
            except SpecError as e:
                out["moe_local_refusal"] = str(e)
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_world(_check, 1, str(tmp_path_factory.mktemp("te")))[0]


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_te_spec_logits_equal_transformers(result, name):
    print(f"\nTE spec {name} ({result[f'{name}_experts']}): max |logits - transformers| "
          f"{result[f'{name}_logits_diff']:.2e}")
    assert result[f"{name}_logits_diff"] < 2e-3


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_te_checkpoint_exports_bit_for_bit(result, name):
    assert result[f"{name}_export_mismatch"] == []


def test_moe_experts_are_grouped_and_the_local_spec_refuses_their_checkpoint(result):
    assert result["qwen3_moe_experts"] == "MoELayer/TEGroupedMLP"
    assert "actor.kernels.transformer_engine=true" in result["moe_local_refusal"]
