"""Gemma 3 (text) on megatron-core against transformers' ``Gemma3ForCausalLM``, on one world of 2 gloo ranks.

A small random-weight model (fp32; norms randomised, head_dim 32 != hidden / heads, query_pre_attn_scalar 24,
local layers 0 and 2 with a 5-token window and RoPE base 1e4, global layers 1 and 3 with base 1e6 and linear
scaling) over 24 tokens: logits at TP=1, TP=2 and PP=2 (a local and a global layer on each stage), with sdpa
attention, packed sequences and CP=2, the gradients of a cross-entropy step at TP=1 and TP=2, HF -> megarl
checkpoint (PP=2) -> HF export bit-identical, and the vLLM TP=2 tensors the reshard writes against an independent
slicing of the HF tensors.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from tests import family_parity as fp
from tests.distributed import run_world

GEMMA3 = ModelSpec("gemma3", vocab_size=1000, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                   head_dim=32, ffn_hidden_size=96, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
                   rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=256, sliding_window=5,
                   sliding_window_pattern=(1, 0, 1, 0), local_rope_theta=1e4, query_pre_attn_scalar=24)
MESHES = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) in a world of 2


def hf_model(spec: ModelSpec, seed: int = 1):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma inits its norms to 0 (a scale of 1): randomise them so they are checked too
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _world(rank, world, tmp):
    from megatron.core import parallel_state as ps

    from megarl.kernels.context_parallel import split_for_cp_rank
    from megarl.models.lora import LoRASpec
    from megarl.models.pipeline import run_microbatches
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    spec = GEMMA3
    ref = fp.reference(spec, hf_model(spec))
    out = {"logits": {}, "grads": {}, "tmp": tmp}
    with torch.no_grad():  # the window and the local RoPE base change the logits: the test compares them
        out["window_matters"] = ref.diff(hf_model(spec.replace(sliding_window=spec.max_position_embeddings))(
            ref.tokens).logits)
        out["local_rope_matters"] = ref.diff(hf_model(spec.replace(local_rope_theta=spec.rope_theta))(
            ref.tokens).logits)

    for tp, pp in MESHES:
        mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp))
        initialize_model_parallel(mesh)
        model, local, params = fp.load(spec, mesh, ref, rank)
        diff = fp.logits_diff(model, ref)
        if diff is not None:
            out["logits"][(tp, pp)] = diff
        if pp == 1:  # megatron's finalize_model_grads sums the QK-norm gradients over TP
            out["grads"][tp] = fp.grads_diff(model, local, params, ref, tp_summed=("q_layernorm", "k_layernorm"))
        if (tp, pp) == (2, 1):  # LoRA on every target: the layout's names, zero adapters change nothing
            lora = fp.zero_lora(spec, mesh, ref, local, LoRASpec(rank=4, alpha=8.0))
            out["lora_names"], out["lora_adapters"] = lora["lora_names"], lora["lora_adapters"]
            out["logits"]["lora"] = lora["logits"]
            # the reshard into vLLM's TP=2 layout, and back to whole HF tensors
            out.update(fp.reshard_checks(spec, mesh, params, ref.sd, _ref_vllm(ref.sd, rank), rank, world))

    # the trainer's default attention (sdpa), on padded rows and on the two sequences packed in one row
    out["logits"].update(fp.sdpa_and_packed(spec, ref, world, restart_positions=False))

    # CP=2 (sdpa): each rank's share of the tokens (chunks r and 3 - r), its local layers' window across the cut
    mesh = ParallelLayout(tp=1, pp=1, dp=1, cp=2)
    initialize_model_parallel(mesh)
    model, _, _ = fp.load(spec, mesh, ref, 0, attention="sdpa")
    logits = run_microbatches(model.eval(), [{"input_ids": ref.tokens}],
                              lambda mb, o: (o.sum() * 0, {"logits": o[..., :spec.vocab_size]}),
                              forward_only=True)[0]["logits"]
    want = split_for_cp_rank(ref.logits, 1, ps.get_context_parallel_group())
    out["logits"]["cp"] = (logits - want).abs().max().item()

    fp.save_pp2_checkpoint(spec, ref.sd, tmp, rank)  # HF -> megarl dist checkpoint (PP=2), exported in the test
    return out


def _ref_vllm(sd: dict, r: int) -> dict:
    """vLLM 0.24 Gemma3ForCausalLM's TP rank ``r`` of 2, sliced here from the HF tensors: ``qkv_proj`` = [q_r; k_r;
    v_r] (2 query heads and 1 KV head a rank), ``gate_up_proj`` = [gate_r; up_r], o/down split on the input dim,
    the vocab padded to 1024 (a multiple of 64) and split in halves (the padding rows left zero), the norms whole
    (raw weights: GemmaRMSNorm adds 1 in forward), ``lm_head`` tied to ``embed_tokens``."""
    out = {"model.embed_tokens.weight": fp.vllm_vocab_shard(sd["model.embed_tokens.weight"], r),
           "model.norm.weight": sd["model.norm.weight"]}
    for i in range(4):
        p = f"model.layers.{i}."
        q, k, vv = (sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q[64 * r:64 * (r + 1)], k[32 * r:32 * (r + 1)],
                                                         vv[32 * r:32 * (r + 1)]])
        out[p + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"][:, 64 * r:64 * (r + 1)]
        out.update(fp.vllm_mlp_shard(sd, p + "mlp.", 48, r))
        for n in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, 2, str(tmp_path_factory.mktemp("gemma3")), timeout_s=600)


def test_window_and_local_rope_change_the_reference(world):
    assert world[0]["window_matters"] > 1e-2 and world[0]["local_rope_matters"] > 1e-3, world[0]


@pytest.mark.parametrize("tp,pp", MESHES)
def test_logits_equal_transformers(world, tp, pp):
    diffs = [r["logits"][(tp, pp)] for r in world if (tp, pp) in r["logits"]]
    assert len(diffs) == 2 // pp
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("attention", ["sdpa", "packed", "cp", "lora"])
def test_sdpa_attention_packed_sequences_cp2_and_zero_lora_equal_transformers(world, attention):
    assert max(r["logits"][attention] for r in world) <= 1e-4, [r["logits"] for r in world]


@pytest.mark.parametrize("tp", [1, 2])
def test_training_step_gradients_equal_transformers(world, tp):
    assert max(r["grads"][tp] for r in world) <= 1e-5, [r["grads"] for r in world]


def test_lora_adapters_sit_where_the_layout_says(world):
    assert all(r["lora_names"] and len(r["lora_adapters"]) == 4 * 4 * 2 for r in world)


def test_vllm_layout_is_an_independent_slicing_of_the_hf_tensors(world):
    for r in world:
        assert r["vllm_missing"] == r["vllm_extra"] == r["vllm_bad"] == r["hf_bad"] == [], r


def test_convert_export_roundtrip_is_bit_identical(world):
    """HF safetensors -> megarl dist checkpoint (PP=2) -> HF export: every tensor bit-identical, and the exported
    config.json is the same Gemma 3 text model."""
    assert fp.export_roundtrip(GEMMA3, world[0]["tmp"])["model_type"] == "gemma3_text"


def test_hub_config_json_of_gemma3_1b_gives_its_preset():
    """google/gemma-3-1b-pt's config.json (transformers 4.50 keys: rope_local_base_freq, sliding_window_pattern)."""
    from megarl.models.spec import preset

    cfg = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
           "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
           "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
           "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
           "rope_local_base_freq": 10000, "sliding_window": 512, "sliding_window_pattern": 6,
           "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
           "attention_bias": False, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec == preset("gemma3-1b")
    assert spec.sliding_window_pattern == tuple(int(i % 6 != 5) for i in range(26))
    assert 0.99e9 < spec.num_params() < 1.01e9


def test_transformer_engine_is_refused_before_the_run():
    from megarl.config import ConfigError, load_config
    from megarl.models.spec import preset
    from megarl.trainer.preflight import validate_for_model

    cfg = load_config(None, ["actor.kernels.transformer_engine=true"])
    with pytest.raises(ConfigError, match=r"actor\.kernels\.transformer_engine: Gemma 3 runs on the local layer"):
        validate_for_model(cfg, preset("gemma3-1b"))
    validate_for_model(load_config(None), preset("gemma3-1b"))


def test_flops_count_the_local_layers_attention_over_their_window():
    from megarl.measure.flops import forward_flops, matmul_params
    from megarl.models.spec import preset

    spec = preset("gemma3-1b")  # 22 local layers (window 512), 4 global
    s, w, q = 2000, 512, spec.q_size
    attention = 2 * 2 * q * (4 * sum(t + 1 for t in range(s)) + 22 * sum(min(t + 1, w) for t in range(s)))
    assert forward_flops(spec, [s]) == pytest.approx(2 * matmul_params(spec) * s + attention, rel=1e-12)
    assert forward_flops(spec, [w]) == pytest.approx(forward_flops(spec.replace(sliding_window_pattern=None,
                                                                                 sliding_window=None), [w]))


def test_memory_estimate_counts_every_parameter():
    from megarl.launch.memory import stage_params
    from megarl.models.spec import preset

    spec = preset("gemma3-1b")  # vocab 262144: no padding at TP=1
    assert stage_params(spec, 1, 1) == spec.num_params()


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "vision-language"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
])
def test_what_megarl_does_not_run_is_refused(change, message):
    cfg = {**GEMMA3.to_hf_config().to_dict(), **change}
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_hf_config(cfg)
