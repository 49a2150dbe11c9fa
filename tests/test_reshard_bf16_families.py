"""The reshard of a bf16 actor (``model.dtype=bfloat16``) of every family of issue 43 into the rollout engines,
as the trainer runs it (:meth:`megarl.trainer.trainer.Trainer.reshard_actor_to_engine`: the actor's parameters
as they are, no ``wire_dtype``), on one world of 2 gloo ranks.

A bf16 actor is not all bf16: a DeepSeek-style router keeps its expert bias (HF's ``e_score_correction_bias``)
in float32 (:func:`megarl.models.deepseek_moe_layers.freeze_expert_bias`), so DeepSeek-V3's and GLM-4.5's
sources mix two dtypes. The destinations are held as the engines hold them: vLLM 0.24.0 in bf16 but for the
float32 tensors of :func:`vllm_dtype` (read from vllm/model_executor/models/deepseek_v2.py, glm4_moe.py and
layers/mamba/gdn/qwen_gdn_linear_attn.py), transformers (rollout.engine=hf; not gpt-oss) all in float32. The actor is at PP = 2
and each rank holds a TP = 1 engine: a rank copies its own stage's tensors locally (cast as on one GPU) and
receives the other stage's (the transfers travel). Every destination tensor must equal the source cast to its dtype; the
reference is the same reshard of the sources cast to float32 into float32 tensors (one dtype; exact for bf16
and float32 values alike), cast to the destination's dtype.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.test_models_deepseek import V3
from tests.test_models_gemma3 import GEMMA3
from tests.test_models_glm4_moe import GLM
from tests.test_models_gpt_oss import GPT_OSS
from tests.test_models_megatron import PHI3, QWEN3
from tests.test_models_moe import QWEN3_MOE
from tests.test_models_qwen3_5 import QWEN35
from tests.test_models_qwen3_next import NEXT, Q35_MOE

SPECS = [V3.replace(num_layers=2), GLM, GPT_OSS, NEXT, Q35_MOE, QWEN3_MOE, QWEN3, PHI3, GEMMA3, QWEN35]
MESHES = [(1, 2)]  # (tp, pp) of the actor in a world of 2
DESTINATIONS = ("vllm", "hf")
NO_HF = ("gpt_oss",)  # its transformers model's experts are no box of the canonical tensors (hf_layout refuses)


def vllm_dtype(spec, name: str) -> torch.dtype:
    """The dtype vLLM 0.24.0 holds parameter ``name`` of a bf16 model in: float32 for the DeepSeek-style router's
    ``e_score_correction_bias`` (DeepSeek-V3's ``noaux_tc``, GLM-4.5's), GLM-4.5's router weight
    (``nn.Linear(dtype=torch.float32)``) and the gated DeltaNet's ``A_log``; bf16 for everything else."""
    fp32 = name.endswith((".e_score_correction_bias", ".A_log")) or \
        (spec.family == "glm4_moe" and name.endswith(".mlp.gate.weight"))
    return torch.float32 if fp32 else torch.bfloat16


def _world(rank, world):
    from megatron.core import parallel_state as ps

    from megarl.models.checkpoint import chunk_parameters
    from megarl.models.layout import hf_layout, local_views
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard

    results = {}
    for spec in SPECS:
        for tp, pp in MESHES:
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp))
            initialize_model_parallel(mesh, seed=0)
            experts = "sequential" if spec.is_moe else "grouped"
            actor = build_model(spec, mesh, params_dtype=torch.bfloat16, moe_experts=experts)
            src = chunk_parameters(actor)
            g = torch.Generator().manual_seed(rank)
            with torch.no_grad():  # float32 values a bf16 rounding would change, where a tensor holds them
                for p in src.values():
                    p.copy_(torch.randn(p.shape, generator=g))
            dtypes = sorted({str(p.dtype) for p in src.values()})
            for kind in [k for k in DESTINATIONS if k == "vllm" or spec.family not in NO_HF]:
                dst = (vllm_layout(spec, 1, range(world)) if kind == "vllm" else
                       hf_layout(spec, range(world), fused_experts=True))
                plan = plan_reshard(megatron_layout(spec, mesh, padded_vocab=actor.vocab_size, moe_experts=experts),
                                    dst)
                shapes = dst.tensors(rank)
                got = {n: torch.zeros(t.shape, dtype=vllm_dtype(spec, n) if kind == "vllm" else torch.float32)
                       for n, t in shapes.items()}
                ref = {n: torch.zeros(t.shape) for n, t in shapes.items()}
                label = f"{spec.family} tp{tp} pp{pp} ({', '.join(dtypes)}) -> {kind}"
                execute_plan(plan, src, local_views(got, shapes), bucket_bytes=1 << 16)
                execute_plan(plan, {n: p.float() for n, p in src.items()}, local_views(ref, shapes),
                             bucket_bytes=1 << 16)
                results[label] = [n for n in got if not torch.equal(got[n], ref[n].to(got[n].dtype))]
            ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def world_results():
    return run_world(_world, 2)


def test_a_bf16_actor_of_every_family_reshards_exactly_into_the_engines(world_results):
    for rank, results in enumerate(world_results):
        assert len(results) == (len(SPECS) * len(DESTINATIONS) - len(NO_HF)) * len(MESHES)
        bad = {label: r for label, r in results.items() if r}
        assert not bad, f"rank {rank}: {bad}"


def test_the_deepseek_style_routers_send_a_float32_bias_beside_bf16_weights(world_results):
    """The case the reshard must carry: sources of two dtypes (the check above then covers the float32 bias
    reaching vLLM's float32 tensor unrounded)."""
    labels = [label for results in world_results for label in results if "(torch.bfloat16, torch.float32)" in label]
    assert {label.split()[0] for label in labels} == {"deepseek_v3", "glm4_moe"}, world_results


def _gpu_family_actors(rank, world):
    from megatron.core import parallel_state as ps

    from megarl.models.layout import local_views
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from tests.test_gpu_families import FAMILIES, engine_plan

    results = {}
    for family, (make, build_kwargs, _) in FAMILIES.items():
        spec, mesh = make(), ParallelLayout()
        initialize_model_parallel(mesh, seed=0)
        actor = build_model(spec, mesh, params_dtype=torch.bfloat16, **build_kwargs)
        layout = vllm_layout(spec, 1, [0])
        shapes = layout.tensors(0)
        got = {n: torch.full(t.shape, float("nan"), dtype=torch.bfloat16) for n, t in shapes.items()}
        try:
            execute_plan(engine_plan(actor, spec, mesh, layout), {n: p.detach() for n, p in actor.named_parameters()},
                         local_views(got, shapes))
            vocab = ("embed_tokens.weight", "embedding.weight", "lm_head.weight")  # vLLM pads their rows (unwritten)
            results[family] = sorted(n for n, t in got.items()  # the tensors the plan left (partly) unwritten
                                     if (t[:spec.vocab_size] if n.endswith(vocab) else t).isnan().any())
        except Exception as e:  # noqa: BLE001 (reported per family)
            results[family] = f"{type(e).__name__}: {e}"[:300]
        ps.destroy_model_parallel()
    return results


def test_the_gpu_family_checks_reshard_their_actors_into_vllm():
    """What tests/test_gpu_families.py does before vLLM decodes, on the CPU: each family's actor, built with that
    file's arguments (MoE experts as sequential modules), resharded into the vLLM layout, every tensor written.
    (Its plan once assumed grouped experts, and DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5-MoE failed on the
    GPU with a missing source tensor just after vLLM started.)"""
    results = run_world(_gpu_family_actors, 1, timeout_s=900)[0]
    assert results and all(r == [] for r in results.values()), results
