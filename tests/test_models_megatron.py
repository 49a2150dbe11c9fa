"""Megatron actor/critic vs transformers on the same weights, and megarl's checkpoint formats.

One 4-rank gloo world runs every check (TP=1, TP=2, PP=2, TP=2 x PP=2; a Llama-shaped model with GQA, tied
embeddings and llama3 RoPE scaling, and a Qwen2-shaped model with QKV bias and untied embeddings; at TP=1, TP=2
and PP=2 a Qwen3 model with QK-norm, ``head_dim`` != ``hidden / heads`` and tied embeddings, and a Phi-3 model
with fused ``qkv_proj`` / ``gate_up_proj`` and a sliding window shorter than the sequence, whose gradients of one
training step are also compared with transformers'), then the dist-checkpoint reshard (saved at TP=2 x PP=1,
loaded at TP=1 x PP=2) and the HF -> megarl -> HF round trip of Llama, Qwen3 and Phi-3.
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
QWEN3 = ModelSpec("qwen3", vocab_size=1000, hidden_size=48, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                  head_dim=16, ffn_hidden_size=96, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  max_position_embeddings=256)
PHI3 = ModelSpec("phi3", vocab_size=1003, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2,
                 head_dim=16, ffn_hidden_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 max_position_embeddings=256, sliding_window=8)
MESHES = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) in a world of 4: dp fills the rest
NEW_MESHES = MESHES[:3]  # the families of issue 43: TP=1, TP=2, PP=2


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


def hf_gradients(ref, tokens, weights) -> dict:
    """Gradients of ``(logits * weights).sum()`` for every parameter of the transformers model (by HF name)."""
    ref.zero_grad()
    (ref(tokens).logits * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    return grads


def megatron_gradient_diff(spec, mesh, model, local, tokens, weights, hf_grads) -> tuple[float, float]:
    """One training forward and backward of ``(logits * weights).sum()`` through megarl's pipeline schedule (each
    TP rank's share of the vocab-parallel logits times its columns of ``weights``), then every block of every local
    gradient against the same box of transformers' gradient: ``(max abs difference, max abs reference)``. As
    megatron's ``finalize_model_grads`` does, tied embeddings on two stages add their gradients over the embedding
    group and the QK-norm weights (each TP rank's from its own heads) over TP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models.pipeline import run_microbatches

    tp_rank = ps.get_tensor_model_parallel_rank()
    per = model.embedding.word_embeddings.weight.shape[0] if model.pre_process else model.output_layer.weight.shape[0]
    padded = torch.zeros(*weights.shape[:-1], per * mesh.tp)
    padded[..., :spec.vocab_size] = weights
    mine = padded[..., tp_rank * per:(tp_rank + 1) * per]
    model.zero_grad()
    run_microbatches(model, [{"input_ids": tokens}], lambda mb, out: ((out * mine).sum(), {}), forward_only=False)
    params = dict(model.named_parameters())
    if spec.tie_word_embeddings and mesh.pp > 1:
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if name in params:
                dist.all_reduce(params[name].grad, group=ps.get_embedding_group())
    for name, p in params.items():
        if "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    diff = scale = 0.0
    for name, lt in local.items():
        for b in lt.blocks:
            want = hf_grads[b.name][b.src_box]
            diff = max(diff, (params[name].grad[b.dst_box] - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
    return diff, scale


def _world(rank, world, tmp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint, save_hf_checkpoint
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    out = {"logits": {}, "critic": {}, "grads": {}, "tmp": tmp}
    tokens = torch.randint(0, 1000, (3, 24), generator=torch.Generator().manual_seed(7))
    for spec, seed, meshes in ((LLAMA, 1, MESHES), (QWEN2, 2, MESHES), (QWEN3, 5, NEW_MESHES),
                               (PHI3, 6, NEW_MESHES)):
        ref = hf_model(spec, seed)
        sd = ref.state_dict()
        with torch.no_grad():
            ref_logits = ref(tokens).logits
            ref_hidden = ref.model(tokens).last_hidden_state
        if meshes is NEW_MESHES:
            loss_weights = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(seed))
            hf_grads = hf_gradients(ref, tokens, loss_weights)
        if spec.sliding_window is not None:  # the same weights with full attention: the window changes the logits
            with torch.no_grad():
                full = hf_model(spec.replace(sliding_window=None), seed)(tokens).logits
            out["window_matters"] = (full - ref_logits).abs().max().item()
        for tp, pp in meshes:
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
                    if meshes is NEW_MESHES:
                        out["grads"][(spec.family, tp, pp)] = megatron_gradient_diff(
                            spec, mesh, model, local, tokens, loss_weights, hf_grads)
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
    for spec, seed in ((LLAMA, 4), (QWEN3, 8), (PHI3, 9)):
        sd = {n: t for n, t in hf_model(spec, seed).state_dict().items() if n in spec.hf_tensor_shapes()}
        if rank == 0:
            save_hf_checkpoint(f"{tmp}/hf_in_{spec.family}", spec, sd, max_shard_bytes=200_000)
        dist.barrier()
        mesh = ParallelLayout(tp=2, pp=2, dp=1)
        initialize_model_parallel(mesh)
        model = build_model(spec, mesh)
        ck.load_hf_weights(model, open_hf_checkpoint(f"{tmp}/hf_in_{spec.family}"))
        ck.save_model(f"{tmp}/mg_{spec.family}", model)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    return run_world(_world, 4, str(tmp))


CASES = [(f, tp, pp) for f in ("llama", "qwen2") for tp, pp in MESHES] + \
    [(f, tp, pp) for f in ("qwen3", "phi3") for tp, pp in NEW_MESHES]


@pytest.mark.parametrize("family,tp,pp", CASES)
def test_actor_logits_equal_transformers(world, family, tp, pp):
    diffs = [r["logits"][(family, tp, pp)] for r in world if (family, tp, pp) in r["logits"]]
    assert len(diffs) == 4 // pp  # every last-stage rank compared
    assert max(diffs) <= 1e-4, diffs


def test_phi3_window_shorter_than_the_sequence_is_what_is_compared(world):
    assert PHI3.sliding_window < 24 and all(r["window_matters"] > 1e-2 for r in world), world


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
@pytest.mark.parametrize("tp,pp", NEW_MESHES)
def test_training_step_gradients_equal_transformers(world, family, tp, pp):
    """Every rank's gradient of every parameter, box by box of the canonical tensors it holds, equals
    transformers' gradient of the same loss within 1e-5 of the largest gradient."""
    grads = [r["grads"][(family, tp, pp)] for r in world]
    for diff, scale in grads:
        assert scale > 0 and diff <= 1e-5 * scale, grads


@pytest.mark.parametrize("family,tp,pp", CASES)
def test_critic_values_are_the_value_head_on_the_trunk(world, family, tp, pp):
    diffs = [r["critic"][(family, tp, pp)] for r in world if (family, tp, pp) in r["critic"]]
    assert diffs and max(diffs) <= 1e-3, diffs


def test_dist_checkpoint_saved_at_tp2_loads_at_pp2(world):
    assert all(r["reshard_load"] for r in world)
    assert all(r["reshard_load_not_trivial"] for r in world)  # a fresh model differs: the load did the work


# each export starts a world of its own (~20 s): the newer families' in the slow tier
@pytest.mark.parametrize("spec", [LLAMA, *(pytest.param(s, marks=pytest.mark.slow) for s in (QWEN3, PHI3))],
                         ids=lambda s: s.family)
def test_hf_convert_export_roundtrip_is_bit_exact(world, spec):
    from transformers import AutoModelForCausalLM

    from megarl.launch.convert import export_to_hf
    from megarl.models.hf_io import open_hf_checkpoint

    tmp, fam = world[0]["tmp"], spec.family
    source = open_hf_checkpoint(f"{tmp}/hf_in_{fam}")
    assert len(set(source._files.values())) > 1  # the input was a sharded safetensors checkpoint
    export_to_hf(f"{tmp}/mg_{fam}", f"{tmp}/hf_out_{fam}")
    back = open_hf_checkpoint(f"{tmp}/hf_out_{fam}")
    assert sorted(back.tensor_names) == sorted(spec.hf_tensor_shapes())
    bad = [n for n in spec.hf_tensor_shapes() if not torch.equal(back.read(n), source.read(n))]
    assert not bad
    # the export is a checkpoint of its family that transformers loads as it is (Phi-3: fused qkv/gate_up)
    loaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/hf_out_{fam}", dtype=torch.float32).state_dict()
    assert back.spec == spec  # its config.json is the same model
    assert not [n for n in spec.hf_tensor_shapes() if not torch.equal(loaded[n], source.read(n))]


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


@pytest.mark.parametrize("theta", [10000.0, 1e6, 150000])
def test_default_rope_frequencies_on_the_cpu_are_transformers_bit_for_bit(theta):
    """The default RoPE's inverse frequencies megarl gives megatron (computed on the buffer's device with vLLM's
    expression, so that a GPU gets vLLM's values) equal transformers' formula bit for bit on the CPU."""
    from types import SimpleNamespace

    from megarl.models.megatron import _set_rope_frequencies

    spec = QWEN2.replace(rope_theta=theta)
    rotary = SimpleNamespace(inv_freq=torch.zeros(spec.head_dim // 2))
    _set_rope_frequencies(rotary, spec)
    dim = spec.head_dim
    hf = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))  # transformers'
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, hf)
