"""Clear errors for models megarl cannot build or layouts that do not fit (no process world needed)."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.models.hf_io import open_hf_checkpoint, save_hf_checkpoint
from megarl.models.megatron import check_layout, have_transformer_engine, layer_spec, padded_vocab_size
from megarl.models.spec import PRESETS, ModelSpec, SpecError
from megarl.parallel.mesh import ParallelLayout

SMOL = PRESETS["smollm2-135m"]


def test_unknown_architecture_is_named():
    with pytest.raises(SpecError, match="unknown architecture.*GPT2LMHeadModel"):
        ModelSpec.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("tp,pp,match", [
    (2, 1, r"tp=2 does not divide num_attention_heads=9; TP sizes that fit this model: \[1, 3\]"),
    (1, 4, r"pp=4 does not divide num_layers=30; PP sizes that fit: \[1, 2, 3, 5, 6, 10, 15, 30\]"),
])
def test_layout_that_does_not_divide_names_sizes_and_fix(tp, pp, match):
    with pytest.raises(SpecError, match=match):
        check_layout(SMOL, ParallelLayout(tp=tp, pp=pp))


def test_tp_that_divides_heads_but_not_query_groups():
    spec = SMOL.replace(num_attention_heads=12, num_kv_heads=3)
    with pytest.raises(SpecError, match="tp=2 does not divide the query groups num_kv_heads=3"):
        check_layout(spec, ParallelLayout(tp=2))


@pytest.mark.skipif(have_transformer_engine(), reason="Transformer Engine is there")
def test_te_layer_spec_without_te_says_how_to_get_it():
    with pytest.raises(SpecError, match="use_te=True: Transformer Engine's layer spec needs .*perf/gpu_te.sh"):
        layer_spec(use_te=True)


def test_padded_vocab_is_the_same_for_every_power_of_two_tp():
    assert {padded_vocab_size(151_655, tp) for tp in (1, 2, 4, 8)} == {151_680}
    assert padded_vocab_size(49_152, 3) == 49_152 and padded_vocab_size(1001, 3) % 3 == 0


def test_missing_and_mismatched_checkpoint_tensors(tmp_path):
    spec = SMOL.replace(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=4, num_kv_heads=2,
                        head_dim=8, ffn_hidden_size=48)
    tensors = {n: torch.zeros(s) for n, s in spec.hf_tensor_shapes().items()}
    path = save_hf_checkpoint(tmp_path / "ok", spec, tensors)
    ckpt = open_hf_checkpoint(path)
    ckpt.check_complete()
    with pytest.raises(SpecError, match="missing tensors"):
        save_hf_checkpoint(tmp_path / "bad", spec, {k: v for k, v in tensors.items() if "norm" not in k})
    # a config that promises a bigger FFN than the stored tensors
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=r"mlp.gate_proj.weight.*\(48, 32\).*\(64, 32\)"):
        open_hf_checkpoint(path).read("model.layers.0.mlp.gate_proj.weight")
    with pytest.raises(SpecError, match="does not match its config"):
        open_hf_checkpoint(path).check_complete()


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_hf_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        open_hf_checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("written_te", [True, False])
def test_resuming_an_moe_checkpoint_under_the_other_layer_spec_is_refused_before_any_process(tmp_path, written_te,
                                                                                            monkeypatch):
    """An MoE model's experts load only under the layer spec that wrote them (TE's ``TEGroupedMLP`` or the local
    ``SequentialMLP``): ``check_run_folder`` refuses the resume naming ``actor.kernels.transformer_engine``, and
    accepts the same spec (only the checkpoint's metadata is read: its tensor files are stood in for, found
    sound)."""
    from megarl.config import ConfigError, load_config, to_dict
    from megarl.models import checkpoint as ck
    from megarl.trainer.checkpointing import check_run_folder

    monkeypatch.setattr(ck, "checkpoint_fault", lambda path: None)

    base = [f"run.output_dir={tmp_path}", "run.name=moe", "model.path=preset:tiny-qwen3-moe", "trainer.steps=2",
            "trainer.resume=true"]
    then = load_config(None, base + [f"actor.kernels.transformer_engine={str(written_te).lower()}"])
    step = tmp_path / "moe" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    meta = ck.model_meta(PRESETS["tiny-qwen3-moe"], torch.float32, None, use_te=written_te, step=1,
                         optimizer_format="fully_reshardable", config=to_dict(then), critic_scheduler=None)
    (step / ck.META_FILE).write_text(json.dumps(meta))
    check_run_folder(then, 1)
    with pytest.raises(ConfigError, match=r"trainer.resume: .* cannot be resumed with a changed "
                                          r"actor.kernels.transformer_engine \(an MoE model's experts"):
        check_run_folder(load_config(None, base + [f"actor.kernels.transformer_engine={str(not written_te).lower()}"]),
                         1)


def test_an_moe_checkpoint_with_the_older_chained_optimizer_keys_refuses_a_change_of_its_chain(tmp_path, monkeypatch):
    """Issue 32: a checkpoint written before ``optimizer_chain_prefix`` keys the experts' optimizer state under
    ``chained_<k>.``, which exists only where EP > 1 or TP > 1: ``check_run_folder`` refuses EP 1 -> 2 and TP 1 -> 2
    of such a checkpoint, naming the field, accepts EP 2 -> TP 2 (the same chain), and accepts every change for a
    checkpoint with the keys by parameter name (only the metadata is read)."""
    from megarl.config import ConfigError, load_config, to_dict
    from megarl.models import checkpoint as ck
    from megarl.trainer.checkpointing import check_run_folder

    monkeypatch.setattr(ck, "checkpoint_fault", lambda path: None)
    base = [f"run.output_dir={tmp_path}", "run.name=moe", "model.path=preset:tiny-qwen3-moe", "trainer.steps=2",
            "trainer.resume=true"]
    step = tmp_path / "moe" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)

    def write(layout, **keys):
        meta = ck.model_meta(PRESETS["tiny-qwen3-moe"], torch.float32, None, step=1, critic_scheduler=None,
                             optimizer_format="fully_reshardable", config=to_dict(load_config(None, base + layout)),
                             **keys)
        (step / ck.META_FILE).write_text(json.dumps(meta))

    write([])
    for layout, field in ((["actor.parallel.ep=2"], r"actor.parallel.ep \(1 -> 2\)"),
                          (["actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"],
                           r"actor.parallel.tp \(1 -> 2\)")):
        with pytest.raises(ConfigError, match=rf"trainer.resume: .* cannot be resumed with a changed {field} "
                                              r"\(the experts' optimizer state"):
            check_run_folder(load_config(None, base + layout), 2)
    write(["actor.parallel.ep=2"])
    check_run_folder(load_config(None, base + ["actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"]), 2)
    write([], optimizer_chain_prefix=False)
    check_run_folder(load_config(None, base + ["actor.parallel.ep=2"]), 2)


@pytest.mark.parametrize("family,changes,match", [
    ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
     r"rope_type='longrope': Phi-3's LongRoPE .*use a checkpoint with plain RoPE"),
    ("phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
     r"rope_type='su': Phi-3's LongRoPE"),
    ("phi3", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5: megarl rotates every channel"),
    ("qwen3", {"attention_bias": True}, r"attention_bias=True on a qwen3 model"),
    ("phi3", {"attention_bias": True}, r"attention_bias=True on a phi3 model"),
])
def test_qwen3_and_phi3_configs_megarl_cannot_build_are_refused(family, changes, match):
    """Phi-3's LongRoPE (Phi-3-mini-128k, Phi-3.5), partial rotary embeddings and Q/K/V biases are refused with
    the field and the fix; the same configs without them build, and round-trip through transformers' config."""
    spec = ModelSpec(family, 100, 32, 2, 4, 2, 8, 48, max_position_embeddings=64)
    cfg = {**spec.to_hf_config().to_dict(), "rope_parameters": None}
    assert ModelSpec.from_hf_config(cfg) == spec
    with pytest.raises(SpecError, match=match):
        ModelSpec.from_hf_config({**cfg, **changes})


def test_qwen3_and_phi3_presets_have_their_checkpoints_sizes():
    """The presets' parameter counts are those of the released models (Qwen3-0.6B: 0.6B with tied embeddings,
    Qwen3-8B, Qwen3-32B; Phi-3-mini-4k 3.8B; phi-4 14.7B), Qwen3's head_dim 128 is not hidden / heads, and
    Phi-3's canonical tensors are its fused qkv_proj and gate_up_proj."""
    from megarl.models.spec import preset

    sizes = {"qwen3-0.6b": 0.596, "qwen3-8b": 8.19, "qwen3-32b": 32.76, "phi-3-mini": 3.82, "phi-4": 14.66}
    for name, billions in sizes.items():
        assert abs(preset(name).num_params() / 1e9 - billions) < 0.01, name
    assert preset("qwen3-0.6b").head_dim * preset("qwen3-0.6b").num_attention_heads == 2048 != 1024
    phi = preset("phi-4?layers=2").hf_tensor_shapes()
    assert phi["model.layers.1.self_attn.qkv_proj.weight"] == ((40 + 2 * 10) * 128, 5120)
    assert phi["model.layers.1.mlp.gate_up_proj.weight"] == (2 * 17920, 5120)
    assert not [n for n in phi if "q_proj" in n or "gate_proj" in n]
