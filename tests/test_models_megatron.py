"""Megatron actor/critic vs transformers on the same weights, and megarl's checkpoint formats.

One 4-rank gloo world runs every check (TP=1, TP=2, PP=2, TP=2 x PP=2; a Llama-shaped model with GQA, tied
embeddings and llama3 RoPE scaling, and a Qwen2-shaped model with QKV bias and untied embeddings), then the
dist-checkpoint reshard (saved at TP=2 x PP=1, loaded at TP=1 x PP=2) and the HF -> megarl -> HF round trip.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

LLAMA = ModelSpec("llama", vocab_size=1000, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=256,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
QWEN2 = ModelSpec("qwen2", vocab_size=1001, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=128, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, max_position_embeddings=256)
MESHES = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) in a world of 4: dp fills the rest


def hf_model(spec: ModelSpec, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them so they are checked too
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def megatron_logits(model, tokens):
    """Full-vocab logits ``[b, s, padded_vocab]`` on the last stage (None elsewhere)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.models.pipeline import run_microbatches

    def output_fn(mb, out):
        return out.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(out).detach()}

    with torch.no_grad():
        res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=True)
    return res[0]["logits"] if res else None


def _world(rank, world, tmp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint, save_hf_checkpoint
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    out = {"logits": {}, "critic": {}, "tmp": tmp}
    tokens = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(7))
    for spec, seed in ((LLAMA, 1), (QWEN2, 2)):
        ref = hf_model(spec, seed)
        sd = ref.state_dict()
        with torch.no_grad():
            ref_logits = ref(tokens).logits
            ref_hidden = ref.model(tokens).last_hidden_state
        for tp, pp in MESHES:
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp))
            initialize_model_parallel(mesh)
            for role in ("actor", "critic"):
                model = build_model(spec, mesh, role).eval()
                local = megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(),
                                              ps.get_pipeline_model_parallel_rank(), role=role)
                read = state_dict_reader({**sd, "score.weight": torch.ones(1, spec.hidden_size)},
                                         {**spec.hf_tensor_shapes(), "score.weight": (1, spec.hidden_size)})
                fill_local_tensors(local, dict(model.named_parameters()), read)
                if role == "actor":
                    logits = megatron_logits(model, tokens)
                    if logits is not None:
                        diff = (logits[..., :spec.vocab_size] - ref_logits).abs().max().item()
                        out["logits"][(spec.family, tp, pp)] = diff
                else:
                    values = megatron_logits(model, tokens)  # value head of ones: values = sum of hidden
                    if values is not None:
                        diff = (values[..., 0] - ref_hidden.sum(-1)).abs().max().item()
                        out["critic"][(spec.family, tp, pp)] = diff

    # A dist checkpoint saved at TP=2 x PP=1 (x DP=2) loads at TP=1 x PP=2 with every parameter exact.
    spec = QWEN2
    sd = hf_model(spec, 3).state_dict()
    read = state_dict_reader(sd, spec.hf_tensor_shapes())
    initialize_model_parallel(ParallelLayout(tp=2, pp=1, dp=2))
    model = build_model(spec, ParallelLayout(tp=2, pp=1, dp=2))
    fill_local_tensors(megatron_rank_tensors(spec, ParallelLayout(2, 1, 2), ps.get_tensor_model_parallel_rank(),
                                             0), dict(model.named_parameters()), read)
    ck.save_model(f"{tmp}/tp2", model)
    mesh = ParallelLayout(tp=1, pp=2, dp=2)
    initialize_model_parallel(mesh)
    loaded = build_model(spec, mesh)
    before = {n: p.detach().clone() for n, p in loaded.named_parameters()}
    ck.load_model(f"{tmp}/tp2", loaded)
    expected = build_model(spec, mesh)
    fill_local_tensors(megatron_rank_tensors(spec, mesh, 0, ps.get_pipeline_model_parallel_rank()),
                       dict(expected.named_parameters()), read)
    exp = dict(expected.named_parameters())
    out["reshard_load"] = all(torch.equal(p, exp[n]) for n, p in loaded.named_parameters())
    out["reshard_load_not_trivial"] = not all(torch.equal(p, exp[n]) for n, p in before.items())

    # HF (safetensors, sharded) -> megarl checkpoint at TP=2 x PP=2 -> HF: every tensor bit-exact.
    spec = LLAMA
    sd = {n: t for n, t in hf_model(spec, 4).state_dict().items() if n in spec.hf_tensor_shapes()}
    if rank == 0:
        save_hf_checkpoint(f"{tmp}/hf_in", spec, sd, max_shard_bytes=200_000)
    dist.barrier()
    mesh = ParallelLayout(tp=2, pp=2, dp=1)
    initialize_model_parallel(mesh)
    model = build_model(spec, mesh)
    ck.load_hf_weights(model, open_hf_checkpoint(f"{tmp}/hf_in"))
    ck.save_model(f"{tmp}/mg", model)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    return run_world(_world, 4, str(tmp))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", MESHES)
def test_actor_logits_equal_transformers(world, family, tp, pp):
    diffs = [r["logits"][(family, tp, pp)] for r in world if (family, tp, pp) in r["logits"]]
    assert len(diffs) == 4 // pp  # every last-stage rank compared
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp,pp", MESHES)
def test_critic_values_are_the_value_head_on_the_trunk(world, family, tp, pp):
    diffs = [r["critic"][(family, tp, pp)] for r in world if (family, tp, pp) in r["critic"]]
    assert diffs and max(diffs) <= 1e-3, diffs


def test_dist_checkpoint_saved_at_tp2_loads_at_pp2(world):
    assert all(r["reshard_load"] for r in world)
    assert all(r["reshard_load_not_trivial"] for r in world)  # a fresh model differs: the load did the work


def test_hf_convert_export_roundtrip_is_bit_exact(world, tmp_path_factory):
    from megarl.launch.convert import export_to_hf
    from megarl.models.hf_io import open_hf_checkpoint

    tmp = world[0]["tmp"]
    source = open_hf_checkpoint(f"{tmp}/hf_in")
    assert len(set(source._files.values())) > 1  # the input was a sharded safetensors checkpoint
    export_to_hf(f"{tmp}/mg", f"{tmp}/hf_out")
    back = open_hf_checkpoint(f"{tmp}/hf_out")
    assert sorted(back.tensor_names) == sorted(LLAMA.hf_tensor_shapes())
    bad = [n for n in LLAMA.hf_tensor_shapes() if not torch.equal(back.read(n), source.read(n))]
    assert not bad


MISTRAL = ModelSpec("mistral", vocab_size=500, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                    head_dim=16, ffn_hidden_size=96, rms_norm_eps=1e-5, max_position_embeddings=256,
                    sliding_window=6)


def _sliding_window_world(rank, world):
    from megatron.core import parallel_state as ps

    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    tokens = torch.randint(0, MISTRAL.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = hf_model(MISTRAL, 5)
    full = hf_model(MISTRAL.replace(sliding_window=None), 5)  # the same weights with full causal attention
    with torch.no_grad():
        windowed_logits, full_logits = ref(tokens).logits, full(tokens).logits
    out = {"window_matters": (windowed_logits - full_logits).abs().max().item()}
    for tp in (1, 2):
        mesh = ParallelLayout(tp=tp, pp=1, dp=world // tp)
        initialize_model_parallel(mesh)
        model = build_model(MISTRAL, mesh).eval()
        fill_local_tensors(megatron_rank_tensors(MISTRAL, mesh, ps.get_tensor_model_parallel_rank(), 0),
                           dict(model.named_parameters()), state_dict_reader(ref.state_dict(),
                                                                             MISTRAL.hf_tensor_shapes()))
        logits = megatron_logits(model, tokens)[..., :MISTRAL.vocab_size]
        out[tp] = (logits - windowed_logits).abs().max().item()
    ps.destroy_model_parallel()
    return out


def test_mistral_sliding_window_matches_transformers_beyond_the_window():
    """A 24-token sequence through a 6-token window (Megatron's window_size) at TP=1 and TP=2 gives
    transformers' logits; the same weights with full attention differ, so the window is what is compared."""
    for r in run_world(_sliding_window_world, 2):
        assert r["window_matters"] > 1e-2, r
        assert r[1] <= 1e-4 and r[2] <= 1e-4, r
