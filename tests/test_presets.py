"""The named shapes of ``megarl.models.spec.PRESETS`` against the published config.json values they copy.

Where a transformers 5.17 config class's defaults are the published checkpoint's shape (its docstring names the
checkpoint; the values were compared field by field), the preset must be what megarl reads from that config,
with the fields where the defaults differ from the checkpoint given here, each from a stated offline source:

- DeepseekV3Config() = deepseek-ai/DeepSeek-V3 but the context and YaRN (163840; factor 40, mscale 1: copies of the
  config.json in public repositories; NeMo-RL's DeepSeek-V3 arguments).
- Glm4MoeConfig() = zai-org/GLM-4.5-Air but attention_bias, head_dim, rope_theta and token ids (a dump of the
  checkpoint's config.json in a public repository: ms-swift's model listing).
- GptOssConfig() = openai/gpt-oss-120b but router_aux_loss_coef (0.9) and the token ids (eos 200002, pad 199999):
  copies of the config.json in public repositories.
- Phi3Config() = microsoft/Phi-3-mini-4k-instruct but sliding_window (2047: copies of the config.json).
- Qwen3NextConfig() = Qwen/Qwen3-Next-80B-A3B-Instruct but intermediate_size (5632 there, 5120 in copies of the
  config.json; no layer has a dense MLP), rope_theta, context (copies) and token ids (unchecked).
- Qwen3MoeConfig() = Qwen/Qwen3-30B-A3B's widths and experts; layers, head_dim, RoPE base and context from litgpt
  0.5.13's entry; norm_topk_prob and token ids unchecked.

Moonlight has no transformers class of its own: its preset is checked against the copy of
Moonlight-16B-A3B-Instruct's config.json (revision 4e735b07) its definition names.
"""

import pytest
import transformers

from megarl.models.spec import PRESETS, ModelSpec

QWEN_IDS = dict(bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)

FROM_DEFAULTS = {
    "deepseek-v3": (transformers.DeepseekV3Config, dict(max_position_embeddings=163840, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
    "glm-4.5-air": (transformers.Glm4MoeConfig, dict(
        attention_bias=True, head_dim=128, eos_token_id=[151329, 151336, 151338], pad_token_id=151329,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5))),
    "gpt-oss-120b": (transformers.GptOssConfig, dict(router_aux_loss_coef=0.9, eos_token_id=200002,
                                                     pad_token_id=199999)),
    "phi-3-mini": (transformers.Phi3Config, dict(sliding_window=2047)),
    "qwen3-next-80b-a3b": (transformers.Qwen3NextConfig, dict(
        intermediate_size=5120, max_position_embeddings=262144, **QWEN_IDS,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))),
    "qwen3-30b-a3b": (transformers.Qwen3MoeConfig, dict(
        num_hidden_layers=48, head_dim=128, norm_topk_prob=True, max_position_embeddings=40960, **QWEN_IDS,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}

# Moonlight-16B-A3B-Instruct's config.json (revision 4e735b07), the fields megarl reads
MOONLIGHT = dict(
    model_type="deepseek_v3", bos_token_id=163584, eos_token_id=163586, first_k_dense_replace=1, hidden_size=2048,
    intermediate_size=11264, kv_lora_rank=512, max_position_embeddings=8192, moe_intermediate_size=1408, n_group=1,
    n_routed_experts=64, n_shared_experts=2, norm_topk_prob=True, num_attention_heads=16, num_experts_per_tok=6,
    num_hidden_layers=27, num_key_value_heads=16, num_nextn_predict_layers=0, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, rms_norm_eps=1e-05, rope_theta=50000.0, routed_scaling_factor=2.446, scoring_func="sigmoid",
    tie_word_embeddings=False, topk_group=1, topk_method="noaux_tc", v_head_dim=128, vocab_size=163840)


@pytest.mark.parametrize("name", sorted(FROM_DEFAULTS))
def test_preset_is_the_published_config(name):
    config_cls, published = FROM_DEFAULTS[name]
    assert PRESETS[name] == ModelSpec.from_hf_config(config_cls(**published))


def test_moonlight_preset_is_its_config_json():
    assert PRESETS["moonlight-16b-a3b"] == ModelSpec.from_hf_config(MOONLIGHT)
