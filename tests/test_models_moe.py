"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) as megatron-core GPTModels
with megatron's MoELayer, against transformers on the same weights.

One 4-rank gloo world runs every check: logits at EP=1, EP=2, TP=2, TP=2 x EP=2 and EP=2 x PP=2 for each family,
finite and non-zero gradients of every parameter (experts included) at EP=2 x PP=2, and the HF (sharded
safetensors) -> megarl checkpoint at EP=2 x PP=2 -> HF round trip, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec, SpecError
from tests.distributed import run_world

COMMON = dict(vocab_size=500, hidden_size=64, num_layers=4, num_attention_heads=4, num_kv_heads=2, head_dim=16,
              ffn_hidden_size=96, max_position_embeddings=256, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32,
              moe_aux_loss_coef=0.01)
QWEN3_MOE = ModelSpec("qwen3_moe", rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      moe_norm_topk_prob=True, **COMMON)
QWEN2_MOE = ModelSpec("qwen2_moe", rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      moe_norm_topk_prob=False, shared_expert_ffn_hidden_size=48, **COMMON)
MIXTRAL = ModelSpec("mixtral", rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    **{**COMMON, "ffn_hidden_size": 32})  # Mixtral's intermediate_size is the experts' width
SPECS = {s.family: s for s in (QWEN3_MOE, QWEN2_MOE, MIXTRAL)}
MESHES = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2)]  # (tp, pp, ep) in a world of 4


def hf_moe_model(spec: ModelSpec, seed: int):
    """A random transformers model of ``spec`` (norms randomised too) and its canonical (checkpoint-form)
    state dict (:func:`~megarl.models.weights.transformers_canonical`: one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    from megarl.models.weights import transformers_canonical

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.to_hf_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model, transformers_canonical(spec, dict(model.named_parameters()))


def _world(rank, world, tmp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint, save_hf_checkpoint
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from tests.test_models_megatron import megatron_logits

    out = {"logits": {}, "tmp": tmp}
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(7))
    for seed, spec in enumerate(SPECS.values()):
        ref, sd = hf_moe_model(spec, seed)
        with torch.no_grad():
            ref_logits = ref(tokens).logits
        if rank == 0:
            save_hf_checkpoint(f"{tmp}/{spec.family}", spec, sd, max_shard_bytes=300_000)
        dist.barrier()
        hf = open_hf_checkpoint(f"{tmp}/{spec.family}")
        for tp, pp, ep in MESHES:
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
            initialize_model_parallel(mesh)
            model = build_model(spec, mesh, init_weights=False).eval()
            ck.load_hf_weights(model, hf)  # each rank reads its own slices (its experts only)
            logits = megatron_logits(model, tokens)
            if logits is not None:
                diff = (logits[..., :spec.vocab_size] - ref_logits).abs().max().item()
                out["logits"][(spec.family, tp, pp, ep)] = diff
            if (tp, pp, ep) == (1, 2, 2):
                model.train()

                def loss_fn(mb, logits):
                    return logits.float().pow(2).mean(), {}

                batch = torch.randint(0, 500, (4, 48), generator=torch.Generator().manual_seed(8))
                run_microbatches(model, [{"input_ids": batch}], loss_fn, forward_only=False)
                grads = {n: p.grad if p.grad is not None else getattr(p, "main_grad", None)
                         for n, p in model.named_parameters()}
                out.setdefault("grads", {})[spec.family] = (
                    all(g is not None and torch.isfinite(g).all().item() for g in grads.values()),
                    [n for n, g in grads.items() if g is None or not g.abs().sum().item() > 0],
                    sum(".local_experts." in n for n in grads))
                ck.save_model(f"{tmp}/{spec.family}_mg", model)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, 4, str(tmp_path_factory.mktemp("moe")))


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("tp,pp,ep", MESHES)
def test_moe_logits_equal_transformers(world, family, tp, pp, ep):
    diffs = [r["logits"][(family, tp, pp, ep)] for r in world if (family, tp, pp, ep) in r["logits"]]
    assert len(diffs) == 4 // pp  # every last-stage rank compared
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("family", sorted(SPECS))
def test_moe_gradients_are_finite_and_reach_every_parameter(world, family):
    for r in world:
        finite, zero, experts = r["grads"][family]
        assert finite
        # everything but the experts that no token chose has a gradient (a random model routes its similar
        # tokens to a few favourite experts; HF routes them the same: the logits agree)
        assert all(".local_experts." in n for n in zero), zero
        assert len(zero) < experts / 2, zero


@pytest.mark.parametrize("family", sorted(SPECS))
def test_moe_hf_convert_export_roundtrip_is_bit_exact(world, family):
    from megarl.launch.convert import export_to_hf
    from megarl.models.hf_io import open_hf_checkpoint

    tmp, spec = world[0]["tmp"], SPECS[family]
    source = open_hf_checkpoint(f"{tmp}/{family}")
    assert len(set(source._files.values())) > 1  # a sharded safetensors checkpoint
    export_to_hf(f"{tmp}/{family}_mg", f"{tmp}/{family}_out")
    back = open_hf_checkpoint(f"{tmp}/{family}_out")
    assert back.spec == spec
    assert sorted(back.tensor_names) == sorted(spec.hf_tensor_shapes())
    assert not [n for n in spec.hf_tensor_shapes() if not torch.equal(back.read(n), source.read(n))]


def test_moe_specs_round_trip_their_hf_config_and_refuse_what_megarl_cannot_build():
    for spec in SPECS.values():
        assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec
    cfg = QWEN3_MOE.to_hf_config().to_dict()
    with pytest.raises(SpecError, match="mlp_only_layers"):
        ModelSpec.from_hf_config({**cfg, "mlp_only_layers": [0]})
    from megarl.models.megatron import check_layout
    from megarl.parallel.mesh import ParallelLayout

    with pytest.raises(SpecError, match="ep=3 does not divide num_experts=8"):
        check_layout(QWEN3_MOE, ParallelLayout(dp=3, ep=3))


def test_moe_sizes_presets_and_ep_checks():
    """Parameter counts (all, active, per EP rank), the shortened preset, and the EP errors naming the field."""
    from megarl.measure.flops import matmul_params
    from megarl.config import ConfigError, load_config
    from megarl.launch.memory import stage_params
    from megarl.models.megatron import check_layout
    from megarl.models.spec import preset
    from megarl.parallel.mesh import ParallelLayout

    big = preset("qwen3-30b-a3b")
    assert round(big.num_params() / 1e9, 1) == 30.5 and round(big.num_active_params() / 1e9, 1) == 3.4
    expert = 3 * big.hidden_size * big.moe_ffn_hidden_size
    assert matmul_params(big) == big.num_active_params() - big.vocab_size * big.hidden_size - big.num_layers * (
        2 * big.hidden_size + 2 * big.head_dim) - big.hidden_size  # active minus embedding lookup and norms
    for spec in SPECS.values():
        spec = spec.replace(vocab_size=512)  # no vocab padding at TP=1
        assert stage_params(spec, 1, 1) == spec.num_params(), spec.family
        experts = spec.num_layers * spec.num_experts * 3 * spec.hidden_size * spec.moe_ffn_hidden_size
        assert stage_params(spec, 1, 1, ep=2) == spec.num_params() - experts // 2
    assert stage_params(big, 1, 1, ep=8) == big.num_params() - big.num_layers * 112 * expert
    short = preset("qwen3-30b-a3b?layers=4")
    assert short.num_layers == 4 and short.replace(num_layers=48) == big
    with pytest.raises(SpecError, match=r"\?layers=N with 1 <= N <= 48"):
        preset("qwen3-30b-a3b?layers=0")
    with pytest.raises(SpecError, match="needs a mixture-of-experts model"):
        check_layout(preset("tiny-llama"), ParallelLayout(dp=2, ep=2))
    with pytest.raises(ConfigError, match="parallel.ep"):
        load_config(None, ["actor.parallel.ep=0"])
