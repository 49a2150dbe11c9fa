"""Numbers that must never reach the weights (``megarl.algos.nonfinite``): non-finite rollout log-probs leave
the loss, samples with non-finite scores leave their groups, too many of either stop the step naming the
first, and a non-finite loss or gradient stops the update on every rank before the optimizer steps."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.nonfinite import NonFiniteError, check_nonfinite, estimate_without, find_nonfinite
from megarl.models.spec import ModelSpec
from tests.distributed import run_world

NAN, INF = float("nan"), float("inf")
SPEC = ModelSpec("llama", 64, 32, 2, 4, 2, 8, 64, tie_word_embeddings=True, max_position_embeddings=128,
                 eos_token_ids=(1,))


# ---------------------------------------------------------------- the rule on tensors

def test_nonfinite_logprobs_and_scores_are_found_and_counted_padding_aside():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    logprob = torch.tensor([[-1.0, NAN, -0.5], [-INF, -2.0, NAN], [-0.1, INF, NAN], [-1.0, -1.0, -1.0]])
    scores = torch.tensor([1.0, 0.0, NAN, 1.0])
    found = find_nonfinite(logprob, mask, scores)
    assert found.tokens.tolist() == [[False, True, False], [True, False, False], [False] * 3, [False] * 3]
    assert found.samples.tolist() == [True, True, True, False]
    assert found.metrics() == {"rollout/nonfinite_logprob_tokens": 2.0, "reward/nonfinite": 1.0,
                               "nonfinite/sample_frac": 0.75}
    check_nonfinite(found, logprob, scores, max_fraction=0.75)  # at the threshold: trained on
    with pytest.raises(NonFiniteError, match=r"3 of 4 samples \(75.0%\) .* \(2 tokens, 1 scores\), more than "
                                             r"algorithm.nonfinite.max_fraction=0.5; the first, prompt 7 row 21: the "
                                             r"rollout log-prob of its response token 1 is nan"):
        check_nonfinite(found, logprob, scores, max_fraction=0.5, describe=lambda i: f"prompt {i + 7} row {i + 21}")
    with pytest.raises(NonFiniteError, match=r"the first, sample 0: its score is inf"):
        scores = torch.tensor([INF, 0.0, 0.0, 0.0])
        check_nonfinite(find_nonfinite(torch.zeros(4, 3), mask, scores), torch.zeros(4, 3), scores, max_fraction=0.0)
    clean = find_nonfinite(torch.zeros(4, 3), mask, torch.zeros(4))
    check_nonfinite(clean, torch.zeros(4, 3), torch.zeros(4), max_fraction=0.0)
    assert clean.metrics()["nonfinite/sample_frac"] == 0.0


def test_a_dropped_sample_leaves_its_group_statistics():
    """GRPO over the group {1, NaN, 0, 1} with the NaN dropped is GRPO over {1, 0, 1} (hand-computed: mean 2/3,
    unbiased std 1/sqrt(3)); the other group is untouched; the dropped sample gets advantage 0. REINFORCE++'s
    whitening is over the kept tokens alone."""
    from megarl.algos.advantages import grpo_advantage, reinforce_plus_plus_advantage

    scores = torch.tensor([1.0, NAN, 0.0, 1.0, 0.0, 1.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 2)
    dropped = ~torch.isfinite(scores)
    adv, ret = estimate_without(dropped, grpo_advantage, scores, mask, group_index=group)
    std = 1 / math.sqrt(3)
    want = [(1 - 2 / 3) / std, 0.0, (0 - 2 / 3) / std, (1 - 2 / 3) / std, -1 / math.sqrt(2), 1 / math.sqrt(2)]
    torch.testing.assert_close(adv[:, 0], torch.tensor(want), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv, ret)
    assert torch.isfinite(adv).all() and (adv[1] == 0).all()
    adv, ret = estimate_without(dropped, reinforce_plus_plus_advantage, scores, mask, group_index=group)
    kept = adv[~dropped]
    assert abs(float(kept.mean())) < 1e-6 and float(kept.std()) == pytest.approx(1.0, abs=1e-3)
    assert (adv[1] == 0).all() and (ret[1] == 0).all()
    nothing = estimate_without(torch.ones(6, dtype=torch.bool), grpo_advantage, scores, mask, group_index=group)
    assert all((t == 0).all() for t in nothing)


@pytest.mark.parametrize("level,mode", [("token", "truncate"), ("sequence", "truncate"), ("token", "mask"),
                                        ("sequence", "mask")])
def test_every_rollout_correction_metric_is_finite_with_masked_or_no_tokens(level, mode):
    """NaN and infinite log-probs on masked positions (padding, tokens the non-finite rule took out), rows with
    no token, a batch with no token at all and ratios far beyond the clamp: every weight and metric finite."""
    from megarl.algos.rollout_correction import rollout_correction

    old = torch.tensor([[-1.0, NAN, -2.0], [-0.5, -0.5, INF], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.2, -1.0, NAN], [-INF, -1e30, -1.0], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 0]], dtype=torch.float32)
    for m in (mask, torch.zeros_like(mask)):
        weights, keep, stats = rollout_correction(old, rollout, m, level=level, mode=mode, cap=2.0, lower=0.5)
        assert torch.isfinite(weights).all() and not keep[~m.bool()].any()
        assert all(math.isfinite(float(v)) for v in stats.values()), stats


# ---------------------------------------------------------------- the trainer's glue (megarl.trainer.advantages)

def _scored_batch(scores, rows=None):
    """8 samples of 2 groups, 3 response tokens each, with ``scores`` and dataset rows 10 + group."""
    from megarl.data.batch import build_batch

    n = len(scores)
    batch = build_batch([[5, 6]] * n, [[7, 8, 9]] * n, [torch.full((3,), -1.0)] * n, [i // 4 for i in range(n)],
                        pad_token_id=0, meta={"index": rows or [10 + i // 4 for i in range(n)],
                                              "finish_reason": ["stop"] * n})
    batch["scores"] = torch.tensor(scores)
    batch["old_logprobs"] = torch.full((n, 3), -1.1)
    return batch


def test_a_reward_that_returns_nan_drops_the_sample_from_its_group_and_both_losses():
    """A NaN score (the reward function's or the server's): the sample gets advantage 0, its group's GRPO
    statistics are the other three's (hand-computed), it leaves the actor's and the critic's masks, and the reward
    metrics are over the scored samples; a token with a NaN rollout log-prob leaves the actor's mask alone."""
    from megarl.algos.kl import FixedKLController
    from megarl.config import AlgorithmConfig
    from megarl.trainer.advantages import compute_advantages, drop_nonfinite, set_loss_mask
    from megarl.trainer.old_logprobs import old_logprob_metrics

    alg = AlgorithmConfig(name="grpo", norm_adv_eps=0.0)
    alg.nonfinite.max_fraction = 0.25
    batch = _scored_batch([1.0, NAN, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    batch["rollout_logprobs"][5, 2] = NAN
    metrics = drop_nonfinite(batch, alg, step=4)
    assert metrics == {"rollout/nonfinite_logprob_tokens": 1.0, "reward/nonfinite": 1.0,
                       "nonfinite/sample_frac": 0.25}
    compute_advantages(batch, alg, FixedKLController(0.0))
    std = 1 / math.sqrt(3)
    torch.testing.assert_close(batch["advantages"][:4, 0], torch.tensor([1 / 3 / std, 0.0, -2 / 3 / std, 1 / 3 / std]))
    assert torch.isfinite(batch["advantages"]).all() and torch.isfinite(batch["returns"]).all()
    set_loss_mask(batch, alg)
    assert batch["loss_mask"][1].sum() == 0 and batch["value_mask"][1].sum() == 0
    assert batch["loss_mask"].sum() == 24 - 3 - 1 and batch["loss_mask"][5].tolist() == [1.0, 1.0, 0.0]
    assert batch["value_mask"].sum() == 24 - 3
    rc = old_logprob_metrics(batch, alg)  # the rollout correction's statistics (off) among them
    assert "rollout_corr/kl_k3" in rc and all(math.isfinite(v) for v in rc.values())
    with pytest.raises(NonFiniteError, match=r"the first, sample 1 of step 4 \(prompt 0 of the step, dataset row 10\): "
                                             r"its score is nan"):
        alg.nonfinite.max_fraction = 0.2
        drop_nonfinite(_scored_batch([1.0, NAN, 0.0, 1.0, 0.0, 1.0, 1.0, NAN]), alg, step=4)


def test_dynamic_sampling_reads_a_group_signal_from_its_scored_samples():
    """A group whose finite scores tie is tied, whatever its NaN (NaN != x would have made it a group with signal)."""
    from megarl.data.loader import PromptBatch
    from megarl.rollout.base import RolloutOutput, RolloutStats, Sample
    from megarl.trainer.dynamic_sampling import dynamic_sampling

    prompts = PromptBatch(input_ids=[[1], [2]], index=[0, 1], ground_truth=[None, None], raw_prompt=["a", "b"])
    out = RolloutOutput([Sample(k, j, (3,), torch.zeros(1), "stop") for k in range(2) for j in range(3)], 3,
                        RolloutStats(prompt_tokens=6, generated_tokens=6, seconds=1.0))
    scores = torch.tensor([1.0, NAN, 1.0, 0.0, NAN, 1.0])
    _, kept, got, metrics = dynamic_sampling(prompts, out, generate=None, score=lambda p, o: scores,
                                             more_prompts=None, want=1, unit=1, max_extra_rounds=0, step=1)
    assert metrics["dynamic_sampling/groups_with_signal"] == 1 and [s.prompt_index for s in kept.samples] == [0] * 3
    assert got[0] == 0.0 and torch.isnan(got[1])  # the group with signal (prompt 1), its NaN for the trainer to drop


def test_validation_metrics_leave_out_responses_without_a_score(monkeypatch):
    """val/reward_mean over the scored responses, val/reward_nonfinite counting the others (not correct, score null)."""
    import megarl.trainer.validation as validation
    from megarl.data.loader import PromptBatch
    from megarl.rollout.base import RolloutOutput, RolloutStats, Sample, SamplingConfig

    out = RolloutOutput([Sample(k, 0, (3,), torch.zeros(1), "stop") for k in range(3)], 1,
                        RolloutStats(prompt_tokens=3, generated_tokens=3, seconds=1.0))
    monkeypatch.setattr(validation, "generate_data_parallel", lambda engine, ids, sampling, group=None: out)
    tokenizer = type("T", (), {"batch_decode": staticmethod(lambda ids, skip_special_tokens: ["r"] * len(ids))})
    prompts = PromptBatch(input_ids=[[1]] * 3, index=[0, 1, 2], ground_truth=["x"] * 3, raw_prompt=["p"] * 3)
    metrics, records = validation.evaluate(None, prompts, SamplingConfig(n=1), lambda *c: torch.tensor([1.0, NAN, 0.5]),
                                           tokenizer)
    assert metrics["reward_mean"] == 0.75 and metrics["reward_nonfinite"] == 1.0
    assert metrics["accuracy"] == pytest.approx(1 / 3)
    assert [r["score"] for r in records] == [1.0, None, 0.5] and not records[1]["correct"]


def _token_tis(rank, world):
    """One actor update with token TIS on a batch whose rollout log-probs hold a NaN and a -inf, through the
    trainer's glue, and the same update on the same batch with those two tokens out of the loss by hand (the
    TIS weights min(exp(old - rollout), 2) computed here). Returns both updates' weights."""
    from megarl.algos.kl import FixedKLController
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig, RolloutCorrectionConfig
    from megarl.models.checkpoint import chunk_parameters
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.trainer.advantages import compute_advantages, drop_nonfinite, set_loss_mask
    from megarl.workers.actor import PolicyWorker

    mesh = ParallelLayout()
    initialize_model_parallel(mesh, seed=0)
    torch.manual_seed(0)
    rc = ActorConfig(micro_batch_size=4, ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-2))
    glued = PolicyWorker(SPEC, mesh, "actor", "preset:random", torch.float32, rc, trainable=True, temperature=1.0)
    by_hand = PolicyWorker(SPEC, mesh, "actor", glued, torch.float32, rc, trainable=True, temperature=1.0)
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0), rollout_correction=RolloutCorrectionConfig(preset="token_tis"))
    alg.nonfinite.max_fraction = 0.25
    batch = _batch()
    batch.meta.update(index=list(range(8)), finish_reason=["stop"] * 8)
    batch["scores"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    batch["old_logprobs"] = glued.compute_logprobs(batch)["logprobs"]
    noise = 0.3 * torch.randn(batch["old_logprobs"].shape, generator=torch.Generator().manual_seed(1))
    batch["rollout_logprobs"] = batch["old_logprobs"] + noise
    batch["rollout_logprobs"][1, 1], batch["rollout_logprobs"][5, 0] = NAN, -INF
    drop_nonfinite(batch, alg, step=1)
    compute_advantages(batch, alg, FixedKLController(0.0))
    set_loss_mask(batch, alg)
    hand = batch.select(slice(None))
    mask = batch["response_mask"].clone()
    mask[1, 1] = mask[5, 0] = 0
    for name in ("dropped", "logprob_nonfinite", "value_mask", "rollout_weights"):
        del hand.tensors[name]
    hand["loss_mask"] = mask
    log_ratio = torch.where(mask.bool(), batch["old_logprobs"] - batch["rollout_logprobs"], 0.0)
    hand["rollout_weights"] = torch.where(mask.bool(), log_ratio.exp().clamp(max=2.0), 0.0)
    for worker, b in ((glued, batch), (by_hand, hand)):
        worker.update(b, alg, seed=0)
    return [{n: p.detach().clone() for n, p in chunk_parameters(w.model).items()} for w in (glued, by_hand)]


def test_a_nan_and_an_inf_rollout_logprob_leave_the_loss_under_token_tis():
    """The weights after one step are finite and equal those of the same batch with the two tokens masked by
    hand (without the rule, the NaN made every weight NaN after one step)."""
    glued, by_hand = run_world(_token_tis, 1)[0]
    for name, weight in glued.items():
        assert torch.isfinite(weight).all(), name
        torch.testing.assert_close(weight, by_hand[name], rtol=0, atol=1e-7)


# ---------------------------------------------------------------- the update on 2 gloo ranks

def _batch(rows: int = 8):
    from megarl.data.batch import build_batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(rows)]
    responses = [torch.randint(2, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(rows)]
    batch = build_batch(prompts, responses, [torch.zeros(len(r)) for r in responses], [i // 4 for i in range(rows)],
                        pad_token_id=0)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    return batch


def _state(worker) -> list[torch.Tensor]:
    """Every weight and every optimizer state tensor of ``worker`` on this rank, copied."""
    from megarl.models.checkpoint import chunk_parameters

    out = [p.detach().clone() for p in chunk_parameters(worker.model).values()]
    for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        out += [v.detach().clone() for st in opt.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
        out += [p.detach().clone() for g in opt.optimizer.param_groups for p in g["params"]]  # main params
    return out


def _stopped_updates(rank, world, tp):
    """One good update, then one with a NaN advantage in batch row 6 (DP rank 1's second micro-batch at DP=2)
    and one whose gradient rank 1 alone makes NaN (a hook on one of its weights: at TP=2 the other rank's
    gradient stays finite). Returns each error message and whether the weights and optimizer state survived."""
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig, ParallelConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    mesh = ParallelLayout(tp=tp, dp=world // tp)
    initialize_model_parallel(mesh, seed=0)
    torch.manual_seed(0)
    rc = ActorConfig(parallel=ParallelConfig(tp=tp), micro_batch_size=2, ppo_mini_batch_size=8,
                     optim=OptimConfig(lr=1e-2))
    worker = PolicyWorker(SPEC, mesh, "actor", "preset:random", torch.float32, rc, trainable=True, temperature=1.0)
    batch = _batch()
    batch["old_logprobs"] = worker.compute_logprobs(batch)["logprobs"]
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0))
    worker.update(batch, alg, seed=0)
    before = _state(worker)
    out = {}
    poisoned = batch.select(slice(None))
    poisoned["advantages"] = batch["advantages"].clone()
    poisoned["advantages"][6, 0] = NAN
    for case in ("loss", "grad"):
        hook = None
        if case == "grad" and rank == 1:
            weight = next(p for n, p in worker.model.named_parameters() if "linear_qkv.weight" in n)
            hook = weight.register_hook(lambda g: g * NAN)
        try:
            worker.update(poisoned if case == "loss" else batch, alg, seed=0, step=3)
            out[case] = None
        except NonFiniteError as e:
            out[case] = str(e)
        if hook is not None:
            hook.remove()
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _state(worker)))
    out["finite"] = all(torch.isfinite(t).all() for t in _state(worker))
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_a_nonfinite_loss_or_gradient_stops_the_update_on_every_rank(tp):
    for r in run_world(_stopped_updates, 2, tp):
        assert r["unchanged"] and r["finite"]
        where = "on DP rank 1" if tp == 1 else "on DP rank 0"  # row 6 is DP rank 1's at DP=2, DP rank 0's at TP=2
        assert r["loss"] == (
            f"step 3: the actor update of mini-batch 1/1 (epoch 1/1): the loss of micro-batch {2 if tp == 1 else 4} "
            f"{where} is nan; the optimizer did not step (the weights and optimizer state are those of the update "
            "before). Non-finite rollout log-probs and scores never reach the loss (megarl.algos.nonfinite): look "
            "at the learning rate, the advantages and the model's numerics (model.dtype)"), r["loss"]
        # rank 0's gradient buffers stay finite (at TP=2 its own shard of the weight; at DP=2 the distributed
        # optimizer reduce-scatters the weight's gradient into rank 1's shard): it stops because rank 1 does
        assert r["grad"] is not None and ("the gradient is not finite (a NaN or infinity in the gradient buffers "
                                          "of global rank 1) although every micro-batch's loss is finite") \
            in r["grad"], r["grad"]
