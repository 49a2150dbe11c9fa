"""When the trainer skips the old-log-prob pass (:func:`megarl.trainer.old_logprobs.old_logprob_pass`): only
where the actor update's first forward gives the same old log-probs and nothing reads them before it."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError, load_config
from megarl.trainer.old_logprobs import old_logprob_pass

ONE_MINI_BATCH = ["data.prompts_per_step=2", "rollout.n=8"]  # 16 rows, the default mini-batch of 16


@pytest.mark.parametrize("overrides,reason", [
    ([], None),
    (["actor.kernels.chunked_logprob=false", "actor.max_tokens_per_micro_batch=64",
      "actor.logprob_micro_batch_size=8", "actor.lora.rank=4"], None),  # the same micro-batches, no dropout
    (["actor.old_logprob_pass=always"], "actor.old_logprob_pass=always"),
    (["rollout.exact=true"], "rollout.exact: the batch-invariant pass"),
    (["actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
    (["actor.ppo_mini_batch_size=8"], "16 samples in mini-batches of 8"),
    (["algorithm.kl.in_loss=false"], "KL penalty is in the reward"),
    (["algorithm.rollout_correction.preset=token_tis"], "rollout correction"),
    (["algorithm.name=ppo", "critic.warmup_steps=1"], "critic's warm-up"),
    (["actor.lora.rank=4", "actor.lora.dropout=0.1"], "LoRA dropout"),
    (["actor.logprob_micro_batch_size=8"], "logprob_micro_batch_size"),
])
def test_the_pass_is_skipped_only_where_the_update_gives_the_same_old_logprobs(overrides, reason):
    cfg = load_config(None, ONE_MINI_BATCH + overrides)
    got = old_logprob_pass(cfg, rows=16, step=0, moe=False)
    assert got is None if reason is None else reason in got, got


def test_the_pass_runs_for_a_moe_actor_and_for_the_critic_warm_up_only():
    cfg = load_config(None, ONE_MINI_BATCH)
    assert "routing agreement" in old_logprob_pass(cfg, rows=16, step=0, moe=True)
    ppo = load_config(None, ONE_MINI_BATCH + ["algorithm.name=ppo", "critic.warmup_steps=1"])
    assert old_logprob_pass(ppo, rows=16, step=1, moe=False) is None  # the actor trains from step 2 on
    assert old_logprob_pass(cfg, rows=32, step=0, moe=False).startswith("32 samples in mini-batches of 16")  # e.g. dynamic sampling


def test_a_bad_old_logprob_pass_names_the_field():
    with pytest.raises(ConfigError, match="actor.old_logprob_pass: must be one of"):
        load_config(None, ["actor.old_logprob_pass=never"])
