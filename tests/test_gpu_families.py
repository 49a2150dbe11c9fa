"""GPU checks of each model family of issue 43 on vLLM 0.24.0 (marked ``gpu``; skipped without CUDA or vllm):
for a small random-weight model of the family, (a) vLLM with the weights written by the reshard decodes greedily
the same tokens as the Megatron actor (parting, if at all, only where the actor's top logits tie within two bf16
steps) and reports sampled-token log-probs near the actor's teacher-forced ones,
and (b) a GRPO step of ``megarl train`` with vLLM rollouts runs, its rollout-vs-trainer log-prob mismatch
logged (``mismatch/*``; ``perf/RESULTS.md`` takes the figures printed with ``-s``).

Each family is its own case: (a) is one 1-rank world with one vLLM start (~30-60 s), (b) one ``megarl train``
of 2 steps. The actor's output layer is scaled so that its logits are peaked (a standard deviation of ~4): with
flat random logits bf16 rounding flips near-ties and a greedy comparison says nothing (tests/test_gpu_vllm.py).
The shapes are small but each keeps what its family's vLLM kernels need (head sizes FlashAttention takes,
DeepSeek's MLA with the 512 / 64 latent and rotary widths of vLLM's MLA backends, Qwen3.5's and Qwen3-Next's
DeltaNet head dims of 64).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.actor_decoding import actor_greedy, actor_logits, actor_teacher_forced
from tests.distributed import run_world
from tests.rl_tasks import WORDS, save_random_model, task_overrides, train_on_rank, write_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

COMMON = dict(vocab_size=4000, hidden_size=256, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=64,
              ffn_hidden_size=512, max_position_embeddings=1024, eos_token_ids=(3999,))


def _deepseek_v3() -> ModelSpec:
    from transformers import DeepseekV3Config

    return ModelSpec.from_hf_config(DeepseekV3Config(
        vocab_size=4000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=3999, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))


def _glm4_moe() -> ModelSpec:
    from transformers import Glm4MoeConfig

    return ModelSpec.from_hf_config(Glm4MoeConfig(
        vocab_size=4000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.5, use_qk_norm=True,
        attention_bias=True, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=3999, num_nextn_predict_layers=0))


def _qwen3_5(family: str = "qwen3_5", **moe) -> ModelSpec:
    """Qwen3.5 (dense) or, with ``moe``, Qwen3-Next or Qwen3.5-MoE (``family``): a gated DeltaNet layer then a gated
    full-attention one; DeltaNet head dims of 64 (vLLM's FLA kernels), attention heads of 64 with a quarter rotated."""
    from megarl.models.qwen3_5_spec import GatedDeltaNetShape

    gdn = GatedDeltaNetShape((1, 0), num_key_heads=2, num_value_heads=4, key_head_dim=64, value_head_dim=64,
                             conv_kernel=4, partial_rotary_factor=0.25)
    return ModelSpec(family, rope_theta=1e7, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     gdn=gdn, **COMMON, **moe)


def _qwen3(tied: bool) -> ModelSpec:
    """Qwen3 dense, its output layer tied to the embedding (Qwen3 up to 1.7B) or not (from 4B up)."""
    return ModelSpec("qwen3", rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied, **COMMON)


QWEN3_NEXT_MOE = dict(num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128, shared_expert_ffn_hidden_size=256,
                      moe_norm_topk_prob=True)
# family -> (spec factory, build_model keyword arguments, megarl train overrides the family needs)
FAMILIES = {
    "qwen3": (lambda: _qwen3(tied=True), {}, []),
    # Qwen3 as from 4B up: an untied output layer. The control for Phi's 0.02, testing a guess: with a tied
    # output layer the peaked logits come from scaled embeddings, which may dominate the residual stream
    "qwen3_untied": (lambda: _qwen3(tied=False), {}, []),
    "phi3": (lambda: ModelSpec("phi3", rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False,
                               sliding_window=512, **COMMON), {}, []),
    # Phi-4: Phi3ForCausalLM with no sliding window (and Phi-3's fused q/k/v and gate/up)
    "phi4": (lambda: ModelSpec("phi3", rope_theta=2.5e5, rms_norm_eps=1e-5, tie_word_embeddings=False, **COMMON),
             {}, []),
    "gemma3": (lambda: ModelSpec("gemma3", rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                 sliding_window=16, sliding_window_pattern=(1, 0), local_rope_theta=1e4,
                                 query_pre_attn_scalar=64, **COMMON), {}, []),
    "deepseek_v3": (_deepseek_v3, {"moe_experts": "sequential"}, ["actor.kernels.moe_experts=sequential"]),
    "glm4_moe": (_glm4_moe, {"moe_experts": "sequential"}, ["actor.kernels.moe_experts=sequential"]),
    # gpt-oss with its YaRN (vLLM's gpt-oss builds YaRN whatever the config says; factor 4 over 256 positions)
    "gpt_oss": (lambda: ModelSpec("gpt_oss", rope_theta=150000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                "truncate": False, "original_max_position_embeddings": 256},
                                  sliding_window=16, sliding_window_pattern=(1, 0), num_experts=4, moe_top_k=2,
                                  moe_ffn_hidden_size=256, **{**COMMON, "ffn_hidden_size": 256}),
                {"attention": "local", "moe_experts": "sequential"},
                ["actor.kernels.attention=local", "actor.kernels.moe_experts=sequential"]),
    "qwen3_5": (_qwen3_5, {}, []),
    "qwen3_next": (lambda: _qwen3_5("qwen3_next", **QWEN3_NEXT_MOE), {"moe_experts": "sequential"},
                   ["actor.kernels.moe_experts=sequential"]),
    # Qwen3.5-MoE: Qwen3.5's projections with Qwen3-Next's MoE; vLLM runs it as megarl's registered text class
    "qwen3_5_moe": (lambda: _qwen3_5("qwen3_5_moe", **QWEN3_NEXT_MOE), {"moe_experts": "sequential"},
                    ["actor.kernels.moe_experts=sequential"]),
}
PROMPT_LENGTHS = (5, 17, 40)
GREEDY_TOKENS = 24
GRPO = ["rollout.engine=vllm", "model.dtype=bfloat16", "rollout.gpu_memory_utilization=0.3", "trainer.steps=2",
        "trainer.save_every=0", "trainer.progress=false", "validation.enabled=false", "trainer.report=false",
        "data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=16"]


def _peak_logits(actor, spec: ModelSpec) -> None:
    """Scale the output layer (or the tied embedding) so that the logits' standard deviation is ~4."""
    weight = (actor.embedding.word_embeddings.weight if spec.tie_word_embeddings else actor.output_layer.weight)
    with torch.no_grad():
        weight.mul_(4.0 / (weight.float().std().item() * spec.hidden_size ** 0.5))


def engine_plan(actor, spec: ModelSpec, mesh, engine_layout):
    """The reshard plan from ``actor`` (built here, its experts as its layer spec made them: ``megarl_moe_experts``)
    into an engine's layout (``tests/test_reshard_bf16_families.py`` runs it on the CPU for every family)."""
    from megarl.models.layout_megatron import megatron_layout
    from megarl.reshard.planner import plan_reshard

    return plan_reshard(megatron_layout(spec, mesh, padded_vocab=actor.vocab_size,
                                        moe_experts=actor.megarl_moe_experts), engine_layout)


def _decode(rank, world, family):
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.reshard.executor import execute_plan
    from megarl.rollout.base import SamplingConfig
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    make, build_kwargs, _ = FAMILIES[family]
    spec = make()
    mesh = ParallelLayout()
    initialize_model_parallel(mesh, seed=0)
    actor = build_model(spec, mesh, params_dtype=torch.bfloat16, **build_kwargs).cuda().eval()
    _peak_logits(actor, spec)
    engine = VLLMRolloutEngine(spec, tp=1, gpu_memory_utilization=0.3, seed=0, enforce_eager=True)
    plan = engine_plan(actor, spec, mesh, engine.weight_layout([0]))
    src = {n: p.detach() for n, p in actor.named_parameters()}
    engine.update_weights(lambda dst: execute_plan(plan, src, dst))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size - 1, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    greedy = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=GREEDY_TOKENS))
    sampled = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_new_tokens=32, seed=7))
    diffs = torch.cat([(actor_teacher_forced(actor, spec, prompts[s.prompt_index], s.token_ids) - s.logprobs).abs()
                       for s in sampled.samples])
    vllm_tokens = [list(s.token_ids) for s in greedy.samples]
    actor_tokens = [actor_greedy(actor, spec, p, GREEDY_TOKENS) for p in prompts]
    ties = []  # where the two greedy decodings part: the actor's logit gap between its pick and vLLM's, in bf16 ulps
    for p, v, m in zip(prompts, vllm_tokens, actor_tokens):
        i = next((i for i, (a, b) in enumerate(zip(v, m)) if a != b), None)
        if i is not None:
            logits = actor_logits(actor, p + v[:i])[-1, :spec.vocab_size].float()
            top = logits.max()
            ties.append((i, ((top - logits[v[i]]) / 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)).item()))
    return {"vllm": vllm_tokens, "actor": actor_tokens, "ties": ties, "mean_diff": diffs.mean().item(),
            "max_diff": diffs.max().item(), "tokens": len(diffs)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_decodes_greedily_like_the_megatron_actor(family):
    r = run_world(_decode, 1, family, timeout_s=600)[0]
    agree = [next((i for i, (a, b) in enumerate(zip(v, m)) if a != b), min(len(v), len(m)))
             for v, m in zip(r["vllm"], r["actor"])]
    print(f"\n{family} on vLLM: greedy tokens agreeing with the actor {agree} of {GREEDY_TOKENS}; where they part, "
          f"the actor's gap to vLLM's pick (bf16 ulps) {[round(gap, 2) for _, gap in r['ties']]}; sampled-token "
          f"log-prob |vLLM - actor| mean {r['mean_diff']:.4f} max {r['max_diff']:.4f} over {r['tokens']} tokens")
    # the two may part only where the actor's logits tie within bf16 rounding: the logits are bf16 on both sides,
    # and where a family's kernels round otherwise than vLLM's (Phi-3 and Phi-4 on the H100: mean |diff| 0.02, a
    # fraction of a bf16 step of these peaked logits) a near-tie flips (Phi-3's first prompt at its second token)
    assert all(gap <= 2.0 for _, gap in r["ties"]), r
    assert r["mean_diff"] < 0.05, r


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_grpo_step_runs_with_vllm_rollouts(tmp_path, family):
    make, _, overrides = FAMILIES[family]
    spec = dataclasses.replace(make(), vocab_size=len(WORDS), bos_token_id=None, max_position_embeddings=256,
                               eos_token_ids=(WORDS.index("<eos>"),), pad_token_id=WORDS.index("<pad>"))
    model = save_random_model(tmp_path / "model", spec, seed=0, embedding_scale=3.0)
    history = run_world(train_on_rank, 1, [*task_overrides(model, write_prompts(tmp_path / "prompts.jsonl", 32),
                                                           tmp_path / "runs", family), *GRPO, *overrides],
                        timeout_s=900)[0]
    last = history[-1]
    print(f"\n{family} GRPO step on vLLM: reward {[round(h['reward/mean'], 3) for h in history]}, rollout vs "
          f"trainer log-prob |diff| mean {last['mismatch/abs_diff_mean']:.4f} max {last['mismatch/abs_diff_max']:.4f}"
          f", token_mult_prob_error {last['mismatch/token_mult_prob_error']:.4f}")
    assert [h["step"] for h in history] == [1, 2]
    assert all(torch.isfinite(torch.tensor(h["actor/pg_loss"])) for h in history), history
