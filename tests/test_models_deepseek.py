"""DeepSeek-V3 (multi-latent attention MoE) on megatron-core against transformers' ``DeepseekV3ForCausalLM``, on
worlds of 2 gloo ranks.

Two small random-weight models (fp32; norms, experts and the router's score-correction bias randomised), 3 layers,
the first dense: one with a query latent (``q_lora_rank`` set: DeepSeek-V3, Kimi K2), group-limited routing (4
groups, the best 2, scored by their 2 best experts as both megatron and transformers then do) and YaRN RoPE with
DeepSeek-V3's mscale; one without (Moonlight's shape, plain RoPE). Default tier: the V3 shape at TP=2 (logits over
24 tokens within 1e-4, the bias and YaRN shown to change them, megarl's tensors back to HF bit-identical, vLLM's
TP=2 tensors equal to an independent slicing); spec, refusal, preset, FLOPs and preflight checks. Slow: both shapes
at TP=1, TP=2 and EP=2, the gradients of a cross-entropy step at TP=1, and HF -> dist checkpoint -> HF export.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from tests import family_parity as fp
from tests.distributed import run_world


def _config(q_lora: int | None, **extra):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{"num_key_value_heads": 4, **extra}, vocab_size=1000, hidden_size=64,
                            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=4,
                            first_k_dense_replace=1, q_lora_rank=q_lora,
                            kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                            routed_scaling_factor=2.5, max_position_embeddings=256, tie_word_embeddings=False,
                            num_nextn_predict_layers=1)


V3 = ModelSpec.from_hf_config(_config(24, n_group=4, topk_group=2, rope_parameters={
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}))
MOONLIGHT = ModelSpec.from_hf_config(_config(None, n_group=1, topk_group=1, rope_parameters={
    "rope_type": "default", "rope_theta": 50000.0}))
SPECS = {"v3": V3, "moonlight": MOONLIGHT}
MESHES = [(1, 1), (2, 1), (1, 2)]  # (tp, ep) in a world of 2


def hf_model(spec: ModelSpec, seed: int = 1):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1, the bias at 0 and the experts empty: randomise them all
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif ".experts." in name:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.1)
    return model


def _ref_vllm(spec: ModelSpec, sd: dict, r: int) -> dict:
    """vLLM 0.24 DeepseekV2ForCausalLM's TP rank ``r`` of 2, sliced here from the HF tensors: ``fused_qkv_a_proj`` =
    [q_a_proj; kv_a_proj_with_mqa] whole (or ``kv_a_proj_with_mqa`` whole and ``q_proj``'s 2 heads), ``q_b_proj`` /
    ``kv_b_proj`` the rank's 2 heads (20 / 22 rows a head), ``o_proj`` its 2 heads' 20 input columns, the dense
    layer's and the shared experts' gate/up rows and down columns halved, every routed expert's gate/up rows
    [16 r, 16 r + 16) as ``w13_weight`` and down columns as ``w2_weight``, the router and its bias whole, the vocab
    padded to 1024 and halved."""
    out = {name: fp.vllm_vocab_shard(sd[name], r) for name in ("model.embed_tokens.weight", "lm_head.weight")}
    out["model.norm.weight"] = sd["model.norm.weight"]
    for i in range(3):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if spec.mla.q_lora_rank is None:
            out[a + "kv_a_proj_with_mqa.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
            out[a + "q_proj.weight"] = sd[a + "q_proj.weight"][40 * r:40 * (r + 1)]
        else:
            out[a + "fused_qkv_a_proj.weight"] = torch.cat([sd[a + "q_a_proj.weight"],
                                                            sd[a + "kv_a_proj_with_mqa.weight"]])
            out[a + "q_a_layernorm.weight"] = sd[a + "q_a_layernorm.weight"]
            out[a + "q_b_proj.weight"] = sd[a + "q_b_proj.weight"][40 * r:40 * (r + 1)]
        out[a + "kv_a_layernorm.weight"] = sd[a + "kv_a_layernorm.weight"]
        out[a + "kv_b_proj.weight"] = sd[a + "kv_b_proj.weight"][44 * r:44 * (r + 1)]
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"][:, 20 * r:20 * (r + 1)]
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
        out.update(fp.vllm_mlp_shard(sd, p + "mlp.", 48, r) if i == 0 else
                   fp.vllm_mlp_shard(sd, p + "mlp.shared_experts.", 32, r))
        if i:
            e = p + "mlp.experts."
            out[p + "mlp.gate.weight"] = sd[p + "mlp.gate.weight"]
            out[p + "mlp.gate.e_score_correction_bias"] = sd[p + "mlp.gate.e_score_correction_bias"]
            own = slice(16 * r, 16 * (r + 1))
            out[e + "routed_experts.w13_weight"] = torch.cat([torch.cat([
                sd[e + f"{j}.gate_proj.weight"][own], sd[e + f"{j}.up_proj.weight"][own]]) for j in range(8)])
            out[e + "routed_experts.w2_weight"] = torch.cat([sd[e + f"{j}.down_proj.weight"][:, own] for j in range(8)])
    return out


def _world(rank, world, tmp, keys, meshes, checkpoint):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    out = {"logits": {}, "grads": {}, "export_bad": {}, "vllm_bad": {}, "tmp": tmp}
    for key in keys:
        spec = SPECS[key]
        ref = fp.reference(spec, hf_model(spec), canonical=True)
        with torch.no_grad():  # what the parity rests on changes transformers' logits: the routing bias, YaRN
            other = hf_model(spec)
            for name, b in other.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.zero_()
            out[f"bias_matters_{key}"] = ref.diff(other(ref.tokens).logits)
            if spec.rope_scaling:
                out["yarn_matters"] = ref.diff(hf_model(spec.replace(rope_scaling=None))(ref.tokens).logits)

        for tp, ep in meshes:
            mesh = ParallelLayout(tp=tp, pp=1, dp=world // tp, ep=ep)
            initialize_model_parallel(mesh)
            model, local, params = fp.load(spec, mesh, ref, rank, moe_experts="sequential")
            assert sorted(params) == sorted(local), (sorted(set(params) ^ set(local)))
            out["logits"][(key, tp, ep)] = fp.logits_diff(model, ref)
            if (tp, ep) == (1, 1):
                out["grads"][key] = fp.grads_diff(model, local, params, ref, frozen_ok=True)
            if (tp, ep) == (2, 1):  # megarl's tensors back to whole HF tensors, and into vLLM's TP=2 layout
                r = fp.reshard_checks(spec, mesh, params, ref.sd, _ref_vllm(spec, ref.sd, rank), rank, world,
                                      reshape=True, moe_experts="sequential")
                out["export_bad"][key] = r["hf_bad"]
                out["vllm_bad"][key] = r["vllm_missing"] + r["vllm_extra"] + r["vllm_bad"]
            if (tp, ep) == (2, 1) and checkpoint:  # HF safetensors -> megarl dist checkpoint (exported in the test)
                fp.save_dist_checkpoint(build_model(spec, mesh, moe_experts="sequential", init_weights=False), spec,
                                        ref.sd, f"{tmp}/{key}", rank)
            ps.destroy_model_parallel()
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The default tier's world: DeepSeek-V3's shape at TP=2 (logits, HF and vLLM layouts)."""
    return run_world(_world, 2, str(tmp_path_factory.mktemp("deepseek")), ("v3",), [(2, 1)], False, timeout_s=600)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Both shapes at TP=1, TP=2 and EP=2, the gradients at TP=1, the dist checkpoints at TP=2."""
    return run_world(_world, 2, str(tmp_path_factory.mktemp("deepseek")), tuple(SPECS), MESHES, True, timeout_s=900)


def test_v3_shape_at_tp2_equals_transformers_and_lays_out_for_hf_and_vllm(quick):
    assert max(r["logits"][("v3", 2, 1)] for r in quick) <= 1e-4, [r["logits"] for r in quick]
    assert min(r["bias_matters_v3"] for r in quick) > 1e-3 and quick[0]["yarn_matters"] > 1e-3, quick[0]
    assert all(r["export_bad"]["v3"] == [] and r["vllm_bad"]["v3"] == [] for r in quick), quick


@pytest.mark.slow
def test_convert_export_roundtrip_is_bit_identical(world):
    """HF safetensors -> megarl dist checkpoint (TP=2; the router bias a frozen float32 parameter) -> HF export:
    every tensor bit-identical, and the exported config.json the same model with vLLM's routing keys."""
    config = fp.export_roundtrip(V3, f"{world[0]['tmp']}/v3")
    assert (config["scoring_func"], config["topk_method"], config["num_nextn_predict_layers"]) == (
        "sigmoid", "noaux_tc", 0)


@pytest.mark.slow
def test_routing_bias_and_yarn_change_the_reference(world):
    r = world[0]
    assert min(r["bias_matters_v3"], r["bias_matters_moonlight"], r["yarn_matters"]) > 1e-3, r


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SPECS))
@pytest.mark.parametrize("tp,ep", MESHES)
def test_logits_equal_transformers(world, key, tp, ep):
    diffs = [r["logits"][(key, tp, ep)] for r in world]
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SPECS))
def test_training_step_gradients_equal_transformers(world, key):
    assert max(r["grads"][key] for r in world) <= 1e-5, [r["grads"] for r in world]


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SPECS))
def test_megatron_tensors_back_to_hf_and_vllm_equal_an_independent_slicing(world, key):
    assert all(r["export_bad"][key] == [] and r["vllm_bad"][key] == [] for r in world), world


def test_config_round_trip_drops_the_mtp_layer():
    for spec in SPECS.values():
        assert spec.deepseek_moe.mtp_layers == 1 and ModelSpec.from_hf_config(spec.to_hf_config()) == spec
        assert not any(n.startswith("model.layers.3.") for n in spec.hf_tensor_shapes())


@pytest.mark.parametrize("change,words", [
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(n_group=2, topk_group=1), "top 2"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "'linear'"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
])
def test_what_megatron_would_compute_otherwise_is_refused(change, words):
    with pytest.raises(SpecError, match=words):
        ModelSpec.from_hf_config(_config(24, **{"n_group": 1, "topk_group": 1, **change}))


def test_layouts_refuse_what_is_not_built():
    from megarl.models.layout_vllm import check_vllm_fp8
    from megarl.models.megatron import check_layout, layer_spec
    from megarl.models.lora import LoRASpec
    from megarl.parallel.mesh import ParallelLayout

    with pytest.raises(SpecError, match="MoE model"):
        check_vllm_fp8(V3, 1)
    with pytest.raises(SpecError, match="cp=2"):
        check_layout(V3, ParallelLayout(cp=2))
    with pytest.raises(SpecError, match="q_lora_rank=25"):
        check_layout(V3.replace(mla=dataclasses.replace(V3.mla, q_lora_rank=25)), ParallelLayout(tp=2))
    with pytest.raises(SpecError, match="lora.enabled=false"):
        layer_spec(spec=V3, lora=LoRASpec(rank=4, alpha=8.0))


def test_presets_and_flops_count_mla():
    from megarl.measure.flops import forward_flops
    from megarl.models.spec import preset

    v3, moon = preset("deepseek-v3"), preset("moonlight-16b-a3b")
    assert round(v3.num_params() / 1e9) == 671 and round(v3.num_active_params() / 1e9) == 38  # "671B, 37B active"
    assert round(moon.num_params() / 1e9) == 16 and round(moon.num_active_params() / 1e9) == 3  # "16B-A3B"
    assert preset("deepseek-v3?layers=2").deepseek_moe.first_k_dense == 1
    s, m, h, heads = 10, MOONLIGHT.mla, MOONLIGHT.hidden_size, MOONLIGHT.num_attention_heads
    attn = h * heads * m.qk_head_dim + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (
        m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h
    dense, moe = 3 * h * 96, 8 * h + 4 * 3 * h * 32 + 3 * h * 64  # router, 4 experts, shared experts (2 x 32)
    weights = 2 * s * (3 * attn + dense + 2 * moe + 1000 * h)
    scores = 3 * heads * (m.qk_head_dim + m.v_head_dim) * s * (s + 1) / 2 * 2  # QK^T and AV, causal
    assert forward_flops(MOONLIGHT, [s]) == pytest.approx(weights + scores, rel=1e-12)


@pytest.mark.parametrize("overrides,field", [
    (["actor.sequence_packing=true", "actor.max_tokens_per_micro_batch=4096", "actor.kernels.attention=sdpa"],
     "actor.sequence_packing"),
    (["actor.lora.rank=8"], "actor.lora.rank"),
    (["actor.moe.router_replay=true"], "actor.moe.router_replay"),
    (["actor.parallel.cp=2", "actor.kernels.attention=sdpa"], "actor.parallel.cp"),
    (["rollout.engine=vllm", "rollout.quantization=fp8"], "rollout.quantization"),
])
def test_preflight_refuses_what_deepseek_v3_cannot_run(overrides, field):
    from megarl.config import ConfigError, load_config
    from megarl.models.spec import preset
    from megarl.trainer.preflight import validate_for_model

    spec = preset("moonlight-16b-a3b?layers=2")
    validate_for_model(load_config(None, ["rollout.engine=vllm"]), spec)
    with pytest.raises(ConfigError, match=f"^{field}: "):
        validate_for_model(load_config(None, overrides), spec)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_transformers_engine_takes_the_router_bias_as_a_weight(family):
    """The transformers rollout engine holds ``e_score_correction_bias`` as a buffer (DeepSeek-V3, GLM-4.5): its
    weights are the canonical tensors all the same, the bias written in place."""
    from megarl.rollout.hf_engine import HFRolloutEngine
    from tests.test_models_glm4_moe import GLM

    engine = HFRolloutEngine(V3 if family == "deepseek_v3" else GLM)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    views = engine.update_weights(lambda views: views)
    views[name].fill_(0.25)
    assert dict(engine.model.named_buffers())[name].eq(0.25).all()
