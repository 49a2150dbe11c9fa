"""Qwen3-Next and Qwen3.5-MoE (hybrid gated DeltaNet + gated attention, an MoE block with a gated shared expert on
every layer) on megatron-core against transformers' ``Qwen3NextForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (logits,
gradients at TP=1, TP=2 and EP=2, the vLLM tensors), on worlds of 2 gloo ranks.

A small random-weight model (fp32; norms randomised; layers 0 and 2 gated DeltaNet, 1 and 3 gated attention; 4
experts, top 2, a shared expert) over 16 tokens: logits at TP=1, TP=2 (with sequence parallelism), EP=2 and PP=2,
a training step's gradients at TP=1, HF -> megarl checkpoint (PP=2) -> HF export bit-identical, Qwen3-Next's
DeltaNet projections fused by key-head group (``in_proj_qkvz``, ``in_proj_ba``) cut into megatron's ``in_proj``, and
the vLLM TP=2 tensors against an independent slicing of the HF tensors. A second world trains each model as the
trainer's actor does (DDP, ``finalize_model_grads``, grouped experts, all-to-all dispatch) at TP=1, TP=2 (sequence
parallel) and EP=2: every gradient equals transformers'.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests import family_parity as fp
from tests.distributed import run_world
from tests.test_models_qwen3_5 import QWEN35

NEXT = dataclasses.replace(QWEN35, family="qwen3_next", num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32,
                           shared_expert_ffn_hidden_size=48, moe_norm_topk_prob=True)
Q35_MOE = dataclasses.replace(NEXT, family="qwen3_5_moe", ffn_hidden_size=32)  # Qwen3.5's projections, the same MoE
SPECS = {"qwen3_next": NEXT, "qwen3_5_moe": Q35_MOE}
MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (tp, ep, pp) in a world of 2
SEQ = 16


def _world(rank, world, tmp):
    from megatron.core import parallel_state as ps

    out = {"logits": {}, "names": {}, "vllm_names": {}, "vllm_bad": {}, "tmp": tmp}
    for spec in SPECS.values():
        _family_checks(spec, rank, world, out, tmp)
    ps.destroy_model_parallel()
    return out


def hf_model(spec):
    """The transformers model of ``spec`` (fp32, random weights, norms randomised)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    ref = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if p.dim() == 1 and "A_log" not in n and "dt_bias" not in n:
                p.add_(torch.randn_like(p) * 0.3)
    return ref


def _family_checks(spec, rank, world, out, tmp):
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    ref = fp.reference(spec, hf_model(spec), seq=SEQ, canonical=True)
    f = spec.family
    for tp, ep, pp in MESHES:
        mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
        initialize_model_parallel(mesh)
        model, local, params = fp.load(spec, mesh, ref, rank, fill=pp != 2, init_weights=False,
                                       moe_experts="sequential", sequence_parallel=tp > 1)
        out["names"][(f, tp, ep, pp)] = sorted(params) == sorted(local)
        if pp == 2:  # HF safetensors -> megarl dist checkpoint at PP=2 (exported in the test)
            fp.save_dist_checkpoint(model, spec, ref.sd, f"{tmp}/{f}", rank)
        diff = fp.logits_diff(model, ref)
        if diff is not None:  # the last stage
            out["logits"][(f, tp, ep, pp)] = diff
        if (tp, ep, pp) == (1, 1, 1):  # a training step's gradients (no aux loss: moe_aux_loss_coef 0)
            out.setdefault("grads", {})[f] = fp.grads_diff(model, local, params, ref)
        if (tp, ep, pp) == (2, 1, 1):  # the rest as Qwen3.5's (tests/test_models_qwen3_5.py)
            r = fp.reshard_checks(spec, mesh, params, ref.sd, _ref_vllm(ref.sd, rank, fused=f == "qwen3_next"), rank,
                                  world, moe_experts="sequential")
            out["vllm_names"][f], out["vllm_bad"][f] = r["vllm_missing"] == [], r["vllm_bad"]
            out.setdefault("hf_bad", {})[f] = r["hf_bad"]


def _ref_vllm(sd: dict, r: int, fused: bool) -> dict:
    """vLLM 0.24 Qwen3NextForCausalLM's DeltaNet and MoE tensors on TP rank ``r`` of 2, sliced here from the HF
    ones: ``in_proj_qkvz`` the rank's half of the fused rows (key-head group ``r``: 16 + 16 + 16 + 16 rows),
    ``in_proj_ba`` its half (4 rows), ``conv1d`` ``[q_r; k_r; v_r]`` of the non-fused channels; the router whole, the
    experts' w13 ``[gate_r; up_r]`` per expert (16 rows each), w2 on its input dim, the shared expert as a dense MLP
    of width 48 (24 a rank) and its gate whole. Qwen3.5-MoE (not ``fused``): the MoE tensors only (its DeltaNet's are
    Qwen3.5's)."""
    out = {}
    for i in (0, 2) if fused else ():
        a = f"model.layers.{i}.linear_attn."
        out[a + "in_proj_qkvz.weight"] = sd[a + "in_proj_qkvz.weight"][64 * r:64 * (r + 1)]
        out[a + "in_proj_ba.weight"] = sd[a + "in_proj_ba.weight"][4 * r:4 * (r + 1)]
        conv = sd[a + "conv1d.weight"]
        out[a + "conv1d.weight"] = torch.cat([conv[16 * r:16 * (r + 1)], conv[32 + 16 * r:32 + 16 * (r + 1)],
                                              conv[64 + 16 * r:64 + 16 * (r + 1)]])
    for i in range(4):
        p = f"model.layers.{i}.mlp."
        out[p + "gate.weight"] = sd[p + "gate.weight"]
        out[p + "experts.routed_experts.w13_weight"] = torch.cat([torch.cat([
            sd[p + f"experts.{e}.gate_proj.weight"][16 * r:16 * (r + 1)],
            sd[p + f"experts.{e}.up_proj.weight"][16 * r:16 * (r + 1)]]) for e in range(4)])
        out[p + "experts.routed_experts.w2_weight"] = torch.cat([
            sd[p + f"experts.{e}.down_proj.weight"][:, 16 * r:16 * (r + 1)] for e in range(4)])
        out[p + "shared_expert.gate_up_proj.weight"] = torch.cat([
            sd[p + "shared_expert.gate_proj.weight"][24 * r:24 * (r + 1)],
            sd[p + "shared_expert.up_proj.weight"][24 * r:24 * (r + 1)]])
        out[p + "shared_expert.down_proj.weight"] = sd[p + "shared_expert.down_proj.weight"][:, 24 * r:24 * (r + 1)]
        out[p + "shared_expert_gate.weight"] = sd[p + "shared_expert_gate.weight"]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, 2, str(tmp_path_factory.mktemp("qwen3_next")), timeout_s=600)


TRAINER_MESHES = [(1, 1), (2, 1), (1, 2)]  # (tp, ep) in a world of 2


def _trainer_world(rank, world, tmp):
    """Each family's actor as the trainer builds it (:class:`megarl.workers.engine.MegatronWorker`: megatron's DDP
    and ``finalize_model_grads``, grouped experts, the all-to-all dispatcher at EP > 1, sequence parallelism at
    TP > 1), loaded from the HF checkpoint, one training step of the cross-entropy: per (family, tp, ep) the max abs
    difference of this rank's gradients (``main_grad``, every block of every tensor) from transformers'."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.config import ActorConfig
    from megarl.config.roles import OptimConfig, ParallelConfig
    from megarl.models.hf_io import save_hf_checkpoint
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.pipeline import run_microbatches
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.engine import MegatronWorker

    out = {}
    for f, spec in SPECS.items():
        ref = fp.reference(spec, hf_model(spec), seq=SEQ, canonical=True)
        if rank == 0:
            save_hf_checkpoint(f"{tmp}/{f}", spec, ref.sd)
        dist.barrier()
        for tp, ep in TRAINER_MESHES:
            mesh = ParallelLayout(tp=tp, pp=1, dp=world // tp, ep=ep)
            initialize_model_parallel(mesh)
            rc = ActorConfig(parallel=ParallelConfig(tp=tp, ep=ep, sequence_parallel=tp > 1),
                             optim=OptimConfig(distributed=False))  # every DP rank's gradients whole
            worker = MegatronWorker(spec, mesh, "actor", f"{tmp}/{f}", torch.float32, rc, trainable=True)
            run_microbatches(worker.model, [{"input_ids": ref.tokens}], ref.output_fn(True), forward_only=False)
            local = megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(), 0,
                                          ep_rank=mesh.ep_rank(rank), moe_experts=rc.kernels.moe_experts)
            params = dict(worker.bare.named_parameters())
            out[(f, tp, ep)] = {n: max((params[n].main_grad[b.dst_box] - ref.grads[b.name][b.src_box]).abs().max()
                                       .item() for b in lt.blocks) for n, lt in local.items()}
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def trainer_world(tmp_path_factory):
    return run_world(_trainer_world, 2, str(tmp_path_factory.mktemp("qwen3_next_trainer")), timeout_s=600)


@pytest.mark.slow  # about 60 s on 2 cores
@pytest.mark.parametrize("family", SPECS)
@pytest.mark.parametrize("tp,ep", TRAINER_MESHES)
def test_trainer_gradients_at_tp2_and_ep2_match_transformers(trainer_world, family, tp, ep):
    bad = {n: d for out in trainer_world for n, d in out[(family, tp, ep)].items() if not d < 1e-4}
    assert bad == {}, bad


@pytest.mark.slow  # the world takes about 50 s on 2 cores (Qwen3.5's dense file keeps the default tier's checks)
@pytest.mark.parametrize("family", SPECS)
@pytest.mark.parametrize("tp,ep,pp", MESHES)
def test_logits_match_transformers(world, family, tp, ep, pp):
    assert all(out["names"][(family, tp, ep, pp)] for out in world)
    diffs = [out["logits"][(family, tp, ep, pp)] for out in world if (family, tp, ep, pp) in out["logits"]]
    assert diffs and max(diffs) < 1e-4, diffs


@pytest.mark.slow
@pytest.mark.parametrize("family", SPECS)
def test_training_step_gradients_match_transformers(world, family):
    assert max(out["grads"][family] for out in world) < 1e-4, [out["grads"][family] for out in world]


@pytest.mark.slow
@pytest.mark.parametrize("family", SPECS)
def test_vllm_layout_is_an_independent_slicing_of_the_hf_tensors(world, family):
    for out in world:
        assert out["vllm_names"][family] and out["vllm_bad"][family] == [] and out["hf_bad"][family] == [], out


@pytest.mark.slow
@pytest.mark.parametrize("family", SPECS)
def test_convert_export_roundtrip_is_bit_identical(world, family):
    fp.export_roundtrip(SPECS[family], f"{world[0]['tmp']}/{family}")


def test_config_round_trip_preset_and_memory_estimate():
    from megarl.models.spec import preset

    assert ModelSpec.from_hf_config(NEXT.to_hf_config()) == NEXT
    assert ModelSpec.from_hf_config(Q35_MOE.to_hf_config()) == Q35_MOE
    spec = preset("qwen3-next-80b-a3b?layers=4")
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
    from megarl.launch.memory import stage_params

    full = preset("qwen3-next-80b-a3b")
    assert stage_params(full, 1, 1) == full.num_params() and 79e9 < full.num_params() < 81e9
