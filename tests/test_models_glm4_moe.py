"""GLM-4.5 (GQA with partial RoPE, q/k/v bias and QK-norm; DeepSeek-V3's MoE) on megatron-core against transformers'
``Glm4MoeForCausalLM``, on a world of 2 gloo ranks.

A small random-weight model (fp32; norms, q/k/v biases, experts and the router's score-correction bias randomised):
4 layers, the first dense; 4 query and 2 KV heads of 16 channels, half of them rotated; 8 experts in 4 groups (the
best 2 groups, scored by their 2 best experts as both megatron and transformers then do), top 4, one shared expert,
routed_scaling_factor 2.5; one MTP layer in the config (dropped). Default tier: logits over 24 tokens within 1e-4 at
TP=2 and EP=2 and with the sdpa attention on padded and packed rows, the routing bias and the partial RoPE shown to
change them, megarl's TP=2 tensors back to HF bit-identical and into vLLM's TP=2 layout equal to an independent
slicing; spec, refusal, preset, FLOPs, preflight and transformers-engine checks. Slow: logits at TP=1, PP=2 (a dense and
an MoE layer on the first stage) and PP=2 x VPP=2 too, a cross-entropy step's gradients at TP=1, and HF safetensors ->
megarl dist checkpoint (PP=2) -> HF export, bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from tests import family_parity as fp
from tests.distributed import run_world
from tests.test_models_deepseek import hf_model  # the same random init: norms, biases, experts and the routing bias

MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]  # (tp, pp, ep) in a world of 2
QUICK = [(2, 1, 1), (1, 1, 2)]


def _config(**extra):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{"n_group": 4, "topk_group": 2, "use_qk_norm": True, "attention_bias": True,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}, **extra},
                         vocab_size=1000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, partial_rotary_factor=0.5, max_position_embeddings=256,
                         tie_word_embeddings=False, num_nextn_predict_layers=1)


GLM = ModelSpec.from_hf_config(_config())


def _ref_vllm(sd: dict, r: int) -> dict:
    """vLLM 0.24 Glm4MoeForCausalLM's TP rank ``r`` of 2, sliced here from the HF tensors: ``qkv_proj`` weight and bias
    = [q_r; k_r; v_r] (2 query heads, 1 KV head: 32 + 16 + 16 rows), ``o_proj`` its 32 input columns, q/k norms and
    layer norms whole, the dense layer's gate/up rows (48 each) and the shared experts' (16 each) as ``gate_up_proj``
    and their down columns halved, every routed expert's gate/up rows [16 r, 16 r + 16) stacked as ``w13_weight`` and
    its down columns as ``w2_weight``, the router (``mlp.gate``) and its ``e_score_correction_bias`` whole, the vocab
    padded to 1024 and halved."""
    out = {name: fp.vllm_vocab_shard(sd[name], r) for name in ("model.embed_tokens.weight", "lm_head.weight")}
    out["model.norm.weight"] = sd["model.norm.weight"]
    q_rows, kv_rows = slice(32 * r, 32 * (r + 1)), slice(16 * r, 16 * (r + 1))
    for i in range(4):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for suffix in ("weight", "bias"):
            out[a + f"qkv_proj.{suffix}"] = torch.cat([sd[a + f"q_proj.{suffix}"][q_rows],
                                                      sd[a + f"k_proj.{suffix}"][kv_rows],
                                                      sd[a + f"v_proj.{suffix}"][kv_rows]])
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"][:, q_rows]
        for n in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
        out.update(fp.vllm_mlp_shard(sd, p + "mlp.", 48, r) if i == 0 else
                   fp.vllm_mlp_shard(sd, p + "mlp.shared_experts.", 16, r))
        if i:
            e, own = p + "mlp.experts.", slice(16 * r, 16 * (r + 1))
            out[p + "mlp.gate.weight"] = sd[p + "mlp.gate.weight"]
            out[p + "mlp.gate.e_score_correction_bias"] = sd[p + "mlp.gate.e_score_correction_bias"]
            out[e + "routed_experts.w13_weight"] = torch.cat([torch.cat([
                sd[e + f"{j}.gate_proj.weight"][own], sd[e + f"{j}.up_proj.weight"][own]]) for j in range(8)])
            out[e + "routed_experts.w2_weight"] = torch.cat([sd[e + f"{j}.down_proj.weight"][:, own] for j in range(8)])
    return out


def _world(rank, world, tmp, meshes, checkpoint):
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models.checkpoint import chunk_parameters
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.lora import LoRASpec
    from megarl.models.megatron import build_model, build_model_chunks
    from megarl.models.pipeline import run_microbatches
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    spec = GLM
    ref = fp.reference(spec, hf_model(spec), canonical=True)
    out = {"logits": {}, "tmp": tmp}
    with torch.no_grad():  # what the parity rests on changes transformers' logits: the routing bias, partial RoPE
        other = hf_model(spec)
        for name, b in other.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        out["bias_matters"] = ref.diff(other(ref.tokens).logits)
        full = hf_model(spec.replace(glm=dataclasses.replace(spec.glm, partial_rotary_factor=1.0)))
        out["partial_rope_matters"] = ref.diff(full(ref.tokens).logits)

    for tp, pp, ep in meshes:
        mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
        initialize_model_parallel(mesh)
        model, local, params = fp.load(spec, mesh, ref, rank)
        assert sorted(params) == sorted(local), sorted(set(params) ^ set(local))
        diff = fp.logits_diff(model, ref)
        if diff is not None:
            out["logits"][(tp, pp, ep)] = diff
        if (tp, pp, ep) == (1, 1, 1):
            out["grads"] = fp.grads_diff(model, local, params, ref, frozen_ok=True)
            out["frozen"] = sorted(n for n, p in params.items() if not p.requires_grad)
        if (tp, pp, ep) == (2, 1, 1):  # megarl's tensors back to whole HF tensors, and into vLLM's TP=2 layout
            r = fp.reshard_checks(spec, mesh, params, ref.sd, _ref_vllm(ref.sd, rank), rank, world, reshape=True)
            out["export_bad"] = r["hf_bad"]
            out["vllm_bad"] = r["vllm_missing"] + r["vllm_extra"] + r["vllm_bad"]
            # on every target: the layout's names, zero adapters change nothing
            lora = fp.zero_lora(spec, mesh, ref, local, LoRASpec(rank=4, alpha=8.0))
            out["lora_names"] = (lora["lora_names"], sorted(n.split(".", 2)[-1] for n in lora["lora_adapters"]))
            out["logits"]["lora"] = lora["logits"]
        if pp == 2 and checkpoint:  # HF safetensors -> megarl dist checkpoint at PP=2 (exported in the test)
            fp.save_dist_checkpoint(build_model(spec, mesh, init_weights=False), spec, ref.sd, tmp, rank)
        ps.destroy_model_parallel()
        dist.barrier()
    if checkpoint:  # PP=2 x VPP=2: the dense layer alone in rank 0's first chunk, one layer a chunk
        mesh = ParallelLayout(pp=2, vpp=2)
        initialize_model_parallel(mesh)
        chunks = build_model_chunks(spec, mesh)
        params = chunk_parameters(chunks)
        fill_local_tensors(megatron_rank_tensors(spec, mesh, 0, ps.get_pipeline_model_parallel_rank()), params,
                           state_dict_reader(ref.sd, spec.hf_tensor_shapes()))
        res = run_microbatches(chunks, [{"input_ids": ref.tokens[i:i + 1]} for i in range(2)],
                               lambda mb, o: (o.sum() * 0, {"logits": o[..., :spec.vocab_size]}), forward_only=True)
        if res:
            out["logits"]["vpp"] = ref.diff(torch.cat([r["logits"] for r in res]))
        ps.destroy_model_parallel()
    if not checkpoint:  # the trainer's attention (sdpa), on padded rows and on the two sequences packed in one row
        out["logits"].update(fp.sdpa_and_packed(spec, ref, world, restart_positions=True))
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The default tier's world: TP=2 (logits, HF and vLLM layouts) and EP=2 (logits)."""
    return run_world(_world, 2, str(tmp_path_factory.mktemp("glm4_moe")), QUICK, False, timeout_s=600)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every mesh, the gradients at TP=1, the dist checkpoint at PP=2."""
    return run_world(_world, 2, str(tmp_path_factory.mktemp("glm4_moe")), MESHES, True, timeout_s=900)


def test_at_tp2_and_ep2_equals_transformers_and_lays_out_for_hf_and_vllm(quick):
    assert max(r["logits"][mesh] for r in quick for mesh in (*QUICK, "lora")) <= 1e-4, [r["logits"] for r in quick]
    assert min(r["bias_matters"] for r in quick) > 1e-3 and quick[0]["partial_rope_matters"] > 1e-3, quick[0]
    assert all(r["export_bad"] == [] and r["vllm_bad"] == [] for r in quick), quick


def test_lora_adapts_attention_the_dense_layer_and_the_shared_experts(quick):
    """LoRA on every target at TP=2: the model's parameters are the layout's, with adapters on q/k/v, o, the dense
    first layer's MLP and the MoE layers' shared experts (not the routed experts: ``lora.experts`` is off)."""
    same, adapted = quick[0]["lora_names"]
    assert same and adapted == sorted(
        [f"{i}.self_attention.{m}.{f}" for i in range(4) for m in ("linear_qkv", "linear_proj") for f in ("lora_a",
                                                                                                        "lora_b")]
        + [f"0.mlp.{m}.{f}" for m in ("linear_fc1", "linear_fc2") for f in ("lora_a", "lora_b")]
        + [f"{i}.mlp.shared_experts.{m}.{f}" for i in (1, 2, 3) for m in ("linear_fc1", "linear_fc2")
           for f in ("lora_a", "lora_b")]), adapted


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", MESHES)
def test_logits_equal_transformers(world, tp, pp, ep):
    diffs = [r["logits"][(tp, pp, ep)] for r in world if (tp, pp, ep) in r["logits"]]
    assert len(diffs) == 2 // pp and max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("key", ["sdpa", "packed"])
def test_sdpa_and_packed_logits_equal_transformers(quick, key):
    """The trainer's sdpa attention, on padded rows and on both rows packed in one (positions restarting, as
    :func:`megarl.workers.packing.pack_rows` packs them): the partial RoPE of each sequence from its own start."""
    assert max(r["logits"][key] for r in quick) <= 1e-4, [r["logits"][key] for r in quick]


@pytest.mark.slow
def test_pp2_vpp2_logits_equal_transformers(world):
    diffs = [r["logits"]["vpp"] for r in world if "vpp" in r["logits"]]
    assert len(diffs) == 1 and diffs[0] <= 1e-4, diffs


@pytest.mark.slow
def test_training_step_gradients_equal_transformers(world):
    """Every trained weight's gradient within 1e-5; the only frozen parameters are the routers' expert bias (HF's
    ``e_score_correction_bias``, a buffer there)."""
    assert max(r["grads"] for r in world) <= 1e-5, [r["grads"] for r in world]
    assert world[0]["frozen"] == [f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)], world[0]["frozen"]


@pytest.mark.slow
def test_convert_export_roundtrip_is_bit_identical(world):
    """HF safetensors -> megarl dist checkpoint (PP=2) -> HF export: every tensor bit-identical, and the exported
    config.json the same model (no MTP layer)."""
    config = fp.export_roundtrip(GLM, world[0]["tmp"])
    assert config["num_nextn_predict_layers"] == 0


def test_config_round_trip_drops_the_mtp_layer():
    assert GLM.deepseek_moe.mtp_layers == 1 and ModelSpec.from_hf_config(GLM.to_hf_config()) == GLM
    assert (GLM.qkv_bias, GLM.qk_norm, GLM.glm.rotary_dim(GLM.head_dim)) == (True, True, 8)
    assert not any(n.startswith("model.layers.4.") for n in GLM.hf_tensor_shapes())
    air = ModelSpec.from_hf_config(_config(use_qk_norm=False, attention_bias=False))
    assert not (air.qk_norm or air.qkv_bias) and not any("norm.weight" in n and "self_attn" in n
                                                         for n in air.hf_tensor_shapes())


@pytest.mark.parametrize("change,words", [
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(n_group=2, topk_group=1), "top 2"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "'linear'"),
])
def test_what_megatron_would_compute_otherwise_is_refused(change, words):
    with pytest.raises(SpecError, match=words):
        ModelSpec.from_hf_config(_config(**change))


def test_presets_count_parameters_and_flops():
    from megarl.measure.flops import forward_flops
    from megarl.models.spec import preset

    big, air = preset("glm-4.5"), preset("glm-4.5-air")
    assert round(big.num_params() / 1e9) == 353 and round(big.num_active_params() / 1e9) == 34  # "355B-A32B"
    assert round(air.num_params() / 1e9) == 107 and round(air.num_active_params() / 1e9) == 13  # "106B-A12B"
    assert preset("glm-4.5?layers=2").deepseek_moe.first_k_dense == 1
    s, h = 10, GLM.hidden_size
    attn = 2 * h * 64 + 2 * h * 32  # q and o (4 heads x 16), k and v (2 heads x 16)
    dense, moe = 3 * h * 96, 8 * h + 4 * 3 * h * 32 + 3 * h * 32  # router, 4 experts, the shared expert
    weights = 2 * s * (4 * attn + dense + 3 * moe + 1000 * h)
    scores = 4 * 64 * s * (s + 1) / 2 * 2 * 2  # QK^T and AV over 64 channels, causal
    assert forward_flops(GLM, [s]) == pytest.approx(weights + scores, rel=1e-12)


@pytest.mark.parametrize("overrides,field", [
    (["actor.moe.router_replay=true"], "actor.moe.router_replay"),
    (["actor.parallel.cp=2", "actor.kernels.attention=sdpa"], "actor.parallel.cp"),
    (["rollout.engine=vllm", "rollout.quantization=fp8"], "rollout.quantization"),
])
def test_preflight_refuses_what_glm_cannot_run(overrides, field):
    from megarl.config import ConfigError, load_config
    from megarl.models.spec import preset
    from megarl.trainer.preflight import validate_for_model

    spec = preset("glm-4.5-air?layers=2")
    packing = ["actor.sequence_packing=true", "actor.max_tokens_per_micro_batch=4096", "actor.kernels.attention=sdpa"]
    validate_for_model(load_config(None, ["rollout.engine=vllm", "actor.lora.rank=8", *packing]), spec)
    with pytest.raises(ConfigError, match=f"^{field}: "):
        validate_for_model(load_config(None, overrides), spec)
