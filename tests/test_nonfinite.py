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


# ---------------------------------------------------------------- the update on 2 gloo ranks

def _batch(rows: int = 8):
    from megarl.trainer.batch import build_batch

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
    from megarl.trainer.workers import PolicyWorker

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
