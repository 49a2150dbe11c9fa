"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) as megatron-core GPTModels
with megatron's MoELayer, against transformers on the same weights.

One 4-rank gloo world runs every check: logits at EP=1, EP=2, TP=2, TP=2 x EP=2 and EP=2 x PP=2 for each family
with the grouped experts (``actor.kernels.moe_experts``' default), at EP=2 and EP=2 x PP=2 with megatron's
``SequentialMLP``; finite and non-zero gradients of every parameter (experts included) at EP=2 x PP=2; the
all-to-all token dispatcher (the default at EP > 1) against the all-gather one on the same weights, logits and
gradients of a training forward and backward at EP=2, TP=2 x EP=2 with sequence parallelism and EP=2 x PP=2; the HF
(sharded safetensors) -> megarl checkpoint at EP=2 x PP=2 -> HF round trip, bit for bit; checkpoints of either
experts kind loaded by the other (at EP=2, PP=1); and, at TP=2 x EP=2, the grouped experts against
``SequentialMLP`` on the same weights: outputs and gradients (experts without tokens, no tokens at all) and the
sharded state dicts (keys, shapes, offsets, replica ids, data).
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
# (tp, pp, ep, moe_experts): every mesh with the grouped experts, EP=2 x PP=2 with SequentialMLP (its checkpoint
# is the one the grouped model loads below)
CASES = [(*m, "grouped") for m in MESHES] + [(1, 2, 2, "sequential")]
DISPATCH_MESHES = [(2, 1, 2), (1, 2, 2)]  # (tp, pp, ep): all-to-all against all-gather, TP=2 with SP


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


def _sharded(module) -> list:
    """The ShardedTensors and ShardedObjects of ``module``'s sharded state dict (factories built; as layer 1 of
    4), by key and global offset: (key, global shape, global offset, axis fragmentations, replica id, data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    sd = module.sharded_state_dict(prefix="decoder.layers.mlp.experts.", sharded_offsets=((0, 1, 4),))
    apply_factories(sd)
    out = [(x.key, tuple(x.global_shape), tuple(x.global_offset), tuple(getattr(x, "axis_fragmentations", ())),
            x.replica_id, x.data) for x in nested_values(sd) if isinstance(x, (ShardedTensor, ShardedObject))]
    return sorted(out, key=lambda x: x[:3])


def _experts_checks(spec, mesh) -> dict:
    """:class:`~megarl.kernels.grouped_experts.GroupedExperts` against megatron's ``SequentialMLP`` (first layer of each
    model) on the same weights: max abs differences of outputs and gradients (input, probabilities, weights)
    with tokens for some local experts only, and with none; whether the sharded state dicts are the same."""
    from megarl.models.megatron import build_model

    grouped, seq = (build_model(spec, mesh, moe_experts=k).decoder.layers[0].mlp.experts
                    for k in ("grouped", "sequential"))
    with torch.no_grad():
        grouped.linear_fc1.weight.copy_(torch.cat([e.linear_fc1.weight for e in seq.local_experts]))
        grouped.linear_fc2.weight.copy_(torch.cat([e.linear_fc2.weight for e in seq.local_experts]))
    g = torch.Generator().manual_seed(3)
    out = {}
    for counts in ([3, 0, 5, 0], [0, 0, 0, 0]):
        x = torch.randn(sum(counts), spec.hidden_size, generator=g)
        probs = torch.rand(sum(counts), generator=g)
        dy = torch.randn(sum(counts), spec.hidden_size, generator=g)  # not expanded: grouped_mm's strides
        results = []
        for module in (grouped, seq):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            module.zero_grad()
            y, _ = module(xi, torch.tensor(counts), pi)
            y.backward(dy)
            results.append([y, xi.grad, pi.grad])
        results[0] += [grouped.linear_fc1.weight.grad, grouped.linear_fc2.weight.grad]
        results[1] += [torch.cat([getattr(e, n).weight.grad for e in seq.local_experts])
                       for n in ("linear_fc1", "linear_fc2")]
        out[sum(counts)] = max((a - b).abs().max().item() if a.numel() else 0.0 for a, b in zip(*results))
    a, b = _sharded(grouped), _sharded(seq)
    out["sharded"] = len(a) == len(b) == 5 * grouped.num_local_experts and all(
        p[:5] == q[:5] and (p[5] is None and q[5] is None or torch.equal(p[5], q[5])) for p, q in zip(a, b))
    return out


def _dispatcher_checks(spec, mesh, rank: int) -> dict:
    """megatron's all-to-all token dispatcher (``moe_dispatcher="auto"`` at EP > 1) against the all-gather one on
    the same random weights: one training forward and backward (sequence parallel at TP > 1) of this rank's own
    tokens, the max abs differences of the last stage's logits and of every parameter's gradient, the two
    dispatchers' class names, and whether some gradient of a local expert is non-zero."""
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches

    batch = torch.randint(0, 500, (4, 48), generator=torch.Generator().manual_seed(8 + rank))
    results, weights = [], None
    for dispatcher in ("allgather", "auto"):
        model = build_model(spec, mesh, sequence_parallel=mesh.tp > 1, moe_dispatcher=dispatcher).train()
        if weights is None:
            weights = model.state_dict()
        else:
            model.load_state_dict(weights)

        def loss_fn(mb, logits):
            return logits.float().pow(2).mean(), {"logits": logits.detach().clone()}

        res = run_microbatches(model, [{"input_ids": batch}], loss_fn, forward_only=False)
        results.append((type(model.decoder.layers[0].mlp.token_dispatcher).__name__,
                        res[0]["logits"] if res else None, {n: p.grad for n, p in model.named_parameters()}))
    (gather, l0, g0), (a2a, l1, g1) = results
    return {"kinds": (gather, a2a), "logits": (l0 - l1).abs().max().item() if l0 is not None else 0.0,
            "grads": max((g0[n] - g1[n]).abs().max().item() for n in g0),
            "experts_learn": any(".experts." in n and g.abs().sum().item() > 0 for n, g in g1.items())}


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
        for tp, pp, ep, experts in CASES:
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
            initialize_model_parallel(mesh)
            if seed == 0 and (tp, pp, ep, experts) == (2, 1, 2, "grouped"):
                out["experts"] = _experts_checks(spec, mesh)
            model = build_model(spec, mesh, init_weights=False, moe_experts=experts).eval()
            out.setdefault("dispatcher", {})[ep] = type(model.decoder.layers[0].mlp.token_dispatcher).__name__
            ck.load_hf_weights(model, hf)  # each rank reads its own slices (its experts only)
            logits = megatron_logits(model, tokens)
            if logits is not None:
                diff = (logits[..., :spec.vocab_size] - ref_logits).abs().max().item()
                out["logits"][(spec.family, tp, pp, ep, experts)] = diff
            if (tp, pp, ep, experts) == (1, 2, 2, "sequential"):
                ck.save_model(f"{tmp}/{spec.family}_sequential", model)
            if (tp, pp, ep, experts) == (1, 2, 2, "grouped"):
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
                    sum(".experts." in n for n in grads))
                ck.save_model(f"{tmp}/{spec.family}_mg", model)
        for tp, pp, ep in DISPATCH_MESHES:
            mesh = ParallelLayout(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep)
            initialize_model_parallel(mesh)
            out.setdefault("dispatch", {})[(spec.family, tp, pp, ep)] = _dispatcher_checks(spec, mesh, rank)
        for experts, written in (("sequential", "mg"), ("grouped", "sequential")):  # the other kind's, PP 2 -> 1
            mesh = ParallelLayout(tp=1, pp=1, dp=world, ep=2)
            initialize_model_parallel(mesh)
            model = build_model(spec, mesh, init_weights=False, moe_experts=experts).eval()
            ck.load_model(f"{tmp}/{spec.family}_{written}", model)
            logits = megatron_logits(model, tokens)
            out.setdefault("interchange", {})[(spec.family, experts)] = \
                (logits[..., :spec.vocab_size] - ref_logits).abs().max().item()
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, 4, str(tmp_path_factory.mktemp("moe")))


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "tp{}-pp{}-ep{}-{}".format(*c))
def test_moe_logits_equal_transformers(world, family, case):
    diffs = [r["logits"][(family, *case)] for r in world if (family, *case) in r["logits"]]
    assert len(diffs) == 4 // case[1]  # every last-stage rank compared
    assert max(diffs) <= 1e-4, diffs


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_moe_checkpoints_load_across_grouped_and_sequential_experts(world, family, experts):
    diffs = [r["interchange"][(family, experts)] for r in world]
    assert max(diffs) <= 1e-4, diffs


def test_grouped_experts_equal_sequential_mlp_and_checkpoint_alike(world):
    for r in world:  # TP=2 x EP=2: 4 local experts of 8, two of them without tokens; then no tokens at all
        assert r["experts"][8] <= 1e-5 and r["experts"][0] == 0.0, r["experts"]
        assert r["experts"]["sharded"]


def test_the_token_dispatcher_is_all_to_all_at_ep_above_1_and_all_gather_at_1(world):
    for r in world:
        assert r["dispatcher"] == {1: "MoEAllGatherTokenDispatcher", 2: "MoEAlltoAllTokenDispatcher"}


@pytest.mark.parametrize("family", sorted(SPECS))
@pytest.mark.parametrize("mesh", DISPATCH_MESHES, ids=lambda m: "tp{}-pp{}-ep{}".format(*m))
def test_all_to_all_dispatcher_equals_all_gather(world, family, mesh):
    for r in world:
        d = r["dispatch"][(family, *mesh)]
        assert d["kinds"] == ("MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher")
        assert d["logits"] <= 1e-5 and d["grads"] <= 1e-5, d
        assert d["experts_learn"]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_moe_gradients_are_finite_and_reach_every_parameter(world, family):
    for r in world:
        finite, zero, experts = r["grads"][family]
        assert finite
        # every parameter has a gradient: the stacked experts' from whichever of them the tokens chose
        assert experts and not zero, zero


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
