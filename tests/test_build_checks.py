"""``megarl train --check`` refuses what megatron-core refuses when the ranks build or train the model (issue 33,
item B), and what torch's ``grouped_mm`` refuses of the grouped experts (issue 32):
:func:`megarl.trainer.preflight.check_megatron_build` and the world checks of
:func:`megarl.parallel.placement.validate_for_world`, on the config and the model's spec alone (no rank, no
weight)."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.models.spec import preset
from megarl.parallel.placement import validate_for_world
from megarl.trainer.preflight import validate_for_model

MOE = preset("tiny-qwen3-moe")  # 8 experts, top-2, 4 heads / 2 KV heads
DENSE = preset("tiny-llama")


def test_an_moe_model_trained_with_tp_needs_sequence_parallel():
    # MoELayer.forward raises in training with tp > 1 and no sequence parallelism (megatron-core 0.19)
    with pytest.raises(ConfigError, match=r"actor\.parallel\.sequence_parallel: .*tp=2 .*sequence_parallel=true"):
        validate_for_model(load_config(None, ["actor.parallel.tp=2"]), MOE)
    validate_for_model(load_config(None, ["actor.parallel.tp=2", "actor.parallel.sequence_parallel=true"]), MOE)
    validate_for_model(load_config(None, ["actor.parallel.tp=2"]), DENSE)  # a dense model trains without it
    ppo = ["algorithm.name=ppo", "actor.parallel.tp=2", "actor.parallel.sequence_parallel=true", "critic.parallel.tp=2"]
    with pytest.raises(ConfigError, match=r"critic\.parallel\.sequence_parallel"):
        validate_for_model(load_config(None, ppo), MOE)
    validate_for_model(load_config(None, ppo + ["critic.parallel.sequence_parallel=true"]), MOE)


def test_the_reference_runs_forward_only_and_needs_no_sequence_parallel():
    validate_for_model(load_config(None, ["algorithm.kl.coef=0.01", "placement.reference_parallel.tp=2"]), MOE)


def test_a_top1_router_renormalised_over_the_top_k_is_refused():
    # TransformerConfig: "Please use --moe-router-pre-softmax when topk is 1"; with pre-softmax it is another model
    with pytest.raises(ConfigError, match=r"model\.path: .*top-1 expert .*norm_topk_prob"):
        validate_for_model(load_config(None), MOE.replace(moe_top_k=1, moe_norm_topk_prob=True))
    validate_for_model(load_config(None), MOE.replace(moe_top_k=1, moe_norm_topk_prob=False))


def test_lora_on_an_moe_model_refuses_transformer_engine():
    cfg = load_config(None, ["actor.lora.rank=4", "actor.kernels.transformer_engine=true"])
    with pytest.raises(ConfigError, match=r"actor\.kernels\.transformer_engine: LoRA on a mixture-of-experts"):
        validate_for_model(cfg, MOE)
    validate_for_model(cfg, DENSE)


def test_lora_on_the_experts_refuses_the_grouped_experts_naming_both_fields():
    with pytest.raises(ConfigError, match=r"lora\.experts.*kernels\.moe_experts=sequential"):
        validate_for_model(load_config(None, ["actor.lora.rank=4", "actor.lora.experts=true"]), MOE)
    validate_for_model(load_config(None, ["actor.lora.rank=4", "actor.lora.experts=true",
                                          "actor.kernels.moe_experts=sequential"]), MOE)
    with pytest.raises(ConfigError, match=r"kernels\.moe_experts: must be one of"):
        load_config(None, ["actor.kernels.moe_experts=loop"])


def test_lora_on_the_experts_of_a_dense_model_says_it_has_none():
    """Issue 48: on a dense model ``actor.lora.experts`` said to set ``moe_experts=sequential``, which does not
    help: the model has no experts; at any ``moe_experts``."""
    for experts in ("grouped", "sequential"):
        cfg = load_config(None, ["actor.lora.rank=4", "actor.lora.experts=true",
                                 f"actor.kernels.moe_experts={experts}"])
        with pytest.raises(ConfigError, match=r"^actor\.lora\.experts: .* is a dense llama model: it has no experts "
                                              r"to adapt; set actor\.lora\.experts=false") as e:
            validate_for_model(cfg, DENSE)
        assert "sequential" not in str(e.value)


def test_any_other_refusal_of_megatrons_transformer_config_names_the_parallel_field(monkeypatch):
    # with megarl's own size checks out of the way, megatron's TransformerConfig.__post_init__ is what refuses
    import megarl.models.megatron as mg
    import megarl.trainer.preflight as pf

    monkeypatch.setattr(pf, "check_layout", lambda spec, layout: None)
    monkeypatch.setattr(mg, "check_layout", lambda spec, layout: None)
    with pytest.raises(ConfigError, match=r"actor\.parallel: megatron-core refuses the actor's model config on tp=3"
                                          r".*num_attention_heads \(4\) must be a multiple of "
                                          r"tensor_model_parallel_size \(3\)"):
        validate_for_model(load_config(None, ["actor.parallel.tp=3"]), DENSE)


def test_expert_parallelism_must_fit_the_ranks_of_a_stage():
    # placement.global_layout on the ranks: ep must divide tp x dp (here one rank); the error says dp must be a
    # multiple of ep and how to get there (issue 48: it gave no fix)
    with pytest.raises(ConfigError, match=r"actor\.parallel\.ep: 2 does not divide the actor's tp=1 x dp=1 .*dp "
                                          r"must be a multiple of ep\); set actor\.parallel\.dp=2 .* or "
                                          r"actor\.parallel\.ep=1$"):
        validate_for_world(load_config(None, ["actor.parallel.ep=2"]), 1)
    with pytest.raises(ConfigError, match=r"dp must be a multiple of 2\); set actor\.parallel\.dp=2 \(or a "
                                          r"multiple: the job runs on 4 ranks at dp=2\)"):
        validate_for_world(load_config(None, ["actor.parallel.ep=4", "actor.parallel.tp=2"]), 2)
    validate_for_world(load_config(None, ["actor.parallel.ep=2"]), 2)
    with pytest.raises(ConfigError, match=r"actor\.parallel\.ep: 2 does not divide the actor's tp=1 x dp=1"):
        validate_for_world(load_config(None, ["actor.parallel.ep=2", "actor.parallel.pp=2"]), 2)


def test_a_token_budget_below_one_row_is_a_warning(caplog):
    # a row longer than max_tokens_per_micro_batch gets a micro-batch of its own (megarl.workers.packing): over budget
    base = ["data.max_prompt_length=64", "rollout.max_new_tokens=64"]
    with caplog.at_level("WARNING", logger="megarl.parallel.placement"):
        validate_for_world(load_config(None, base + ["actor.max_tokens_per_micro_batch=100"]), 1)
    assert "actor.max_tokens_per_micro_batch=100 is below one row of up to 128 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megarl.parallel.placement"):
        validate_for_world(load_config(None, base + ["actor.max_tokens_per_micro_batch=128"]), 1)
        # the trainer's own check, after the pre-run checks in the same process, says it no second time
        validate_for_world(load_config(None, base + ["actor.max_tokens_per_micro_batch=100"]), 1, warn=False)
    assert "max_tokens_per_micro_batch" not in caplog.text


@pytest.mark.parametrize("overrides,world,warning", [
    (["algorithm.policy_loss=gspo", "algorithm.clip_ratio_low=3e-4", "algorithm.clip_ratio_high=4e-4"], 1,
     "algorithm.loss_agg_mode=token-mean with algorithm.policy_loss=gspo: GSPO's objective averages each sequence's "
     "tokens, then the sequences; set algorithm.loss_agg_mode=seq-mean-token-mean"),
    (["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"], 1,
     "algorithm.clip_ratio_low=0.2 and algorithm.clip_ratio_high=0.2 with algorithm.policy_loss=gspo: PPO-sized "
     "clip ranges (> 0.01) barely clip a sequence-level ratio; the GSPO paper uses clip_ratio_low=3e-4"),
    (["actor.parallel.sequence_parallel=true"], 1,
     "actor.parallel.sequence_parallel=true has no effect at tp=1"),
    (["placement.pools.train=[0,1]", "placement.pools.gen=[2]", "placement.actor=train", "placement.rollout=gen",
      "placement.reward=train", "placement.reference=train", "validation.enabled=false"], 4,
     "placement.pools: ranks [3] of the world of 4 run no role"),
])
def test_settings_that_do_nothing_are_one_warning_naming_the_field(caplog, overrides, world, warning):
    # accepted, as the ranks would accept them, but each said in one line (issue 33 item 10)
    with caplog.at_level("WARNING", logger="megarl.parallel.placement"):
        validate_for_world(load_config(None, overrides), world)
    assert [r.getMessage() for r in caplog.records if warning in r.getMessage()] != [], caplog.text
    assert len(caplog.records) == 1, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="megarl.parallel.placement"):  # the defaults: no warning
        validate_for_world(load_config(None, ["algorithm.policy_loss=gspo", "algorithm.clip_ratio_low=3e-4",
                                              "algorithm.clip_ratio_high=4e-4",
                                              "algorithm.loss_agg_mode=seq-mean-token-mean"]), world)
    assert caplog.records == [], caplog.text


@pytest.mark.parametrize("dtype, sizes, field", [("float32", dict(moe_ffn_hidden_size=30), "moe_ffn_hidden_size=30"),
                                                 ("bfloat16", dict(moe_ffn_hidden_size=36), "moe_ffn_hidden_size=36"),
                                                 ("float32", dict(hidden_size=66, num_attention_heads=2,
                                                                  num_kv_heads=2, head_dim=33), "hidden_size=66")])
def test_grouped_experts_refuse_sizes_grouped_mm_cannot_take_naming_sequential(dtype, sizes, field):
    # torch's grouped_mm: "strides should be multiple of 16 bytes" (4 fp32 elements, 8 bf16)
    odd = MOE.replace(**sizes)
    with pytest.raises(ConfigError, match=rf"actor\.kernels\.moe_experts: .*{field} is not a multiple of "
                                          r".*actor\.kernels\.moe_experts=sequential"):
        validate_for_model(load_config(None, [f"model.dtype={dtype}"]), odd)
    validate_for_model(load_config(None, [f"model.dtype={dtype}", "actor.kernels.moe_experts=sequential"]), odd)
    validate_for_model(load_config(None, [f"model.dtype={dtype}"]), MOE)  # its sizes align in either dtype
    ppo = ["algorithm.name=ppo", "actor.kernels.moe_experts=sequential", f"model.dtype={dtype}"]
    with pytest.raises(ConfigError, match=r"critic\.kernels\.moe_experts: .*critic\.kernels\.moe_experts=sequential"):
        validate_for_model(load_config(None, ppo), odd)


def test_grouped_experts_refuse_misaligned_sizes_when_built_too():
    from types import SimpleNamespace

    import torch

    from megarl.kernels.grouped_experts import GroupedExperts, misaligned_sizes
    from megarl.models.megatron import transformer_config
    from megarl.parallel.mesh import ParallelLayout

    assert misaligned_sizes(64, 32, torch.float32) == {} == misaligned_sizes(64, 32, torch.bfloat16)
    assert misaligned_sizes(64, 36, torch.float32) == {}
    assert misaligned_sizes(64, 36, torch.bfloat16) == {"moe_ffn_hidden_size": 8}
    assert misaligned_sizes(66, 30, torch.float16) == {"hidden_size": 8, "moe_ffn_hidden_size": 8}
    config = transformer_config(MOE.replace(moe_ffn_hidden_size=30), ParallelLayout(), init_weights=False)
    groups = SimpleNamespace(expt_tp=SimpleNamespace(size=lambda: 1))  # refused before any other group is read
    with pytest.raises(ValueError, match=r"grouped_mm needs rows of a multiple of 16 bytes.*'moe_ffn_hidden_size': 4"):
        GroupedExperts(4, config, pg_collection=groups)


def test_the_token_dispatcher_is_one_megatron_builds():
    from megarl.config import MOE_DISPATCHERS, MOE_EXPERTS
    from megarl.models import megatron as mg

    assert (MOE_DISPATCHERS, MOE_EXPERTS) == (mg.MOE_DISPATCHERS, mg.MOE_EXPERTS)
    with pytest.raises(ConfigError, match=r"actor\.moe\.token_dispatcher: must be one of"):
        load_config(None, ["actor.moe.token_dispatcher=flex"])
    for dispatcher in MOE_DISPATCHERS:
        validate_for_model(load_config(None, [f"actor.moe.token_dispatcher={dispatcher}"]), MOE)
    kinds = {(d, ep): mg.moe_config_kwargs(MOE, ep, dispatcher=d)["moe_token_dispatcher_type"]
             for d in MOE_DISPATCHERS for ep in (1, 2)}
    assert kinds == {("auto", 1): "allgather", ("auto", 2): "alltoall", ("allgather", 1): "allgather",
                     ("allgather", 2): "allgather", ("alltoall", 1): "alltoall", ("alltoall", 2): "alltoall"}
