"""Context parallelism (CP) on CPU with gloo, without Transformer Engine, on one world of 4 ranks.

- :func:`megarl.kernels.context_parallel.context_parallel_attention` at CP=4 (and CP=2 with a sliding window) equals
  this rank's rows of full causal SDPA, forward and the gradients of queries, keys and values.
- The actor at CP=2 (x DP=2) and CP=2 x TP=2 equals the same model without CP (single rank; TP=2), on the same
  weights: per-token log-probs forward, and the parameter gradients after megatron's DDP (which reduces over
  DP x CP) of a weighted sum of log-probs; the critic's values likewise.
- The reshard from a TP=2 x CP=2 Megatron layout to vLLM and HF layouts is exact (the reference slicer of
  ``tests/test_reshard_exact.py``).
- Config and layout errors name the field.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

SPEC = ModelSpec("llama", vocab_size=300, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                 head_dim=8, ffn_hidden_size=48, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 max_position_embeddings=64)
SEQ = 16


def _attention_checks(rank: int) -> dict:
    """CP attention vs full causal SDPA: max abs differences of the output and of the q, k, v gradients."""
    from megatron.core import parallel_state as ps

    from megarl.kernels.context_parallel import context_parallel_attention, split_for_cp_rank
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    out = {}
    for cp, window in ((4, None), (2, (3, 0))):
        initialize_model_parallel(ParallelLayout(cp=cp, dp=4 // cp))
        group = ps.get_context_parallel_group()
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(SEQ, 2, heads, 8, generator=g) for heads in (4, 2, 2))  # [s, b, n, d], GQA
        grad_out = torch.randn(SEQ, 2, 4, 8, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = None
        if window is not None:
            i, j = torch.arange(SEQ).unsqueeze(1), torch.arange(SEQ).unsqueeze(0)
            mask = (j <= i) & (j >= i - window[0])
        ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in full), attn_mask=mask,
                                             is_causal=mask is None, enable_gqa=True).permute(2, 0, 1, 3)
        ref.backward(grad_out)
        local = [split_for_cp_rank(t, 0, group).detach().requires_grad_() for t in (q, k, v)]
        got = context_parallel_attention(*local, group, window=window)
        got.backward(split_for_cp_rank(grad_out, 0, group))
        out[(cp, window)] = dict(
            out=(got - split_for_cp_rank(ref, 0, group)).abs().max().item(),
            grads=max((a.grad - split_for_cp_rank(b.grad, 0, group)).abs().max().item()
                      for a, b in zip(local, full)),
            k_grad_scale=full[1].grad.abs().max().item())
    return out


def _model_run(spec, mesh, hf_sd, tokens, weights, role: str):
    """Forward and backward of ``role`` on ``mesh`` (megatron DDP): log-probs (or values) ``[b, s]`` on the last
    stage and the parameter gradients (``main_grad`` after DDP's reduction) by name."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megarl.kernels.context_parallel import gather_from_cp_ranks, next_tokens, split_for_cp_rank
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.logprobs import vocab_parallel_logprobs
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import initialize_model_parallel

    initialize_model_parallel(mesh)
    model = build_model(spec, mesh, role, attention="sdpa", init_weights=False)
    shapes = {**spec.hf_tensor_shapes(), "score.weight": (1, spec.hidden_size)}
    fill_local_tensors(megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(), 0, role=role),
                       dict(model.named_parameters()), state_dict_reader(hf_sd, shapes))
    config = model.config
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    cp_group = ps.get_context_parallel_group()

    def output_fn(mb, out):
        if role == "actor":
            labels = split_for_cp_rank(next_tokens(mb["input_ids"]), 1, cp_group)
            per_token, _ = vocab_parallel_logprobs(out, labels, vocab_size=spec.vocab_size)
        else:
            per_token = out[..., 0]
        per_token = gather_from_cp_ranks(per_token, 1, cp_group, reduce_grad=False)
        return (per_token * weights).sum(), {"per_token": per_token.detach()}

    model.zero_grad_buffer()
    res = run_microbatches(model, [{"input_ids": tokens}], output_fn, forward_only=False)
    grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    return res[0]["per_token"], grads


def _model_checks(rank: int) -> dict:
    """Actor log-probs / critic values and parameter gradients at CP=2 vs the same TP without CP."""
    from transformers import AutoModelForCausalLM

    from megarl.parallel.mesh import ParallelLayout

    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(SPEC.to_hf_config(), dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    hf_sd = {**hf.state_dict(), "score.weight": torch.randn(1, SPEC.hidden_size)}
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, SPEC.vocab_size, (3, SEQ), generator=g)
    weights = torch.randn(3, SEQ, generator=g)
    out = {}
    for role in ("actor", "critic"):
        for tp in (1, 2):
            ref, ref_grads = _model_run(SPEC, ParallelLayout(tp=tp, dp=4 // tp), hf_sd, tokens, weights, role)
            got, grads = _model_run(SPEC, ParallelLayout(tp=tp, cp=2, dp=2 // tp), hf_sd, tokens, weights, role)
            out[(role, tp)] = dict(
                forward=(got - ref).abs().max().item(),
                grads=max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1)).item()
                          for n in ref_grads),
                grad_scale=min(ref_grads[n].abs().max().item() for n in ref_grads),
                names=sorted(grads) == sorted(ref_grads))
    return out


def _reshard_checks(rank: int) -> dict:
    """The reshard from Megatron TP=2 x CP=2 to vLLM TP=2 / TP=4 and to whole HF tensors, vs the reference
    slicer; the CP peers' layouts are the same blocks."""
    from megarl.models.layout import hf_layout
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout
    from megarl.parallel.mesh import ParallelLayout
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard
    from tests.test_reshard_exact import MODELS, hf_weights, ref_megatron, ref_vllm

    out = {}
    model = "gqa_tied"
    fam, vocab, h, layers, heads, kv, hd, ffn, tied = MODELS[model]
    spec = ModelSpec(fam, vocab, h, layers, heads, kv, hd, ffn, tie_word_embeddings=tied)
    w = hf_weights(model)
    src = megatron_layout(spec, ParallelLayout(tp=2, cp=2, dp=1))
    out["cp_peers_same_blocks"] = all(src.tensors(r) == src.tensors(r + 2) for r in (0, 1))
    src_tensors = ref_megatron(model, w, 2, 1, rank % 2, 0)  # rank = tp + 2 * cp: TP rank is rank % 2
    for dst in (("vllm", 2), ("vllm", 4), ("hf", None)):
        if dst[0] == "vllm":
            dst_layout, want = vllm_layout(spec, dst[1], range(4)), ref_vllm(model, w, dst[1], rank % dst[1])
        else:
            dst_layout, want = hf_layout(spec, range(4)), {k: v.clone() for k, v in w.items()}
        got = {k: torch.zeros(v.shape) for k, v in want.items()}
        execute_plan(plan_reshard(src, dst_layout), src_tensors, got)
        out[dst] = [k for k in want if not torch.equal(got[k], want[k])]
    return out


def _checkpoint_checks(rank: int, tmp: str) -> dict:
    """A dist checkpoint saved at TP=2 x CP=2 (CP peers are replicas: megatron saves each shard once and
    validates the sharding) loads at TP=1 x DP=4 with every parameter exact."""
    from megatron.core import parallel_state as ps

    from megarl.models import checkpoint as ck
    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    g = torch.Generator().manual_seed(3)
    read = state_dict_reader({n: torch.randn(s, generator=g) for n, s in SPEC.hf_tensor_shapes().items()},
                             SPEC.hf_tensor_shapes())

    def filled(mesh):
        model = build_model(SPEC, mesh, attention="sdpa")
        fill_local_tensors(megatron_rank_tensors(SPEC, mesh, ps.get_tensor_model_parallel_rank(), 0),
                           dict(model.named_parameters()), read)
        return model

    mesh = ParallelLayout(tp=2, cp=2)
    initialize_model_parallel(mesh)
    ck.save_model(f"{tmp}/cp2", filled(mesh))
    mesh = ParallelLayout(dp=4)
    initialize_model_parallel(mesh)
    loaded = build_model(SPEC, mesh)
    ck.load_model(f"{tmp}/cp2", loaded)
    expected = dict(filled(mesh).named_parameters())
    return {"exact": all(torch.equal(p, expected[n]) for n, p in loaded.named_parameters())}


def _world(rank: int, world: int, tmp: str) -> dict:
    from megatron.core import parallel_state as ps

    out = {"attention": _attention_checks(rank), "model": _model_checks(rank), "reshard": _reshard_checks(rank),
           "checkpoint": _checkpoint_checks(rank, tmp)}
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_world(_world, 4, str(tmp_path_factory.mktemp("cp")))


def test_dist_checkpoint_saved_at_cp2_loads_at_dp4(world):
    assert all(r["checkpoint"]["exact"] for r in world), [r["checkpoint"] for r in world]


def test_cp_attention_equals_full_causal_sdpa(world):
    for r in world:
        for case, d in r["attention"].items():
            assert d["out"] < 1e-5 and d["grads"] < 1e-5, (case, d)
            assert d["k_grad_scale"] > 1e-2, d  # gradients that can fail


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("tp", [1, 2])
def test_cp2_model_equals_the_model_without_cp(world, role, tp):
    """Log-probs (values) and the DDP-reduced parameter gradients at CP=2 equal those without CP (TP=1: the
    single-rank model)."""
    for r in world:
        d = r["model"][(role, tp)]
        assert d["names"], d
        assert d["forward"] < 1e-5 and d["grads"] < 1e-5, d
        assert d["grad_scale"] > 0, d


def test_reshard_from_a_cp2_layout_is_exact(world):
    for r in world:
        assert r["reshard"].pop("cp_peers_same_blocks")
        assert all(bad == [] for bad in r["reshard"].values()), r["reshard"]


def test_layout_rank_order_and_errors():
    from megarl.parallel.mesh import LayoutError, ParallelLayout

    mesh = ParallelLayout(tp=2, cp=2, dp=2, pp=2)
    assert mesh.world_size == 16
    for rank in range(16):  # megatron's tp-cp-ep-dp-pp order, from scratch
        c = mesh.coords(rank)
        assert (c.tp, c.cp, c.dp, c.pp) == (rank % 2, rank // 2 % 2, rank // 4 % 2, rank // 8)
        assert mesh.rank(c.tp, c.pp, c.dp, c.cp) == rank
    with pytest.raises(LayoutError, match="cp must be >= 1"):
        ParallelLayout(cp=0)
    with pytest.raises(LayoutError, match="cp=2 with ep=2"):
        ParallelLayout(cp=2, dp=2, ep=2)


def test_config_errors_name_the_field():
    from megarl.config import ConfigError, load_config
    from megarl.parallel.placement import validate_for_world

    with pytest.raises(ConfigError, match="actor.parallel.cp"):
        load_config(overrides=["actor.parallel.cp=0"])
    cfg = load_config(overrides=["actor.parallel.cp=2", "critic.parallel.cp=2", "actor.kernels.attention=local"])
    with pytest.raises(ConfigError, match="actor.kernels.attention"):
        validate_for_world(cfg, 2)
    cfg = load_config(overrides=["actor.parallel.cp=2", "critic.parallel.cp=2",
                                 "actor.max_tokens_per_micro_batch=256"])
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch"):
        validate_for_world(cfg, 2)
    cfg = load_config(overrides=["actor.parallel.cp=2", "algorithm.name=ppo"])
    assert cfg.world_size == 2
    with pytest.raises(ConfigError, match="placement.critic: .*cp=2.* not one layout"):
        validate_for_world(cfg, 2)  # the critic's cp must be the actor's
    validate_for_world(load_config(overrides=["actor.parallel.cp=2", "critic.parallel.cp=2", "algorithm.name=ppo"]),
                       2)


def test_cp_attention_rejects_a_sequence_not_divisible_by_2cp():
    from megarl.kernels.context_parallel import cp_positions

    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 4"):
        cp_positions(10, 0, 2)


TRAIN = ["trainer.steps=1", "trainer.save_every=0", "data.prompts_per_step=4", "rollout.n=4",
         "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.optim.lr=1e-2"]
COMPARED = ["reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl", "actor/clipfrac",
            "actor/ppo_kl", "critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"]


def test_trainer_at_cp2_matches_dp2_at_step_1(tmp_path):
    """PPO with a critic and a reference policy: one step at CP=2 (the sequences split over the 2 ranks,
    chunked log-probs) gives the metrics of DP=2 on the same rollouts (two mini-batches: the second runs after
    an update). Both runs in one 2-rank world (:func:`tests.rl_tasks.train_each_on_rank`: one process start)."""
    from tests.rl_tasks import make_tiny_model, task_overrides, train_each_on_rank, write_prompts

    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 16)
    ppo = TRAIN + ["algorithm.name=ppo", "critic.ppo_mini_batch_size=8", "critic.micro_batch_size=2",
                   "algorithm.kl.coef=0.01", "algorithm.kl.in_loss=true"]
    layouts = {"dp2": [], "cp2": ["actor.parallel.cp=2", "critic.parallel.cp=2"]}
    runs = run_world(train_each_on_rank, 2, [task_overrides(model, data, tmp_path / "runs", name) + ppo + extra
                                             for name, extra in layouts.items()])[0]
    ref, cp2 = (history[0] for history, _ in runs)
    assert ref["actor/ppo_kl"] != 0 and ref["critic/vf_loss"] != 0, ref
    for key in COMPARED:
        assert cp2[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


def test_memory_estimate_divides_activations_and_optimizer_by_cp():
    """At the same DP, CP=2 halves a rank's tokens (its activations, less the gathered keys and values, and its
    logits) and shards the DistributedOptimizer's state over DP x CP; weights and gradients stay whole."""
    from megarl.config import load_config
    from megarl.launch.memory import estimate_memory
    from megarl.models.spec import SpecError, preset

    spec = preset("qwen2.5-7b")
    base = ["data.max_prompt_length=4096", "rollout.max_new_tokens=4096", "actor.micro_batch_size=1",
            "actor.kernels.chunked_logprob=false"]
    dp2 = estimate_memory(load_config(overrides=base), spec, 2, gpu=True, device_bytes=0)
    cp2 = estimate_memory(load_config(overrides=base + ["actor.parallel.cp=2"]), spec, 4, gpu=True, device_bytes=0)
    assert (cp2.params, cp2.grads) == (dp2.params, dp2.grads)
    assert cp2.optimizer == pytest.approx(dp2.optimizer / 2, rel=1e-6)
    assert 0.5 * dp2.activations < cp2.activations < 0.6 * dp2.activations, (cp2.activations, dp2.activations)
    moe = ModelSpec("qwen3_moe", 100, 32, 2, 4, 2, 8, 64, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
    with pytest.raises(SpecError, match="cp=2: context parallelism runs dense models only"):
        estimate_memory(load_config(overrides=["actor.parallel.cp=2"]), moe, 2, gpu=False)
