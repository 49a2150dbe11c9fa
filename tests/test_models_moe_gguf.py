"""Qwen3-MoE and Qwen2-MoE GGUF files (llama.cpp's ``qwen3moe`` / ``qwen2moe`` architectures) through megarl's
import path, against transformers' own load of the same file; Mixtral GGUFs are refused.

The tiny GGUF files are written here with the ``gguf`` package's ``GGUFWriter`` from a random transformers model,
in llama.cpp's tensor names and layout (stacked experts ``blk.N.ffn_{gate,up,down}_exps.weight`` ``[experts, rows,
cols]``, Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` and its 1-D gate ``ffn_gate_inp_shexp``) and
metadata (``{arch}.expert_count``, ``expert_used_count``, ``expert_feed_forward_length``,
``expert_shared_feed_forward_length``), F32 so every comparison but the logits is exact. One 2-rank gloo world
loads each file into the Megatron model at EP=1 and EP=2, converts it at TP=2 and exports it to safetensors
(the rank functions of ``megarl convert`` and ``megarl export``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megarl.models.spec import SpecError
from tests.distributed import run_world
from tests.test_models_moe import QWEN2_MOE, QWEN3_MOE, hf_moe_model

SPECS = {s.family: s for s in (QWEN3_MOE, QWEN2_MOE)}
TOKENS = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(7))


def write_gguf(path, model, spec) -> None:
    """Write transformers ``model`` (a Qwen3-MoE or Qwen2-MoE of ``spec``) as an F32 GGUF file the way llama.cpp's
    convert_hf_to_gguf.py names and lays out its tensors (no q/k permutation for these architectures)."""
    import gguf

    arch = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}[spec.family]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.ffn_hidden_size)
    w.add_head_count(spec.num_attention_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    if spec.family == "qwen3_moe":
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    w.add_expert_count(spec.num_experts)
    w.add_expert_used_count(spec.moe_top_k)
    w.add_expert_feed_forward_length(spec.moe_ffn_hidden_size)
    if spec.shared_expert_ffn_hidden_size:
        w.add_expert_shared_feed_forward_length(spec.shared_expert_ffn_hidden_size)
    names = gguf.get_tensor_name_map(arch, spec.num_layers)
    for name, t in model.state_dict().items():
        t = t.detach().float()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith(".mlp.experts.gate_up_proj"):  # [experts, 2 * ffn, hidden], gate then up
            gate, up = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.contiguous().numpy())
        elif name.endswith(".mlp.experts.down_proj"):  # [experts, hidden, ffn]
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", t.numpy())
        else:
            base, suffix = name.rsplit(".", 1)
            gguf_name = names.get_name(base)
            assert gguf_name is not None, name
            if gguf_name.endswith("ffn_gate_inp_shexp"):
                t = t.reshape(-1)  # llama.cpp stores the shared expert's gate [1, hidden] as [hidden]
            w.add_tensor(f"{gguf_name}.{suffix}", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _world(rank, world, tmp):
    from megatron.core import parallel_state as ps

    from megarl.models import checkpoint as ck
    from megarl.models.convert import convert_rank, export_rank
    from megarl.models.hf_io import open_hf_checkpoint
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from tests.test_models_megatron import megatron_logits

    out = {}
    for family in SPECS:
        hf = open_hf_checkpoint(f"{tmp}/{family}.gguf")
        for ep in (1, 2):
            mesh = ParallelLayout(dp=world, ep=ep)
            initialize_model_parallel(mesh)
            model = build_model(hf.spec, mesh, init_weights=False).eval()
            ck.load_hf_weights(model, hf)
            out[(family, ep)] = megatron_logits(model, TOKENS)[..., :hf.spec.vocab_size]
        convert_rank(rank, world, f"{tmp}/{family}.gguf", f"{tmp}/{family}_mg", 2, 1, None)
        export_rank(rank, world, f"{tmp}/{family}_mg", f"{tmp}/{family}_out{rank}")  # a folder per rank
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per family: the random transformers model, its canonical tensors, transformers' load of the GGUF file
    written from it and that load's logits; and the 2-rank world's results."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("moe_gguf")
    out = {"tmp": tmp}
    for seed, (family, spec) in enumerate(SPECS.items()):
        model, canonical = hf_moe_model(spec, seed)
        write_gguf(tmp / f"{family}.gguf", model, spec)
        ref = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=f"{family}.gguf", dtype=torch.float32).eval()
        with torch.no_grad():
            out[family] = (model, canonical, ref, ref(TOKENS).logits)
    out["world"] = run_world(_world, 2, str(tmp))
    return out


def _gguf_spec(spec):
    # GGUF stores rms_norm_eps as float32 and no aux-loss coefficient (transformers' default, 0.001)
    return dataclasses.replace(spec, rms_norm_eps=float(np.float32(spec.rms_norm_eps)), moe_aux_loss_coef=0.001)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_transformers_reads_back_the_gguf_tensors_written(models, family):
    model, _, ref, _ = models[family]
    written, read = model.state_dict(), ref.state_dict()
    assert sorted(written) == sorted(read)
    assert not [n for n, t in written.items() if not torch.equal(read[n], t)]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_gguf_spec_has_the_experts_widths_and_shared_expert(models, family):
    from megarl.models.checkpoint import source_spec
    from megarl.models.hf_io import open_hf_checkpoint

    path = models["tmp"] / f"{family}.gguf"
    spec, dtype, tokenizer = source_spec(path)
    # transformers' GGUF config keeps its config class's expert widths (768 / 1408 / 5632); megarl reads the file's
    assert spec == _gguf_spec(SPECS[family])
    assert (spec.moe_ffn_hidden_size, spec.shared_expert_ffn_hidden_size) == (
        32, 48 if family == "qwen2_moe" else 0)
    assert dtype == torch.float32 and tokenizer == str(path)
    ckpt = open_hf_checkpoint(path)
    assert ckpt.spec == spec
    ckpt.check_complete()
    _, canonical, _, _ = models[family]
    assert sorted(ckpt.tensor_names) == sorted(canonical)  # one tensor per expert, as in a safetensors checkpoint
    assert not [n for n, t in canonical.items() if not torch.equal(ckpt.read(n), t)]


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("ep", [1, 2])
def test_megatron_logits_from_gguf_equal_transformers(models, family, ep):
    ref_logits = models[family][3]
    diffs = [(r[(family, ep)] - ref_logits).abs().max().item() for r in models["world"]]
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("family", sorted(SPECS))
def test_gguf_convert_export_roundtrip_gives_the_written_tensors(models, family):
    import json

    from megarl.models.hf_io import open_hf_checkpoint

    _, canonical, _, _ = models[family]
    for rank in range(2):
        out = models["tmp"] / f"{family}_out{rank}"
        back = open_hf_checkpoint(out)
        assert back.spec == _gguf_spec(SPECS[family])
        assert sorted(back.tensor_names) == sorted(canonical)
        assert not [n for n, t in canonical.items() if not torch.equal(back.read(n), t)]
        assert json.loads((out / "config.json").read_text())["moe_intermediate_size"] == 32


def test_mixtral_gguf_is_refused_naming_the_family(tmp_path):
    import gguf

    from megarl.models.checkpoint import source_spec
    from megarl.models.hf_io import open_hf_checkpoint

    path = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")  # llama.cpp writes Mixtral as the llama architecture with experts
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for read in (source_spec, open_hf_checkpoint):
        with pytest.raises(SpecError, match="Mixtral GGUF .* not supported"):
            read(path)
