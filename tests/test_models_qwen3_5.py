"""Qwen3.5 (text, hybrid gated DeltaNet + gated attention) on megatron-core against transformers'
``Qwen3_5ForCausalLM``, on one world of 2 gloo ranks (megatron's ``GatedDeltaNet`` on megarl's torch kernels).

A small random-weight model (fp32; norms randomised; layers 0 and 2 gated DeltaNet with 2 key heads and 4 value heads
of 16 / 8 channels, layers 1 and 3 gated attention with a quarter of each 16-channel head rotated) over 24 tokens:
logits at TP=1, TP=2 and PP=2, the gradients of a cross-entropy step at TP=1 and TP=2, HF -> megarl checkpoint
(PP=2) -> HF export bit-identical, and the refusals (CP, TP not dividing the DeltaNet heads, LoRA/TE).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.models.qwen3_5_spec import GatedDeltaNetShape
from megarl.models.spec import ModelSpec, SpecError
from tests import family_parity as fp
from tests.distributed import run_world

QWEN35 = ModelSpec("qwen3_5", vocab_size=1000, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                   head_dim=16, ffn_hidden_size=96, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   max_position_embeddings=256,
                   gdn=GatedDeltaNetShape((1, 0, 1, 0), num_key_heads=2, num_value_heads=4, key_head_dim=16,
                                          value_head_dim=8, conv_kernel=4, partial_rotary_factor=0.25))
MESHES = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) in a world of 2
TP_SUMMED = ("q_layernorm", "k_layernorm")  # summed over TP by megatron's finalize_model_grads (out_norm: in backward)


def hf_model(spec: ModelSpec, seed: int = 1):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():  # the (1 + w) norms start at 0 and the gated norm at 1: randomise them so they are checked
        for n, p in model.named_parameters():
            if p.dim() == 1 and "A_log" not in n and "dt_bias" not in n:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _world(rank, world, tmp):
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    spec = QWEN35
    ref = fp.reference(spec, hf_model(spec))
    out = {"logits": {}, "grads": {}, "tmp": tmp, "names": {}}
    for tp, pp in MESHES:
        mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp))
        initialize_model_parallel(mesh)
        model, local, params = fp.load(spec, mesh, ref, rank)
        out["names"][(tp, pp)] = fp.names_match(params, local)
        diff = fp.logits_diff(model, ref)
        if diff is not None:
            out["logits"][(tp, pp)] = diff
        if pp == 1:
            out["grads"][tp] = fp.grads_diff(model, local, params, ref, tp_summed=TP_SUMMED)
        if (tp, pp) == (2, 1):  # the reshard into vLLM's TP=2 layout, and back to whole HF tensors
            out.update(fp.reshard_checks(spec, mesh, params, ref.sd, _ref_vllm(ref.sd, rank), rank, world))

    # the trainer's default attention (sdpa), on padded rows and on the two sequences packed in one row (the
    # DeltaNet's convolution and state restart at the second sequence: cu_seqlens)
    out["logits"].update(fp.sdpa_and_packed(spec, ref, world, restart_positions=False))

    fp.save_pp2_checkpoint(spec, ref.sd, tmp, rank)  # HF -> megarl dist checkpoint (PP=2), exported in the test
    return out


def _ref_vllm(sd: dict, r: int) -> dict:
    """vLLM 0.24 Qwen3_5ForCausalLM's TP rank ``r`` of 2, sliced here from the HF tensors. DeltaNet layers (0, 2):
    ``in_proj_qkvz`` = [q_r; k_r; v_r; z_r] (16 rows each: in_proj_qkv holds q, k, v as rows 0-31, 32-63, 64-95),
    ``in_proj_ba`` = [b_r; a_r] (2 heads each), ``conv1d`` the same q/k/v channels, ``A_log``/``dt_bias`` 2 heads,
    ``norm`` whole, ``out_proj`` columns halved. Attention layers (1, 3): ``qkv_proj`` = [q_proj rows of heads 2r,
    2r + 1 (query and gate, 64 rows); k_r; v_r]. ``gate_up_proj`` = [gate_r; up_r], the vocab padded to 1024 and
    halved, untied ``lm_head`` the same way."""
    def half(t, n, start=0):
        return t[start + n * r:start + n * (r + 1)]

    out = {name: fp.vllm_vocab_shard(sd[name], r) for name in ("model.embed_tokens.weight", "lm_head.weight")}
    out["model.norm.weight"] = sd["model.norm.weight"]
    for i in range(4):
        p = f"model.layers.{i}."
        if i % 2 == 0:
            a = p + "linear_attn."
            qkv, conv = sd[a + "in_proj_qkv.weight"], sd[a + "conv1d.weight"]
            out[a + "in_proj_qkvz.weight"] = torch.cat([half(qkv, 16), half(qkv, 16, 32), half(qkv, 16, 64),
                                                        half(sd[a + "in_proj_z.weight"], 16)])
            out[a + "in_proj_ba.weight"] = torch.cat([half(sd[a + "in_proj_b.weight"], 2),
                                                      half(sd[a + "in_proj_a.weight"], 2)])
            out[a + "conv1d.weight"] = torch.cat([half(conv, 16), half(conv, 16, 32), half(conv, 16, 64)])
            out[a + "A_log"], out[a + "dt_bias"] = half(sd[a + "A_log"], 2), half(sd[a + "dt_bias"], 2)
            out[a + "norm.weight"] = sd[a + "norm.weight"]
            out[a + "out_proj.weight"] = sd[a + "out_proj.weight"][:, 16 * r:16 * (r + 1)]
        else:
            a = p + "self_attn."
            q, k, vv = (sd[a + f"{x}_proj.weight"] for x in "qkv")
            out[a + "qkv_proj.weight"] = torch.cat([half(q, 64), half(k, 16), half(vv, 16)])
            out[a + "o_proj.weight"] = sd[a + "o_proj.weight"][:, 32 * r:32 * (r + 1)]
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]
        out.update(fp.vllm_mlp_shard(sd, p + "mlp.", 48, r))
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, 2, str(tmp_path_factory.mktemp("qwen3_5")), timeout_s=600)


@pytest.mark.parametrize("tp,pp", MESHES)
def test_logits_match_transformers(world, tp, pp):
    for out in world:
        assert out["names"][(tp, pp)], "the layout's local tensors are not the model's parameters"
    diffs = [out["logits"][(tp, pp)] for out in world if (tp, pp) in out["logits"]]
    assert diffs and max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("attention", ["sdpa", "packed"])
def test_sdpa_attention_and_packed_sequences_match_transformers(world, attention):
    assert max(out["logits"][attention] for out in world) < 1e-4, [out["logits"][attention] for out in world]


@pytest.mark.parametrize("tp", [1, 2])
def test_gradients_match_transformers(world, tp):
    assert max(out["grads"][tp] for out in world) < 1e-4, [out["grads"][tp] for out in world]


def test_vllm_layout_is_an_independent_slicing_of_the_hf_tensors(world):
    for out in world:
        assert out["vllm_missing"] == out["vllm_extra"] == out["vllm_bad"] == out["hf_bad"] == [], out


@pytest.mark.slow  # about 20 s on top of the world's 40 s
def test_convert_export_roundtrip_is_bit_identical(world):
    """HF safetensors -> megarl dist checkpoint (PP=2) -> HF export: every tensor bit-identical, and the exported
    config.json is the same Qwen3.5 text model."""
    assert fp.export_roundtrip(QWEN35, world[0]["tmp"])["model_type"] == "qwen3_5_text"


def test_preset_shape_round_trips_through_its_hf_config():
    from megarl.models.spec import preset

    spec = preset("qwen3.5-27b?layers=8")
    assert spec.gdn.linear_pattern == (1, 1, 1, 0, 1, 1, 1, 0)
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


@pytest.mark.parametrize("change,message", [
    ({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}, "vision-language"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
    ({"linear_num_value_heads": 3}, "multiple of"),
])
def test_what_megarl_does_not_run_is_refused(change, message):
    cfg = {**QWEN35.to_hf_config().to_dict(), **change}
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("layout,kwargs,message", [
    (dict(tp=4), {}, "linear_num_key_heads=2"),
    (dict(tp=1, cp=2), {}, "context parallelism with Qwen3.5's linear attention"),
    (dict(tp=1), dict(use_te=True), "transformer_engine|Transformer Engine"),
])
def test_layouts_and_kernels_it_cannot_run_are_refused(layout, kwargs, message):
    from megarl.models.megatron import build_model, check_layout
    from megarl.parallel.mesh import ParallelLayout

    mesh = ParallelLayout(**layout)
    spec = QWEN35.replace(num_kv_heads=4) if layout.get("tp") == 4 else QWEN35
    with pytest.raises(SpecError, match=message):
        check_layout(spec, mesh) if not kwargs else build_model(spec, mesh, **kwargs)


@pytest.mark.parametrize("override,message", [
    ("actor.kernels.transformer_engine=true", r"actor\.kernels\.transformer_engine: Qwen3\.5 runs on the local"),
    ("actor.lora.rank=8", r"actor\.lora\.rank: LoRA adapters on Qwen3\.5"),
    ("actor.parallel.cp=2", r"context parallelism with Qwen3\.5's linear attention"),
])
def test_what_it_cannot_train_is_refused_before_the_run(override, message):
    spec = QWEN35.replace(max_position_embeddings=4096)  # the default config's prompt + response fit
    from megarl.config import ConfigError, load_config
    from megarl.trainer.preflight import validate_for_model

    with pytest.raises(ConfigError, match=message):
        validate_for_model(load_config(None, [override]), spec)
    validate_for_model(load_config(None), spec)


def test_flops_count_full_attention_on_full_layers_and_the_state_on_the_others():
    from megarl.measure.flops import forward_flops, matmul_params
    from megarl.models.spec import preset

    spec = preset("qwen3.5-27b")  # 48 DeltaNet layers (48 value heads of 128 x 128), 16 full-attention layers
    h, q, kv, s = spec.hidden_size, spec.q_size, spec.kv_size, 3000
    g = spec.gdn
    per_linear = h * (2 * g.key_dim + g.value_dim) + 2 * h * g.value_dim + 2 * h * g.num_value_heads
    per_full = h * 2 * q + 2 * h * kv + h * q
    assert matmul_params(spec) == 48 * per_linear + 16 * per_full + 64 * 3 * h * spec.ffn_hidden_size \
        + spec.vocab_size * h
    attention = 2 * 16 * q * s * (s + 1) + 6 * 48 * 48 * 128 * 128 * s
    assert forward_flops(spec, [s]) == pytest.approx(2 * matmul_params(spec) * s + attention, rel=1e-12)


def test_memory_estimate_counts_every_parameter_of_each_stage():
    import math

    from megarl.launch.memory import stage_params
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.spec import preset
    from megarl.parallel.mesh import ParallelLayout

    assert stage_params(preset("qwen3.5-27b"), 1, 1) == preset("qwen3.5-27b").num_params()
    spec = QWEN35.replace(vocab_size=1024, gdn=dataclasses.replace(QWEN35.gdn, linear_pattern=(1, 1, 1, 0)))
    held = [sum(math.prod(t.shape) for t in megatron_rank_tensors(spec, ParallelLayout(pp=2), 0, r).values())
            for r in range(2)]  # 3 DeltaNet layers and an attention one: the stages differ
    assert held[0] != held[1] and stage_params(spec, 1, 2) == max(held)
