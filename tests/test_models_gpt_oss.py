"""gpt-oss on megatron-core against transformers' ``GptOssForCausalLM``, on one world of 2 gloo ranks.

A small random-weight model (fp32; every bias, sink and norm randomised, weights scaled so that the SwiGLU clamp at
7 bites): 2 layers, layer 0 with a 5-token window and layer 1 full, head_dim 16 != hidden / heads, GQA, YaRN RoPE
(factor 4: attention factor 1.139), 4 experts of top-2. Over 24 tokens: logits at TP=1, TP=2, EP=2 and PP=2, with
zero LoRA adapters on every target, the gradients of a cross-entropy step at TP=1, the vLLM TP=2 tensors the reshard
writes against an independent slicing, HF safetensors -> megarl -> HF export bit-identical, presets, FLOPs and the
refusals.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from tests import family_parity as fp
from tests.distributed import run_world

GPT_OSS = ModelSpec("gpt_oss", vocab_size=1000, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                    head_dim=16, ffn_hidden_size=32, rope_theta=150000.0,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 64},
                    rms_norm_eps=1e-5, max_position_embeddings=256, sliding_window=5, sliding_window_pattern=(1, 0),
                    num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, eos_token_ids=(2,), pad_token_id=0)
MESHES = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1)]  # (tp, ep, pp) in a world of 2: PP=2 puts layer 0 (sliding) and
# layer 1 (full) on stages of their own


def hf_model(spec: ModelSpec, seed: int = 1):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = spec.to_hf_config()
    config._attn_implementation = "eager"  # the sinks: eager (or flex) attention
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # biases and sinks start at 0, norms at 1: randomise them; experts large enough to clamp
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.5)
            elif "experts" in name:
                p.mul_(40.0)
    return model


def _world(rank, world):
    from megatron.core import parallel_state as ps

    from megarl.models.gpt_oss import canonical_to_checkpoint
    from megarl.models.layout_lora import adapter_layout, lora_targets, with_lora_merge
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.models.lora import LoRASpec
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    spec = GPT_OSS
    ref_model = hf_model(spec)
    ref = fp.reference(spec, ref_model, canonical=True)
    hf = {n: p.detach() for n, p in ref_model.named_parameters()}
    out = {"logits": {}, "grads": {}}
    with torch.no_grad():  # the window, the sinks and the clamp change the logits: the test compares them
        out["window_matters"] = ref.diff(hf_model(spec.replace(sliding_window_pattern=(0, 0)))(ref.tokens).logits)
        sinkless = hf_model(spec)
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        out["sinks_matter"] = ref.diff(sinkless(ref.tokens).logits)
        layer0 = ref_model.model.layers[0]
        x = layer0.post_attention_layernorm(ref_model.model.embed_tokens(ref.tokens))  # roughly layer 0's input
        gate_up = x @ layer0.mlp.experts.gate_up_proj[0]
        out["clamped"] = (gate_up.abs() > 7).float().mean().item()

    for tp, ep, pp in MESHES:
        mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
        initialize_model_parallel(mesh)
        model, local, params = fp.load(spec, mesh, ref, rank, attention="local", moe_experts="sequential")
        out.setdefault("names", {})[(tp, ep, pp)] = sorted(params) == sorted(local)
        diff = fp.logits_diff(model, ref)
        if diff is not None:  # the last stage
            out["logits"][(tp, ep, pp)] = diff
        if (tp, ep, pp) == (2, 1, 1):  # the reshard into vLLM's TP=2 layout, and back to whole HF tensors
            out.update(fp.reshard_checks(spec, mesh, params, ref.sd, _ref_vllm(hf, rank), rank, world,
                                         moe_experts="sequential"))
            # LoRA on every target, experts too: the layout's adapter names are the model's, zero adapters change
            # nothing
            lora = LoRASpec(rank=4, alpha=8.0, experts=True)
            zero = fp.zero_lora(spec, mesh, ref, local, lora, attention="local", moe_experts="sequential")
            out["lora_names"], out["logits"]["lora"] = zero["lora_names"], zero["logits"]
            out["lora_adapters"] = sum("lora_a" in n for n in zero["lora_adapters"])
            # random adapters (replicas alike: seeded by name), merged by the reshard into vLLM's layout
            aparams = dict(zero["model"].named_parameters())
            with torch.no_grad():
                for n, t in aparams.items():
                    if "lora_" in n:
                        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode()))))
            lsrc = megatron_layout(spec, mesh, lora=lora, moe_experts="sequential")
            ad = fp.reshard(aparams, lsrc, adapter_layout(spec, lora, range(world)), rank)
            merged = dict(ref.sd)
            for w, (a, b) in lora_targets(spec, lora).items():
                merged[w] = (ref.sd[w].double() + lora.alpha / lora.rank * (ad[b].double() @ ad[a].double())).float()
            want = _ref_vllm(canonical_to_checkpoint(spec, merged), rank)
            got = fp.reshard(aparams, lsrc, with_lora_merge(vllm_layout(spec, 2, range(world)), lora), rank)
            out["lora_vllm_bad"] = [n for n in want if n not in got or not torch.equal(got[n], want[n])]
            out["lora_merge_changes"] = sum(not torch.equal(want[n], v) for n, v in _ref_vllm(hf, rank).items())
        if (tp, ep, pp) == (1, 1, 1):
            out["grads"] = fp.grads_diff(model, local, params, ref)
    ps.destroy_model_parallel()
    return out


def _convert_world(rank, world, tmp):
    """HF safetensors (the checkpoint's fused experts) -> megarl dist checkpoint at EP=2."""
    from megatron.core import parallel_state as ps

    from megarl.models.megatron import build_model
    from megarl.models.weights import transformers_canonical
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    sd = transformers_canonical(GPT_OSS, dict(hf_model(GPT_OSS).named_parameters()))
    initialize_model_parallel(ParallelLayout(tp=1, pp=1, dp=2, ep=2))
    model = build_model(GPT_OSS, ParallelLayout(tp=1, pp=1, dp=2, ep=2), moe_experts="sequential")
    fp.save_dist_checkpoint(model, GPT_OSS, sd, tmp, rank)
    ps.destroy_model_parallel()


def _ref_vllm(hf: dict, r: int) -> dict:
    """vLLM 0.24 GptOssForCausalLM's TP rank ``r`` of 2, sliced here from transformers' parameters as vLLM's
    ``_load_weights_other`` slices a bf16 checkpoint: ``qkv_proj`` = [q_r; k_r; v_r] (2 query heads and 1 KV head a
    rank) with its bias, ``o_proj`` split on the input dim with its bias whole, 2 sinks a rank, the router whole,
    ``w13`` = ``gate_up_proj[e, :, 32 r : 32 (r + 1)].T`` (gate and up interleaved), ``w2`` = ``down_proj[e, 16 r :
    16 (r + 1)].T``, ``w2_bias`` on rank 0 only (zeros elsewhere), the vocab padded to 1024 and split in halves, the
    3-D experts viewed 2-D."""
    out = {}
    for name, local in (("model.embed_tokens.weight", "model.embedding.weight"), ("lm_head.weight", "lm_head.weight")):
        padded = torch.zeros(1024, 64)
        padded[:1000] = hf[name]
        out[local] = padded[512 * r:512 * (r + 1)]
    for i in range(2):
        p, a, m, x = (f"model.layers.{i}.", f"model.layers.{i}.attn.", f"model.layers.{i}.mlp.",
                      f"model.layers.{i}.mlp.experts.")
        for suffix in ("weight", "bias"):
            q, k, vv = (hf[p + f"self_attn.{n}_proj.{suffix}"] for n in "qkv")
            out[a + f"qkv_proj.{suffix}"] = torch.cat([q[32 * r:32 * (r + 1)], k[16 * r:16 * (r + 1)],
                                                       vv[16 * r:16 * (r + 1)]])
        out[a + "o_proj.weight"] = hf[p + "self_attn.o_proj.weight"][:, 32 * r:32 * (r + 1)]
        out[a + "o_proj.bias"] = hf[p + "self_attn.o_proj.bias"]
        out[a + "sinks"] = hf[p + "self_attn.sinks"][2 * r:2 * (r + 1)]
        out[m + "router.weight"], out[m + "router.bias"] = hf[m + "router.weight"], hf[m + "router.bias"]
        y = x + "routed_experts."
        out[y + "w13_weight"] = hf[x + "gate_up_proj"][:, :, 32 * r:32 * (r + 1)].permute(0, 2, 1).reshape(-1, 64)
        out[y + "w13_bias"] = hf[x + "gate_up_proj_bias"][:, 32 * r:32 * (r + 1)].reshape(-1)
        out[y + "w2_weight"] = hf[x + "down_proj"][:, 16 * r:16 * (r + 1)].permute(0, 2, 1).reshape(-1, 16)
        out[y + "w2_bias"] = hf[x + "down_proj_bias"].reshape(-1) * (r == 0)
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = hf[p + n + ".weight"]
    out["model.norm.weight"] = hf["model.norm.weight"]
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(_world, 2, timeout_s=600)


def test_window_sinks_and_clamp_change_the_reference(world):
    w = world[0]
    assert w["window_matters"] > 1e-2 and w["sinks_matter"] > 1e-2 and w["clamped"] > 0.05, w


@pytest.mark.parametrize("mesh", MESHES)
def test_logits_equal_transformers(world, mesh):
    for rank in (0, 1):
        assert world[rank]["names"][mesh], "the layout names every parameter of megatron's model"
    last = 1 if mesh[2] == 2 else 0
    assert world[last]["logits"][mesh] < 1e-4, (mesh, world[last]["logits"])
    assert mesh[2] == 2 or world[1]["logits"][mesh] < 1e-4, (mesh, world[1]["logits"])


def test_reshard_into_vllm_equals_an_independent_slicing(world):
    """megarl's vLLM TP=2 tensors (reshard from Megatron TP=2) equal vLLM's bf16 loader's slicing of transformers'
    parameters, done in the test; the reshard back to whole HF tensors gives the canonical ones."""
    for rank in (0, 1):
        w = world[rank]
        assert w["vllm_missing"] == w["vllm_extra"] == w["vllm_bad"] == w["hf_bad"] == [], (rank, w)


def test_lora_on_every_target_keeps_the_logits(world):
    """LoRA adapters (zero) on q/k/v, o, and the 4 experts' fc1/fc2 of each of the 2 layers, at TP=2: the layout's
    names and shapes are the model's, the logits transformers'; random adapters merged by the reshard into vLLM's
    layout equal the merge of the whole tensors sliced as vLLM's loader slices them."""
    for rank in (0, 1):
        w = world[rank]
        assert w["lora_names"] and w["lora_adapters"] == 2 * (2 + 2 * 4), w["lora_adapters"]
        assert w["logits"]["lora"] < 1e-4, w["logits"]
        # random adapters merged into vLLM's TP=2 tensors: W + (alpha / r) B A of the whole canonical tensors, sliced
        assert w["lora_vllm_bad"] == [] and w["lora_merge_changes"] == 2 * 4, (w["lora_vllm_bad"],
                                                                               w["lora_merge_changes"])


def test_gradients_equal_transformers(world):
    assert world[0]["grads"] < 1e-4, world[0]["grads"]



@pytest.mark.slow  # two worlds of their own (as test_models_megatron's newer families' exports)
def test_convert_export_roundtrip_is_bit_identical(tmp_path):
    """HF safetensors (experts fused as transformers writes them) -> megarl dist checkpoint (EP=2) -> HF export: every
    stored tensor bit-identical, loadable by transformers, and the exported config.json the same model."""
    from transformers import AutoModelForCausalLM

    from megarl.launch.convert import export_to_hf
    from megarl.models.gpt_oss import checkpoint_shapes
    from megarl.models.hf_io import open_hf_checkpoint, read_hf_config

    tmp = str(tmp_path)
    run_world(_convert_world, 2, tmp, timeout_s=600)
    export_to_hf(f"{tmp}/mg", f"{tmp}/hf_out")
    source, back = open_hf_checkpoint(f"{tmp}/hf_in"), open_hf_checkpoint(f"{tmp}/hf_out")
    stored = checkpoint_shapes(GPT_OSS)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored and sorted(back.tensor_names) == sorted(stored)
    assert [n for n in stored if not torch.equal(back._read_stored(n), source._read_stored(n))] == []
    assert ModelSpec.from_hf_config(read_hf_config(f"{tmp}/hf_out")) == GPT_OSS
    loaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/hf_out", dtype=torch.float32)
    ref = hf_model(GPT_OSS)
    assert all(torch.equal(p, ref.state_dict()[n]) for n, p in loaded.state_dict().items())


def test_presets_have_the_model_cards_sizes():
    """gpt-oss-20b and -120b: 20.91B and 116.83B parameters (model card, table 1); active 3.61B and 5.13B there,
    which leaves out the unembedding (201088 x 2880), counted here."""
    from megarl.models.spec import preset

    unembedding = 201088 * 2880
    for name, total, active in (("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)):
        spec = preset(name)
        assert spec.num_params() == pytest.approx(total, abs=0.005e9)
        assert spec.num_active_params() - unembedding == pytest.approx(active, abs=0.005e9)
    cut = preset("gpt-oss-20b?layers=3")
    assert cut.num_layers == 3 and cut.sliding_window_pattern == (1, 0, 1)


def test_config_json_round_trip_and_refusals(tmp_path):
    """A gpt_oss config.json (transformers 4.55's keys: rope_scaling, swiglu_limit) gives the 20b preset; the MXFP4
    release is refused with the recipe for a bf16 copy; other swiglu limits and layer types are refused."""
    from megarl.models.spec import preset

    spec = preset("gpt-oss-20b")
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
           "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
           "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings":
                            4096, "rope_type": "yarn", "truncate": False}, "rms_norm_eps": 1e-05,
           "max_position_embeddings": 131072, "attention_bias": True, "swiglu_limit": 7.0, "eos_token_id": 200002,
           "pad_token_id": 199999, "router_aux_loss_coef": 0.9, "tie_word_embeddings": False}
    assert ModelSpec.from_hf_config(cfg) == spec
    mxfp4 = {**cfg, "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}
    with pytest.raises(SpecError, match=r"quantised with 'mxfp4'.*Mxfp4Config\(dequantize=True\)"):
        ModelSpec.from_hf_config(mxfp4)
    with pytest.raises(SpecError, match="swiglu_limit=8.0"):
        ModelSpec.from_hf_config({**cfg, "swiglu_limit": 8.0})
    with pytest.raises(SpecError, match="layer_types"):
        ModelSpec.from_hf_config({**cfg, "layer_types": ["chunked_attention"] * 24})


def test_kernels_without_sinks_or_expert_biases_are_refused_before_the_run():
    from megarl.config import ConfigError, load_config
    from megarl.models.megatron import layer_spec
    from megarl.models.spec import preset
    from megarl.trainer.preflight import validate_for_model

    spec = preset("gpt-oss-20b?layers=2")
    ok = ["actor.kernels.attention=local", "actor.kernels.moe_experts=sequential", "rollout.engine=vllm"]
    validate_for_model(load_config(None, ok), spec)
    for override, match in (("actor.kernels.attention=sdpa", r"actor\.kernels\.attention: .*sinks"),
                            ("actor.kernels.moe_experts=grouped", r"actor\.kernels\.moe_experts: .*biases"),
                            ("rollout.engine=hf", r"rollout\.engine: ")):
        with pytest.raises(ConfigError, match=match):
            validate_for_model(load_config(None, [*ok, override]), spec)
    with pytest.raises(SpecError, match="attention='sdpa': gpt-oss's attention sinks"):
        layer_spec(attention="sdpa", spec=spec, moe_experts="sequential")
    # vLLM's gpt-oss builds YaRN whatever the config says (a KeyError in vLLM's loader without its fields)
    without_beta = {k: v for k, v in spec.rope_scaling.items() if k != "beta_fast"}
    for rope in (None, without_beta):
        with pytest.raises(ConfigError, match=r"model\.path: rope_scaling=.*vLLM's gpt-oss always applies YaRN"):
            validate_for_model(load_config(None, ok), spec.replace(rope_scaling=rope))


def test_flops_count_the_windowed_layers_attention_over_their_window():
    """gpt-oss-20b: 12 layers attend over a 128-token band, 12 over every earlier token."""
    from megarl.measure.flops import forward_flops, matmul_params
    from megarl.models.spec import preset

    spec = preset("gpt-oss-20b")
    s, w, q = 1000, 128, spec.q_size
    attention = 2 * 2 * q * (12 * sum(t + 1 for t in range(s)) + 12 * sum(min(t + 1, w) for t in range(s)))
    assert forward_flops(spec, [s]) == pytest.approx(2 * matmul_params(spec) * s + attention, rel=1e-12)


def test_memory_estimate_counts_every_parameter():
    """The memory estimate's parameter count of one stage is the model's, biases and sinks included (TP=1 x
    PP=1), and an EP=2 rank holds half of the experts."""
    from megarl.launch.memory import stage_params
    from megarl.models.megatron import padded_vocab_size

    spec = GPT_OSS
    padding = 2 * (padded_vocab_size(spec.vocab_size, 1) - spec.vocab_size) * spec.hidden_size
    assert stage_params(spec, 1, 1) == spec.num_params() + padding
    expert = 3 * 64 * 32 + 2 * 32 + 64
    assert stage_params(spec, 1, 1, ep=2) == spec.num_params() + padding - 2 * 2 * expert
